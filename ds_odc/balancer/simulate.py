"""Simulator: predicted idle time (bubble rate) of each planner at cluster scale, from sequence lengths alone.

    python -m ds_odc.balancer.simulate (--lengths FILE | --preset NAME) --ranks R --minibatch-size M \\
        --max-tokens T [--cost tokens|quadratic] [--steps N] [--seed S] [--json] [--plot out.png]

For each of ``--steps`` minibatches, ``M * R`` lengths are drawn (``--seed``): from FILE (one length per line;
without replacement when the file is large enough) or from a preset (see :mod:`ds_odc.balancer.presets`).  Each
planner plans the minibatch; a rank's *busy* time is the summed cost (``--cost``) of its samples.  Step time
depends on how the planner's runtime synchronises:

* collective (``local-sort``, ``lb-micro``): every microbatch ends in collectives, so microbatch slot ``j`` ends
  when the slowest rank finishes its ``j``-th microbatch: step = sum over slots j of max over ranks of cost(r, j);
* ODC (``lb-mini``): ranks only meet at the end of the minibatch: step = max over ranks of the rank's total.

Bubble rate = 1 - sum(busy) / (R * makespan), aggregated over steps as
1 - sum_steps sum_ranks busy / (R * sum_steps step_time): the fraction of device time spent waiting.

The model ignores communication and the optimizer step; it isolates the imbalance a planner leaves. A fixed cost per
microbatch (``--microbatch-overhead``, e.g. the host overhead measured on GPUs) can be added to every microbatch.  The *balance bound* per step is max(total / R, costliest sample): no minibatch-level planner can
finish faster, so when one sample costs more than the fair share the bound, not the planner, limits the gain.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from .cost import CostModel, FittedCost, get_cost_model
from .planners import PLANNERS, Plan, plan_minibatch
from .presets import PRESETS, get_preset

__all__ = ["SYNC_MODE", "StepResult", "simulate_step", "simulate", "main"]

SYNC_MODE = {"local-sort": "collective", "lb-micro": "collective", "lb-mini": "odc", "lb-mini-sp": "odc-sp"}


@dataclass(frozen=True)
class StepResult:
    planner: str
    busy: np.ndarray  # per rank, cost units
    step_time: float
    num_microbatches: np.ndarray  # per rank
    truncated: int
    skipped: int


def step_time_of(plan: Plan, mb_costs: Sequence[Sequence[float]], sync: str) -> float:
    """Step time of one plan under ``sync`` ("collective", "odc", or "odc-sp": ODC whose split samples make their
    groups meet) given per-microbatch costs."""
    if sync == "odc-sp":
        from .sp import split_step_time
        return split_step_time(plan, mb_costs)
    if sync == "odc":
        return max((math.fsum(r) for r in mb_costs), default=0.0)
    slots = max((len(r) for r in mb_costs), default=0)
    return math.fsum(max((r[j] for r in mb_costs if j < len(r)), default=0.0) for j in range(slots))


def simulate_step(
    lengths: Sequence[int],
    ranks: int,
    max_tokens: int | None,
    cost: "str | CostModel" = "tokens",
    planners: Iterable[str] = PLANNERS,
    oversize: str = "truncate",
    microbatch_overhead: float = 0.0,
    split: "SplitPolicy | None" = None,
) -> dict[str, StepResult]:
    """Plan one minibatch with each planner and time it under the planner's sync mode. ``microbatch_overhead`` (cost
    units) is added to every microbatch's time but not told to the planners: the fixed host cost a runtime pays per
    microbatch (measured on GPUs: docs/BENCHMARKS.md)."""
    cm = get_cost_model(cost)
    out = {}
    for name in planners:
        plan = plan_minibatch(lengths, ranks, planner=name, max_tokens=max_tokens, cost=cm, oversize=oversize,
                              split=split)
        mbc = [[c + microbatch_overhead for c in r] for r in plan.microbatch_costs(cm, lengths)]
        out[name] = StepResult(
            planner=name,
            busy=np.array([math.fsum(r) for r in mbc]),
            step_time=step_time_of(plan, mbc, SYNC_MODE[name]),
            num_microbatches=np.array([len(r) for r in plan.microbatches]),
            truncated=len(plan.truncated),
            skipped=len(plan.skipped),
        )
    return out


def _draw(source: np.ndarray | str, n: int, rng: np.random.Generator) -> np.ndarray:
    if isinstance(source, str):
        return get_preset(source).sample(n, rng)
    return rng.choice(source, size=n, replace=len(source) < n)


def simulate(
    source: "np.ndarray | Sequence[int] | str",
    *,
    ranks: int,
    minibatch_size: int,
    max_tokens: int | None,
    cost: "str | CostModel" = "tokens",
    steps: int = 20,
    seed: int = 0,
    oversize: str = "truncate",
    planners: Iterable[str] = PLANNERS,
    keep_steps: bool = False,
    microbatch_overhead: float = 0.0,
    in_order: bool = False,
    split: "SplitPolicy | None" = None,
) -> dict:
    """Run ``steps`` minibatches; ``source`` is a preset name or a pool of lengths.  Returns the JSON summary.

    ``in_order``: minibatch k is the pool's k-th run of ``ranks * minibatch_size`` lengths, as a sampler without
    shuffling sees a lengths file (to predict a measured run); at most ``len(pool) // (ranks * minibatch_size)``
    steps."""
    planners = list(planners)
    cm = get_cost_model(cost)
    pool = source if isinstance(source, str) else np.asarray(source, dtype=np.int64)
    rng = np.random.default_rng(seed)
    busy = {p: 0.0 for p in planners}
    wall = {p: 0.0 for p in planners}
    mbs = {p: [] for p in planners}
    trunc = {p: 0 for p in planners}
    bound_time, dominant = 0.0, 0
    history = []
    per_step = ranks * minibatch_size
    if in_order:
        if isinstance(pool, str) or len(pool) < per_step:
            raise ValueError(f"in-order simulation needs a lengths file of at least {per_step} lengths")
        steps = min(steps, len(pool) // per_step)
    for step in range(steps):
        lengths = pool[step * per_step:(step + 1) * per_step] if in_order else _draw(pool, per_step, rng)
        res = simulate_step(lengths, ranks, max_tokens, cm, planners, oversize, microbatch_overhead, split)
        eff = lengths if max_tokens is None or oversize != "truncate" else np.minimum(lengths, max_tokens)
        c = cm(eff)
        fair, biggest = float(c.sum()) / ranks, float(c.max())
        bound_time += max(fair, biggest)
        dominant += biggest > fair
        for p, r in res.items():
            busy[p] += float(r.busy.sum())
            wall[p] += r.step_time
            mbs[p].append(r.num_microbatches)
            trunc[p] += r.truncated
        if keep_steps:
            history.append(res)
    base = wall.get("local-sort")
    summary = {}
    for p in planners:
        all_mbs = np.concatenate(mbs[p])
        summary[p] = {
            "sync": SYNC_MODE[p],
            "bubble_rate": 1.0 - busy[p] / (ranks * wall[p]) if wall[p] > 0 else 0.0,
            "step_time": wall[p] / steps,
            "busy_time_per_rank": busy[p] / (ranks * steps),
            "speedup_vs_local_sort": base / wall[p] if base and wall[p] > 0 else None,
            "microbatches_per_rank_mean": float(all_mbs.mean()),
            "microbatches_per_rank_max": int(all_mbs.max()),
            "microbatches_per_rank_min": int(all_mbs.min()),
            "truncated_samples": trunc[p],
            "balance_bound_step_time": bound_time / steps,
            "balance_bound_bubble_rate": 1.0 - busy[p] / (ranks * bound_time) if bound_time > 0 else 0.0,
            "steps_with_dominant_sample": dominant,
        }
    if keep_steps:
        summary["_steps"] = history  # not JSON: for plotting
    return summary


def plot_step(res: dict[str, StepResult], path: str, title: str = "") -> None:
    """Per-rank busy (filled) and idle (hatched, up to the step time) bars, one panel per planner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(res), 1, figsize=(10, 2.2 * len(res)), sharex=True, squeeze=False)
    for ax, (name, r) in zip(axes[:, 0], res.items()):
        x = np.arange(len(r.busy))
        idle = r.step_time - r.busy
        ax.bar(x, r.busy, width=1.0, color="tab:blue", label="busy")
        ax.bar(x, idle, bottom=r.busy, width=1.0, color="tab:red", alpha=0.35, label="idle")
        bubble = 1.0 - r.busy.sum() / (len(r.busy) * r.step_time) if r.step_time else 0.0
        ax.set_ylabel("cost")
        ax.set_title(f"{name} ({SYNC_MODE[name]}): bubble {bubble:.1%}", fontsize=9)
    axes[0, 0].legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("rank")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _read_lengths(path: str) -> np.ndarray:
    vals = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                vals.append(int(float(line)))
            except ValueError:
                raise SystemExit(f"{path}:{lineno}: expected one integer length per line, got {line!r}") from None
    if not vals:
        raise SystemExit(f"{path}: no lengths found")
    return np.asarray(vals, dtype=np.int64)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ds_odc.balancer.simulate",
        description="Predict the bubble rate of local-sort, lb-micro (collective) and lb-mini (ODC).",
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", help="file with one sample length (tokens) per line")
    src.add_argument("--preset", choices=sorted(PRESETS), help="synthetic length distribution")
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--minibatch-size", type=int, required=True, help="samples per rank per minibatch")
    ap.add_argument("--max-tokens", type=int, required=True,
                    help="token budget per microbatch (0: no packing, one sample per microbatch)")
    ap.add_argument("--cost", default="tokens", choices=["tokens", "quadratic", "fitted"])
    ap.add_argument("--cost-coeffs", metavar="A,B,C", help="with --cost fitted: cost = A*L + B*L^2 + C per sample")
    ap.add_argument("--microbatch-overhead", type=float, default=0.0,
                    help="fixed cost of every microbatch, in cost units, unknown to the planners (default 0)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--in-order", action="store_true",
                    help="with --lengths: consecutive minibatches of the file in order, as a run with --no-shuffle "
                         "(benchmarks/e2e.py) sees them, instead of random draws")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--oversize", default="truncate", choices=["error", "truncate", "skip"],
                    help="samples longer than --max-tokens (default truncate; counted in the output)")
    ap.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    ap.add_argument("--plot", help="PNG of per-rank busy/idle bars for the first step")
    ap.add_argument("--split", action="store_true",
                    help="also plan lb-mini-sp (ODC, giant samples split over groups of ranks with sequence "
                         "parallelism); with --cost quadratic the groups follow the Qwen2.5-1.5B heads (12/2)")
    ap.add_argument("--sp-efficiency", type=float, default=0.8,
                    help="with --split: a sample split g ways takes 1/(g*E) of its time per member (default 0.8)")
    ap.add_argument("--ranks-per-node", type=int, default=8, help="with --split: largest group (default 8)")
    args = ap.parse_args(argv)

    source = args.preset if args.preset else _read_lengths(args.lengths)
    split, planners = None, PLANNERS
    if args.split:
        from .sp import SPLIT_PLANNER, SplitPolicy
        options = dict(efficiency=args.sp_efficiency, ranks_per_node=args.ranks_per_node)
        split = SplitPolicy.qwen2_1_5b(**options) if args.cost == "quadratic" else SplitPolicy(**options)
        planners = PLANNERS + (SPLIT_PLANNER,)
    cost: "str | CostModel" = args.cost
    if args.cost == "fitted":
        if not args.cost_coeffs:
            ap.error("--cost fitted needs --cost-coeffs A,B,C")
        a, b, c = (float(x) for x in args.cost_coeffs.split(","))
        cost = FittedCost(a=a, b=b, c=c)
    t0 = time.perf_counter()
    try:
        summary = simulate(source, ranks=args.ranks, minibatch_size=args.minibatch_size,
                           max_tokens=args.max_tokens or None, cost=cost, steps=args.steps, seed=args.seed,
                           oversize=args.oversize, keep_steps=bool(args.plot),
                           microbatch_overhead=args.microbatch_overhead, in_order=args.in_order,
                           planners=planners, split=split)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    history = summary.pop("_steps", None)
    if args.plot and history:
        plot_step(history[0], args.plot,
                  f"{args.preset or args.lengths}: R={args.ranks}, M={args.minibatch_size}, T={args.max_tokens}, "
                  f"cost={args.cost}, step 0")
    if args.json:
        print(json.dumps(summary))
        return 0
    src_name = f"preset {args.preset}" if args.preset else args.lengths
    print(f"{src_name}: R={args.ranks} M={args.minibatch_size} T={args.max_tokens} cost={args.cost} "
          f"steps={args.steps} seed={args.seed} ({time.perf_counter() - t0:.1f} s)")
    print(f"{'planner':<11} {'sync':<10} {'bubble':>7} {'step time':>12} {'speedup':>8} {'mb/rank':>12}")
    for p, s in summary.items():
        print(f"{p:<11} {s['sync']:<10} {s['bubble_rate']:>7.2%} {s['step_time']:>12.4g} "
              f"{s['speedup_vs_local_sort']:>7.3f}x {s['microbatches_per_rank_mean']:>5.2f} "
              f"[{s['microbatches_per_rank_min']}-{s['microbatches_per_rank_max']}]")
    any_s = next(iter(summary.values()))
    print(f"balance bound: step time {any_s['balance_bound_step_time']:.4g} "
          f"(bubble {any_s['balance_bound_bubble_rate']:.2%}); in {any_s['steps_with_dominant_sample']} of "
          f"{args.steps} steps one sample costs more than the fair share total/R, so no minibatch planner can "
          "balance those steps fully")
    if any_s["truncated_samples"]:
        print(f"{any_s['truncated_samples']} samples longer than --max-tokens were truncated ({args.oversize})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
