"""A trainer's balancer options as one frozen record, and the one place a cost choice becomes a cost.

:class:`BalancerOptions` holds what LB-Mini needs from a trainer besides the data: the planner, the microbatch token
budget, the cost, the oversize policy, the split policy and the dataset column with the lengths. It checks its values
when built, so a wrong one fails where it was written, not at the first step.

:func:`choose_cost` is the only function that turns a user's cost choice into what plans with, for every caller (the
sampler, the trainers, the rollout planner, the SFT command line):

==================== ==========================================================================================
choice               becomes
==================== ==========================================================================================
``"auto"``           an :class:`~ds_odc.balancer.autocost.AutoCost` starting from :func:`auto_cost_prior`
an ``AutoCost``      itself (its own prior, lag and fit settings)
``"tokens"``         :class:`~ds_odc.balancer.cost.TokenCost`
``"quadratic"``      :meth:`QuadraticCost.from_hf_config(model_config) <ds_odc.balancer.cost.QuadraticCost>`
a ``CostModel``      itself
==================== ==========================================================================================

A planner takes a fixed cost model: :func:`planning_cost` gives the one an ``AutoCost`` plans with now.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Union

from .autocost import AutoCost
from .cost import COST_MODELS, MICROBATCH_PRIOR_TOKENS, CostModel, QuadraticCost, get_cost_model
from .plan import check_max_tokens, check_oversize
from .planners import DEFAULT_PLANNER, Planner, get_planner
from .sp import SplitPolicy

__all__: list[str] = []

logger = logging.getLogger("ds_odc.balancer")

CostChoice = Union[str, CostModel, AutoCost]


def auto_cost_prior(model_config: Any = None) -> CostModel:
    """Where ``cost="auto"`` starts: the model shape's training FLOPs (``QuadraticCost.from_hf_config``) or, without
    a model config, one unit per token; in both cases plus a microbatch worth :data:`MICROBATCH_PRIOR_TOKENS`."""
    if model_config is not None:
        try:
            return QuadraticCost.from_hf_config(model_config, microbatch_tokens=MICROBATCH_PRIOR_TOKENS)
        except ValueError:  # not a decoder's config: the fit learns the shape from tokens up
            logger.info("ds_odc balancer: the model config has no decoder shape; the automatic cost starts from tokens")
    return QuadraticCost(a=1.0, b=0.0, c=float(MICROBATCH_PRIOR_TOKENS))


def choose_cost(choice: "CostChoice | None", model_config: Any = None, *, lag: int = 0,
                auto_cost: dict | None = None) -> "CostModel | AutoCost":
    """The cost a user's ``choice`` stands for (see the module docstring). ``model_config``: the model's (Hugging
    Face) config, the shape ``"auto"`` starts from and ``"quadratic"`` needs. ``lag`` and ``auto_cost`` (keyword
    arguments of :class:`~ds_odc.balancer.autocost.AutoCost`) set up the automatic cost that ``"auto"`` builds; an
    ``AutoCost`` passed in keeps its own."""
    if isinstance(choice, AutoCost):
        return choice
    if isinstance(choice, str) and choice == "auto":
        return AutoCost(auto_cost_prior(model_config), lag=lag, **(auto_cost or {}))
    return get_cost_model(choice, model_config)


def planning_cost(cost: "CostModel | AutoCost") -> CostModel:
    """The cost model a plan made now uses: an ``AutoCost``'s latest fit (or its prior), a fixed model itself."""
    return cost.model if isinstance(cost, AutoCost) else cost


def _check_cost_choice(choice: Any) -> None:
    if isinstance(choice, (CostModel, AutoCost)) or choice in ("auto", "quadratic"):
        return  # "quadratic" needs the model config: checked when the cost is chosen
    if not isinstance(choice, str):
        raise ValueError(f"unknown cost model {choice!r}; use one of {COST_MODELS}, a CostModel or an AutoCost")
    get_cost_model(choice)  # raises for a name it does not know


@dataclass(frozen=True)
class BalancerOptions:
    """How LB-Mini plans a trainer's optimizer steps (every field optional).

    Attributes:
        planner: a planner of :data:`~ds_odc.balancer.planners.PLANNERS`: ``"lb-mini"`` (default: any microbatch count
            per rank), ``"lb-mini-sp"`` (lb-mini, and samples no rank can take alone split over groups of ranks), or
            the collective-compatible ``"lb-micro"`` / ``"local-sort"`` for comparisons.
        max_tokens: token budget of one microbatch; ``None``: the trainer's default (one sample per microbatch for
            SFT, the stock microbatch's size for GRPO).
        cost: what LB-Mini balances (:func:`choose_cost`): ``"auto"`` (default), ``"tokens"``, ``"quadratic"``, a
            ``CostModel`` or an ``AutoCost``.
        oversize: a sample longer than the planner can train: ``"error"``, ``"truncate"`` or ``"skip"``.
        split: with a planner that splits samples, the :class:`~ds_odc.balancer.sp.SplitPolicy` (``None``: the
            trainer derives one from the model config); ignored by the other planners.
        length_column: the dataset column with each sample's tokens (its length is read) or its length.
    """

    planner: str = DEFAULT_PLANNER
    max_tokens: int | None = None
    cost: CostChoice = "auto"
    oversize: str = "error"
    split: SplitPolicy | None = None
    length_column: str = "input_ids"

    def __post_init__(self) -> None:
        get_planner(self.planner)  # raises, listing the planners
        object.__setattr__(self, "max_tokens", check_max_tokens(self.max_tokens))  # a numpy integer: an int
        _check_cost_choice(self.cost)
        check_oversize(self.oversize)
        if self.split is not None and not isinstance(self.split, SplitPolicy):
            raise ValueError(f"split must be a SplitPolicy or None, got {type(self.split).__name__}")

    @property
    def spec(self) -> Planner:
        """The planner's registry entry (what it runs on, whether it splits samples)."""
        return get_planner(self.planner)

    def sampler_options(self) -> dict[str, Any]:
        """Keyword arguments of :class:`~ds_odc.balancer.sampler.BalancedBatchSampler` (all but the cost, which the
        caller chooses with :func:`choose_cost`)."""
        return dict(planner=self.planner, max_tokens=self.max_tokens, oversize=self.oversize,
                    split=self.split if self.spec.splits else None)
