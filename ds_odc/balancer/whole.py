"""Planners that train every sample whole on one rank: ``local-sort``, ``lb-micro`` and ``lb-mini``.

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

Each planner is an *assignment* (``assign_*``: positions of the checked samples to microbatches per rank) run by
:func:`plan_whole`, which checks the inputs and builds the :class:`~ds_odc.balancer.plan.Plan`. Callers reach them
through the registry, :func:`ds_odc.balancer.planners.plan_minibatch`.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from .cost import CostModel
from .packing import PackingError, fewest_bins, pack_positions
from .partitioner import partition, search_from_heaviest
from .plan import Plan, checked_minibatch

__all__: list[str] = []

# (lengths, costs, fixed cost per microbatch, world size, max_tokens) -> per rank, microbatches of positions
Assignment = Callable[[list[int], list[float], float, int, "int | None"], list[list[list[int]]]]


def plan_whole(lengths: Sequence[int], world_size: int, *, assign: Assignment, name: str,
               max_tokens: int | None = None, cost: "str | CostModel" = "tokens", oversize: str = "error",
               sq_lengths: Sequence[float] | None = None) -> Plan:
    """Check the inputs, apply the oversize policy, and plan the remaining samples with ``assign``."""
    m = checked_minibatch(lengths, world_size, max_tokens, cost, oversize, sq_lengths)
    act = m.active.tolist()
    lens = m.lengths.tolist()
    positions = assign(lens, m.costs.tolist(), m.cost.per_microbatch, m.world_size, max_tokens)
    return Plan(
        microbatches=[[[act[j] for j in mb] for mb in rank] for rank in positions],
        num_samples=len(act),
        num_tokens=int(sum(lens)),
        planner=name,
        max_tokens=max_tokens,
        truncated=m.truncated,
        skipped=m.skipped,
    )


def assign_local_sort(lens: list[int], costs: list[float], fixed: float, W: int,
                      T: int | None) -> list[list[list[int]]]:
    out = []
    for r in range(W):
        pos = sorted(range(r, len(lens), W), key=lambda j: (lens[j], j))
        out.append([[j] for j in pos])
    return out


def _shares(parts: list[list[int]], lens: list[int], costs: list[float]):
    for p in parts:
        yield p, [lens[j] for j in p], [costs[j] for j in p]


def assign_lb_micro(lens: list[int], costs: list[float], fixed: float, W: int,
                    T: int | None) -> list[list[list[int]]]:
    parts = partition(costs, W, equal_size=True)
    shares = list(_shares(parts, lens, costs))
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
            locals_ = [pack_positions(pl, pc, T, m) for _, pl, pc in shares]
            break
        except PackingError:
            m += 1
    return [[[p[j] for j in mb] for mb in local] for (p, _, _), local in zip(shares, locals_)]


def assign_lb_mini(lens: list[int], costs: list[float], fixed: float, W: int,
                   T: int | None) -> list[list[list[int]]]:
    if T is None:  # one sample per microbatch: each sample pays the fixed cost once, exactly
        item = [x + fixed for x in costs]
    else:  # a sample's share of its microbatch's fixed cost; the exchange search below settles the true counts
        item = [x + fixed * L / T for x, L in zip(costs, lens)]
    parts = partition(item, W)
    if len(lens) > W:
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
    return shares.microbatches()


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
        return pack_positions([self.lens[j] for j in part], [self.costs[j] for j in part], self.T, None)

    def _count(self, part: list[int]) -> int:
        """Microbatches :meth:`_pack` makes of ``part`` (without ordering them)."""
        return len(fewest_bins([self.lens[j] for j in part], self.T)) if part else 0

    def _cost(self, part: list[int], bins: list[list[int]]) -> float:
        return math.fsum(self.costs[j] for j in part) + self.fixed * len(bins)

    def makespan(self) -> float:
        return max(self.total, default=0.0)

    def microbatches(self) -> list[list[list[int]]]:
        return [[[p[j] for j in mb] for mb in b] for p, b in zip(self.parts, self.bins)]

    def rebalance(self, max_evals: int, max_partners: int = 4) -> None:
        """Move or swap one sample between the costliest rank and a cheap one while that lowers the larger of the
        two (true costs, microbatch counts repacked): :func:`~ds_odc.balancer.partitioner.search_from_heaviest`
        over the ranks' true costs. Candidates are screened with the count lower bound ``ceil(tokens / T)`` and
        only the most promising few are repacked, so a step stays cheap."""
        T, L, c, fixed = self.T, self.lens, self.costs, self.fixed

        def improve(h: int, p: int, top: float, cost_p: float) -> bool:
            return self._improve(h, p, top - 1e-12 * top, T, L, c, fixed)

        search_from_heaviest(self.total, improve, max_evals=max_evals, max_partners=max_partners)

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
