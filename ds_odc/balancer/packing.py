"""Packing one rank's samples into microbatches under a token budget.

A microbatch is a list of sample indices whose lengths sum to at most ``max_tokens`` (the memory limit of one
packed forward/backward).  Two questions are answered here:

* ``k=None`` -- *how few* microbatches suffice?  Fewer, fuller microbatches use the GPU better.  First-fit
  decreasing gives a feasible count; if it is above the lower bound ``ceil(tokens / max_tokens)`` we also try a
  token-balanced :func:`~ds_odc.balancer.partitioner.partition` for each count in between and keep the first fit.
* ``k=m`` -- split into exactly ``m`` microbatches (collective training needs the same count on every rank).  The
  split balances *cost* (each sample's, by its documents) so that microbatch slot ``j`` takes about the same time
  on every rank; if that split breaks the budget we fall back to a token-balanced split, then to the
  fewest-microbatches packing split further.

Microbatches are returned heaviest first (by cost, ties by first index), which lines slot ``j`` up across ranks.
``max_tokens=None`` means no packing: one sample per microbatch.
"""

from __future__ import annotations

import math
from typing import Sequence

from .cost import CostModel, get_cost_model
from .partitioner import partition

__all__: list[str] = []


class PackingError(ValueError):
    """The samples do not fit in the requested number of microbatches."""


def pack(
    indices: Sequence[int],
    lengths: Sequence[int],
    max_tokens: int | None,
    k: int | None = None,
    cost: "str | CostModel" = "tokens",
    sq_lengths: Sequence[float] | None = None,
) -> list[list[int]]:
    """Pack ``indices`` (positions in ``lengths``) into microbatches of at most ``max_tokens`` tokens.

    Args:
        indices: the samples to pack.
        lengths: token count per sample, indexed by the values in ``indices``.
        max_tokens: token budget per microbatch, or ``None`` for one sample per microbatch.
        k: exact number of microbatches wanted (empty microbatches appear only if ``k > len(indices)``), or
            ``None`` for as few as possible.
        cost: cost model used to balance microbatches when ``k`` is given (each sample's own cost; the fixed
            cost of a microbatch is the same for all ``k`` of them).
        sq_lengths: per sample, the sum of its documents' squared lengths, indexed like ``lengths`` (``None``: one
            document per sample).

    Raises:
        ValueError: a sample is longer than ``max_tokens`` (handle it with the planner's ``oversize`` policy), or
            the samples cannot fit in ``k`` microbatches.
    """
    idx = [int(i) for i in indices]
    lens = [int(lengths[i]) for i in idx]
    sq = None if sq_lengths is None else [float(sq_lengths[i]) for i in idx]
    costs = get_cost_model(cost).sample_costs(lens, sq).tolist() if idx else []
    for i, L in zip(idx, lens):
        if max_tokens is not None and L > max_tokens:
            raise ValueError(
                f"sample {i} has {L} tokens, more than max_tokens={max_tokens}; raise max_tokens or use the "
                "planner's oversize='truncate' / 'skip' policy"
            )
    local = pack_positions(lens, costs, max_tokens, k)
    return [[idx[j] for j in mb] for mb in local]


def first_fit_decreasing(lens: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Classic FFD bin packing of positions ``0..n-1``; uses at most 11/9 OPT + 1 bins."""
    order = sorted(range(len(lens)), key=lambda j: (-lens[j], j))
    bins: list[list[int]] = []
    room: list[int] = []
    for j in order:
        L = lens[j]
        for b, r in enumerate(room):
            if L <= r:
                bins[b].append(j)
                room[b] = r - L
                break
        else:
            bins.append([j])
            room.append(max_tokens - L)
    return bins


def pack_positions(
    lens: list[int], costs: list[float], max_tokens: int | None, k: int | None
) -> list[list[int]]:
    """:func:`pack` on positions ``0..n-1`` with precomputed lengths and costs (what the planners call)."""
    n = len(lens)
    if k is None:
        if max_tokens is None:  # one sample each, heaviest first: what _order makes of singletons, sorted once
            return [[j] for j in sorted(range(n), key=lambda j: (-costs[j], j))]
        else:
            bins = fewest_bins(lens, max_tokens)
    else:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        bins = _exactly(lens, costs, max_tokens, k)
    return _order(bins, costs)


def _fits(bins: list[list[int]], lens: list[int], max_tokens: int) -> bool:
    return all(sum(lens[j] for j in b) <= max_tokens for b in bins)


def fewest_bins(lens: list[int], max_tokens: int) -> list[list[int]]:
    """Positions ``0..n-1`` in as few bins of ``max_tokens`` as found: FFD, or a token-balanced partition into
    fewer bins (from the lower bound ``ceil(tokens / max_tokens)`` up) when one fits. A longer item gets a bin
    of its own."""
    if not lens:
        return []
    ffd = first_fit_decreasing(lens, max_tokens)
    lower = max(1, math.ceil(sum(lens) / max_tokens))
    for m in range(lower, len(ffd)):
        bins = partition(lens, m)
        if _fits(bins, lens, max_tokens):
            return bins
    return ffd


def _exactly(lens: list[int], costs: list[float], max_tokens: int | None, k: int) -> list[list[int]]:
    n = len(lens)
    if k >= n:
        return [[j] for j in range(n)] + [[] for _ in range(k - n)]
    bins = partition(costs, k)
    if max_tokens is None or _fits(bins, lens, max_tokens):
        return bins
    bins = partition(lens, k)
    if _fits(bins, lens, max_tokens):
        return bins
    bins = fewest_bins(lens, max_tokens)
    if len(bins) > k:
        raise PackingError(
            f"{n} samples with {sum(lens)} tokens need more than k={k} microbatches of max_tokens={max_tokens}"
        )
    while len(bins) < k:  # split the costliest splittable microbatch in two; splitting never breaks the budget
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        b = max(splittable, key=lambda b: sum(costs[j] for j in bins[b]))
        items = bins.pop(b)
        halves = partition([costs[j] for j in items], 2)
        bins += [[items[j] for j in h] for h in halves]
    return bins


def _order(bins: list[list[int]], costs: list[float]) -> list[list[int]]:
    """Heaviest microbatch first; inside a microbatch, longest sample first (ties by position)."""
    out = [sorted(b, key=lambda j: (-costs[j], j)) for b in bins]
    out.sort(key=lambda b: (-sum(costs[j] for j in b), b[0] if b else math.inf))
    return out
