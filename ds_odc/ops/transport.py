"""The communication interface ODC needs: symmetric buffers, a one-sided gather, a one-sided scatter-accumulate,
and a fence at the optimizer step.

A *symmetric buffer* has the same size, dtype and layout on every rank, so a rank can address a peer's copy by the
offset it would use locally. ZeRO-3 keeps each rank's parameter shards (and its gradient accumulation partition) in
one flat buffer whose per-parameter offsets are identical on every rank, which is what makes one-sided access
addressable: rank ``r`` owns elements ``[r * n, (r + 1) * n)`` of a parameter whose shard has ``n`` elements, and
stores them at the same ``offset`` in its buffer as every other rank stores its own shard.

Semantics every implementation keeps:

* ``gather`` reads only: the owners do nothing to serve it. Data read is what the owners held at the last
  ``barrier`` (owners change their shards only between ``fence`` and ``barrier``).
* ``scatter_accumulate`` adds only: slice ``r`` of the input is *added* into rank ``r``'s accumulator; the owner
  does nothing to serve it. Contributions from any number of ranks, in any order, sum exactly as the fence defines.
* ``fence`` is collective: when it returns, every rank has arrived, and every accumulation issued (by any rank)
  into this rank's accumulators before that rank arrived is visible in ``accumulator.local``. A rank that does not
  arrive within the timeout makes the others raise :class:`FenceTimeout` naming it.
* ``barrier`` is collective; the step protocol uses it after the optimizer update to publish the new shards and
  the zeroed accumulators before anyone reads or pushes again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

import torch


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
    """A buffer allocated collectively, with the same ``numel`` and ``dtype`` on every rank.

    ``local`` is this rank's copy; implementations keep whatever else they need (peer views, staging) in ``handle``.
    """

    numel: int
    dtype: torch.dtype
    local: torch.Tensor
    accumulator: bool = False
    handle: object = field(default=None, repr=False)


class Transport(ABC):
    """One-sided communication among the ranks of a process group."""

    name: str = "abstract"

    def __init__(self, rank: int, world_size: int, timeout_s: float):
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s

    @abstractmethod
    def allocate(self, numel: int, dtype: torch.dtype, *, accumulator: bool = False) -> SymmetricBuffer:
        """Collectively allocate a zero-filled symmetric buffer. ``accumulator=True`` makes it a target of
        ``scatter_accumulate`` (implementations may attach staging space to it)."""

    @abstractmethod
    def gather(self, source: SymmetricBuffer, segments: Sequence[Segment], outputs: Sequence[torch.Tensor]) -> None:
        """For each segment ``i``: ``outputs[i][r*len:(r+1)*len] = source@r[offset:offset+len]`` for every rank ``r``.

        ``outputs[i]`` is a contiguous tensor of ``world_size * segments[i].length`` elements of ``source.dtype``.
        On CUDA the reads are ordered on the current stream."""

    @abstractmethod
    def scatter_accumulate(self, accumulator: SymmetricBuffer, segments: Sequence[Segment],
                           inputs: Sequence[torch.Tensor], scale: float = 1.0) -> None:
        """For each segment ``i`` and rank ``r``: ``accumulator@r[offset:offset+n] += scale * inputs[i][r*len:r*len+n]``.

        ``inputs[i]`` is a flat tensor of at most ``world_size * len`` elements (ZeRO's last ranks may own padding
        only); ``n`` is what of slice ``r`` exists. The sum is taken in ``accumulator.dtype``. On CUDA the pushes
        are ordered on the current stream, and ``inputs`` may be reused once that stream has passed them."""

    @abstractmethod
    def fence(self, accumulators: Sequence[SymmetricBuffer]) -> None:
        """Collective arrival: see the module docstring."""

    @abstractmethod
    def barrier(self) -> None:
        """Collective arrival with the same timeout and error naming as ``fence``."""

    def zero_(self, accumulators: Sequence[SymmetricBuffer]) -> None:
        """Zero accumulators between a ``fence`` and the following ``barrier``."""
        for acc in accumulators:
            acc.local.zero_()

    def close(self) -> None:
        """Release everything allocated. Called at teardown (and at interpreter exit)."""
