"""Planners: who trains which samples of a minibatch, in which microbatches.

A *minibatch* is the set of samples between two optimizer steps (all ranks together).  A planner maps it to, per
rank, a list of microbatches (lists of sample indices).  Three planners:

``local-sort`` (baseline, collective-compatible)
    Sample ``i`` goes to rank ``i % W``; each rank sorts its samples by length (shortest first) and runs one
    sample per microbatch, so slot ``j`` holds similar lengths on every rank.  Ranks hold the same count unless
    the minibatch size is not a multiple of ``W``; then the first ``n % W`` ranks hold one more (no padding
    samples are invented).  ``max_tokens`` only matters for the oversize policy.
``lb-micro`` (balanced, collective-compatible)
    Equal-cardinality partition of the costs over ranks, then every rank splits its share into the *same* number
    ``m`` of microbatches: the smallest count, starting from the largest per-rank bound ``ceil(tokens / budget)``,
    at which every rank's share fits (each rank evaluates every rank, so no all-reduce is needed); the split
    balances cost so slot ``j`` costs about the same on every rank.  Ranks hold one more sample or one empty
    microbatch only when ``n % W != 0``.
``lb-mini`` (balanced per minibatch, ODC only)
    Free-cardinality partition of the costs over ranks (no rank is empty unless ``n < W``), then each rank packs
    its share into as few microbatches as fit the budget.  Counts differ per rank, which only a runtime without
    per-microbatch collectives (ODC) can execute.  A rank's cost counts the fixed cost of each of its microbatches
    (the cost model's ``c``): one per sample without packing; with packing each sample first carries its share
    ``c * L / max_tokens`` of a microbatch, and after packing a bounded exchange search between the costliest rank
    and the cheapest ones evens out the true totals (packed microbatch counts included).

Costs are per sample (``a*L + b*S``, ``S`` the sum of its documents' squared lengths: pass ``sq_lengths`` for rows
that already pack several documents) plus ``c`` per microbatch; the token budget is checked in tokens.

All planners are pure functions of their arguments: every rank calls :func:`plan_minibatch` with the same lengths
and gets the same :class:`Plan` without communicating.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .cost import CostModel, get_cost_model
from .packing import PackingError, _fewest, _pack_local
from .partitioner import partition

__all__ = ["Plan", "plan_minibatch", "PLANNERS", "OVERSIZE_POLICIES"]

PLANNERS = ("local-sort", "lb-micro", "lb-mini")
OVERSIZE_POLICIES = ("error", "truncate", "skip")


@dataclass(frozen=True)
class Plan:
    """The plan of one minibatch for all ranks.

    Attributes:
        microbatches: ``microbatches[rank][j]`` is the list of sample indices (into the minibatch's ``lengths``)
            of microbatch ``j`` of ``rank``.
        num_samples: samples trained in the whole minibatch (skipped ones excluded): the global normaliser for a
            per-sample mean loss.
        num_tokens: tokens trained in the whole minibatch, after truncation.  With labels equal to the inputs the
            number of loss terms is ``num_tokens - num_samples`` (see :attr:`num_label_tokens`).
        planner: the planner's name.
        max_tokens: the budget used (``None``: one sample per microbatch).
        truncated: samples cut to ``max_tokens`` tokens (``oversize="truncate"``).
        skipped: samples left out of the plan (``oversize="skip"``).
    """

    microbatches: list[list[list[int]]]
    num_samples: int
    num_tokens: int
    planner: str
    max_tokens: int | None = None
    truncated: tuple[int, ...] = field(default=())
    skipped: tuple[int, ...] = field(default=())

    @property
    def world_size(self) -> int:
        return len(self.microbatches)

    @property
    def num_label_tokens(self) -> int:
        """Loss terms in the minibatch when labels are the shifted inputs: each sample's first token is no target."""
        return self.num_tokens - self.num_samples

    def num_microbatches(self, rank: int) -> int:
        return len(self.microbatches[rank])

    def rank_samples(self, rank: int) -> list[int]:
        return [i for mb in self.microbatches[rank] for i in mb]

    def effective_length(self, index: int, lengths: Sequence[int]) -> int:
        """Tokens sample ``index`` actually trains (its length, or ``max_tokens`` if it was truncated)."""
        L = int(lengths[index])
        return min(L, self.max_tokens) if index in self._truncated_set else L

    @property
    def _truncated_set(self) -> frozenset[int]:
        return frozenset(self.truncated)

    def microbatch_costs(self, cost_model: "str | CostModel", lengths: Sequence[int],
                         sq_lengths: Sequence[float] | None = None) -> list[list[float]]:
        """Cost of every microbatch of every rank under ``cost_model``: its samples' costs plus the model's fixed
        cost per microbatch (``c``; an empty microbatch costs nothing)."""
        cm = get_cost_model(cost_model)
        eff, eff_sq = effective_lengths(lengths, sq_lengths, self.truncated, self.max_tokens)
        c = cm.sample_costs(eff, eff_sq) if eff.size else np.zeros(0)
        fixed = cm.per_microbatch
        return [[float(c[mb].sum()) + fixed if mb else 0.0 for mb in rank] for rank in self.microbatches]

    def rank_costs(self, cost_model: "str | CostModel", lengths: Sequence[int],
                   sq_lengths: Sequence[float] | None = None) -> list[float]:
        """Total cost per rank: its busy time under ``cost_model``."""
        return [math.fsum(r) for r in self.microbatch_costs(cost_model, lengths, sq_lengths)]


def effective_lengths(lengths: Sequence[int], sq_lengths: Sequence[float] | None, truncated: Sequence[int],
                      max_tokens: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, sum of squared document lengths) per sample as trained: a truncated sample keeps ``max_tokens``
    tokens, and of a packed row's squared lengths the share of its kept tokens (at most ``max_tokens^2``)."""
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1).copy()
    sq = lens.astype(np.float64) ** 2 if sq_lengths is None else np.asarray(sq_lengths, dtype=np.float64).copy()
    if len(truncated):
        t = np.asarray(truncated, dtype=np.int64)
        T = float(max_tokens)
        sq[t] = np.minimum(sq[t] * T / np.maximum(lens[t], 1), T * T)
        lens[t] = np.minimum(lens[t], max_tokens)
    return lens, sq


