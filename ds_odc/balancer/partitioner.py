"""k-way number partitioning: Karmarkar-Karp (largest differencing) followed by a local search.

Given item costs and ``k`` bins, :func:`partition` returns ``k`` lists of item indices whose cost sums are close
to each other; the objective is the largest bin (the makespan: the slowest rank sets the step time).

Karmarkar-Karp, k-way (free sizes)
    Every item starts as a k-tuple of bins holding only that item.  Repeatedly take the two tuples with the
    largest *spread* (largest minus smallest bin) and merge them: the i-th heaviest bin of one joins the i-th
    lightest bin of the other, so big bins absorb small ones and the spreads cancel.  The last tuple is the answer.
    A tuple is stored sparsely (its non-empty bins in a min-heap plus its maximum), so merging a nearly-empty tuple
    costs O(its bins * log k) rather than O(k).

    Above ``FREE_KK_MAX_ITEMS`` (1,024) items the free variant starts from the equal-size tuples below instead
    (n/k merges done in numpy rather than n merges in Python: 4,096 items on 512 bins take ~1 ms instead of
    ~14 ms); with n >> k singleton KK degenerates to greedy LPT anyway, and the local search's moves then free
    the cardinalities.

Karmarkar-Karp, equal sizes
    Items are sorted and cut into consecutive groups of ``k``; each group is one full tuple (one item per bin), so
    every merge keeps the bin cardinalities equal.  When ``k`` does not divide ``n`` the last group is padded with
    zero-cost placeholders, hence bin sizes differ by at most one.

Portfolio (free sizes)
    Greedy LPT is also computed; if it is better than KK + local search (KK alone loses to LPT on ~0.1% of random
    instances), the local search runs from LPT and that result is used.  So the result is never worse than LPT
    and inherits its bound: makespan <= (4/3 - 1/(3k)) * optimal.

Local search
    Take the heaviest bin ``H`` and try the other bins, lightest first: move one item from ``H`` (free sizes only,
    and never emptying a bin) or swap one item of ``H`` with a cheaper one, choosing the exchange whose transferred
    cost ``d`` is closest to half the gap, with ``0 < d < gap`` so both bins end below the old maximum.  Each step
    strictly lowers the sum of squared bin costs, so the search terminates; it stops when ``H`` cannot be improved
    or after ``max_evals`` bin pairs have been examined (default ``2 * k + 64``); a step examines at most
    ``max_partners`` (default 16) partner bins and one examination costs O(|bin| log |bin|), so the search is
    O((2k + 64) * (n/k) log(n/k)) at worst, never O(n^2).  On 4,096 long-sft items and 512 bins it cuts the gap
    between the largest bin and the mean from ~5% (chunked KK start; greedy LPT: ~3.7%) to ~0.05%.  The loop
    (:func:`search_from_heaviest`) is the one lb-mini's rebalancing of packed ranks runs too (``whole.py``), with
    exchanges that repack.

Ties are broken by item index everywhere, so the result is a deterministic function of ``(costs, k)``: every rank
computes the same plan without communicating.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from typing import Callable, Sequence

import numpy as np

__all__: list[str] = []

DEFAULT_MAX_PARTNERS = 16
FREE_KK_MAX_ITEMS = 1024


def makespan(costs: Sequence[float], parts: Sequence[Sequence[int]]) -> float:
    """Largest bin cost of a partition (0 for no bins)."""
    return max((math.fsum(costs[i] for i in p) for p in parts), default=0.0)


def _bin_max(c: list[float], bins: list[list[int]]) -> float:
    return max(sum(c[i] for i in b) for b in bins)


def greedy_lpt(costs: Sequence[float], k: int) -> list[list[int]]:
    """Longest-processing-time-first greedy: each item (largest first) goes to the currently lightest bin.

    The classic baseline (makespan at most 4/3 - 1/(3k) of optimal); kept for tests and comparisons.
    """
    c = [float(x) for x in costs]
    order = sorted(range(len(c)), key=c.__getitem__, reverse=True)  # stable: ties by index
    heap = [(0.0, b) for b in range(k)]
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        s, b = heapq.heappop(heap)
        parts[b].append(i)
        heapq.heappush(heap, (s + c[i], b))
    return [sorted(p) for p in parts]


def partition(
    costs: Sequence[float],
    k: int,
    *,
    equal_size: bool = False,
    local_search: bool = True,
    max_evals: int | None = None,
    max_partners: int = DEFAULT_MAX_PARTNERS,
) -> list[list[int]]:
    """Split items ``0..n-1`` into ``k`` lists with near-equal cost sums.

    Args:
        costs: non-negative cost per item.
        k: number of bins (>= 1).
        equal_size: bin sizes differ by at most one (``n // k`` or ``n // k + 1`` items).  Otherwise sizes are
            free, but no bin is empty when ``n >= k``.
        local_search: run the exchange local search after Karmarkar-Karp.
        max_evals: cap on local-search work: bin pairs examined (default ``2 * k + 64``).
        max_partners: partner bins tried per local-search step, lightest first.

    Returns:
        ``k`` lists of item indices, each sorted ascending.  Every item appears exactly once.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    c = [float(x) for x in costs]
    n = len(c)
    if c and (not math.isfinite(sum(c)) or min(c) < 0.0):  # the sum is NaN/inf if any item is
        raise ValueError("costs must be finite and non-negative")
    if k == 1:
        return [list(range(n))]
    if n == 0:
        return [[] for _ in range(k)]

    evals = 2 * k + 64 if max_evals is None else max_evals
    if equal_size:
        n_pad = -(-n // k) * k
        # Placeholders n..n_pad-1 cost nothing; at most one lands in each bin.  They are dropped before the
        # local search, whose 1-for-1 swaps then keep the sizes (q or q + 1) as they are.
        bins = [[i for i in b if i < n] for b in _kk_equal(c + [0.0] * (n_pad - n), k)]
        if local_search:
            exchange_search(bins, c, allow_moves=False, max_evals=evals, max_partners=max_partners)
        return [sorted(b) for b in bins]
    if n <= FREE_KK_MAX_ITEMS:
        bins = _kk_free(c, k)
    else:  # chunked start: n/k vectorised merges instead of n Python ones (moves in the local search free it)
        n_pad = -(-n // k) * k
        bins = [[i for i in b if i < n] for b in _kk_equal(c + [0.0] * (n_pad - n), k)]
    if local_search:
        exchange_search(bins, c, allow_moves=True, max_evals=evals, max_partners=max_partners)
    # Portfolio: only worth a second search when greedy LPT already starts below the KK result.
    lpt = greedy_lpt(c, k)
    if _bin_max(c, lpt) < _bin_max(c, bins):
        if local_search:
            exchange_search(lpt, c, allow_moves=True, max_evals=evals, max_partners=max_partners)
        bins = lpt
    return [sorted(b) for b in bins]


# --------------------------------------------------------------------------------------------------------------
# Karmarkar-Karp.  A tuple is (heap, mx, nnz) where ``heap`` is a min-heap of (bin sum, bin id) over its non-empty
# bins and ``mx`` its largest bin sum; the missing k - nnz bins are empty (sum 0).  ``members[bin id]`` lists items.


def _kk_free(c: list[float], k: int) -> list[list[int]]:
    order = sorted(range(len(c)), key=c.__getitem__, reverse=True)  # stable: ties by index
    members: list[list[int]] = [[i] for i in order]
    # Heap entries: (-spread, seq, bins heap, max bin).  Singletons are already in heap order (spread = cost).
    tuples = [(-c[i], seq, [(c[i], seq)], c[i]) for seq, i in enumerate(order)]
    seq = len(order)
    pop, push = heapq.heappop, heapq.heappush
    while len(tuples) > 1:
        _, _, ha, mxa = pop(tuples)
        _, _, hb, mxb = pop(tuples)
        h, mx = _merge(ha, mxa, hb, mxb, k, members)
        push(tuples, ((h[0][0] if len(h) == k else 0.0) - mx, seq, h, mx))
        seq += 1
    h = tuples[0][2]
    return [members[b] for _, b in h] + [[] for _ in range(k - len(h))]


def _kk_equal(c: list[float], k: int) -> list[list[int]]:
    """Equal-size KK on consecutive groups of ``k`` sorted items (``len(c)`` must be a multiple of ``k``).

    All tuples are full, so a merge pairs the whole sorted bin arrays: done with numpy (O(k log k) per merge).
    """
    order = sorted(range(len(c)), key=c.__getitem__, reverse=True)  # stable: ties by index
    members: list[list[int]] = [[i] for i in order]
    tuples = []  # (-spread, seq, bin sums ascending, bin ids in the same order)
    cost_sorted = np.asarray([c[i] for i in order], dtype=np.float64)
    for t, start in enumerate(range(0, len(order), k)):
        sums = cost_sorted[start : start + k][::-1].copy()  # ascending
        ids = np.arange(start + k - 1, start - 1, -1)
        tuples.append((float(sums[0] - sums[-1]), t, sums, ids))
    heapq.heapify(tuples)
    seq = len(tuples)
    while len(tuples) > 1:
        _, _, sa, ia = heapq.heappop(tuples)
        _, _, sb, ib = heapq.heappop(tuples)
        # heaviest bin of A with lightest of B: A descending + B ascending
        sums = sa[::-1] + sb
        ids = ia[::-1]
        for x, y in zip(ids.tolist(), ib.tolist()):
            members[x].extend(members[y])
        o = np.argsort(sums, kind="stable")
        sums, ids = sums[o], ids[o]
        heapq.heappush(tuples, (float(sums[0] - sums[-1]), seq, sums, ids))
        seq += 1
    return [members[b] for b in tuples[0][3].tolist()]


def _merge(ha: list, mxa: float, hb: list, mxb: float, k: int, members: list[list[int]]) -> tuple[list, float]:
    """Largest-differencing merge of two sparse k-tuples (heaviest bin of one with lightest of the other).

    With ``na + nb <= k`` non-empty bins every non-empty bin meets an empty one, so the tuples just concatenate.
    Otherwise the ``r = na + nb - k`` lightest non-empty bins of each side meet, in opposite order (the heavier of
    A's with the lighter of B's); the other bins meet empty bins and are unchanged.
    """
    if len(ha) < len(hb):
        ha, mxa, hb, mxb = hb, mxb, ha, mxa
    r = len(ha) + len(hb) - k
    push = heapq.heappush
    if r <= 0:
        for e in hb:
            push(ha, e)
        return ha, (mxa if mxa >= mxb else mxb)
    pop = heapq.heappop
    a_low = [pop(ha) for _ in range(r)]  # ascending
    b_low = [pop(hb) for _ in range(r)]
    mx = mxa if ha else -math.inf
    if hb and mxb > mx:
        mx = mxb
    for (sa, ba), (sb, bb) in zip(reversed(a_low), b_low):
        members[ba].extend(members[bb])
        s = sa + sb
        if s > mx:
            mx = s
        push(ha, (s, ba))
    for e in hb:
        push(ha, e)
    return ha, mx


# --------------------------------------------------------------------------------------------------------------
# Local search.


def search_from_heaviest(loads: list[float], improve: Callable[[int, int, float, float], bool], *, max_evals: int,
                         max_partners: int) -> int:
    """The exchange search's loop, for any kind of exchange: take the heaviest bin ``h`` and try the other bins,
    lightest first (at most ``max_partners`` per step, ``max_evals`` bin pairs in all), until ``improve(h, p,
    load_h, load_p)`` applies an exchange between ``h`` and ``p`` (it sets ``loads[h]`` and ``loads[p]`` and returns
    True); stop when no partner improves ``h``. Partners within ``1e-12`` of the maximum are not tried. Returns the
    number of exchanges applied. The bins are kept sorted by (load, bin id), updated by bisection after each
    exchange: a step costs O(k) memmove at worst, no sort."""
    order = sorted((s, b) for b, s in enumerate(loads))
    steps = evals = 0
    while evals < max_evals:
        top, h = order[-1]
        tol = 1e-12 * top
        hit = None
        for s_p, p in order[:max_partners]:
            if top - s_p <= tol or evals >= max_evals:
                break
            evals += 1
            if improve(h, p, top, s_p):
                hit = (s_p, p)
                break
        if hit is None:
            break
        for key in ((top, h), hit):
            del order[bisect_left(order, key)]
        insort(order, (loads[h], h))
        insort(order, (loads[hit[1]], hit[1]))
        steps += 1
    return steps


def exchange_search(
    bins: list[list[int]],
    c: list[float],
    *,
    allow_moves: bool,
    max_evals: int,
    max_partners: int,
    base: Sequence[float] | None = None,
) -> int:
    """Improve ``bins`` in place (:func:`search_from_heaviest` with one-item moves and swaps, see the module
    docstring); returns the number of exchanges applied. ``base``: load each bin carries besides its items (work
    assigned elsewhere, e.g. split samples), counted in the balance but never moved.

    State: per bin its items and their costs, both sorted by cost (for bisection)."""
    items: list[list[int]] = []
    icost: list[list[float]] = []
    for b in bins:
        srt = sorted(b, key=c.__getitem__)
        items.append(srt)
        icost.append([c[i] for i in srt])
    sums = [math.fsum(cs) + (base[b] if base is not None else 0.0) for b, cs in enumerate(icost)]

    def improve(h: int, p: int, top: float, s_p: float) -> bool:
        hit = _best_exchange(icost[h], icost[p], top - s_p, 1e-12 * top, allow_moves)
        if hit is None:
            return False
        ja, jb = hit
        a = items[h].pop(ja)
        ca = icost[h].pop(ja)
        d = ca
        if jb is not None:
            b = items[p].pop(jb)
            cb = icost[p].pop(jb)
            d -= cb
            _insert(items[h], icost[h], b, cb)
        _insert(items[p], icost[p], a, ca)
        sums[h] = top - d
        sums[p] = s_p + d
        return True

    steps = search_from_heaviest(sums, improve, max_evals=max_evals, max_partners=max_partners)
    for j in range(len(bins)):
        bins[j] = items[j]
    return steps


def _best_exchange(
    h_costs: list[float], p_costs: list[float], gap: float, tol: float, allow_moves: bool
) -> tuple[int, int | None] | None:
    """Best exchange between bins H and P given their sorted item costs.

    Returns (position in H, position in P or None for a move) whose transferred cost d lies in
    (tol, gap - tol) and is closest to gap / 2, or None.
    """
    half = gap / 2.0
    hi = gap - tol
    best: tuple[int, int | None] | None = None
    best_err = math.inf
    nh, np_ = len(h_costs), len(p_costs)
    if allow_moves and nh > 1:
        j = bisect_left(h_costs, half)
        for jj in (j - 1, j):
            if 0 <= jj < nh:
                d = h_costs[jj]
                if tol < d < hi and abs(d - half) < best_err:
                    best, best_err = (jj, None), abs(d - half)
    if np_:
        for ja in range(nh):
            ca = h_costs[ja]
            j = bisect_left(p_costs, ca - half)
            for jj in (j - 1, j):
                if 0 <= jj < np_:
                    d = ca - p_costs[jj]
                    if tol < d < hi and abs(d - half) < best_err:
                        best, best_err = (ja, jj), abs(d - half)
    return best


def _insert(items: list[int], costs: list[float], x: int, cx: float) -> None:
    j = bisect_left(costs, cx)
    items.insert(j, x)
    costs.insert(j, cx)
