"""The optimizer step on the host, for ``"offload_optimizer": {"device": "cpu"}`` under ODC: each sub-group's
accumulated gradient goes from the owner's device accumulator to the host, DeepSpeed's CPU optimizer steps the fp32
master weights there, and the new parameters come back into the owner's shard, the one peers read.

[Note: the host step]
Stock ZeRO-3 with the optimizer offloaded keeps its gradient partition in host memory: it copies it there at the
accumulation boundary, and with several microbatches it copies the host partition to the device and back to add each
one. Under ODC the gradient partition is the fp32 device accumulator that peers push into until the step's fence, so
it crosses to the host exactly once per step, after the fence::

    fence -> copy out: every sub-group's accumulator range -> its (pinned) host gradient, queued at once on a
             device-to-host stream
          -> for each sub-group i: wait for its copy -> clip and optimizer step on the CPU (stock's code)
             -> copy back: fp32 master -> (pinned) staging in the shard dtype, on the CPU; staging -> the device
                shard on a host-to-device stream
          -> wait for every copy -> publish (peers read the new shards from then on).

So the copies of later sub-groups run while the CPU steps sub-group i, and the copy back of sub-group i runs while
the CPU steps the next one; the two directions use two streams (PCIe is full duplex). Two staging buffers of the
largest sub-group alternate; the CPU refills one only once its previous copy back has finished. What stays on the
device: the shards (the model dtype, 2 bytes per parameter in bf16) and the fp32 accumulator (4 bytes), both per
parameter of this rank's 1/W partition; the host holds the fp32 master, its gradient and the optimizer state, as
stock does, plus the two staging buffers. On a device without streams (CPU training) every copy is synchronous and
happens where the step needs it.

:class:`HostStep` only moves tensors and times the moves; DeepSpeed's step decides the order (its sub-group loop calls
:meth:`HostStep.ready` and :meth:`HostStep.copy_back` through the optimizer), and the optimizer calls
:meth:`HostStep.start` after the fence and :meth:`HostStep.finish` before the publish.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch
from deepspeed.accelerator import get_accelerator

__all__: list[str] = []

_STAGING_SLOTS = 2


@dataclass
class HostStepTimes:
    """Host seconds of one step, by phase: waiting for (or doing) the device-to-host gradient copies, the CPU's clip
    and optimizer step, and casting the new parameters plus waiting for their host-to-device copies."""

    copy_out: float = 0.0
    optimizer: float = 0.0
    copy_back: float = 0.0


class HostStep:
    """Moves each sub-group's gradient to the host and its new parameters back (see [Note: the host step]).

    ``gradients[i]``: sub-group i's range of the device accumulator; ``masters``: the list of fp32 master partitions
    (``fp32_partitioned_groups_flat``, whose ``.grad`` the CPU optimizer reads); ``shards``: the list of shard ranges
    (``fp16_partitioned_groups_flat``). The lists are read at every step, so a tensor re-pointed in place (``.data``)
    is followed."""

    def __init__(self, gradients: Sequence[torch.Tensor], masters: Sequence[torch.Tensor],
                 shards: Sequence[torch.Tensor], pin_memory: bool):
        accelerator = get_accelerator()
        self.gradients = list(gradients)
        self.masters = masters
        self.shards = shards
        self.times = HostStepTimes()
        self._streams = not accelerator.is_synchronized_device()
        self._out_stream = accelerator.Stream() if self._streams else None
        self._back_stream = accelerator.Stream() if self._streams else None
        self._out_done: list = []
        self._staging: list[torch.Tensor] = []
        self._staging_done: list = [None] * _STAGING_SLOTS
        if self._streams:
            largest = max(s.numel() for s in shards)
            for _ in range(_STAGING_SLOTS):
                slot = torch.empty(largest, dtype=shards[0].dtype)
                self._staging.append(accelerator.pin_memory(slot) if pin_memory else slot)
        self._active = False
        self._mark = 0.0

    @property
    def active(self) -> bool:
        """Between :meth:`start` and :meth:`finish` (DeepSpeed's step is running on the host)."""
        return self._active

    def start(self) -> None:
        """After the fence: queue every sub-group's gradient copy to the host."""
        self.times = HostStepTimes()
        self._active = True
        started = time.perf_counter()
        if self._streams:
            accelerator = get_accelerator()
            self._out_stream.wait_stream(accelerator.current_stream())
            self._out_done = []
            with accelerator.stream(self._out_stream):
                for gradient, master in zip(self.gradients, self.masters):
                    master.grad.data.copy_(gradient, non_blocking=True)
                    done = accelerator.Event()
                    done.record(self._out_stream)
                    self._out_done.append(done)
        self.times.copy_out += time.perf_counter() - started

    def ready(self, i: int) -> None:
        """Before the CPU steps sub-group ``i``: its gradient is on the host."""
        if not self._active:
            return
        started = time.perf_counter()
        if self._streams:
            self._out_done[i].synchronize()
        else:
            self.masters[i].grad.data.copy_(self.gradients[i])
        self._mark = time.perf_counter()
        self.times.copy_out += self._mark - started

    def copy_back(self, i: int) -> bool:
        """After the CPU stepped sub-group ``i``: start writing its new parameters into its shard. False outside
        the step (the caller copies as stock does)."""
        if not self._active:
            return False
        started = time.perf_counter()
        self.times.optimizer += started - self._mark
        master, shard = self.masters[i], self.shards[i]
        if not self._streams:
            shard.data.copy_(master.data)  # as stock (the master is a leaf that requires grad)
        else:
            accelerator, k = get_accelerator(), i % _STAGING_SLOTS
            if self._staging_done[k] is not None:
                self._staging_done[k].synchronize()  # its previous copy back has left the buffer
            staging = self._staging[k].narrow(0, 0, shard.numel())
            staging.copy_(master.data)  # the cast to the shard dtype, on the CPU: half the bytes cross
            self._back_stream.wait_stream(accelerator.current_stream())
            with accelerator.stream(self._back_stream):
                shard.data.copy_(staging, non_blocking=True)
                done = accelerator.Event()
                done.record(self._back_stream)
            self._staging_done[k] = done
        self._mark = time.perf_counter()
        self.times.copy_back += self._mark - started
        return True

    def finish(self) -> None:
        """Before the publish: every copy is done (the accumulator may be emptied, peers may read the shards)."""
        if not self._active:
            return
        started = time.perf_counter()
        if self._streams:
            self._out_stream.synchronize()
            self._back_stream.synchronize()
            get_accelerator().current_stream().wait_stream(self._back_stream)
        self.times.copy_back += time.perf_counter() - started
        self._active = False


def release_pinned(unreferenced: list) -> None:
    """Give back the page-locked host memory of the tensors in ``unreferenced`` (emptied here; nothing else may hold
    them): DeepSpeed's own release (its native pinning backend), then torch's cache of freed pinned blocks, which
    would otherwise keep them resident for the rest of the job."""
    pinned = False
    while unreferenced:
        tensor = unreferenced.pop()
        if tensor is not None and tensor.device.type == "cpu":
            get_accelerator().unpin_memory(tensor)
            pinned = True
        del tensor
    empty_host_cache = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if pinned and empty_host_cache is not None and torch.cuda.is_available():
        empty_host_cache()
