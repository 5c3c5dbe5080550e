"""Lock-step meetings (``zero_optimization.odc.lockstep``): ODC with collective ZeRO-3's per-layer synchronisation put
back, as a baseline on the same transport for measuring what meeting only at the optimizer step buys.

With lockstep on, every rank meets every other before each block's forward fetch and after its backward
(:meth:`~ds_odc.ops.transport.Transport.lockstep_barrier`, held by the parameter coordinator), as ZeRO-3's
all-gathers and reduce-scatters make them wait. This module holds what the transports share: the tally of meetings and the time waited in them, the error of
ranks that ran different numbers of microbatches, and the lock-step meeting on the host (the CPU transport's, and
the GPU transport's where it has no peer pointers); the GPU's own is a kernel (``csrc/odc_kernels.cu``).

[Note: a lock-step meeting that meets the fence]
A host meeting cannot tell one meeting from another: a rank that ran fewer microbatches reaches the step's fence
while the others wait in a lock-step meeting, and the two would complete each other. So with lockstep on, a
transport's host meetings at a lock-step meeting and at the fence carry notes (:class:`~ds_odc.ops.meeting.Meeting`):
:data:`LOCKSTEP_NOTE` at a lock-step meeting, the minibatch's tag or "" at the fence. A lock-step note beside any
other means some ranks left their minibatch early: every rank that reads the notes raises :class:`LockstepMismatch`
naming them, at once. On CUDA the lock-step meeting is a kernel that no host meeting completes: a rank that does not
come makes it time out, on the device clock, and the host raises at its next fence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ds_odc.ops.meeting import Meeting
from ds_odc.ops.transport import FenceTimeout

__all__: list[str] = []

LOCKSTEP_NOTE = "lock-step"


@dataclass
class LockstepTally:
    """The lock-step meetings this rank has reached so far, and the seconds it waited in them: the host's time where
    the host meets (``on_device`` False), else the device's time inside the barrier kernels (known up to the last
    fence or barrier), summed over the streams they ran on."""

    meetings: int = 0
    wait_s: float = 0.0
    on_device: bool = False


class LockstepMismatch(FenceTimeout):
    """With ``odc.lockstep``, ranks met at different points of the minibatch: ``missing_ranks`` are those that ran
    fewer microbatches (or fewer layers) than the others."""


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def fewer_microbatches(rank: int, what: str, fewer: list[int], detail: str) -> LockstepMismatch:
    """The error that names ``fewer``, the ranks that ran fewer microbatches, as rank ``rank`` saw it at ``what``."""
    return LockstepMismatch(
        f"ds_odc: rank {rank}: at {what}, {detail}: {_ranks(fewer)} ran fewer microbatches (or fewer layers) in this "
        "minibatch than the others. With zero_optimization.odc.lockstep every rank must run the same number of "
        "microbatches per optimizer step, as under stock ZeRO-3; set lockstep to false to train with different "
        "counts.", fewer)


def check_notes(notes: dict[int, str | None] | None, rank: int, what: str) -> None:
    """Raise :class:`LockstepMismatch` if some ranks posted :data:`LOCKSTEP_NOTE` at this meeting and others did not
    (see [Note: a lock-step meeting that meets the fence]). ``rank``: this rank, ``what``: the meeting."""
    if not notes:
        return
    inside = sorted(r for r, note in notes.items() if note == LOCKSTEP_NOTE)
    if not inside or len(inside) == len(notes):
        return
    fewer = sorted(set(notes) - set(inside))
    raise fewer_microbatches(rank, what, fewer, f"{_ranks(inside)} met in a lock-step meeting inside the minibatch "
                                                f"while {_ranks(fewer)} had left it (for the optimizer step's fence "
                                                "or another meeting)")


class HostLockstep:
    """Lock-step meetings on the host, over a transport's :class:`~ds_odc.ops.meeting.Meeting`."""

    def __init__(self, meet: Meeting):
        self.meet = meet
        self.tally = LockstepTally()

    @property
    def rank(self) -> int:
        return self.meet.job_ranks[self.meet.rank]

    def __call__(self, what: str) -> None:
        """Meet every rank (timing out and naming the missing as every meeting does), counted and timed."""
        self.tally.meetings += 1
        started = time.perf_counter()
        try:
            notes = self.meet(what, note=LOCKSTEP_NOTE)
        finally:
            self.tally.wait_s += time.perf_counter() - started
        check_notes(notes, self.rank, what)

    def meeting(self, what: str, note: str | None = None) -> dict[int, str | None] | None:
        """Any other meeting of the transport (a fence, a barrier), which a lock-step meeting must not complete:
        ``note`` as the caller gave it (None: none) is posted as "" so that every rank's arrival carries one; returns
        the notes as the caller would get them without lockstep (None without a note of its own; a rank that posted
        "" as None)."""
        notes = self.meet(what, note="" if note is None else note)
        check_notes(notes, self.rank, what)
        if note is None or notes is None:
            return None
        return {r: (n or None) for r, n in notes.items()}
