"""Hybrid sharding: the model state sharded inside a shard group, replicated across the groups.

With ``zero_optimization.odc.shard_size`` S smaller than the world size W, consecutive ranks ``[g*S, (g+1)*S)``
form *shard group* ``g``. DeepSpeed partitions parameters, gradients and optimizer state over that group
(``zero.Init``'s ``data_parallel_group``, the stage-3 optimizer's ``dp_process_group``) and ODC's reads and pushes
never leave it. The ranks that hold the same shard, ``{j, S+j, 2S+j, ...}``, form *replica group* ``j``: once per
optimizer step they sum their accumulated gradient shards (one all-reduce), so every replica takes the same step
from the gradient of the whole job's minibatch. Launchers number a node's ranks consecutively (torchrun, the
DeepSpeed launcher, mpirun's default mapping), so S = ranks per node (``"node"``) makes a shard group one node and
the all-reduce the only traffic between nodes.

torch.distributed requires every rank to create every group, in the same order; :func:`hybrid_groups` does that
once per process and layout.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__: list[str] = []

# Where launchers say how many ranks run on this node: torchrun, the DeepSpeed launcher, Open MPI, MPICH.
LOCAL_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def ranks_per_node() -> int | None:
    """The number of ranks on this node, as the launcher announced it (None when no launcher variable is set)."""
    for name in LOCAL_SIZE_VARIABLES:
        value = os.environ.get(name)
        if value and value.isdigit() and int(value) > 0:
            return int(value)
    return None


def resolve_shard_size(shard_size, world_size: int, local_size: int | None = None) -> int:
    """The number of ranks per shard group for the config value ``shard_size`` (None, "node" or an int) in a job of
    ``world_size`` ranks; raises ValueError saying what to change."""
    if shard_size is None:
        return world_size
    if shard_size == "node":
        if local_size is None:
            raise ValueError("ds_odc: zero_optimization.odc.shard_size=\"node\" needs the number of ranks per node, "
                             f"which the launcher announces in one of {', '.join(LOCAL_SIZE_VARIABLES)}; none is set. "
                             "Launch with torchrun or the deepspeed launcher, or give shard_size as a number.")
        shard_size = local_size
    if not isinstance(shard_size, int) or isinstance(shard_size, bool) or shard_size < 1:
        raise ValueError(f"ds_odc: zero_optimization.odc.shard_size={shard_size!r}; use a positive integer, \"node\" "
                         "or leave it out (every rank)")
    if shard_size > world_size or world_size % shard_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"ds_odc: zero_optimization.odc.shard_size={shard_size} does not divide the {world_size} "
                         f"ranks of this job into equal shard groups; use one of {divisors}")
    return shard_size


@dataclass(frozen=True)
class ShardLayout:
    """Which ranks share one copy of the model state (a shard group) and which hold the same shard (a replica
    group), for ``world_size`` ranks in groups of ``shard_size``, seen from ``rank``."""

    world_size: int
    shard_size: int
    rank: int

    def __post_init__(self):
        if self.shard_size < 1 or self.world_size % self.shard_size:
            raise ValueError(f"ds_odc: {self.world_size} ranks do not split into shard groups of {self.shard_size}")

    @property
    def replicas(self) -> int:
        return self.world_size // self.shard_size

    @property
    def hybrid(self) -> bool:
        """More than one shard group: the step sums gradients across replicas."""
        return self.replicas > 1

    @property
    def shard_index(self) -> int:
        """Which shard group this rank belongs to (also its rank in its replica group)."""
        return self.rank // self.shard_size

    @property
    def shard_rank(self) -> int:
        """This rank's place in its shard group: which shard it owns (also which replica group it is in)."""
        return self.rank % self.shard_size

    def shard_group_ranks(self, index: int | None = None) -> list[int]:
        g = self.shard_index if index is None else index
        return list(range(g * self.shard_size, (g + 1) * self.shard_size))

    def replica_group_ranks(self, shard_rank: int | None = None) -> list[int]:
        j = self.shard_rank if shard_rank is None else shard_rank
        return list(range(j, self.world_size, self.shard_size))


@dataclass(frozen=True)
class HybridGroups:
    """The process groups of one layout, as this rank sees them."""

    layout: ShardLayout
    shard: object  # default backend, over this rank's shard group: what DeepSpeed partitions over
    replica: object  # default backend, over this rank's replica group: the step's gradient all-reduce
    shard_control: object  # gloo over the shard group: ODC's meetings (time out, name ranks)
    job_control: object  # gloo over every rank (None: the default group is gloo already)


_GROUPS: dict[tuple[int, int], HybridGroups] = {}


