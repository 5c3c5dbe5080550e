"""Simulator: predicted idle time (bubble rate) of each planner at cluster scale, from sequence lengths alone.

    python -m ds_odc.balancer.simulate (--lengths FILE | --preset NAME) --ranks R --minibatch-size M \\
        --max-tokens T [--cost tokens|quadratic|fitted] [--microbatch-overhead X] [--plan-cost auto|given|oracle] \\
        [--inter-node-gbs B --sharding flat|node [--tflops F]] [--steps N] [--seed S]
        [--planners A,B | --split [--model-config SHAPE] [--sp-efficiency E] [--ranks-per-node N]
        [--max-group-size G]] [--json] [--plot out.png]

For each of ``--steps`` minibatches, ``M * R`` lengths are drawn (``--seed``): from FILE (one length per line;
without replacement when the file is large enough) or from a preset (see :mod:`ds_odc.balancer.presets`).

**The simulated machine.** A microbatch takes the ``--cost`` model's time (its samples' ``a*L + b*L^2`` plus the
model's ``c``) plus ``--microbatch-overhead``. Step time depends on how the planner's runtime synchronises:

* collective (``local-sort``, ``lb-micro``): every microbatch ends in collectives, so microbatch slot ``j`` ends
  when the slowest rank finishes its ``j``-th microbatch: step = sum over slots j of max over ranks of cost(r, j);
* ODC (``lb-mini``, ``lb-mini-sp``): ranks only meet at the end of the minibatch (and a split sample's group
  for that sample): step = max over ranks of the rank's total, its waits for a group included.

**What the planners know** (``--plan-cost``): ``given``, the ``--cost`` model without the overhead; ``oracle``,
the machine's true cost, overhead included; ``auto`` (the default, as in training), the
:class:`~ds_odc.balancer.autocost.AutoCost` fit, starting from the ``--cost`` model plus a per-microbatch prior and
refitted after every simulated step from the simulated busy times (``--noise`` perturbs them), next to the oracle,
so the output shows how many steps the fit takes to plan as well as the truth would.

Bubble rate = 1 - sum(busy) / (R * makespan), aggregated over steps as
1 - sum_steps sum_ranks busy / (R * sum_steps step_time): the fraction of device time spent waiting. A planner that
splits samples over groups of ranks (``lb-mini-sp``) makes them cost more in all than trained whole (the split's
efficiency, the exchange, a fixed cost per member); that *split overhead* counts as busy in the bubble rate, and as
idle in the *work bubble rate*, 1 - (busy - split overhead) / (R * makespan) (the same as the bubble rate for the
planners that do not split). Each plan's step time follows its runtime: under ODC, split samples start when their
whole group is free, in the plan's order.

**Between nodes** (``--inter-node-gbs B``, GB/s leaving each node; needs ``--model-config`` for the parameter
count and a cost in seconds: ``--cost fitted``, or ``--cost quadratic --tflops F`` for a GPU sustaining F TFLOP/s):
the bytes :mod:`ds_odc.balancer.traffic` counts for the ``--sharding`` are charged at B, not overlapped with
compute. ``flat``: every microbatch's gathers and reductions cross nodes (stock ZeRO-3 under collectives, flat ODC,
G times the bytes, under ODC); ``node`` (one shard group per node of ``--ranks-per-node`` GPUs): nothing per
microbatch, one all-reduce of the gradient shards per step (MiCS-style under collectives, hybrid ODC under ODC).
That time counts as busy, so the bubble stays the time ranks wait for each other.

Otherwise the model ignores communication and the optimizer step; it isolates the imbalance a planner leaves. The
*balance bound* per step is max(fair share, costliest sample alone in a microbatch), the fair share being the
minibatch's least possible work (its samples plus the fewest microbatches the budget allows) over R: no planner can
finish a step sooner, so when one sample costs more than the fair share the bound, not the planner, limits the
gain (the bound counts compute only).
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

from .autocost import AutoCost
from .cost import MICROBATCH_PRIOR_TOKENS, CostModel, FittedCost, QuadraticCost, TokenCost, get_cost_model
from .lengths import read_lengths
from .plan import OVERSIZE_POLICIES, Plan, effective_lengths, odc_schedule, step_time
from .planners import BASELINE_PLANNER, PLANNERS, get_planner, plan_minibatch
from .presets import MODEL_SHAPES, PRESETS, get_preset
from .sp import DEFAULT_INTER_NODE_SLOWDOWN, SplitPolicy
from .traffic import InterNode, parameter_count

__all__ = ["simulate", "replay_run"]

WHOLE_SAMPLE_PLANNERS = tuple(name for name, p in PLANNERS.items() if not p.splits)  # the default comparison
PLAN_COSTS = ("auto", "given", "oracle")
CONVERGED = 0.02  # auto plans count as converged once their step times stay within 2% of the oracle's (or below)
CONVERGED_WINDOW = 5


@dataclass(frozen=True)
class Machine:
    """The simulated machine: a microbatch takes ``cost``'s time plus ``overhead``, plus ``internode``'s traffic
    between nodes (None: not modelled)."""

    cost: CostModel
    overhead: float = 0.0
    internode: InterNode | None = None

    def communication(self, sync: str) -> tuple[float, float]:
        """(seconds per microbatch, seconds per step) spent moving data between nodes under ``sync``."""
        if self.internode is None:
            return 0.0, 0.0
        return self.internode.per_microbatch(sync), self.internode.per_step(sync)

    @property
    def truth(self) -> FittedCost:
        """The machine's cost as one model (what an oracle planner would be told)."""
        a, b, c = self.cost.coefficients()
        return FittedCost(a, b, c + self.overhead)