def checked_minibatch(lengths: Sequence[int], world_size: int, max_tokens: int | None, cost: "str | CostModel",
                      oversize: str, sq_lengths: Sequence[float] | None, limit: int | None = None,
                      too_long: str | None = None):
    """A planner's checked inputs: ``(W, cost model, lengths, squared lengths, truncated, skipped)``, the lengths as
    trained. Samples longer than ``limit`` (default ``max_tokens``) get the ``oversize`` policy; ``too_long`` says why
    such a sample cannot be trained whole, in the error (default: it exceeds ``max_tokens``)."""
    if oversize not in OVERSIZE_POLICIES:
        raise ValueError(f"unknown oversize policy {oversize!r}; choose one of {OVERSIZE_POLICIES}")
    W = int(world_size)
    if W < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int or None, got {max_tokens}")
    cm = get_cost_model(cost)
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if lens.size and lens.min() < 0:
        raise ValueError("lengths must be non-negative")
    if sq_lengths is not None and len(sq_lengths) != lens.size:
        raise ValueError(f"sq_lengths has {len(sq_lengths)} entries for {lens.size} samples")
    limit = max_tokens if limit is None else limit

    truncated: tuple[int, ...] = ()
    skipped: tuple[int, ...] = ()
    if limit is not None:
        over = np.flatnonzero(lens > limit)
        if over.size:
            if oversize == "error":
                i = int(over[0])
                more = f" ({over.size} samples in total, e.g. {over[:5].tolist()})" if over.size > 1 else ""
                raise ValueError(
                    f"sample {i} has {int(lens[i])} tokens, {too_long or f'more than max_tokens={max_tokens}'}"
                    f"{more}. Raise max_tokens, filter long samples out of the dataset, or pass oversize='truncate' "
                    f"(train the first {limit} tokens) or oversize='skip' (leave them out; they are listed in "
                    "Plan.skipped)."
                )
            if oversize == "truncate":
                truncated = tuple(over.tolist())
            else:
                skipped = tuple(over.tolist())
    lens, sq = effective_lengths(lens, sq_lengths, truncated, limit)
    return W, cm, lens, sq, truncated, skipped


