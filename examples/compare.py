"""The main job: the same SFT run under stock ZeRO-3 and under ZeRO-3 + ODC, side by side.

Trains a tiny Qwen2-shaped model (random init, nothing downloaded) on N CPU ranks, four times on the same samples,
all in one ``torchrun`` launch (the training loop of ``examples/sft.py``, ``ds_odc.recipes.train``, mode after
mode): stock ZeRO-3 with the usual per-rank sort, stock ZeRO-3 with balanced microbatches (``lb-micro``), ODC with
``lb-micro``, and ODC with ``lb-mini`` (different microbatch counts per rank). Every mode balances the automatic
cost, which it refits from its own measured step times.

The data has the shape that makes balancing matter: every optimizer step's minibatch holds one long sample
(``--long-tokens``) among short ones (``--short-tokens``), as when a few long conversations sit among many short
ones. ``lb-micro`` must give every rank the same number of samples, so the rank with the long sample also gets short
ones and the others wait for it; ``lb-mini`` can give it fewer. ``--preset NAME`` trains on a preset's lengths
instead (``ds_odc.balancer.presets``).

Prints the per-step losses, which must agree across modes, each mode's samples/s (and its speed against the first
mode), the share of time ODC's ranks wait for each other (its bubble; stock ZeRO-3's ranks wait inside every layer's
collectives, where it cannot be measured), microbatches per rank, what lb-mini changed against lb-micro on the same
minibatches, step by step, and the fitted cost.

    .venv/bin/python examples/compare.py                      # CPU, 2 ranks
    .venv/bin/python examples/compare.py --json out.json      # also write every run's metrics
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = [  # (label, ds_config, balancer)
    ("stock + local-sort", "zero3_fp32_cpu.json", "local-sort"),
    ("stock + lb-micro", "zero3_fp32_cpu.json", "lb-micro"),
    ("odc + lb-micro", "zero3_odc_fp32_cpu.json", "lb-micro"),
    ("odc + lb-mini", "zero3_odc_fp32_cpu.json", "lb-mini"),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup-steps", type=int, default=6,
                   help="leading steps left out of samples/s, bubble and the step-by-step comparison (the automatic "
                        "cost learns in them)")
    p.add_argument("--minibatch-size", type=int, default=2, help="samples per rank per optimizer step")
    p.add_argument("--long-tokens", default="700,1000", metavar="MIN,MAX",
                   help="length range of the one long sample of every minibatch")
    p.add_argument("--short-tokens", default="40,200", metavar="MIN,MAX", help="length range of the others")
    p.add_argument("--preset", default=None, help="train on this preset's lengths instead (e.g. baselines-longtail)")
    p.add_argument("--length-scale", type=float, default=0.06, help="with --preset: scale its lengths down for CPU")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="token budget per microbatch (default: one sample per microbatch, where lb-mini gives ranks "
                        "different microbatch counts)")
    p.add_argument("--cost", default="auto", help="balancer cost of every mode (examples/sft.py --cost)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", help="write all runs' metrics here")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # set by the launch: where rank 0 writes the runs
    p.add_argument("--lengths-file", help=argparse.SUPPRESS)  # set by the launch: the generated workload
    return p.parse_args(argv)


def one_long_sample_per_minibatch(args) -> list[int]:
    """Sample lengths in training order: every minibatch of ``nproc * minibatch_size`` samples holds one long sample
    at a random place among short ones (drawn from ``--seed``, the same in every mode)."""
    rng = random.Random(args.seed)
    (long_lo, long_hi), (short_lo, short_hi) = (tuple(int(x) for x in r.split(","))
                                                for r in (args.long_tokens, args.short_tokens))
    lengths = []
    for _ in range(args.steps):
        minibatch = [rng.randint(long_lo, long_hi)]
        minibatch += [rng.randint(short_lo, short_hi) for _ in range(args.nproc * args.minibatch_size - 1)]
        rng.shuffle(minibatch)
        lengths += minibatch
    return lengths


def sft_argv(config: str, balancer: str, args) -> list[str]:
    data = (["--lengths-file", args.lengths_file, "--no-shuffle"] if args.lengths_file else
            ["--preset", args.preset, "--length-scale", str(args.length_scale)])
    argv = ["--deepspeed", str(ROOT / "ds_configs" / config), "--balancer", balancer, "--model", "tiny", *data,
            "--minibatch-size", str(args.minibatch_size), "--steps", str(args.steps), "--warmup-steps",
            str(args.warmup_steps), "--seed", str(args.seed), "--cost", args.cost, "--quiet"]
    return argv + (["--max-tokens", str(args.max_tokens)] if args.max_tokens else [])


def worker(args) -> None:
    """Runs on every rank: one process group, the four modes one after the other."""
    import torch.distributed as dist

    from ds_odc.recipes.sft import sft_argument_parser
    from ds_odc.recipes.train import train
    from ds_odc.training.distributed import init_distributed, shutdown_and_exit

    init_distributed()
    runs = {}
    for label, config, balancer in MODES:
        if dist.get_rank() == 0:
            print(f"running {label} ...", flush=True)
        started = time.perf_counter()
        out = train(sft_argument_parser().parse_args(sft_argv(config, balancer, args)))
        if out is not None:
            out["wall_s"] = time.perf_counter() - started
            runs[label] = out
    if dist.get_rank() == 0:
        Path(args.worker).write_text(json.dumps(runs))
    shutdown_and_exit()


def launch(args, tmp: Path) -> dict:
    result = tmp / "runs.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(Path(__file__).resolve()), "--worker", str(result)]
    for flag in ("steps", "warmup_steps", "minibatch_size", "preset", "length_scale", "max_tokens", "cost", "seed"):
        if getattr(args, flag) is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if args.preset is None:
        lengths = tmp / "lengths.txt"
        lengths.write_text("\n".join(str(n) for n in one_long_sample_per_minibatch(args)) + "\n")
        cmd += ["--lengths-file", str(lengths)]
    # TMPDIR: torchrun's log folder goes into the run's temporary folder, removed with it
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
               DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore", TMPDIR=str(tmp),
               PYTHONPATH=os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p))
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=args.timeout)
    sys.stdout.write("".join(line + "\n" for line in proc.stdout.splitlines() if line.startswith("running ")))
    if proc.returncode != 0 or not result.exists():
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"the training launch failed (rc={proc.returncode})")
    return json.loads(result.read_text())


def lb_mini_against_lb_micro(runs: dict, warmup_steps: int) -> dict:
    """What lb-mini changed against lb-micro (both under ODC) on the same minibatches, over the timed steps: in how
    many steps the rank with the most tokens trained fewer samples than another rank, in how many lb-mini's ranks
    waited less (a smaller bubble), and the bubble and samples/s of both."""
    mini, micro = runs["odc + lb-mini"], runs["odc + lb-micro"]
    timed = range(min(warmup_steps, len(mini["steps"]) - 1), len(mini["steps"]))

    def heaviest_rank_has_fewer(step: dict) -> bool:
        ranks = step["per_rank"]
        heaviest = max(ranks, key=lambda r: r["tokens"])
        return heaviest["microbatches"] < max(r["microbatches"] for r in ranks)

    return {
        "steps": len(timed),
        "first_step": timed[0],
        "heaviest_rank_fewer_samples": sum(heaviest_rank_has_fewer(mini["steps"][i]) for i in timed),
        "waited_less": sum(mini["steps"][i]["bubble_rate"] < micro["steps"][i]["bubble_rate"] for i in timed),
        "bubble": {"lb-mini": mini["summary"]["bubble_rate"], "lb-micro": micro["summary"]["bubble_rate"]},
        "samples_per_s": {"lb-mini": mini["summary"]["samples_per_s"],
                          "lb-micro": micro["summary"]["samples_per_s"]},
    }


def report(runs: dict, args) -> tuple[float, dict]:
    labels = list(runs)
    print("\nloss per step (global token mean; identical data in every mode)")
    print("step  " + "  ".join(f"{label:>18}" for label in labels))
    for step in range(args.steps):
        print(f"{step:>4}  " + "  ".join(f"{runs[label]['steps'][step]['loss']:>18.6f}" for label in labels))
    first = labels[0]
    print(f"\n{'mode':<20}{'samples/s':>10}{'speed':>8}  {'bubble':<22}microbatches per rank, step by step")
    for label in labels:
        s = runs[label]["summary"]
        counts = " ".join("/".join(str(r["microbatches"]) for r in step["per_rank"]) for step in runs[label]["steps"])
        speed = s["samples_per_s"] / runs[first]["summary"]["samples_per_s"]
        bubble = f"{s['bubble_rate']:.1%}" if label.startswith("odc") else "in every layer (*)"
        print(f"{label:<20}{s['samples_per_s']:>10.1f}{speed:>7.2f}x  {bubble:<22}{counts}")
    seen = ", ".join(f"{runs[label]['summary']['bubble_rate']:.1%}" for label in labels if not label.startswith("odc"))
    print(f"speed: samples/s against {first}. bubble: the share of the ranks' time spent waiting for each other,\n"
          "which ODC does only at the optimizer step, where it is measured whole.\n"
          "(*) stock ZeRO-3's ranks wait for each other inside every layer's all-gather and reduce-scatter, where no\n"
          "    clock tells waiting from work, so its bubble cannot be shown next to ODC's: compare samples/s. The\n"
          f"    waits seen outside the collectives ({seen}) are only what little shows.")

    shown = lb_mini_against_lb_micro(runs, args.warmup_steps)
    n, bubble, rate = shown["steps"], shown["bubble"], shown["samples_per_s"]
    fewer, speed = shown["heaviest_rank_fewer_samples"], rate["lb-mini"] / rate["lb-micro"]
    print(f"\nlb-mini against lb-micro (both ODC), same minibatches, steps {shown['first_step']}-{args.steps - 1}:\n"
          f"  the rank with the most tokens trained fewer samples than another in {fewer} of {n} steps\n"
          f"  lb-mini's ranks waited less in {shown['waited_less']} of {n} steps; bubble {bubble['lb-mini']:.1%} "
          f"against {bubble['lb-micro']:.1%}\n"
          f"  samples/s {rate['lb-mini']:.1f} against {rate['lb-micro']:.1f} ({speed:.2f}x; the modes run one after "
          "another, so other programs' load moves this more than the bubble)")

    print("\nautomatic cost at the end of each run (busy = a*tokens + b*sum L^2 + c*microbatches + d)")
    for label in labels:
        cost = next((st["cost"] for st in reversed(runs[label]["steps"]) if st.get("cost")), None)
        if cost and cost["fitted"]:
            c = f"c {cost['c']:.3g} s/microbatch" if cost["c_measured"] else "c not measured (equal counts)"
            print(f"{label:<20} a {cost['a']:.3g} s/token  b {cost['b']:.3g} s/token^2  {c}  d {cost['d']:.3g} s/step")
        elif cost:
            print(f"{label:<20} still the prior (too few steps to fit)")
    reference = [s["loss"] for s in runs[labels[0]]["steps"]]
    worst = max(abs(s["loss"] - r) / abs(r) for label in labels for s, r in zip(runs[label]["steps"], reference))
    print(f"\nlargest relative loss difference between modes: {worst:.2e}")
    print(f"(samples/s and bubble over steps {shown['first_step']}-{args.steps - 1}. CPU timings of a tiny model show "
          "the mechanics,\n not GPU speed: see docs/BENCHMARKS.md)")
    return worst, shown


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ds_odc_compare_") as tmp:
        runs = launch(args, Path(tmp))
    worst, shown = report(runs, args)
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "max_rel_loss_diff": worst, "lb_mini_against_lb_micro":
                                               shown}, indent=1))


if __name__ == "__main__":
    main()