@dataclass(frozen=True)
class StepResult:
    planner: str
    busy: np.ndarray  # per rank, cost units
    step_time: float
    num_microbatches: np.ndarray  # per rank
    truncated: int
    skipped: int
    microbatch_times: tuple[tuple[float, ...], ...] = ()  # per rank, per microbatch (for plots)
    tokens: np.ndarray | None = None  # per rank (what a run measures, for the automatic cost)
    sq_tokens: np.ndarray | None = None
    splits: tuple = ()  # the split samples (ds_odc.balancer.plan.SplitSample), in execution order
    split_overhead: float = 0.0  # busy time the groups spent beyond the split samples' cost trained whole
    internode: np.ndarray | None = None  # per rank, time spent moving data between nodes (in busy)


def run_plan(name: str, plan: Plan, lengths: Sequence[int], machine: Machine,
             runtime: str | None = None) -> StepResult:
    """Time ``plan`` on ``machine`` under ``runtime`` (default: the planner's; ``"odc"`` for a collective planner's
    plan trained under ODC, ``"collective"`` for one trained with per-layer meetings)."""
    runtime = runtime or get_planner(name).runtime
    per_mb, per_step = machine.communication(runtime)
    mbc = [[t + machine.overhead + per_mb for t in r] for r in plan.microbatch_costs(machine.cost, lengths)]
    tokens, sq_tokens = plan.rank_loads(lengths)  # a group member counts its share of a split sample
    split_overhead = 0.0  # what the groups spent beyond the split samples' cost trained whole on one rank
    if plan.splits:
        eff, sq = plan.trained_lengths(lengths)
        alone = machine.cost.sample_costs(eff, sq) + machine.truth.per_microbatch + per_mb
        seen = [0] * plan.world_size  # a member's split samples are its first microbatches, in plan order
        for s in plan.splits:
            spent = math.fsum(mbc[r][seen[r]] for r in s.ranks)
            for r in s.ranks:
                seen[r] += 1
            split_overhead += spent - float(alone[s.index])
    return StepResult(
        planner=name,
        busy=np.array([math.fsum(r) + per_step for r in mbc]),
        step_time=step_time(mbc, runtime, plan.splits) + per_step,
        num_microbatches=np.array([len(r) for r in plan.microbatches]),
        truncated=len(plan.truncated),
        skipped=len(plan.skipped),
        microbatch_times=tuple(tuple(r) for r in mbc),
        tokens=tokens,
        sq_tokens=sq_tokens,
        splits=plan.splits,
        split_overhead=split_overhead,
        internode=np.array([per_mb * len(r) + per_step for r in mbc]),
    )


def simulate_step(
    lengths: Sequence[int],
    ranks: int,
    max_tokens: int | None,
    cost: "str | CostModel" = "tokens",
    planners: Iterable[str] = WHOLE_SAMPLE_PLANNERS,
    oversize: str = "truncate",
    microbatch_overhead: float = 0.0,
    plan_cost: "CostModel | dict[str, CostModel] | None" = None,
    split: SplitPolicy | None = None,
    internode: InterNode | None = None,
    runtime: str | None = None,
) -> dict[str, StepResult]:
    """Plan one minibatch with each planner and time it under the planner's sync mode.

    ``cost``, ``microbatch_overhead`` and ``internode`` are the machine (see the module docstring); ``plan_cost``
    what the planners plan with (one model, or one per planner; default: ``cost``, blind to the overhead)."""
    machine = Machine(get_cost_model(cost), microbatch_overhead, internode)
    out = {}
    for name in planners:
        known = plan_cost.get(name) if isinstance(plan_cost, dict) else plan_cost
        plan = plan_minibatch(lengths, ranks, planner=name, max_tokens=max_tokens, cost=known or machine.cost,
                              oversize=oversize, split=split)
        out[name] = run_plan(name, plan, lengths, machine, runtime)
    return out