def plan_minibatch(
    lengths: Sequence[int],
    world_size: int,
    *,
    planner: str = "lb-mini",
    max_tokens: int | None = None,
    cost: "str | CostModel" = "tokens",
    oversize: str = "error",
    sq_lengths: Sequence[float] | None = None,
    split: "SplitPolicy | None" = None,
) -> Plan:
    """Plan one minibatch of samples with token counts ``lengths`` over ``world_size`` ranks.

    Args:
        lengths: token count of each sample of the (global) minibatch; indices in the plan refer to it.
        world_size: number of data-parallel ranks.
        planner: ``"local-sort"``, ``"lb-micro"`` or ``"lb-mini"`` (see the module docstring).
        max_tokens: token budget per microbatch; ``None`` disables packing (one sample per microbatch).
        cost: ``"tokens"`` or a :class:`~ds_odc.balancer.cost.CostModel` (e.g.
            ``QuadraticCost.from_hf_config(model.config)``); balances busy time. The budget is always checked in
            tokens.
        oversize: what to do with a sample longer than ``max_tokens``: ``"error"`` (raise), ``"truncate"``
            (train its first ``max_tokens`` tokens; listed in ``Plan.truncated``) or ``"skip"`` (leave it out;
            listed in ``Plan.skipped``).
        sq_lengths: per sample, the sum of its documents' squared lengths (a row packing several documents costs
            attention per document); ``None``: one document per sample.
        split: with ``planner="lb-mini-sp"`` (LB-Mini plus sequence parallelism for giant samples, ODC only), how
            samples may be split: a :class:`~ds_odc.balancer.sp.SplitPolicy` (see ``ds_odc.balancer.sp``).
    """
    if planner == "lb-mini-sp":  # samples no rank can take alone go to groups of ranks (balancer/sp.py)
        from .sp import plan_split
        return plan_split(lengths, world_size, max_tokens=max_tokens, cost=cost, oversize=oversize, split=split,
                          sq_lengths=sq_lengths)
    if planner not in PLANNERS:
        raise ValueError(f"unknown planner {planner!r}; choose one of {PLANNERS}")
    W, cm, lens, sq, truncated, skipped = checked_minibatch(lengths, world_size, max_tokens, cost, oversize,
                                                            sq_lengths)

    active = np.arange(lens.size)
    if skipped:
        active = np.setdiff1d(active, np.asarray(skipped, dtype=np.int64))
    act = active.tolist()
    act_lens = lens[active].tolist()
    act_costs = cm.sample_costs(lens[active], sq[active]).tolist() if act else []

    if planner == "local-sort":
        mbs = _local_sort(act, act_lens, W)
    elif planner == "lb-micro":
        mbs = _lb_micro(act, act_lens, act_costs, W, max_tokens)
    else:
        mbs = _lb_mini(act, act_lens, act_costs, cm.per_microbatch, W, max_tokens)
    return Plan(
        microbatches=mbs,
        num_samples=len(act),
        num_tokens=int(sum(act_lens)),
        planner=planner,
        max_tokens=max_tokens,
        truncated=truncated,
        skipped=skipped,
    )


def _local_sort(act: list[int], lens: list[int], W: int) -> list[list[list[int]]]:
    out = []
    for r in range(W):
        pos = sorted(range(r, len(act), W), key=lambda j: (lens[j], j))
        out.append([[act[j]] for j in pos])
    return out


def _split(parts: list[list[int]], lens: list[int], costs: list[float]):
    for p in parts:
        yield p, [lens[j] for j in p], [costs[j] for j in p]


def _lb_micro(act: list[int], lens: list[int], costs: list[float], W: int, T: int | None) -> list[list[list[int]]]:
    parts = partition(costs, W, equal_size=True)
    shares = list(_split(parts, lens, costs))
    if T is None:
        m = max(len(p) for p in parts)
    else:
        # Smallest common count: start at the largest per-rank lower bound ceil(tokens / T) and raise it until
        # every rank's share fits (rarely needed more than once).
        m = max((max(1, math.ceil(sum(pl) / T)) if pl else 0) for _, pl, _ in shares)
    if m == 0:  # empty minibatch
        return [[] for _ in range(W)]
    while True:
        try:
            locals_ = [_pack_local(pl, pc, T, m) for _, pl, pc in shares]
            break
        except PackingError:
            m += 1
    return [[[act[p[j]] for j in mb] for mb in local] for (p, _, _), local in zip(shares, locals_)]


