"""Simulated bubble rates with lb-mini-sp (samples split over groups of ranks) beside the other planners.

    python benchmarks/split_tables.py [--steps 20] [--seed 1] [--ranks 8,32,64,128,512]

Prints the markdown tables of docs/BENCHMARKS.md ("Giant samples"), every cell from
:func:`ds_odc.balancer.simulate.simulate` with the Qwen2.5-1.5B quadratic cost, planners told that cost, split
efficiency 0.8 (assumed until measured on several GPUs) and the policy's exchange prices (H200 estimate, 4x slower
between nodes of 8 ranks). Each row is also the simulator's command::

    python -m ds_odc.balancer.simulate --preset P --ranks R --minibatch-size M --max-tokens T --cost quadratic \\
        --model-config qwen2.5-1.5b --plan-cost given --steps 20 --seed 1 --split [--ranks-per-node N] --json

1. without a budget (heavy-tail and agent, 8 samples per rank) and long-sft with its 64k budget (4 per rank), 8-512
   ranks, with the group shapes used (``UxR``: Ulysses ranks x ring ranks);
2. every token budget, 64 ranks, seeds 1-3: lb-mini truncates the long samples, lb-mini-sp trains them whole;
3. the node size: the same 512-rank run with 8, 16 or 64 ranks per node;
4. the split efficiency: planned with the true one, and planned with 0.8 while the runs get the true one.

"bubble" is the simulator's (a split sample's extra work, the split overhead, counts as busy); "work bubble" counts
the split overhead as idle.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time

import numpy as np

from ds_odc.balancer.cost import QuadraticCost
from ds_odc.balancer.plan import step_time
from ds_odc.balancer.planners import plan_minibatch
from ds_odc.balancer.presets import MODEL_SHAPES, get_preset
from ds_odc.balancer.simulate import simulate
from ds_odc.balancer.sp import SplitPolicy

SHAPE = MODEL_SHAPES["qwen2.5-1.5b"]
COST = QuadraticCost.from_hf_config(SHAPE)
ALL = ("local-sort", "lb-micro", "lb-mini", "lb-mini-sp")
PAIR = ("lb-mini", "lb-mini-sp")
CASES = (("heavy-tail", 8, None), ("agent", 8, None), ("long-sft", 4, 65536))
BUDGETS = (8192, 16384, 32768, 65536)


def run(preset: str, ranks: int, m: int, T: int | None, steps: int, seed: int, planners=PAIR, **policy) -> dict:
    return simulate(preset, ranks=ranks, minibatch_size=m, max_tokens=T, cost=COST, steps=steps, seed=seed,
                    planners=planners, plan_cost="given", split=SplitPolicy.from_hf_config(SHAPE, **policy))


def shapes(s: dict) -> str:
    return ", ".join(f"{k}: {n}" for k, n in s["split_shapes"].items()) or "-"


def misjudged(assumed: float, true: float, ranks: int, steps: int, seed: int) -> tuple[float, float]:
    """(bubble, step-time gain over lb-mini) on heavy-tail when plans assume ``assumed`` and runs get ``true``."""
    rng = np.random.default_rng(seed)
    plan_policy = SplitPolicy.from_hf_config(SHAPE, efficiency=assumed)
    run_policy = SplitPolicy.from_hf_config(SHAPE, efficiency=true)
    busy = sp_time = mini_time = 0.0
    for _ in range(steps):
        lengths = get_preset("heavy-tail").sample(ranks * 8, rng)
        planned = plan_minibatch(lengths, ranks, planner="lb-mini-sp", cost=COST, split=plan_policy)
        plan = dataclasses.replace(planned, policy=run_policy)
        mbc = plan.microbatch_costs(COST, lengths)
        sp_time += step_time(mbc, "odc", plan.splits)
        busy += sum(map(sum, mbc))
        mini = plan_minibatch(lengths, ranks, planner="lb-mini", cost=COST)
        mini_time += max(mini.rank_costs(COST, lengths))
    return 1 - busy / (ranks * sp_time), mini_time / sp_time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ranks", default="8,32,64,128,512")
    ap.add_argument("--efficiencies", default="0.6,0.7,0.8,0.9")
    args = ap.parse_args()
    started = time.perf_counter()
    print(f"python {platform.python_version()}, numpy {np.__version__}; steps {args.steps}, seed {args.seed}\n")

    print("| preset | M | T | R | local-sort | lb-micro | lb-mini | lb-mini-sp | lb-mini-sp work bubble | "
          "lb-mini-sp vs lb-mini | split samples / step | group shapes UxR (count over all steps) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for preset, m, T in CASES:
        for R in (int(r) for r in args.ranks.split(",")):
            res = run(preset, R, m, T, args.steps, args.seed, planners=ALL)
            mini, sp = res["lb-mini"], res["lb-mini-sp"]
            cells = " | ".join(f"{res[p]['bubble_rate']:.1%}" for p in ALL)
            print(f"| {preset} | {m} | {T or '-'} | {R} | {cells} | {sp['work_bubble_rate']:.1%} | "
                  f"{mini['step_time'] / sp['step_time']:.2f}x | {sp['split_samples_per_step']:.1f} | {shapes(sp)} |")

    print("\nEvery token budget, 64 ranks, 8 samples per rank, seeds 1-3 (mean of the three runs' rates):\n")
    print("| preset | T | lb-mini bubble (truncates) | lb-mini-sp bubble (trains whole) | lb-mini-sp - lb-mini | "
          "lb-mini-sp work bubble | samples lb-mini truncates / step | split samples / step | group shapes UxR (seed 1) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for preset in ("heavy-tail", "agent"):
        for T in BUDGETS:
            runs = [run(preset, 64, 8, T, args.steps, seed) for seed in (1, 2, 3)]
            mean = {k: float(np.mean([r["lb-mini-sp"][k] for r in runs]))
                    for k in ("bubble_rate", "work_bubble_rate", "split_samples_per_step")}
            mini = float(np.mean([r["lb-mini"]["bubble_rate"] for r in runs]))
            cut = np.mean([r["lb-mini"]["truncated_samples"] for r in runs]) / args.steps
            print(f"| {preset} | {T} | {mini:.1%} | {mean['bubble_rate']:.1%} | "
                  f"{100 * (mean['bubble_rate'] - mini):+.1f} pt | {mean['work_bubble_rate']:.1%} | {cut:.1f} | "
                  f"{mean['split_samples_per_step']:.1f} | {shapes(runs[0]['lb-mini-sp'])} |")

    print("\nheavy-tail, 512 ranks, no budget, by ranks per node (groups across nodes pay 4x per exchanged byte):\n")
    print("| ranks per node | lb-mini-sp bubble | work bubble | lb-mini-sp vs lb-mini | group shapes UxR |")
    print("|---|---|---|---|---|")
    for rpn in (8, 16, 64):
        res = run("heavy-tail", 512, 8, None, args.steps, args.seed, ranks_per_node=rpn)
        mini, sp = res["lb-mini"], res["lb-mini-sp"]
        print(f"| {rpn} | {sp['bubble_rate']:.1%} | {sp['work_bubble_rate']:.1%} | "
              f"{mini['step_time'] / sp['step_time']:.2f}x | {shapes(sp)} |")

    print("\nheavy-tail, 64 ranks, by split efficiency (left: planned with the true efficiency; right: planned with 0.8 "
          "while the runs get the true one):\n")
    print("| efficiency | lb-mini-sp bubble | work bubble | lb-mini-sp vs lb-mini | planned with 0.8: bubble | "
          "planned with 0.8: vs lb-mini |")
    print("|---|---|---|---|---|---|")
    for eff in (float(e) for e in args.efficiencies.split(",")):
        res = run("heavy-tail", 64, 8, None, args.steps, args.seed, efficiency=eff)
        mini, sp = res["lb-mini"], res["lb-mini-sp"]
        wrong_bubble, wrong_gain = misjudged(0.8, eff, 64, args.steps, args.seed)
        print(f"| {eff:g} | {sp['bubble_rate']:.1%} | {sp['work_bubble_rate']:.1%} | "
              f"{mini['step_time'] / sp['step_time']:.2f}x | {wrong_bubble:.1%} | {wrong_gain:.2f}x |")
    print(f"\n({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
