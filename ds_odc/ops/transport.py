"""The communication interface ODC needs: symmetric buffers, a one-sided gather, a one-sided scatter-accumulate,
and the collective meetings of the optimizer step.

A *symmetric buffer* has the same size, dtype and layout on every rank, so a rank can address a peer's copy by the
offset it would use locally. ZeRO-3 keeps each rank's parameter shards (and its gradient accumulation partition) in
one flat buffer whose per-parameter offsets are identical on every rank, which is what makes one-sided access
addressable: rank ``r`` owns elements ``[r * n, (r + 1) * n)`` of a parameter whose shard has ``n`` elements, and
stores them at the same ``offset`` in its buffer as every other rank stores its own shard.

Moving data takes a *plan*: what a set of segments means for this transport (peer addresses, slot views, task
tables), computed once with :meth:`Transport.plan_gather` / :meth:`Transport.plan_scatter` and reused every time the
same parameters move, so nothing that stays the same from step to step is rebuilt on the hot path.

Semantics every implementation keeps:

* ``gather`` reads only: the owners do nothing to serve it. Data read is what the owners held at their last
  ``barrier`` (owners change their shards only between ``fence`` and ``barrier``, or before a ``barrier`` that
  publishes a write made outside the step).
* ``scatter_accumulate`` adds only: slice ``r`` of the input is *added* into rank ``r``'s accumulator; the owner
  does nothing to serve it. Contributions from any number of ranks, in any order, sum exactly as the fence defines.
* ``fence`` is collective: when it returns, every rank has arrived, and every accumulation issued (by any rank)
  into this rank's accumulators before that rank arrived is in ``accumulator.local``. A rank that does not arrive
  within the timeout makes the others raise :class:`FenceTimeout` naming it. It may carry a short note from every
  rank (see :class:`~ds_odc.ops.meeting.Meeting`), which it returns.
* ``barrier`` is collective with the same timeout and naming; it publishes: whatever a rank wrote into its buffers
  before it arrived is what peers read after it returns.
* ``lockstep_barrier`` (only with ``odc.lockstep``, a baseline for measuring) is collective and does nothing else:
  every rank waits for every rank, as at a collective all-gather; see :mod:`ds_odc.ops.lockstep`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["Segment", "OdcError", "FenceTimeout"]


class OdcError(RuntimeError):
    """Base class for ds_odc runtime errors."""


class FenceTimeout(OdcError):
    """A fence or barrier did not complete: some ranks did not arrive (or died)."""

    def __init__(self, message: str, missing_ranks: Sequence[int] = ()):
        super().__init__(message)
        self.missing_ranks = list(missing_ranks)


@dataclass(frozen=True)
class Segment:
    """One parameter's place in a symmetric buffer: ``length`` elements at ``offset`` on every rank."""

    offset: int
    length: int


@dataclass(eq=False)
class SymmetricBuffer:
    """A buffer allocated collectively, with the same ``numel`` and ``dtype`` on every rank; ``local`` is this rank's
    copy. Each transport returns its own subclass, which holds what it needs to reach the peers' copies."""

    numel: int
    dtype: torch.dtype
    local: torch.Tensor
    accumulator: bool


@dataclass(eq=False)
class GatherPlan:
    """Reads of ``segments`` of ``source`` into one flat output of ``out_numel`` elements: segment ``i`` lands at
    ``out_offsets[i]`` as ``world_size * segments[i].length`` elements, owner by owner."""

    source: SymmetricBuffer
    segments: tuple[Segment, ...]
    out_offsets: tuple[int, ...]
    out_numel: int


@dataclass(eq=False)
class ScatterPlan:
    """Pushes of one input per segment into ``accumulator``: input ``i`` has ``input_numels[i]`` elements (at most
    ``world_size * segments[i].length``; a shorter input means the last owners hold padding only)."""

    accumulator: SymmetricBuffer
    segments: tuple[Segment, ...]
    input_numels: tuple[int, ...]


