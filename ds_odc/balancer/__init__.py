"""Minibatch load balancing for ODC (LB-Mini), its collective-compatible baselines, and a simulator.

No ``torch.distributed`` here: world size and rank are plain ints and every rank computes the same plan from the
same inputs (the automatic cost too: it is fitted from numbers every rank already has). No torch either: the packed
collator that turns a plan's microbatches into rows is ``ds_odc.training.collate``. See docs/BALANCER.md.
"""

from .autocost import AutoCost, CostUpdate
from .checks import DataError, DataReport
from .cost import CostModel, FittedCost, QuadraticCost, TokenCost, get_cost_model
from .lengths import lengths_from_dataset, lengths_from_file, read_lengths, sq_lengths_from_dataset
from .options import BalancerOptions, auto_cost_prior, choose_cost, planning_cost
from .packing import PackingError, first_fit_decreasing, pack
from .partitioner import greedy_lpt, makespan, partition
from .plan import OVERSIZE_POLICIES, Plan, SplitSample
from .planners import PLANNERS, Planner, get_planner, plan_minibatch
from .sampler import BalancedBatchSampler, RankBatch
from .sp import SplitPlan, SplitPolicy

__all__ = ["CostModel", "TokenCost", "QuadraticCost", "FittedCost", "AutoCost", "CostUpdate", "BalancerOptions", "DataError", "Plan", "RankBatch", "plan_minibatch", "PLANNERS", "get_planner", "SplitPolicy", "BalancedBatchSampler", "read_lengths", "lengths_from_dataset", "lengths_from_file", "sq_lengths_from_dataset"]

