"""The plan contract: what every planner returns, and the inputs every planner checks the same way.

A *minibatch* is the set of samples between two optimizer steps (all ranks together). A planner maps it to a
:class:`Plan`: per rank, a list of microbatches (lists of sample indices into the minibatch's ``lengths``). A sample
is normally trained whole by one rank; a :class:`SplitSample` is trained by a group of ranks together (sequence
parallelism), and then appears as a one-sample microbatch on every member.

Everything here is below the planners (``whole.py``, ``sp.py``) and the registry (``planners.py``): the planners
share one input check (:func:`checked_minibatch`) and one notion of the lengths a sample trains
(:func:`effective_lengths`), and callers read costs and loads off any plan with the same methods.

The rules of two options that every way into the balancer takes live here, each written once:
:func:`check_max_tokens` (the microbatch token budget) and :func:`check_oversize` (the oversize policy, one of
:data:`OVERSIZE_POLICIES`). ``BalancerOptions`` (the trainers' keywords), the sampler, the planners, the ds_config's
``zero_optimization.odc.balancer`` block and the SFT command line's flags all call them (or, for the ds_config's
``oversize``, type the key with the tuple), so a value one of them takes is taken by all.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .cost import CostModel, get_cost_model

__all__ = ["step_time"]

OVERSIZE_POLICIES = ("error", "truncate", "skip")


def check_max_tokens(max_tokens: Any) -> int | None:
    """The microbatch token budget's one rule: ``None`` (no budget) or an integer of at least 1 (an ``int`` or a
    numpy integer, not a bool), returned as an ``int``. The error names the option ``max_tokens``; a front door that
    calls it something else (a trainer keyword, a flag) names its own name before it."""
    if max_tokens is None:
        return None
    if isinstance(max_tokens, (bool, np.bool_)) or not isinstance(max_tokens, numbers.Integral) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int or None, got {max_tokens!r}")
    return int(max_tokens)


def check_oversize(oversize: Any) -> str:
    """The oversize policy's one rule: one of :data:`OVERSIZE_POLICIES`; the error lists them."""
    if not isinstance(oversize, str) or oversize not in OVERSIZE_POLICIES:
        raise ValueError(f"unknown oversize policy {oversize!r}; choose one of {OVERSIZE_POLICIES}")
    return oversize


@dataclass(frozen=True)
class SplitSample:
    """Sample ``index`` trained by ``ranks`` together (ascending, an aligned block of ``size`` ranks).

    Inside attention the group is ``ulysses`` ranks that share the heads (Ulysses: all-to-alls between consecutive
    members) times ``ring`` such sets that exchange keys and values (context parallelism between members
    ``ulysses`` apart); ``size == ulysses * ring``. ``ulysses=0`` (the default) means the whole group.
    """

    index: int
    ranks: tuple[int, ...]
    ulysses: int = 0

    def __post_init__(self):
        if self.ulysses == 0:
            object.__setattr__(self, "ulysses", len(self.ranks))
        if self.ulysses < 1 or len(self.ranks) % self.ulysses:
            raise ValueError(f"SplitSample: {len(self.ranks)} ranks do not form Ulysses groups of {self.ulysses}")

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def ring(self) -> int:
        """How many sets of ``ulysses`` members exchange keys and values (1: Ulysses alone)."""
        return len(self.ranks) // self.ulysses

    @property
    def shape(self) -> str:
        """``"UxR"``: Ulysses ranks x ring ranks."""
        return f"{self.ulysses}x{self.ring}"


