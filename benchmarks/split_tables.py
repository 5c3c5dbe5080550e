"""Simulated bubble rates with lb-mini-sp (giant samples split over groups of ranks) beside the other planners.

    python benchmarks/split_tables.py [--steps 20] [--ranks 8,32,64,128,512] [--efficiencies 0.6,0.7,0.8,0.9]

Prints markdown tables (docs/BENCHMARKS.md, "Giant samples"): for the ``agent`` preset (8 samples per rank, no
packing) and ``long-sft`` (4 per rank, max_tokens 65,536), the Qwen2.5-1.5B quadratic cost, planners told that cost
(``--plan-cost given``), split efficiency 0.8 and groups of up to 8 ranks that the model's 12/2 heads allow (2 or
4). Each row is the simulator's command::

    python -m ds_odc.balancer.simulate --preset P --ranks R --minibatch-size M --max-tokens T --cost quadratic \\
        --model-config qwen2.5-1.5b --plan-cost given --steps 20 --seed 0 --split [--sp-efficiency E] --json

"bubble" is the simulator's (a split sample's extra work counts as busy); "work bubble" counts it as idle:
1 - (lb-mini's busy time, the minibatch's useful work) / lb-mini-sp's step time. Then the sensitivity of the 64-rank
agent row to the efficiency, which is assumed until it is measured on several GPUs.
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
from ds_odc.balancer.simulate import simulate
from ds_odc.balancer.sp import SplitPolicy
from ds_odc.balancer.presets import MODEL_SHAPES, get_preset

PLANNERS = ("local-sort", "lb-micro", "lb-mini", "lb-mini-sp")
CASES = (("agent", 8, None), ("long-sft", 4, 65536))


def _split_stats(preset: str, ranks: int, m: int, T: int | None, cost, policy, steps: int, seed: int):
    """Split samples per step and the group sizes used, on the simulator's minibatches (same draws)."""
    rng = np.random.default_rng(seed)
    counts, sizes = [], {}
    for _ in range(steps):
        lengths = get_preset(preset).sample(ranks * m, rng)
        plan = plan_minibatch(lengths, ranks, planner="lb-mini-sp", max_tokens=T, cost=cost, oversize="truncate",
                              split=policy)
        counts.append(len(plan.splits))
        for s in plan.splits:
            sizes[s.size] = sizes.get(s.size, 0) + 1
    return float(np.mean(counts)), dict(sorted(sizes.items()))


def _misjudged(cost, shape, assumed: float, true: float, steps: int, seed: int, ranks: int = 64) -> tuple[float, float]:
    """(work bubble, step-time gain over lb-mini) when plans assume efficiency ``assumed`` and runs get ``true``."""
    rng = np.random.default_rng(seed)
    plan_policy = SplitPolicy.from_hf_config(shape, efficiency=assumed)
    run_policy = SplitPolicy.from_hf_config(shape, efficiency=true)
    useful = sp_time = mini_time = 0.0
    for _ in range(steps):
        lengths = get_preset("agent").sample(ranks * 8, rng)
        planned = plan_minibatch(lengths, ranks, planner="lb-mini-sp", cost=cost, split=plan_policy)
        plan = dataclasses.replace(planned, policy=run_policy)
        sp_time += step_time(plan.microbatch_costs(cost, lengths), "odc", plan.splits)
        mini = plan_minibatch(lengths, ranks, planner="lb-mini", cost=cost)
        mini_time += max(mini.rank_costs(cost, lengths))
        useful += float(cost(lengths).sum())
    return 1 - useful / (ranks * sp_time), mini_time / sp_time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ranks", default="8,32,64,128,512")
    ap.add_argument("--efficiencies", default="0.6,0.7,0.8,0.9")
    args = ap.parse_args()
    shape = MODEL_SHAPES["qwen2.5-1.5b"]
    cost = QuadraticCost.from_hf_config(shape)
    started = time.perf_counter()
    print(f"python {platform.python_version()}, numpy {np.__version__}; steps {args.steps}, seed {args.seed}\n")
    print("| preset | M | T | R | local-sort | lb-micro | lb-mini | lb-mini-sp | lb-mini-sp work bubble | "
          "lb-mini-sp vs lb-mini | split samples / step | groups (size: count) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    policy = SplitPolicy.from_hf_config(shape)
    for preset, m, T in CASES:
        for R in (int(r) for r in args.ranks.split(",")):
            res = simulate(preset, ranks=R, minibatch_size=m, max_tokens=T, cost=cost, steps=args.steps,
                           seed=args.seed, planners=PLANNERS, split=policy)
            mini, sp = res["lb-mini"], res["lb-mini-sp"]
            work = 1 - mini["busy_time_per_rank"] / sp["step_time"]
            per_step, sizes = _split_stats(preset, R, m, T, cost, policy, args.steps, args.seed)
            cells = " | ".join(f"{res[p]['bubble_rate']:.1%}" for p in PLANNERS)
            print(f"| {preset} | {m} | {T or '-'} | {R} | {cells} | {work:.1%} | "
                  f"{mini['step_time'] / sp['step_time']:.2f}x | {per_step:.1f} | "
                  f"{', '.join(f'{g}: {n}' for g, n in sizes.items()) or '-'} |")
    print("\nagent, 64 ranks, by split efficiency (planned with the true efficiency; then planned with 0.8 while the "
          "runs get the true one):\n")
    print("| efficiency | lb-mini-sp bubble | work bubble | lb-mini-sp vs lb-mini | planned with 0.8: work bubble | "
          "planned with 0.8: vs lb-mini |")
    print("|---|---|---|---|---|---|")
    for eff in (float(e) for e in args.efficiencies.split(",")):
        res = simulate("agent", ranks=64, minibatch_size=8, max_tokens=None, cost=cost, steps=args.steps,
                       seed=args.seed, planners=("lb-mini", "lb-mini-sp"),
                       split=SplitPolicy.from_hf_config(shape, efficiency=eff))
        mini, sp = res["lb-mini"], res["lb-mini-sp"]
        wrong_bubble, wrong_gain = _misjudged(cost, shape, 0.8, eff, args.steps, args.seed)
        print(f"| {eff:g} | {sp['bubble_rate']:.1%} | {1 - mini['busy_time_per_rank'] / sp['step_time']:.1%} | "
              f"{mini['step_time'] / sp['step_time']:.2f}x | {wrong_bubble:.1%} | {wrong_gain:.2f}x |")
    print(f"\n({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