def balance_bound(lengths: np.ndarray, ranks: int, max_tokens: int | None, oversize: str,
                  machine: Machine) -> tuple[float, float, bool]:
    """(least total busy time, bound on the step time, whether one sample alone exceeds the fair share)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    truncated: Sequence[int] = ()
    if max_tokens is not None:
        over = lengths > max_tokens
        if oversize == "skip":
            lengths = lengths[~over]
        elif oversize == "truncate":
            truncated = np.flatnonzero(over)
    if lengths.size == 0:
        return 0.0, 0.0, False
    eff, sq = effective_lengths(lengths, None, truncated, max_tokens)
    costs = machine.cost.sample_costs(eff, sq)
    fixed = machine.truth.per_microbatch
    fewest = eff.size if max_tokens is None else max(1, -(-int(eff.sum()) // max_tokens))
    least = float(costs.sum()) + fixed * fewest
    fair, biggest = least / ranks, float(costs.max()) + fixed
    return least, max(fair, biggest), biggest > fair


def _draw(source: np.ndarray | str, n: int, rng: np.random.Generator) -> np.ndarray:
    if isinstance(source, str):
        return get_preset(source).sample(n, rng)
    return rng.choice(source, size=n, replace=len(source) < n)


def auto_prior(cost: CostModel) -> CostModel:
    """What ``plan_cost="auto"`` starts from: ``cost`` plus a microbatch worth :data:`MICROBATCH_PRIOR_TOKENS` of its
    per-token term, as the sampler's prior does."""
    a, b, c = cost.coefficients()
    return QuadraticCost(a=a, b=b, c=c + a * MICROBATCH_PRIOR_TOKENS)


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
    planners: Iterable[str] = WHOLE_SAMPLE_PLANNERS,
    keep_steps: bool = False,
    microbatch_overhead: float = 0.0,
    in_order: bool = False,
    plan_cost: str = "given",
    noise: float = 0.0,
    split: SplitPolicy | None = None,
    internode: InterNode | None = None,
) -> dict:
    """Run ``steps`` minibatches; ``source`` is a preset name or a pool of lengths.  Returns the JSON summary.

    ``in_order``: minibatch k is the pool's k-th run of ``ranks * minibatch_size`` lengths, as a sampler without
    shuffling sees a lengths file (to predict a measured run); at most ``len(pool) // (ranks * minibatch_size)``
    steps. ``plan_cost``: ``"given"``, ``"oracle"`` or ``"auto"`` (see the module docstring); with ``"auto"`` each
    planner also runs with the oracle's cost on the same minibatches, for comparison, and ``noise`` is the relative
    standard deviation of the busy times the fit sees."""
    if plan_cost not in PLAN_COSTS:
        raise ValueError(f"unknown plan_cost {plan_cost!r}; choose one of {PLAN_COSTS}")
    planners = list(planners)
    machine = Machine(get_cost_model(cost), microbatch_overhead, internode)
    pool = source if isinstance(source, str) else np.asarray(source, dtype=np.int64)
    rng = np.random.default_rng(seed)
    noise_rng = np.random.default_rng([seed, 1])
    per_step = ranks * minibatch_size
    if in_order:
        if isinstance(pool, str) or len(pool) < per_step:
            raise ValueError(f"in-order simulation needs a lengths file of at least {per_step} lengths")
        steps = min(steps, len(pool) // per_step)
    fits = {p: AutoCost(auto_prior(machine.cost)) for p in planners} if plan_cost == "auto" else {}
    runs: dict[str, list[StepResult]] = {p: [] for p in planners}
    oracle: dict[str, list[StepResult]] = {p: [] for p in planners}
    least_busy = bound_time = 0.0
    dominant = 0
    history = []
    for step in range(steps):
        lengths = pool[step * per_step:(step + 1) * per_step] if in_order else _draw(pool, per_step, rng)
        if plan_cost == "auto":
            known: "CostModel | dict[str, CostModel]" = {p: fits[p].model for p in planners}
        else:
            known = machine.truth if plan_cost == "oracle" else machine.cost
        res = simulate_step(lengths, ranks, max_tokens, machine.cost, planners, oversize, machine.overhead, known,
                            split, internode)
        if plan_cost == "auto":
            best = simulate_step(lengths, ranks, max_tokens, machine.cost, planners, oversize, machine.overhead,
                                 machine.truth, split, internode)
            for p, r in res.items():
                oracle[p].append(best[p])
                measured = r.busy * (1.0 + noise * noise_rng.standard_normal(r.busy.size)) if noise else r.busy
                fits[p].observe(r.tokens, r.sq_tokens, r.num_microbatches, measured)
        least, bound, dom = balance_bound(lengths, ranks, max_tokens, oversize, machine)
        least_busy += least
        bound_time += bound
        dominant += dom
        for p, r in res.items():
            runs[p].append(r)
        if keep_steps:
            history.append(res)
    base = sum(r.step_time for r in runs[BASELINE_PLANNER]) if BASELINE_PLANNER in runs else None
    summary = {}
    for p in planners:
        wall = sum(r.step_time for r in runs[p])
        busy = sum(float(r.busy.sum()) for r in runs[p])
        overhead = sum(r.split_overhead for r in runs[p])
        all_mbs = np.concatenate([r.num_microbatches for r in runs[p]])
        summary[p] = {
            "sync": get_planner(p).runtime,
            "plan_cost": plan_cost,
            "bubble_rate": max(0.0, 1.0 - busy / (ranks * wall)) if wall > 0 else 0.0,  # >= 0 but for rounding
            "work_bubble_rate": max(0.0, 1.0 - (busy - overhead) / (ranks * wall)) if wall > 0 else 0.0,
            "split_overhead_per_rank": overhead / (ranks * steps),
            "split_samples_per_step": sum(len(r.splits) for r in runs[p]) / steps,
            "split_shapes": _shape_counts(runs[p]),
            "step_time": wall / steps,
            "busy_time_per_rank": busy / (ranks * steps),
            "speedup_vs_local_sort": base / wall if base and wall > 0 else None,
            "microbatches_per_rank_mean": float(all_mbs.mean()),
            "microbatches_per_rank_max": int(all_mbs.max()),
            "microbatches_per_rank_min": int(all_mbs.min()),
            "truncated_samples": sum(r.truncated for r in runs[p]),
            "balance_bound_step_time": bound_time / steps,
            "balance_bound_bubble_rate": max(0.0, 1.0 - least_busy / (ranks * bound_time)) if bound_time > 0 else 0.0,
            "steps_with_dominant_sample": dominant,
            "internode_time_per_rank": sum(float(r.internode.mean()) for r in runs[p]) / steps,
        }
        if plan_cost == "auto":
            summary[p].update(_convergence(runs[p], oracle[p], fits[p], machine))
    if keep_steps:
        summary["_steps"] = history  # not JSON: for plotting
    return summary


def replay_run(metrics: dict, lengths: Sequence[int] | None = None, warmup_steps: int | None = None,
               cost: dict | None = None) -> dict:
    """The simulator's step time for a measured run, beside the measured one.

    ``metrics``: a ``--metrics-json`` file of ``examples/sft.py`` or ``benchmarks/fsdp2_sft.py`` run with
    ``--no-shuffle`` (as ``benchmarks/e2e.py`` runs them); ``lengths``: its samples' lengths (default: its
    ``--lengths-file``). Each timed step is simulated on the run's own minibatch, planned by the run's planner, under
    the run's sync (ODC's once per minibatch when ODC ran without ``lockstep``, else collective: every microbatch on
    every rank at once), with the cost fitted to the run's own timed rank-steps (:mod:`ds_odc.balancer.fit`; the cost
    the run had fitted itself when there are too few rank-steps), its per-step term added to every step; or with
    ``cost`` (``{"a", "b", "c", "d"}``, e.g. another run's replay's ``"cost"``): a prediction of this run from what
    was measured elsewhere. Returns ``{"predicted_s", "measured_s", "ratio", "bound_s", "steps", "cost"}``, totals
    over the timed steps; ratio = predicted / measured; bound_s: the balance bound of the same minibatches at the same
    cost (no plan that trains every sample whole on one rank finishes them sooner), so measured / bound is the most any
    such plan could gain over this run at this run's own speed. Raises ValueError when the run cannot be replayed."""
    from .fit import automatic_cost, fit, rank_steps

    config = metrics.get("config") or {}
    if not config.get("no_shuffle"):
        raise ValueError("only a run with --no-shuffle can be replayed (its minibatches are the file's in order)")
    if lengths is None:
        if not config.get("lengths_file"):
            raise ValueError("the run has no --lengths-file; pass its lengths")
        lengths = read_lengths(config["lengths_file"])
    warmup = int(config.get("warmup_steps", 0)) if warmup_steps is None else warmup_steps
    if cost is not None:
        a, b, c, d = (float(cost[k]) for k in "abcd")
        source = cost.get("source", "given")
    else:
        rows = rank_steps(metrics, warmup)
        try:
            (a, b, c, d), _ = fit(rows)
            source = "fit of the run's timed rank-steps"
        except ValueError:
            auto = automatic_cost(metrics)
            if auto is None:
                raise ValueError(f"{len(rows)} timed rank-steps and no automatic cost recorded: nothing to price the "
                                 "samples with") from None
            a, b, c, d = (float(auto[k]) for k in "abcd")
            source = "the run's automatic cost"
    ranks, per_rank = int(config["world_size"]), int(config["minibatch_size"])
    per_step = ranks * per_rank
    pool = np.asarray(lengths, dtype=np.int64)
    cost = FittedCost(a=a, b=b, c=c)
    planner = config["balancer"]
    runtime = None if "odc" not in config else "odc" if config["odc"] and not config.get("lockstep") else "collective"
    profiled = config.get("profile_step")
    predicted = measured = bound = 0.0
    machine = Machine(cost)
    timed = [i for i in range(len(metrics["steps"])) if i >= warmup and i != profiled]
    for i in timed:
        minibatch = pool[i * per_step:(i + 1) * per_step]
        if len(minibatch) < per_step:
            raise ValueError(f"the lengths hold {len(pool)} samples; step {i} needs {(i + 1) * per_step}")
        result = simulate_step(minibatch, ranks, config.get("max_tokens") or None, cost, [planner], "truncate",
                               runtime=runtime)
        predicted += result[planner].step_time + d
        bound += balance_bound(minibatch, ranks, config.get("max_tokens") or None, "truncate", machine)[1] + d
        measured += float(metrics["steps"][i]["step_time_s"])
    return {"predicted_s": predicted, "measured_s": measured, "ratio": predicted / measured if measured else math.nan,
            "bound_s": bound, "steps": len(timed), "cost": {"a": a, "b": b, "c": c, "d": d, "source": source}}


def _shape_counts(results: list[StepResult]) -> dict[str, int]:
    """How often each group shape was used, ``{"UxR": count}``, ordered by group size then Ulysses size."""
    counts: dict[tuple[int, int], int] = {}
    for r in results:
        for s in r.splits:
            counts[(s.size, s.ulysses)] = counts.get((s.size, s.ulysses), 0) + 1
    return {f"{u}x{g // u}": n for (g, u), n in sorted(counts.items())}


def _convergence(auto: list[StepResult], oracle: list[StepResult], fit: AutoCost, machine: Machine) -> dict:
    """How the auto plans compare with the oracle's on the same minibatches."""
    ratios = [a.step_time / o.step_time if o.step_time > 0 else 1.0 for a, o in zip(auto, oracle)]
    # Converged: the first step from which the step times are within 2% of the oracle's on average, both over the
    # next CONVERGED_WINDOW steps and over the rest of the run (single steps jitter either way: a heuristic planner
    # meets near-ties, and a noisy fit tips them).
    def mean(xs):
        return sum(xs) / len(xs)
    converged = next((i for i in range(len(ratios)) if mean(ratios[i:i + CONVERGED_WINDOW]) <= 1.0 + CONVERGED
                      and mean(ratios[i:]) <= 1.0 + CONVERGED), None)
    wall = sum(o.step_time for o in oracle)
    a, b, c = fit.model.coefficients()
    return {
        "oracle_step_time": wall / len(oracle),
        "vs_oracle_per_step": ratios,
        "converged_step": converged,
        "vs_oracle_after_convergence": (sum(ratios[converged:]) / len(ratios[converged:])
                                        if converged is not None else None),
        "fitted": {"a": a, "b": b, "c": c},
        "truth": dict(zip("abc", machine.truth.coefficients())),
    }


# -- the plot -------------------------------------------------------------------------------------------------------
def plot_steps(history: list[dict[str, StepResult]], path: str, title: str = "", max_ranks: int = 8) -> None:
    """All planners on one time axis: per rank, its microbatches (bars with edges) and its idle time (hatched) in
    every plotted step, one lane group per planner; vertical lines end each planner's steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    planners = list(history[0])
    ranks = min(len(history[0][planners[0]].busy), max_ranks)
    fig, ax = plt.subplots(figsize=(11, 0.32 * ranks * len(planners) + 1.6))
    colours = plt.get_cmap("tab10")
    y, yticks, ylabels = 0, [], []
    for k, name in enumerate(planners):
        start = 0.0
        for res in (h[name] for h in history):
            slot_starts = None
            runtime = get_planner(name).runtime
            if runtime == "collective":  # slot j starts when every rank finished slot j - 1
                slots = max((len(r) for r in res.microbatch_times), default=0)
                ends = np.cumsum([max((r[j] for r in res.microbatch_times if j < len(r)), default=0.0)
                                  for j in range(slots)])
                slot_starts = np.concatenate([[0.0], ends[:-1]]) if slots else np.zeros(0)
            split_starts, shared = None, [0] * ranks
            if res.splits:  # split samples first, when their whole group is free
                split_starts = odc_schedule(res.splits, res.microbatch_times)
                for split in res.splits:
                    for r in split.ranks:
                        if r < ranks:
                            shared[r] += 1
            for r in range(ranks):
                ax.barh(y + r, res.step_time, left=start, color="none", edgecolor="grey", hatch="///",
                        linewidth=0)  # idle shows through wherever no microbatch runs
                t = 0.0
                for j, d in enumerate(res.microbatch_times[r]):
                    if slot_starts is not None:
                        t = float(slot_starts[j])
                    if split_starts is not None:
                        t = split_starts[r][j]
                    ax.barh(y + r, d, left=start + t, color=colours(k), edgecolor="black", linewidth=0.4,
                            hatch="xx" if j < shared[r] else None)
                    t += d
            start += res.step_time
            ax.plot([start, start], [y - 0.5, y + ranks - 0.5], color="black", lw=1.0)
        bubble = 1.0 - sum(float(h[name].busy.sum()) for h in history) / (len(history[0][name].busy) * start)
        yticks.append(y + (ranks - 1) / 2)
        ylabels.append(f"{name}\n({get_planner(name).runtime})\nbubble {bubble:.1%}")
        y += ranks + 1
    ax.set_yticks(yticks, ylabels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"time (cost units); bars: microbatches of ranks 0-{ranks - 1} (crossed: split samples); "
                  "hatched: idle; lines: step ends")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the command line -----------------------------------------------------------------------------------------------
def _model_config(spec: str) -> dict:
    """A model config from a JSON file (e.g. a checkpoint's config.json) or the name of an example model shape."""
    try:
        with open(spec) as f:
            return json.load(f)
    except FileNotFoundError:
        pass
    if spec in MODEL_SHAPES:
        return dict(MODEL_SHAPES[spec], model_type="qwen2")  # the shapes are Qwen2.5's
    raise SystemExit(f"--model-config {spec!r}: neither a JSON file nor a known model shape {sorted(MODEL_SHAPES)}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ds_odc.balancer.simulate",
        description="Predict the bubble rate of the balancer's planners: "
                    + "; ".join(f"{p.name} ({p.runtime}): {p.description}" for p in PLANNERS.values()) + ".",
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", help="file with one sample length (tokens) per line")
    src.add_argument("--preset", choices=sorted(PRESETS), help="synthetic length distribution")
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--minibatch-size", type=int, required=True, help="samples per rank per minibatch")
    ap.add_argument("--max-tokens", type=int, required=True,
                    help="token budget per microbatch (0: no packing, one sample per microbatch)")
    ap.add_argument("--cost", default="tokens", choices=["tokens", "quadratic", "fitted"],
                    help="the simulated machine's cost of a sample (quadratic needs --model-config)")
    ap.add_argument("--model-config", metavar="JSON|SHAPE",
                    help="with --cost quadratic: the model's config.json, or a model shape of examples/sft.py "
                         "(e.g. qwen2.5-1.5b)")
    ap.add_argument("--cost-coeffs", metavar="A,B,C", help="with --cost fitted: A*L + B*L^2 per sample, C per "
                                                           "microbatch")
    ap.add_argument("--microbatch-overhead", type=float, default=0.0,
                    help="fixed cost of every microbatch on the simulated machine, in cost units (default 0)")
    ap.add_argument("--plan-cost", default="auto", choices=PLAN_COSTS,
                    help="what the planners plan with: auto (learned from the simulated steps, compared with the "
                         "oracle; default), given (--cost, blind to --microbatch-overhead), oracle (the truth)")
    ap.add_argument("--noise", type=float, default=0.0,
                    help="with --plan-cost auto: relative noise of the busy times the fit sees (e.g. 0.05)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--in-order", action="store_true",
                    help="with --lengths: consecutive minibatches of the file in order, as a run with --no-shuffle "
                         "(benchmarks/e2e.py) sees them, instead of random draws")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--oversize", default="truncate", choices=OVERSIZE_POLICIES,
                    help="samples longer than --max-tokens (default truncate; counted in the output)")
    ap.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    ap.add_argument("--plot", help="PNG: every planner's ranks on one time axis, microbatch by microbatch")
    ap.add_argument("--plot-steps", type=int, default=3, help="steps drawn by --plot (default 3)")
    splitting = [p.name for p in PLANNERS.values() if p.splits]
    ap.add_argument("--planners", default=None, metavar="A,B,...",
                    help=f"the planners to compare (default: {','.join(WHOLE_SAMPLE_PLANNERS)}; all: "
                         f"{','.join(PLANNERS)})")
    ap.add_argument("--split", action="store_true",
                    help=f"also plan {', '.join(splitting)} (samples no rank can take alone are split over groups of "
                         "ranks with sequence parallelism; the groups follow --model-config's attention heads)")
    ap.add_argument("--sp-efficiency", type=float, default=0.8,
                    help="with --split: a sample split g ways takes 1/(g*E) of its time per member (default 0.8)")
    ap.add_argument("--ranks-per-node", type=int, default=8,
                    help="GPUs per node (default 8): with --split, a group's exchange across nodes costs "
                         "--inter-node-slowdown times more; the node of --inter-node-gbs")
    ap.add_argument("--max-group-size", type=int, default=None,
                    help="with --split: the most ranks one sample is split over (default: --ranks)")
    ap.add_argument("--inter-node-slowdown", type=float, default=DEFAULT_INTER_NODE_SLOWDOWN,
                    help=f"with --split: how much longer a byte takes between nodes than inside one (default "
                         f"{DEFAULT_INTER_NODE_SLOWDOWN:g})")
    ap.add_argument("--inter-node-gbs", type=float, metavar="B",
                    help="charge the traffic between nodes at B GB/s per node (each way); needs --model-config and a "
                         "cost in seconds (--cost fitted, or --cost quadratic with --tflops)")
    ap.add_argument("--sharding", default="flat", choices=["flat", "node"],
                    help="with --inter-node-gbs: flat (stock ZeRO-3 / flat ODC) or one shard group per node "
                         "(MiCS-style / hybrid ODC)")
    ap.add_argument("--tflops", type=float, metavar="F",
                    help="with --cost quadratic: the GPU sustains F TFLOP/s, so costs (and --microbatch-overhead) "
                         "are in seconds")
    args = ap.parse_args(argv)

    try:
        source = args.preset if args.preset else read_lengths(args.lengths)
    except (OSError, ValueError) as err:
        ap.error(f"--lengths: {err}")
    cost: CostModel = TokenCost()
    if args.cost == "fitted":
        if not args.cost_coeffs:
            ap.error("--cost fitted needs --cost-coeffs A,B,C")
        a, b, c = (float(x) for x in args.cost_coeffs.split(","))
        cost = FittedCost(a=a, b=b, c=c)
    elif args.cost == "quadratic":
        if not args.model_config:
            ap.error("--cost quadratic derives a*L + b*L^2 from a model's shape: add --model-config CONFIG.json "
                     "(or a shape name such as qwen2.5-1.5b)")
        cost = QuadraticCost.from_hf_config(_model_config(args.model_config))
        if args.tflops:
            a, b, c = cost.coefficients()
            rate = args.tflops * 1e12
            cost = QuadraticCost(a=a / rate, b=b / rate, c=c / rate)
    internode = None
    if args.inter_node_gbs:
        if not args.model_config:
            ap.error("--inter-node-gbs counts bytes from the model's parameters: add --model-config")
        if not (args.cost == "fitted" or (args.cost == "quadratic" and args.tflops)):
            ap.error("--inter-node-gbs charges seconds: use --cost fitted (seconds) or --cost quadratic --tflops F")
        try:
            internode = InterNode(params=parameter_count(_model_config(args.model_config)), ranks=args.ranks,
                                  gpus_per_node=args.ranks_per_node, bandwidth=args.inter_node_gbs * 1e9,
                                  sharding=args.sharding)
        except ValueError as e:
            ap.error(str(e))
    planners = tuple(args.planners.split(",")) if args.planners else WHOLE_SAMPLE_PLANNERS
    if args.split:
        planners += tuple(p for p in splitting if p not in planners)
    try:
        specs = [get_planner(p) for p in planners]
    except ValueError as err:
        ap.error(f"--planners: {err}")
    split = None
    if any(p.splits for p in specs):
        options = dict(efficiency=args.sp_efficiency, ranks_per_node=args.ranks_per_node,
                       max_group_size=args.max_group_size, inter_node_slowdown=args.inter_node_slowdown)
        split = (SplitPolicy.from_hf_config(_model_config(args.model_config), **options) if args.model_config
                 else SplitPolicy(**options))
    t0 = time.perf_counter()
    try:
        summary = simulate(source, ranks=args.ranks, minibatch_size=args.minibatch_size,
                           max_tokens=args.max_tokens or None, cost=cost, steps=args.steps, seed=args.seed,
                           oversize=args.oversize, keep_steps=bool(args.plot),
                           microbatch_overhead=args.microbatch_overhead, in_order=args.in_order,
                           plan_cost=args.plan_cost, noise=args.noise, planners=planners, split=split,
                           internode=internode)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    history = summary.pop("_steps", None)
    if args.plot and history:
        plot_steps(history[:max(1, args.plot_steps)], args.plot,
                   f"{args.preset or args.lengths}: R={args.ranks}, M={args.minibatch_size}, T={args.max_tokens}, "
                   f"cost={args.cost}, overhead={args.microbatch_overhead:g}, plans: {args.plan_cost}")
    if args.json:
        print(json.dumps(summary))
        return 0
    _print_table(summary, args, time.perf_counter() - t0)
    return 0


def cost_unit(args: argparse.Namespace) -> tuple[str, str]:
    """The unit of the simulated times (step time, overhead, bound), and a line saying what it is."""
    if args.cost == "fitted":
        return "s", "times in seconds (the fitted cost's unit)"
    if args.cost == "quadratic" and args.tflops:
        return "s", f"times in seconds (training FLOPs at {args.tflops:g} TFLOP/s)"
    if args.cost == "quadratic":
        return "FLOPs", ("times in training FLOPs, not seconds (a sample of L tokens costs a*L + b*L^2 FLOPs; "
                         "--tflops F gives seconds)")
    return "tokens", ("times in tokens, not seconds: --cost tokens counts a sample of L tokens as L (--cost fitted, or "
                      "quadratic with --tflops, gives seconds)")


def _print_table(summary: dict, args: argparse.Namespace, seconds: float) -> None:
    src_name = f"preset {args.preset}" if args.preset else args.lengths
    network = (f" inter-node={args.inter_node_gbs:g} GB/s/node sharding={args.sharding} "
               f"G={args.ranks_per_node}" if args.inter_node_gbs else "")
    unit, meaning = cost_unit(args)
    print(f"{src_name}: R={args.ranks} M={args.minibatch_size} T={args.max_tokens} cost={args.cost} "
          f"overhead={args.microbatch_overhead:g} {unit} plans={args.plan_cost} steps={args.steps} seed={args.seed}"
          f"{network} (simulated in {seconds:.1f} s)")
    auto = args.plan_cost == "auto"
    print(f"{'planner':<11} {'sync':<10} {'bubble':>7} {'work bubble':>11} {f'step time ({unit})':>16} "
          f"{'speedup':>8} {'mb/rank':>12}" + (f" {f'inter-node ({unit})':>17}" if args.inter_node_gbs else "")
          + (f" {f'oracle step ({unit})':>18} {'within 2% from step':>20}" if auto else ""))
    for p, s in summary.items():
        line = (f"{p:<11} {s['sync']:<10} {s['bubble_rate']:>7.2%} {s['work_bubble_rate']:>11.2%} "
                f"{s['step_time']:>16.4g} "
                f"{s['speedup_vs_local_sort'] or 0:>7.3f}x {s['microbatches_per_rank_mean']:>5.2f} "
                f"[{s['microbatches_per_rank_min']}-{s['microbatches_per_rank_max']}]")
        if args.inter_node_gbs:
            line += f" {s['internode_time_per_rank']:>17.4g}"
        if auto:
            conv = s["converged_step"]
            line += f" {s['oracle_step_time']:>18.4g} {'never' if conv is None else conv:>20}"
        print(line)
    print(meaning)
    any_s = next(iter(summary.values()))
    if auto:
        f, t = any_s["fitted"], any_s["truth"]
        print(f"auto cost after {args.steps} steps: a={f['a']:.4g} b={f['b']:.4g} c={f['c']:.4g} per microbatch "
              f"(truth a={t['a']:.4g} b={t['b']:.4g} c={t['c']:.4g}; fit of the {next(iter(summary))} run)")
    print(f"balance bound: step time {any_s['balance_bound_step_time']:.4g} {unit} "
          f"(bubble {any_s['balance_bound_bubble_rate']:.2%}); in {any_s['steps_with_dominant_sample']} of "
          f"{args.steps} steps one sample costs more than the fair share total/R, so no planner that trains every "
          "sample whole can balance those steps fully")
    for p, s in summary.items():
        if s["split_shapes"]:
            shapes = ", ".join(f"{k}: {n}" for k, n in s["split_shapes"].items())
            print(f"{p}: {s['split_samples_per_step']:.1f} split samples per step; groups (Ulysses x ring: count) "
                  f"{shapes}; split overhead {s['split_overhead_per_rank']:.4g} {unit} per rank and step (busy in the "
                  "bubble, idle in the work bubble)")
    for p, s in summary.items():
        if s["truncated_samples"]:
            print(f"{p}: {s['truncated_samples']} samples longer than it can train were truncated ({args.oversize})")


if __name__ == "__main__":
    raise SystemExit(main())
