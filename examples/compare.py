"""The main job: the same SFT run under stock ZeRO-3 and under ZeRO-3 + ODC, side by side.

Trains a tiny Qwen2-shaped model (random init, nothing downloaded) on N CPU ranks, four ways on the same samples,
all in one ``torchrun`` launch: stock ZeRO-3 with the usual per-rank sort, stock ZeRO-3 with balanced microbatches
(``lb-micro``), ODC with ``lb-micro``, and ODC with ``lb-mini`` (different microbatch counts per rank). The four
engines live side by side and every minibatch is trained by each of them in turn, in an order that rotates from one
minibatch to the next (the training loop of ``examples/sft.py``, ``ds_odc.recipes.train.SftRun``, one step at a
time), so a burst of another program's load lands on one step of one mode, not on a whole mode; every comparison is
made within a step (ratios, then their median over the steps). ODC with ``lb-mini`` trains through DeepSpeed's own
three-line loop (``engine(**batch)``, ``engine.backward(loss)``, ``engine.step()``) over the loader that
``deepspeed.initialize(training_data=...)`` returns under ``zero_optimization.odc.balancer`` (``examples/sft.py
--loop stock``); the other modes through the recipe's loop. Every mode draws the same minibatches (checked before
training) and balances the automatic cost, which it refits from its own measured step times.

The data has the shape that makes balancing matter: every optimizer step's minibatch holds one long sample
(``--long-tokens``) among short ones (``--short-tokens``), as when a few long conversations sit among many short
ones. ``lb-micro`` must give every rank the same number of samples, so the rank with the long sample also gets short
ones and the others wait for it; ``lb-mini`` can give it fewer. ``--preset NAME`` trains on a preset's lengths
instead (``ds_odc.balancer.presets``).

Prints the per-step losses, which must agree across modes, each mode's samples/s and speed against the first mode,
the share of time ODC's ranks wait for each other (its bubble; stock ZeRO-3's ranks wait inside every layer's
collectives, where it cannot be measured), microbatches per rank, what lb-mini changed against lb-micro on the same
minibatches, step by step, and the fitted cost. Draws every rank's busy and waiting time per step, lb-micro above
lb-mini, into a PNG (``--plot``; needs matplotlib).

    .venv/bin/python examples/compare.py                      # CPU, 2 ranks
    .venv/bin/python examples/compare.py --json out.json      # also write every run's metrics
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ds_odc.training.launch import run_launch

ROOT = Path(__file__).resolve().parent.parent
MODES = [  # (label, ds_config, balancer, loop: the recipe's own, or DeepSpeed's over the balancer key's loader)
    ("stock + local-sort", "zero3_fp32_cpu.json", "local-sort", "recipe"),
    ("stock + lb-micro", "zero3_fp32_cpu.json", "lb-micro", "recipe"),
    ("odc + lb-micro", "zero3_odc_fp32_cpu.json", "lb-micro", "recipe"),
    ("odc + lb-mini", "zero3_odc_fp32_cpu.json", "lb-mini", "stock"),
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
    p.add_argument("--plot", default=str(ROOT / "runs" / "compare" / "busy-wait.png"),
                   help="draw per-rank busy and waiting time per step, lb-micro above lb-mini, into this PNG "
                        "(default: %(default)s; '' draws nothing)")
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


def sft_argv(config: str, balancer: str, loop: str, args) -> list[str]:
    data = (["--lengths-file", args.lengths_file, "--no-shuffle"] if args.lengths_file else
            ["--preset", args.preset, "--length-scale", str(args.length_scale)])
    argv = ["--deepspeed", str(ROOT / "ds_configs" / config), "--balancer", balancer, "--loop", loop, "--model",
            "tiny", *data, "--minibatch-size", str(args.minibatch_size), "--steps", str(args.steps), "--warmup-steps",
            str(args.warmup_steps), "--seed", str(args.seed), "--cost", args.cost, "--quiet"]
    return argv + (["--max-tokens", str(args.max_tokens)] if args.max_tokens else [])


def check_same_minibatches(samplers: dict, steps: int) -> None:
    """Every mode's sampler (the recipe's own, or the one inside the stock loop's loader) must cut the same samples
    into the same minibatches, in the same order, for the first ``steps`` steps: the losses are compared step by
    step."""
    drawn = {label: s.epoch_order(0)[:steps * s.global_minibatch_size].reshape(steps, -1) for label, s in
             samplers.items()}
    first, *others = drawn
    for label in others:
        differ = [i for i in range(steps) if sorted(drawn[label][i].tolist()) != sorted(drawn[first][i].tolist())]
        if differ:
            raise SystemExit(f"{label} trains other samples than {first} in steps {differ}: every mode must draw the "
                             "same minibatches (the same lengths, seed, shuffle and minibatch size)")


def worker(args) -> None:
    """Runs on every rank: one process group, the four engines alive at once, every minibatch trained by each mode in
    turn. The order rotates by one mode per minibatch (the same on every rank), so each mode takes each place in
    turn."""
    import torch.distributed as dist

    from ds_odc.recipes.sft import sft_argument_parser
    from ds_odc.recipes.train import SftRun
    from ds_odc.training.distributed import init_distributed, shutdown_and_exit

    init_distributed()
    if dist.get_rank() == 0:
        print(f"running {len(MODES)} modes side by side, each minibatch under every mode in turn ...", flush=True)
    runs = [SftRun(sft_argument_parser().parse_args(sft_argv(config, balancer, loop, args)))
            for _, config, balancer, loop in MODES]
    check_same_minibatches({label: run.sampler for (label, *_), run in zip(MODES, runs)}, min(run.steps for run in runs))
    orders = []
    for step in range(min(run.steps for run in runs)):
        order = [(step + i) % len(runs) for i in range(len(runs))]
        for m in order:
            runs[m].step()
        orders.append([MODES[m][0] for m in order])
    out = {label: run.finish() for (label, *_), run in zip(MODES, runs)}
    if dist.get_rank() == 0:
        Path(args.worker).write_text(json.dumps({"runs": out, "order": orders}))
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
    finished = run_launch(cmd, env=env, timeout=args.timeout)
    sys.stdout.write("".join(line + "\n" for line in finished.output.splitlines() if line.startswith("running ")))
    if finished.returncode != 0 or not result.exists():
        sys.stderr.write(finished.output[-9000:])
        raise SystemExit(f"the training launch failed: it {finished.describe(args.timeout, '--timeout')}")
    return json.loads(result.read_text())


def step_by_step(runs: dict, warmup_steps: int) -> dict:
    """Every comparison the job prints, made within each timed step (all modes trained that minibatch within moments
    of each other) and summed up by the median over the steps: each mode's samples/s and its speed against the first
    mode, ODC's bubble, and what lb-mini changed against lb-micro (both ODC) on the same minibatches: in how many
    steps the rank with the most tokens trained fewer samples than another (and one alone), in how many lb-mini's
    ranks waited less (a smaller bubble), and lb-mini's speed against lb-micro."""
    labels = list(runs)
    steps = {label: runs[label]["steps"] for label in labels}
    n = min(len(s) for s in steps.values())
    timed = range(min(warmup_steps, n - 1), n)
    first = labels[0]

    def median_over_steps(value) -> float:
        return statistics.median(value(i) for i in timed)

    def speed(label: str, against: str) -> float:  # median over the steps of the step-time ratio
        return median_over_steps(lambda i: steps[against][i]["step_time_s"] / steps[label][i]["step_time_s"])

    def heaviest(step: dict) -> dict:  # the rank with the most tokens (the long sample's)
        return max(step["per_rank"], key=lambda r: r["tokens"])

    def fewer_samples(step: dict) -> bool:  # it trained fewer samples than another rank
        return heaviest(step)["microbatches"] < max(r["microbatches"] for r in step["per_rank"])

    modes = {label: {"samples_per_s": median_over_steps(lambda i, label=label: steps[label][i]["samples_per_s"]),
                     "speed": speed(label, first),
                     "bubble": median_over_steps(lambda i, label=label: steps[label][i]["bubble_rate"]),
                     "bubble_whole": runs[label]["summary"]["bubble_rate"]} for label in labels}
    odc = [label for label in labels if label.startswith("odc")]
    stock = [label for label in labels if label not in odc]
    mini, micro = steps["odc + lb-mini"], steps["odc + lb-micro"]
    return {
        "steps": len(timed), "first_step": timed[0], "modes": modes,
        "odc_above_stock": min(modes[m]["speed"] for m in odc) > max(modes[m]["speed"] for m in stock),
        "odc_above_stock_steps": sum(max(steps[m][i]["step_time_s"] for m in odc)
                                     < min(steps[m][i]["step_time_s"] for m in stock) for i in timed),
        "heaviest_rank_fewer_samples": sum(fewer_samples(mini[i]) for i in timed),
        "heaviest_rank_one_sample": sum(heaviest(mini[i])["microbatches"] == 1 for i in timed),
        "waited_less": sum(mini[i]["bubble_rate"] < micro[i]["bubble_rate"] for i in timed),
        "bubble": {"lb-mini": modes["odc + lb-mini"]["bubble"], "lb-micro": modes["odc + lb-micro"]["bubble"]},
        "lb_mini_speed": speed("odc + lb-mini", "odc + lb-micro"),
        "max_rel_loss_diff": max(abs(s["loss"] - r["loss"]) / abs(r["loss"]) for label in labels
                                 for s, r in zip(steps[label], steps[first])),
    }


