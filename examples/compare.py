"""The main job: the same SFT run under stock ZeRO-3 and under ZeRO-3 + ODC, side by side.

Trains a tiny Qwen2-shaped model (random init, nothing downloaded) on long-tail sequence lengths on N CPU ranks,
four times on the same samples, all in one ``torchrun`` launch (the training loop of ``examples/sft.py``,
``ds_odc.recipes.train``, mode after mode): stock ZeRO-3 with the usual per-rank sort, stock ZeRO-3 with balanced microbatches (``lb-micro``), ODC with
``lb-micro``, and ODC with ``lb-mini`` (different microbatch counts per rank). Every mode balances the automatic
cost, which it refits from its own measured step times. Prints the per-step losses, which must agree across modes,
then each mode's samples/s (and its speed against the first mode), the share of time ODC's ranks wait for each other
(its bubble; stock ZeRO-3's ranks wait inside every layer's collectives, where it cannot be measured), microbatches
per rank and fitted cost.

    python examples/compare.py                      # CPU, 2 ranks
    python examples/compare.py --json out.json      # also write every run's metrics
"""

from __future__ import annotations

import argparse
import json
import os
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
                   help="leading steps left out of samples/s and bubble (the automatic cost learns in them)")
    p.add_argument("--minibatch-size", type=int, default=2, help="samples per rank per optimizer step")
    p.add_argument("--preset", default="baselines-longtail")
    p.add_argument("--length-scale", type=float, default=0.06, help="scale preset lengths down for a CPU run")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="token budget per microbatch (default: one sample per microbatch, where lb-mini gives ranks "
                        "different microbatch counts)")
    p.add_argument("--cost", default="auto", help="balancer cost of every mode (examples/sft.py --cost)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", help="write all runs' metrics here")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # set by the launch: where rank 0 writes the runs
    return p.parse_args(argv)


def sft_argv(config: str, balancer: str, args) -> list[str]:
    argv = ["--deepspeed", str(ROOT / "ds_configs" / config), "--balancer", balancer, "--model", "tiny",
            "--preset", args.preset, "--length-scale", str(args.length_scale), "--minibatch-size",
            str(args.minibatch_size), "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps),
            "--seed", str(args.seed), "--cost", args.cost, "--quiet"]
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


def launch(args, result: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(Path(__file__).resolve()), "--worker", str(result)]
    for flag in ("steps", "warmup_steps", "minibatch_size", "preset", "length_scale", "max_tokens", "cost", "seed"):
        if getattr(args, flag) is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    # TMPDIR: torchrun's log folder goes into the run's temporary folder, removed with it
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
               DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore", TMPDIR=str(result.parent),
               PYTHONPATH=os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p))
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=args.timeout)
    sys.stdout.write("".join(line + "\n" for line in proc.stdout.splitlines() if line.startswith("running ")))
    if proc.returncode != 0 or not result.exists():
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"the training launch failed (rc={proc.returncode})")
    return json.loads(result.read_text())


def report(runs: dict, args) -> float:
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
    timed = f"steps {args.warmup_steps}-{args.steps - 1}" if args.warmup_steps else "all steps"
    print(f"\nlargest relative loss difference between modes: {worst:.2e}")
    print(f"(samples/s and bubble over {timed}. CPU timings of a tiny model show the mechanics, not GPU speed: see\n"
          " docs/BENCHMARKS.md)")
    return worst


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        runs = launch(args, Path(tmp) / "runs.json")
    worst = report(runs, args)
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "max_rel_loss_diff": worst}, indent=1))


if __name__ == "__main__":
    main()