def hybrid_groups(shard_size: int, timeout_s: float) -> HybridGroups:
    """The groups for shard groups of ``shard_size`` ranks (collective on the first call with a given size: every
    rank must call it). Their collectives time out after ``timeout_s`` (``zero_optimization.odc.timeout_s``), like
    ODC's meetings, not after torch's default of 10-30 minutes."""
    layout = ShardLayout(dist.get_world_size(), shard_size, dist.get_rank())
    key = (layout.world_size, layout.shard_size)
    if key in _GROUPS:
        return _GROUPS[key]
    timeout = timedelta(seconds=timeout_s)
    gloo_is_default = dist.get_backend() == "gloo"

    def mine(rank_lists, backend=None):
        found = None
        for ranks in rank_lists:  # every rank creates every group, in this order
            group = dist.new_group(ranks=ranks, timeout=timeout, backend=backend)
            if layout.rank in ranks:
                found = group
        return found

    shards = [layout.shard_group_ranks(g) for g in range(layout.replicas)]
    replicas = [layout.replica_group_ranks(j) for j in range(layout.shard_size)]
    shard = mine(shards)
    replica = mine(replicas)
    shard_control = shard if gloo_is_default else mine(shards, backend="gloo")
    job_control = None if gloo_is_default else dist.new_group(timeout=timeout, backend="gloo")
    _GROUPS[key] = HybridGroups(layout, shard, replica, shard_control, job_control)
    return _GROUPS[key]


def same_ranks(group, ranks: list[int]) -> bool:
    """Whether ``group`` (a process group, or None for the world) spans exactly ``ranks``."""
    members = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    return sorted(members) == sorted(ranks)


def groups_for(odc) -> HybridGroups | None:
    """The hybrid groups an ``OdcConfig`` asks for in this job (collective), or None when one group holds every rank
    (plain ZeRO-3 sharding); raises ValueError when ``shard_size`` does not fit the job."""
    if not odc.enabled or odc.shard_size is None:
        return None
    if not dist.is_initialized():
        from deepspeed import comm
        comm.init_distributed()  # what zero.Init would do next
    world = dist.get_world_size()
    size = resolve_shard_size(odc.shard_size, world, ranks_per_node())
    return None if size == world else hybrid_groups(size, odc.timeout_s)


def shard_group_for(config, mpu=None):
    """``zero.Init``'s default group for a ds_config (a dict or anything ``DeepSpeedConfig`` reads): the shard group
    when ``odc.shard_size`` asks for hybrid sharding, else None (stock: the world)."""
    if isinstance(config, dict):
        zero = config.get("zero_optimization")
        if not isinstance(zero, dict) or not isinstance(zero.get("odc"), dict) or "shard_size" not in zero["odc"]:
            return None  # no shard_size: stock's group, without parsing the config twice
        from ds_odc.config import odc_config_from_ds_config
        odc = odc_config_from_ds_config(config)
    else:
        from deepspeed.runtime.config import DeepSpeedConfig
        odc = DeepSpeedConfig(config, mpu).zero_config.odc
    groups = groups_for(odc)
    return None if groups is None else groups.shard


class Replicas:
    """This rank's shard as the other shard groups hold it: what keeps the W/S copies one model.

    * :meth:`meet`: the step's meeting of every rank of the job (a rank missing anywhere is named everywhere, within
      ``timeout_s``), before the gradient shards are summed;
    * :meth:`sum_`: the one all-reduce per step, over the ranks holding this shard;
    * :meth:`broadcast_`: the first shard group's copy to the others, wherever shards are written outside the step.

    Gradients read before the step (``safe_get_full_grad`` and the like) are summed early, and the accumulator then
    holds the whole job's sum, which the caller may also overwrite. A later sum must add only what was pushed after
    that: :meth:`resume` (at the first push after the early sum) keeps the accumulator aside, and a sum with nothing
    pushed since leaves it as it is."""

    def __init__(self, groups: HybridGroups, timeout_s: float):
        from ds_odc.ops.meeting import Meeting
        self.groups = groups
        self.everyone = Meeting(None, timeout_s, control=groups.job_control)
        self.source = groups.layout.shard_rank  # rank 0 of the replica group: the first shard group's copy
        self.summed: torch.Tensor | None = None  # what the accumulator held when pushes resumed after an early sum
        self.complete = False  # summed over the replicas, and nothing pushed since
        self.sum_s = 0.0  # seconds the last sum took

    def meet(self, what: str, note: str | None = None) -> dict[int, str | None] | None:
        return self.everyone(what, note=note)

    def leave(self, why: str) -> None:
        self.everyone.leave(why)

    def sum_(self, accumulator: torch.Tensor) -> None:
        """``accumulator`` (this shard group's sum) becomes the sum over every shard group, on every replica."""
        started = time.perf_counter()
        if self.complete:
            self._keep(accumulator)  # the whole job's already: add nothing to it (every replica joins all the same)
        if self.summed is not None:
            accumulator.sub_(self.summed)  # what every replica holds already
        dist.all_reduce(accumulator, group=self.groups.replica)
        if self.summed is not None:
            accumulator.add_(self.summed)
        self.complete = True
        self.sum_s = time.perf_counter() - started

    def resume(self, accumulator: torch.Tensor, dropped: bool) -> None:
        """Pushes start again after an early sum: keep the accumulator aside (or nothing, if it is being emptied)."""
        if dropped:
            self.summed = None
        else:
            self._keep(accumulator)
        self.complete = False

    def reset(self) -> None:
        """The step is over: the next sum starts from nothing."""
        self.summed, self.complete = None, False

    def _keep(self, accumulator: torch.Tensor) -> None:
        if self.summed is None:
            self.summed = accumulator.clone()
        else:
            self.summed.copy_(accumulator)

    def broadcast_(self, tensors) -> None:
        for tensor in tensors:
            dist.broadcast(tensor, src=self.source, group=self.groups.replica)