@dataclass(frozen=True)
class Plan:
    """The plan of one minibatch for all ranks.

    Attributes:
        microbatches: ``microbatches[rank][j]`` is the list of sample indices (into the minibatch's ``lengths``)
            of microbatch ``j`` of ``rank``.
        num_samples: samples trained in the whole minibatch (skipped ones excluded; a split sample once): the
            global normaliser for a per-sample mean loss.
        num_tokens: tokens trained in the whole minibatch, after truncation.  With labels equal to the inputs the
            number of loss terms is ``num_tokens - num_samples`` (see :attr:`num_label_tokens`).
        planner: the planner's name.
        max_tokens: the budget used (``None``: one sample per microbatch).
        truncated: samples cut to :attr:`truncated_to` tokens (``oversize="truncate"``).
        skipped: samples left out of the plan (``oversize="skip"``).
        splits: samples trained by a group of ranks, in the order every member runs them (each is a one-sample
            microbatch at the front of every member's list); empty for planners that train every sample whole.
    """

    microbatches: list[list[list[int]]]
    num_samples: int
    num_tokens: int
    planner: str
    max_tokens: int | None = None
    truncated: tuple[int, ...] = field(default=())
    skipped: tuple[int, ...] = field(default=())
    splits: tuple[SplitSample, ...] = field(default=())

    @property
    def world_size(self) -> int:
        return len(self.microbatches)

    @property
    def num_label_tokens(self) -> int:
        """Loss terms in the minibatch when labels are the shifted inputs: each sample's first token is no target."""
        return self.num_tokens - self.num_samples

    @property
    def truncated_to(self) -> int | None:
        """The tokens a truncated sample keeps."""
        return self.max_tokens

    @property
    def groups(self) -> dict[int, tuple[int, ...]]:
        """``{sample index: member ranks}`` of the split samples."""
        return {s.index: s.ranks for s in self.splits}

    def num_microbatches(self, rank: int) -> int:
        return len(self.microbatches[rank])

    def rank_samples(self, rank: int) -> list[int]:
        return [i for mb in self.microbatches[rank] for i in mb]

    def effective_length(self, index: int, lengths: Sequence[int]) -> int:
        """Tokens sample ``index`` actually trains (its length, or :attr:`truncated_to` if it was truncated)."""
        L = int(lengths[index])
        return min(L, self.truncated_to) if index in frozenset(self.truncated) else L

    def trained_lengths(self, lengths: Sequence[int],
                        sq_lengths: Sequence[float] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, sum of squared document lengths) of every sample as trained (see :func:`effective_lengths`)."""
        return effective_lengths(lengths, sq_lengths, self.truncated, self.truncated_to)

    def microbatch_costs(self, cost_model: "str | CostModel", lengths: Sequence[int],
                         sq_lengths: Sequence[float] | None = None) -> list[list[float]]:
        """Cost of every microbatch of every rank under ``cost_model``: its samples' costs plus the model's fixed
        cost per microbatch (``c``; an empty microbatch costs nothing). A split sample's microbatch costs each
        member its share (see :meth:`split_member_cost`)."""
        cm = get_cost_model(cost_model)
        eff, sq = self.trained_lengths(lengths, sq_lengths)
        c = (cm.sample_costs(eff, sq) if eff.size else np.zeros(0)).tolist()  # floats: cheaper than numpy per sum
        fixed = cm.per_microbatch
        member = {s.index: float(self.split_member_cost(s, c[s.index], int(eff[s.index]), cm)) + fixed
                  for s in self.splits}
        out = []
        for rank in self.microbatches:
            row = []
            for mb in rank:
                if len(mb) == 1 and mb[0] in member:
                    row.append(member[mb[0]])
                else:
                    row.append(math.fsum(c[i] for i in mb) + fixed if mb else 0.0)
            out.append(row)
        return out

    def split_member_cost(self, split: SplitSample, cost: float, length: int, cost_model: CostModel) -> float:
        """One member's cost of a split sample whose own cost is ``cost`` (without the fixed cost of a microbatch).
        A plain :class:`Plan` has no model of the split's overheads and counts an even share."""
        return cost / split.size

    def split_compute_share(self, split: SplitSample) -> float:
        """The fraction of a split sample's compute that each member spends (what a cost fit should see)."""
        return 1.0 / split.size

    def rank_costs(self, cost_model: "str | CostModel", lengths: Sequence[int],
                   sq_lengths: Sequence[float] | None = None) -> list[float]:
        """Total cost per rank: its busy time under ``cost_model``."""
        return [math.fsum(r) for r in self.microbatch_costs(cost_model, lengths, sq_lengths)]

    def rank_loads(self, lengths: Sequence[int], sq_lengths: Sequence[float] | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, sum of squared document lengths) per rank as a cost fit should see them: each sample as
        trained, a split sample by each member's share of its compute (:meth:`split_compute_share`)."""
        eff, sq = self.trained_lengths(lengths, sq_lengths)
        share = {s.index: self.split_compute_share(s) for s in self.splits}
        tokens, squares = np.zeros(self.world_size), np.zeros(self.world_size)
        for r in range(self.world_size):
            ids = self.rank_samples(r)
            if not ids:
                continue
            w = np.asarray([share.get(i, 1.0) for i in ids])
            tokens[r] = float((eff[ids] * w).sum())
            squares[r] = float((sq[ids] * w).sum())
        return tokens, squares


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