class Transport(ABC):
    """One-sided communication among the ranks of a process group."""

    name: str = "abstract"
    can_evict: bool = False  # whether evict() gives symmetric memory back while the job runs
    lockstep_tally = None  # with odc.lockstep: a LockstepTally (ds_odc.ops.lockstep) of the lock-step meetings so far

    def __init__(self, rank: int, world_size: int, timeout_s: float):
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s

    @abstractmethod
    def allocate(self, numel: int, dtype: torch.dtype, *, accumulator: bool = False) -> SymmetricBuffer:
        """Collectively allocate a zero-filled symmetric buffer. ``accumulator=True`` makes it a target of
        ``scatter_accumulate`` (implementations may attach staging space to it)."""

    @abstractmethod
    def plan_gather(self, source: SymmetricBuffer, segments: Sequence[Segment]) -> GatherPlan:
        """Prepare reads of ``segments`` (local work only; keep the plan and reuse it)."""

    @abstractmethod
    def gather(self, plan: GatherPlan, out: torch.Tensor) -> None:
        """``out[plan.out_offsets[i] + r*len : ... + (r+1)*len] = source@r[offset : offset+len]`` for every segment
        ``i`` and rank ``r``. ``out`` is contiguous, ``plan.out_numel`` elements of ``source.dtype``. On CUDA the reads
        are ordered on the current stream."""

    @abstractmethod
    def plan_scatter(self, accumulator: SymmetricBuffer, segments: Sequence[Segment],
                     input_numels: Sequence[int]) -> ScatterPlan:
        """Prepare pushes of inputs of ``input_numels`` elements into ``segments`` of ``accumulator``."""

    @abstractmethod
    def scatter_accumulate(self, plan: ScatterPlan, inputs: Sequence[torch.Tensor], scale: float = 1.0) -> None:
        """For each segment ``i`` and rank ``r``: ``accumulator@r[offset:offset+n] += scale * inputs[i][r*len:r*len+n]``,
        where ``n`` is what of slice ``r`` exists. ``inputs[i]`` are contiguous with the plan's numels; the sum is
        taken in ``accumulator.dtype``. On CUDA the pushes are ordered on the current stream, and ``inputs`` may be
        reused once that stream has passed them."""

    @abstractmethod
    def fence(self, accumulators: Sequence[SymmetricBuffer], what: str = "the fence at the optimizer step",
              note: str | None = None) -> dict[int, str | None] | None:
        """Collective arrival that completes every push (see the module docstring). ``what`` names the occasion in
        the error raised when a peer does not arrive. With ``note``: every rank's note, by job rank (None when notes
        cannot travel), as :class:`~ds_odc.ops.meeting.Meeting` returns them."""

    @abstractmethod
    def barrier(self, what: str = "the barrier after the optimizer step") -> None:
        """Collective arrival that publishes this rank's writes."""

    def lockstep_barrier(self, what: str) -> None:
        """A lock-step meeting (``odc.lockstep``): every rank waits here for every other, nothing moves; ``what``
        names it in errors. Counted, with the time waited, in :attr:`lockstep_tally`. On CUDA it is ordered on the
        current stream: the GPU waits, as an NCCL collective makes the stream wait, and the host does not block; a
        rank that does not come within the timeout is named by the next ``fence`` or ``barrier``, which raises
        :class:`FenceTimeout`. On CPU the host meets, and raises here, as ``fence`` does. A no-op at one rank.
        Transports built without lockstep raise :class:`OdcError`."""
        raise OdcError(f"ds_odc: the {self.name} transport was built without lock-step meetings "
                       "(zero_optimization.odc.lockstep)")

    def zero_(self, accumulators: Sequence[SymmetricBuffer]) -> None:
        """Zero accumulators (and anything staged for them) between a ``fence`` and the following ``barrier``."""
        for acc in accumulators:
            acc.local.zero_()

    def evict(self, buffers: Sequence[SymmetricBuffer]) -> None:
        """Give back the memory behind this rank's copy of each of ``buffers`` (and an accumulator's staging) for a
        while: the buffers keep their addresses and read as zeros until written again. Local work only; peers must
        not read or push into them meanwhile (the caller meets them before). Transports that cannot
        (``can_evict`` False) raise :class:`OdcError`."""
        raise OdcError(f"ds_odc: the {self.name} transport cannot give symmetric memory back while the job runs")

    def leave(self, why: str) -> None:
        """This rank will not meet again (``why``: what it did): a meeting the others wait in says so."""

    def close(self) -> None:
        """Release everything allocated. Called at teardown (and at interpreter exit)."""


def out_layout(segments: Sequence[Segment], world_size: int) -> tuple[tuple[int, ...], int]:
    """Offsets of each segment's gathered copy in one flat output, and the output's size."""
    offsets, total = [], 0
    for seg in segments:
        offsets.append(total)
        total += world_size * seg.length
    return tuple(offsets), total
