"""Minibatch load balancing for ODC (LB-Mini), its collective-compatible baselines, and a simulator.

No ``torch.distributed`` here: every rank computes the same plan from the same inputs.  See docs/BALANCER.md.
"""

from .cost import CostModel, FittedCost, QuadraticCost, TokenCost, get_cost_model
from .packing import first_fit_decreasing, pack
from .partitioner import greedy_lpt, makespan, partition
from .planners import OVERSIZE_POLICIES, PLANNERS, Plan, plan_minibatch

__all__ = [
    "CostModel",
    "TokenCost",
    "QuadraticCost",
    "FittedCost",
    "get_cost_model",
    "partition",
    "greedy_lpt",
    "makespan",
    "pack",
    "first_fit_decreasing",
    "Plan",
    "plan_minibatch",
    "PLANNERS",
    "OVERSIZE_POLICIES",
]