@dataclass(frozen=True)
class CheckedMinibatch:
    """A planner's inputs after :func:`checked_minibatch`: lengths as trained, and what the oversize policy did.

    ``active`` are the samples to plan (all but the skipped ones), ``lengths``/``sq_lengths``/``costs`` are theirs
    (position ``j`` is sample ``active[j]``); ``costs`` are the samples' own (``a*L + b*S``, no fixed cost)."""

    world_size: int
    cost: CostModel
    active: np.ndarray
    lengths: np.ndarray
    sq_lengths: np.ndarray
    costs: np.ndarray
    truncated: tuple[int, ...]
    skipped: tuple[int, ...]


def checked_minibatch(lengths: Sequence[int], world_size: int, max_tokens: int | None, cost: "str | CostModel",
                      oversize: str, sq_lengths: Sequence[float] | None, limit: int | None = None,
                      too_long: str | None = None) -> CheckedMinibatch:
    """Check a planner's inputs and apply the oversize policy: samples longer than ``limit`` (default
    ``max_tokens``) are refused, truncated to it or skipped; ``too_long`` says, in the error, why such a sample
    cannot be trained whole (default: it exceeds ``max_tokens``)."""
    check_oversize(oversize)
    W = int(world_size)
    if W < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    check_max_tokens(max_tokens)
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
    active = np.arange(lens.size)
    if skipped:
        active = np.setdiff1d(active, np.asarray(skipped, dtype=np.int64))
    act_lens, act_sq = lens[active], sq[active]
    costs = cm.sample_costs(act_lens, act_sq) if active.size else np.zeros(0)
    return CheckedMinibatch(W, cm, active, act_lens, act_sq, costs, truncated, skipped)


RUNTIMES = ("collective", "odc")


def odc_schedule(splits: Sequence[SplitSample], mb_costs: Sequence[Sequence[float]]) -> list[list[float]]:
    """When each microbatch of each rank starts under ODC, given the microbatches' durations: a split sample (the
    first microbatches of its members, in ``splits`` order) starts once all its members have finished what they ran
    before it, and ends when the slowest member's share is done; a rank's own microbatches then follow without
    waiting for anybody."""
    ready = [0.0] * len(mb_costs)
    starts: list[list[float]] = [[] for _ in mb_costs]
    for s in splits:
        start = max(ready[r] for r in s.ranks)
        end = start + max(mb_costs[r][len(starts[r])] for r in s.ranks)
        for r in s.ranks:
            starts[r].append(start)
            ready[r] = end
    for r, row in enumerate(mb_costs):
        t = ready[r]
        for d in row[len(starts[r]):]:
            starts[r].append(t)
            t += d
    return starts


def step_time(mb_costs: Sequence[Sequence[float]], runtime: str, splits: Sequence[SplitSample] = ()) -> float:
    """Step time of a plan whose microbatches take ``mb_costs`` (per rank, in order), on a ``runtime`` of
    :data:`RUNTIMES`: under ``collective`` microbatch slot ``j`` ends when the slowest rank finishes its ``j``-th
    microbatch; under ``odc`` the slowest rank sets it, the plan's ``splits`` starting when their whole group is free
    (:func:`odc_schedule`)."""
    if runtime == "odc":
        if not splits:
            return max((math.fsum(r) for r in mb_costs), default=0.0)
        starts = odc_schedule(splits, mb_costs)
        return max((s[-1] + row[-1] for s, row in zip(starts, mb_costs) if row), default=0.0)
    if runtime != "collective":
        raise ValueError(f"unknown runtime {runtime!r}; choose one of {RUNTIMES}")
    slots = max((len(r) for r in mb_costs), default=0)
    return math.fsum(max((r[j] for r in mb_costs if j < len(r)), default=0.0) for j in range(slots))