def _lb_mini(act: list[int], lens: list[int], costs: list[float], fixed: float, W: int,
             T: int | None) -> list[list[list[int]]]:
    if T is None:  # one sample per microbatch: each sample pays the fixed cost once, exactly
        item = [x + fixed for x in costs]
    else:  # a sample's share of its microbatch's fixed cost; the exchange search below settles the true counts
        item = [x + fixed * L / T for x, L in zip(costs, lens)]
    parts = partition(item, W)
    if len(act) > W:
        # Equal-size solutions are feasible here too and sometimes balance better (the free local search may stop
        # at a worse optimum); keeping the better one makes lb-mini never less balanced than lb-micro's split.
        equal = partition(item, W, equal_size=True)
        if _max_sum(equal, item) < _max_sum(parts, item):
            parts = equal
    shares = _RankPacking(parts, lens, costs, fixed, T)
    if T is not None and fixed > 0.0:
        # The shares are an estimate of the packed counts; the split that ignores them packs differently and is
        # sometimes better: keep whichever packs to the lower true makespan, then rebalance it.
        plain = _RankPacking(partition(costs, W), lens, costs, fixed, T)
        if plain.makespan() < shares.makespan():
            shares = plain
        shares.rebalance(max_evals=W // 2 + 16)  # bounded: ~30% of the plan's time at 512 ranks
    return [[[act[j] for j in mb] for mb in local] for local in shares.microbatches()]


def _max_sum(parts: list[list[int]], costs: list[float]) -> float:
    return max(sum(costs[j] for j in p) for p in parts)


class _RankPacking:
    """Each rank's samples, packed into its fewest microbatches, with its true cost: samples + fixed cost x count."""

    def __init__(self, parts: list[list[int]], lens: list[int], costs: list[float], fixed: float, T: int | None):
        self.lens, self.costs, self.fixed, self.T = lens, costs, fixed, T
        self.parts = [list(p) for p in parts]
        self.bins = [self._pack(p) for p in self.parts]
        self.total = [self._cost(p, b) for p, b in zip(self.parts, self.bins)]

    def _pack(self, part: list[int]) -> list[list[int]]:
        return _pack_local([self.lens[j] for j in part], [self.costs[j] for j in part], self.T, None)

    def _count(self, part: list[int]) -> int:
        """Microbatches :meth:`_pack` makes of ``part`` (without ordering them)."""
        return len(_fewest([self.lens[j] for j in part], self.T)) if part else 0

    def _cost(self, part: list[int], bins: list[list[int]]) -> float:
        return math.fsum(self.costs[j] for j in part) + self.fixed * len(bins)

    def makespan(self) -> float:
        return max(self.total, default=0.0)

    def microbatches(self) -> list[list[list[int]]]:
        return [[[p[j] for j in mb] for mb in b] for p, b in zip(self.parts, self.bins)]

    def rebalance(self, max_evals: int, max_partners: int = 4) -> None:
        """Move or swap one sample between the costliest rank and a cheap one while that lowers the larger of the
        two (true costs, microbatch counts repacked). Candidates are screened with the count lower bound
        ``ceil(tokens / T)`` and only the most promising few are repacked, so a step stays cheap."""
        T, L, c, fixed = self.T, self.lens, self.costs, self.fixed
        order = sorted((t, r) for r, t in enumerate(self.total))  # ranks by cost, kept sorted by bisection
        evals = 0
        while evals < max_evals:
            top, h = order[-1]
            tol = 1e-12 * top
            hit = None
            for cost_p, p in order[:max_partners]:
                if top - cost_p <= tol or evals >= max_evals:
                    break
                evals += 1
                if self._improve(h, p, top - tol, T, L, c, fixed):
                    hit = (cost_p, p)
                    break
            if hit is None:
                return
            for key in ((top, h), hit):
                del order[bisect_left(order, key)]
            insort(order, (self.total[h], h))
            insort(order, (self.total[hit[1]], hit[1]))

    def _improve(self, h: int, p: int, limit: float, T: int, L: list[int], c: list[float], fixed: float) -> bool:
        H, P = self.parts[h], self.parts[p]
        tok_h, tok_p = sum(L[j] for j in H), sum(L[j] for j in P)
        cost_h, cost_p = math.fsum(c[j] for j in H), math.fsum(c[j] for j in P)

        def bound(tokens: int, cost: float, nonempty: bool) -> float:
            return cost + fixed * (max(1, -(-tokens // T)) if nonempty else 0)

        screened = []
        for a in H:
            for b in [None] + P:
                if b is None and len(H) == 1:
                    continue
                dl = L[a] - (0 if b is None else L[b])
                dc = c[a] - (0.0 if b is None else c[b])
                est = max(bound(tok_h - dl, cost_h - dc, True), bound(tok_p + dl, cost_p + dc, True))
                if est < limit:
                    screened.append((est, a, -1 if b is None else b))
        for _, a, b in sorted(screened)[:3]:
            new_h = [j for j in H if j != a] + ([] if b < 0 else [b])
            new_p = [j for j in P if j != b] + [a]
            th = math.fsum(c[j] for j in new_h) + fixed * self._count(new_h)
            tp = math.fsum(c[j] for j in new_p) + fixed * self._count(new_p)
            if max(th, tp) < limit:
                self.parts[h], self.parts[p] = new_h, new_p
                for r in (h, p):
                    self.bins[r] = self._pack(self.parts[r])
                    self.total[r] = self._cost(self.parts[r], self.bins[r])
                return True
        return False
