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
    per-microbatch collectives (ODC) can execute.

All planners are pure functions of their arguments: every rank calls :func:`plan_minibatch` with the same lengths
and gets the same :class:`Plan` without communicating.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .cost import CostModel, get_cost_model
from .packing import PackingError, _pack_local
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

    def microbatch_costs(self, cost_model: "str | CostModel", lengths: Sequence[int]) -> list[list[float]]:
        """Cost of every microbatch of every rank under ``cost_model`` (sum of its samples' costs)."""
        cm = get_cost_model(cost_model)
        eff = np.asarray(lengths, dtype=np.int64).copy()
        if self.truncated:
            t = np.asarray(self.truncated, dtype=np.int64)
            eff[t] = np.minimum(eff[t], self.max_tokens)
        c = cm(eff) if eff.size else np.zeros(0)
        return [[float(c[mb].sum()) if mb else 0.0 for mb in rank] for rank in self.microbatches]

    def rank_costs(self, cost_model: "str | CostModel", lengths: Sequence[int]) -> list[float]:
        """Total cost per rank: its busy time under ``cost_model``."""
        return [math.fsum(r) for r in self.microbatch_costs(cost_model, lengths)]


def plan_minibatch(
    lengths: Sequence[int],
    world_size: int,
    *,
    planner: str = "lb-mini",
    max_tokens: int | None = None,
    cost: "str | CostModel" = "tokens",
    oversize: str = "error",
    split: "SplitPolicy | None" = None,
) -> Plan:
    """Plan one minibatch of samples with token counts ``lengths`` over ``world_size`` ranks.

    Args:
        lengths: token count of each sample of the (global) minibatch; indices in the plan refer to it.
        world_size: number of data-parallel ranks.
        planner: ``"local-sort"``, ``"lb-micro"`` or ``"lb-mini"`` (see the module docstring).
        max_tokens: token budget per microbatch; ``None`` disables packing (one sample per microbatch).
        cost: ``"tokens"``, ``"quadratic"`` or a :class:`~ds_odc.balancer.cost.CostModel`; balances busy time.
            The budget is always checked in tokens.
        oversize: what to do with a sample longer than ``max_tokens``: ``"error"`` (raise), ``"truncate"``
            (train its first ``max_tokens`` tokens; listed in ``Plan.truncated``) or ``"skip"`` (leave it out;
            listed in ``Plan.skipped``).
        split: with ``planner="lb-mini-sp"`` (LB-Mini plus sequence parallelism for giant samples, ODC only), how
            samples may be split: a :class:`~ds_odc.balancer.sp.SplitPolicy` (see ``ds_odc.balancer.sp``).
    """
    if planner == "lb-mini-sp":  # samples no rank can take alone go to groups of ranks (balancer/sp.py)
        from .sp import plan_split
        return plan_split(lengths, world_size, max_tokens=max_tokens, cost=cost, oversize=oversize, split=split)
    if planner not in PLANNERS:
        raise ValueError(f"unknown planner {planner!r}; choose one of {PLANNERS}")
    if oversize not in OVERSIZE_POLICIES:
        raise ValueError(f"unknown oversize policy {oversize!r}; choose one of {OVERSIZE_POLICIES}")
    W = int(world_size)
    if W < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int or None, got {max_tokens}")
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if lens.size and lens.min() < 0:
        raise ValueError("lengths must be non-negative")

    truncated: tuple[int, ...] = ()
    skipped: tuple[int, ...] = ()
    if max_tokens is not None:
        over = np.flatnonzero(lens > max_tokens)
        if over.size:
            if oversize == "error":
                i = int(over[0])
                more = f" ({over.size} samples in total, e.g. {over[:5].tolist()})" if over.size > 1 else ""
                raise ValueError(
                    f"sample {i} has {int(lens[i])} tokens, more than max_tokens={max_tokens}{more}. Raise "
                    "max_tokens, filter long samples out of the dataset, or pass oversize='truncate' (train the "
                    "first max_tokens tokens) or oversize='skip' (leave them out; they are listed in Plan.skipped)."
                )
            if oversize == "truncate":
                truncated = tuple(over.tolist())
                lens = lens.copy()
                lens[over] = max_tokens
            else:
                skipped = tuple(over.tolist())

    active = np.arange(lens.size)
    if skipped:
        active = np.setdiff1d(active, np.asarray(skipped, dtype=np.int64))
    act = active.tolist()
    act_lens = lens[active].tolist()
    act_costs = get_cost_model(cost)(lens[active]).tolist() if act else []

    if planner == "local-sort":
        mbs = _local_sort(act, act_lens, W)
    elif planner == "lb-micro":
        mbs = _lb_micro(act, act_lens, act_costs, W, max_tokens)
    else:
        mbs = _lb_mini(act, act_lens, act_costs, W, max_tokens)
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


def _max_sum(parts: list[list[int]], costs: list[float]) -> float:
    return max(sum(costs[j] for j in p) for p in parts)


def _lb_mini(act: list[int], lens: list[int], costs: list[float], W: int, T: int | None) -> list[list[list[int]]]:
    parts = partition(costs, W)
    if len(act) > W:
        # Equal-size solutions are feasible here too and sometimes balance better (the free local search may stop
        # at a worse optimum); keeping the better one makes lb-mini never less balanced than lb-micro's split.
        equal = partition(costs, W, equal_size=True)
        if _max_sum(equal, costs) < _max_sum(parts, costs):
            parts = equal
    out = []
    for p, pl, pc in _split(parts, lens, costs):
        local = _pack_local(pl, pc, T, None)
        out.append([[act[p[j]] for j in mb] for mb in local])
    return out
