"""The plan an engine follows in the stock DeepSpeed loop: which microbatch of the planned minibatch the loop's next
``engine(batch)``, ``engine.backward(loss)`` and ``engine.step()`` train, and what that means for the engine.

A planned loader (:mod:`ds_odc.training.planned_loader`, what ``deepspeed.initialize(training_data=...)`` returns when
``zero_optimization.odc.balancer`` is set) hands the engine a :class:`PlannedMicrobatch` as it yields each
microbatch. While one is current:

- ``engine.backward(loss)`` multiplies the loss by the microbatch's weight instead of dividing it by
  ``gradient_accumulation_steps`` (the weights make the step's update the gradient of the minibatch's global mean
  loss, whatever the number of microbatches on each rank);
- the accumulation boundary is the rank's last microbatch of the minibatch;
- ``gradient_accumulation_steps()`` is this rank's number of microbatches in the minibatch,
  ``train_micro_batch_size_per_gpu()`` the samples of the current microbatch and ``train_batch_size()`` the samples
  of the whole minibatch over all ranks.
"""

from __future__ import annotations

import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable

__all__: list[str] = []

_ATTRIBUTE = "ds_odc_plan"
_STEPPED = weakref.WeakSet()  # engines whose first step checked that their balancer block is read
_UNREAD_EXPLAINED = [False]  # a trainer already warned that it plans from its own keywords instead


@dataclass(frozen=True)
class PlannedMicrobatch:
    """One microbatch of a rank's share of a planned minibatch."""

    index: int  # its place among this rank's microbatches of the minibatch
    count: int  # this rank's microbatches in the minibatch
    samples: int  # samples in this microbatch
    weight: float  # what engine.backward multiplies its loss by

    @property
    def boundary(self) -> bool:
        return self.index == self.count - 1


class EnginePlan:
    """What an engine's planned loader told it about the microbatch being trained, and what the engine's backward
    saw of it (this rank's share of the minibatch's loss, when its last backward ended)."""

    def __init__(self, minibatch_samples: int, world_size: int):
        self.minibatch_samples = int(minibatch_samples)  # every rank's samples of one minibatch
        self.world_size = int(world_size)  # the ranks the update averages over
        self.current: PlannedMicrobatch | None = None
        self.backward_ended_s: float | None = None
        self._loss_share = None  # a tensor: no device sync per microbatch
        self.on_step: Callable[[], None] | None = None  # called when the minibatch's optimizer step returned

    def follow(self, engine, microbatch: PlannedMicrobatch) -> None:
        """``engine``'s next forward, backward and step train ``microbatch``."""
        if microbatch.index == 0:
            self._loss_share = None
            self.backward_ended_s = None
        self.current = microbatch
        engine.set_gradient_accumulation_boundary(microbatch.boundary)

    def weigh(self, loss):
        """The loss ``engine.backward`` differentiates: ``loss`` times the current microbatch's weight."""
        weighted = loss * self.current.weight
        share = weighted.detach() / self.world_size
        self._loss_share = share if self._loss_share is None else self._loss_share + share
        return weighted

    def backward_ended(self) -> None:
        self.backward_ended_s = time.perf_counter()

    def stepped(self) -> None:
        """``engine.step()`` at the rank's last microbatch of the minibatch returned: the step is over."""
        if self.on_step is not None:
            self.on_step()

    def loss_share(self) -> float:
        """This rank's share of the minibatch's global mean loss (the ranks' shares add up to it)."""
        return 0.0 if self._loss_share is None else float(self._loss_share)


def plan_of(engine) -> EnginePlan | None:
    """The plan ``engine`` follows, or None (a stock loop)."""
    return getattr(engine, _ATTRIBUTE, None)


def attach_plan(engine, minibatch_samples: int, world_size: int) -> EnginePlan:
    """Give ``engine`` a plan to follow (see the module docstring)."""
    plan = EnginePlan(minibatch_samples, world_size)
    setattr(engine, _ATTRIBUTE, plan)
    return plan


def balancer_unread_explained() -> None:
    """A trainer has warned that it plans from its own keywords: :func:`check_balancer_read` need not warn again."""
    _UNREAD_EXPLAINED[0] = True


def check_balancer_read(engine, balancer_of: Callable) -> None:
    """At ``engine``'s first step: a ``zero_optimization.odc.balancer`` block (``balancer_of(engine)``, None if
    absent; read at that step only) that no planned loader reads (the loop trains from a loader of its own, not the
    one ``deepspeed.initialize(training_data=...)`` returned) plans nothing; say so once instead of ignoring it."""
    if engine in _STEPPED:
        return
    _STEPPED.add(engine)
    if plan_of(engine) is not None or _UNREAD_EXPLAINED[0] or balancer_of(engine) is None:
        return
    warnings.warn("ds_odc: zero_optimization.odc.balancer is set, but this engine trains without the loader "
                  "deepspeed.initialize(training_data=...) returns, so nothing is balanced: pass your dataset as "
                  "training_data and iterate over the loader it returns, or drop the block", UserWarning,
                  stacklevel=4)
