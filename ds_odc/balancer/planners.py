"""The planners, in one registry, and :func:`plan_minibatch`, the one way every caller plans a minibatch.

=============== ============ ===========================================================================
name            runtime      what it does
=============== ============ ===========================================================================
``local-sort``  collective   round-robin, each rank sorted shortest first, one sample per microbatch
``lb-micro``    collective   balanced, the same microbatch count on every rank (``whole.py``)
``lb-mini``     odc          balanced per minibatch, any count per rank (``whole.py``)
``lb-mini-sp``  odc          lb-mini, plus samples no rank can take alone split over groups (``sp.py``)
=============== ============ ===========================================================================

A *collective* runtime ends every microbatch in collectives, so microbatch ``j`` runs on every rank at once; the
*odc* runtime meets once per minibatch (and a split sample's group for that sample). :class:`Planner` says which,
what the longest trainable sample is, and whether the planner takes a
:class:`~ds_odc.balancer.sp.SplitPolicy`; the sampler, the simulator and the command lines read it instead of
testing planner names.

All planners are pure functions of their arguments: every rank calls :func:`plan_minibatch` with the same lengths
and gets the same :class:`~ds_odc.balancer.plan.Plan` without communicating.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

from .cost import CostModel
from .plan import Plan
from .sp import SplitPolicy, longest_split_sample, plan_split
from .whole import assign_lb_micro, assign_lb_mini, assign_local_sort, plan_whole

__all__ = ["PLANNERS", "DEFAULT_PLANNER", "BASELINE_PLANNER", "get_planner", "plan_minibatch"]

DEFAULT_PLANNER = "lb-mini"
BASELINE_PLANNER = "local-sort"  # what speedups are measured against: close to what stock training does


@dataclass(frozen=True)
class Planner:
    """One planner of the registry.

    Attributes:
        name: what ``planner=`` takes.
        runtime: ``"collective"`` (every microbatch ends in collectives: the same count on every rank) or ``"odc"``
            (ranks meet once per minibatch; needs ODC).
        splits: whether it may split a sample over a group of ranks (it then takes a ``SplitPolicy``).
        description: one line for help texts.
    """

    name: str
    runtime: str
    splits: bool
    description: str
    plan: Callable[..., Plan]

    def longest_sample(self, max_tokens: int | None, world_size: int, split: SplitPolicy | None = None) -> int | None:
        """The longest sample this planner trains whole under ``max_tokens`` (``None``: any); the oversize policy
        applies beyond it."""
        if self.splits and max_tokens is not None:
            return longest_split_sample(max_tokens, world_size, split or SplitPolicy())
        return max_tokens


PLANNERS: dict[str, Planner] = {
    p.name: p
    for p in (
        Planner("local-sort", "collective", False, "round-robin, sorted, one sample per microbatch (baseline)",
                functools.partial(plan_whole, assign=assign_local_sort)),
        Planner("lb-micro", "collective", False, "balanced, the same microbatch count on every rank",
                functools.partial(plan_whole, assign=assign_lb_micro)),
        Planner("lb-mini", "odc", False, "balanced per minibatch, any microbatch count per rank (ODC)",
                functools.partial(plan_whole, assign=assign_lb_mini)),
        Planner("lb-mini-sp", "odc", True, "lb-mini, and samples no rank can take alone split over groups of ranks "
                "(ODC, sequence parallelism)", plan_split),
    )
}


def get_planner(name: str) -> Planner:
    """The registry's entry for ``name``; the error lists the choices."""
    try:
        return PLANNERS[name]
    except KeyError:
        raise ValueError(f"unknown planner {name!r}; choose one of {tuple(PLANNERS)}") from None


def plan_minibatch(
    lengths: Sequence[int],
    world_size: int,
    *,
    planner: str = DEFAULT_PLANNER,
    max_tokens: int | None = None,
    cost: "str | CostModel" = "tokens",
    oversize: str = "error",
    sq_lengths: Sequence[float] | None = None,
    split: SplitPolicy | None = None,
) -> Plan:
    """Plan one minibatch of samples with token counts ``lengths`` over ``world_size`` ranks.

    Args:
        lengths: token count of each sample of the (global) minibatch; indices in the plan refer to it.
        world_size: number of data-parallel ranks.
        planner: a name of :data:`PLANNERS` (see the module docstring).
        max_tokens: token budget per microbatch; ``None`` disables packing (one sample per microbatch).
        cost: ``"tokens"`` or a :class:`~ds_odc.balancer.cost.CostModel` (e.g.
            ``QuadraticCost.from_hf_config(model.config)``); balances busy time. The budget is always checked in
            tokens.
        oversize: what to do with a sample longer than the planner can train (``max_tokens``, or for a planner
            that splits, ``max_tokens`` times its largest group): ``"error"`` (raise), ``"truncate"`` (train its
            first tokens; listed in ``Plan.truncated``) or ``"skip"`` (leave it out; listed in ``Plan.skipped``).
        sq_lengths: per sample, the sum of its documents' squared lengths (a row packing several documents costs
            attention per document); ``None``: one document per sample.
        split: for a planner that splits samples, how: a :class:`~ds_odc.balancer.sp.SplitPolicy` (default:
            ``SplitPolicy()``); ignored by the others.
    """
    spec = get_planner(planner)
    options = dict(name=spec.name, max_tokens=max_tokens, cost=cost, oversize=oversize, sq_lengths=sq_lengths)
    if spec.splits:
        options["split"] = split
    return spec.plan(lengths, world_size, **options)