def report(runs: dict, args) -> dict:
    labels = list(runs)
    shown = step_by_step(runs, args.warmup_steps)
    n, first_timed, last = shown["steps"], shown["first_step"], len(runs[labels[0]]["steps"]) - 1
    print("\nloss per step (global token mean; identical data in every mode)")
    print("step  " + "  ".join(f"{label:>18}" for label in labels))
    for step in range(last + 1):
        print(f"{step:>4}  " + "  ".join(f"{runs[label]['steps'][step]['loss']:>18.6f}" for label in labels))
    first = labels[0]
    print(f"\n{'mode':<20}{'samples/s':>10}{'speed':>8}  {'bubble':<22}microbatches per rank, step by step")
    for label in labels:
        m = shown["modes"][label]
        counts = " ".join("/".join(str(r["microbatches"]) for r in step["per_rank"]) for step in runs[label]["steps"])
        bubble = f"{m['bubble']:.1%}" if label.startswith("odc") else "in every layer (*)"
        print(f"{label:<20}{m['samples_per_s']:>10.1f}{m['speed']:>7.2f}x  {bubble:<22}{counts}")
    seen = ", ".join(f"{shown['modes'][label]['bubble']:.1%}" for label in labels if not label.startswith("odc"))
    print(f"medians over steps {first_timed}-{last}, every minibatch trained by each mode in turn. samples/s: of the "
          f"median step.\nspeed: the median of the steps' ratios against {first} on the same minibatch; both ODC "
          f"modes took\nless time than both stock modes in {shown['odc_above_stock_steps']} of {n} steps. bubble: the "
          "share of the ranks' time spent waiting for each\nother, which ODC does only at the optimizer step, where "
          "it is measured whole.\n"
          "(*) stock ZeRO-3's ranks wait for each other inside every layer's all-gather and reduce-scatter, where no\n"
          "    clock tells waiting from work, so its bubble cannot be shown next to ODC's: compare samples/s. The\n"
          f"    waits seen outside the collectives ({seen}) are only what little shows.")

    bubble, mini, micro = shown["bubble"], runs["odc + lb-mini"]["steps"], runs["odc + lb-micro"]["steps"]
    print(f"\nlb-mini against lb-micro (both ODC), same minibatches, steps {first_timed}-{last}:\n"
          f"  the rank with the most tokens trained fewer samples than another in {shown['heaviest_rank_fewer_samples']}"
          f" of {n} steps, one sample alone in {shown['heaviest_rank_one_sample']}\n"
          f"  lb-mini's ranks waited less in {shown['waited_less']} of {n} steps; bubble {bubble['lb-mini']:.1%} "
          f"against {bubble['lb-micro']:.1%} (median step)\n"
          f"  lb-mini's speed against lb-micro: {shown['lb_mini_speed']:.2f}x (median of the steps' ratios)\n"
          "  bubble per step, lb-micro: " + " ".join(f"{s['bubble_rate']:.0%}" for s in micro[first_timed:]) + "\n"
          "                   lb-mini:  " + " ".join(f"{s['bubble_rate']:.0%}" for s in mini[first_timed:]))

    print("\nautomatic cost at the end of each run (busy = a*tokens + b*sum L^2 + c*microbatches + d)")
    for label in labels:
        cost = next((st["cost"] for st in reversed(runs[label]["steps"]) if st.get("cost")), None)
        if cost and cost["fitted"]:
            c = f"c {cost['c']:.3g} s/microbatch" if cost["c_measured"] else "c not measured (equal counts)"
            print(f"{label:<20} a {cost['a']:.3g} s/token  b {cost['b']:.3g} s/token^2  {c}  d {cost['d']:.3g} s/step")
        elif cost:
            print(f"{label:<20} still the prior (too few steps to fit)")
    print(f"\nlargest relative loss difference between modes: {shown['max_rel_loss_diff']:.2e}")
    print("(CPU timings of a tiny model show the mechanics, not GPU speed: see docs/BENCHMARKS.md)")
    return shown


def draw_busy_wait(runs: dict, path: Path, first_timed: int) -> bool:
    """Every rank's busy and waiting time per step, lb-micro above lb-mini on the same axes, into the PNG ``path``.
    False (and nothing drawn) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels, long_color = ["odc + lb-micro", "odc + lb-mini"], "#0b2f66"  # the busy bar of the rank with most tokens
    world = len(runs[panels[0]]["steps"][0]["per_rank"])
    width = 0.8 / world
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 6.4), sharex=True, sharey=True)
    for ax, label in zip(axes, panels):
        steps = runs[label]["steps"]
        ax.axvspan(-0.5, first_timed - 0.5, color="0.92", zorder=0)
        for i, step in enumerate(steps):
            heaviest = max(range(world), key=lambda r: step["per_rank"][r]["tokens"])
            for r, rank in enumerate(step["per_rank"]):
                x = i + (r - (world - 1) / 2) * width
                ax.bar(x, rank["busy_s"], width * 0.92, color=long_color if r == heaviest else "tab:blue", zorder=2)
                ax.bar(x, rank["wait_s"], width * 0.92, bottom=rank["busy_s"], color="tab:orange", alpha=0.55,
                       hatch="//", edgecolor="tab:orange", zorder=2)
                ax.text(x, rank["busy_s"] / 2, str(rank["microbatches"]), ha="center", va="center", fontsize=7,
                        color="white", zorder=3)
            ax.text(i, step["step_time_s"], f"{step['bubble_rate']:.0%}", ha="center", va="bottom", fontsize=7,
                    color="0.3")
        timed = [s["bubble_rate"] for s in steps[first_timed:]]
        ax.set_title(f"{label}: bubble {statistics.median(timed):.0%} in the median step "
                     f"(steps {first_timed}-{len(steps) - 1})", fontsize=10, loc="left")
        ax.set_ylabel("seconds")
        ax.margins(y=0.15)
        ax.grid(axis="y", color="0.85", zorder=1)
    axes[0].text(first_timed / 2 - 0.5, axes[0].get_ylim()[1] * 0.97, "warm-up: the cost is fitted", ha="center",
                 va="top", fontsize=8, color="0.4")
    axes[-1].set_xticks(range(len(runs[panels[0]]["steps"])))
    axes[-1].set_xlabel(f"optimizer step (one bar per rank, rank 0 on the left; the number in a bar: the samples "
                        f"that rank trained; above: the step's bubble)")
    axes[0].legend(handles=[Patch(color=long_color, label="busy, the rank with the long sample"),
                            Patch(color="tab:blue", label="busy, the other ranks"),
                            Patch(facecolor="tab:orange", alpha=0.55, hatch="//", edgecolor="tab:orange",
                                  label="waiting for the other ranks")], loc="upper right", fontsize=8)
    fig.suptitle("Per-rank busy and waiting time per step, ODC, same minibatches", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ds_odc_compare_") as tmp:
        launched = launch(args, Path(tmp))
    runs = launched["runs"]
    shown = report(runs, args)
    if args.plot:
        plot = Path(args.plot).resolve()
        if draw_busy_wait(runs, plot, shown["first_step"]):
            print(f"per-rank busy and waiting time per step: {plot}")
        else:
            print("matplotlib is not installed (pip install matplotlib): no plot drawn")
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({**launched, "step_by_step": shown}, indent=1))


if __name__ == "__main__":
    main()
