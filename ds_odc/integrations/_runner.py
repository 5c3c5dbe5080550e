"""The ODC step of every ds_odc trainer: what a runner needs from a trainer, and the one step they all take.

A Hugging Face ``Trainer`` calls ``training_step`` once per microbatch and lets Accelerate decide when to step. Under
ODC + LB-Mini one optimizer step has a different microbatch count on every rank (0 included), so a ds_odc trainer
hands each whole step to its *runner*, chosen once when the trainer is built:

* :class:`StepRunner`: ODC off. Every hook runs the stock trainer method handed to it (``stock``) and nothing else.
* an :class:`OdcRunner`: ODC on. Its subclass says where a step's microbatches come from, and lives beside its
  trainer: :class:`~ds_odc.integrations.transformers.PackRunner` (a map-style dataset, one *pack* per optimizer step:
  ``OdcTrainer``, ``OdcSFTTrainer``, ``OdcDPOTrainer``) and :class:`~ds_odc.integrations.trl_grpo.RolloutRunner`
  (generated rollouts, re-planned across ranks: ``OdcGRPOTrainer``).

One step, top to bottom (:meth:`OdcRunner.run`, entered once per step by the trainer's runner)::

    trainer.training_step            the trainer's file: its runner makes this rank's Microbatch records
      OdcRunner.run                  here: tag the minibatch, start the clock, then
        trainer.odc_prepare_step       once, on every rank (also one with no microbatch)
        for each microbatch:           gradient sync off; forward_backward: inside microbatch_context (a split
          trainer.odc_loss               sample's group attention, TRL's step context), the loss of one
                                         Microbatch, then its backward
        engine.step()                  where every rank meets (ODC's fence), whatever its count
        meet                           one all-gather: busy time, microbatches, tokens, the loss's metrics of every
                                       rank; the same StepRecord on every rank feeds the automatic cost (observe)
        trainer.odc_step_metrics       once: the metrics combined over ranks

So a step enters the trainer's file for its three hooks only (the loss once per microbatch); everything between them
is read here (``tests/integrations/test_step_visits.py`` follows a step file by file).

:class:`StepTrainer` names what the runner needs from a trainer. A new trainer over a dataset subclasses ``OdcTrainer``
(before the TRL class: ``class OdcDPOTrainer(OdcTrainer, DPOTrainer)``) and adds a collator and a loss:

* ``odc_collator()``: a list of samples -> the model inputs of one microbatch (LB-Mini plans samples, so a pair that is
  one sample is never split across ranks or microbatches); the sampler reads each sample's length from the
  ``length_column`` of :class:`~ds_odc.balancer.options.BalancerOptions`;
* ``odc_loss(model, mb)``: the loss of one :class:`Microbatch`, weighted so that the sum over the step's microbatches on
  all ranks is the stock loss (times the world size: ZeRO averages over ranks); TRL's per-microbatch metrics are
  recorded in ``mb.metrics`` under each sample's ``mb.slots``;
* optionally ``odc_prepare_step(model, microbatches)``: what all of this rank's microbatches need first (``OdcTrainer``:
  inputs on the device; DPO adds the reference model's log-probs, whose forwards a stock ZeRO-3 reference engine runs
  in step with the other ranks); returns the microbatches to train;
* optionally ``odc_step_metrics(minibatch, metrics)``: after the meeting, those metrics combined over ranks, one value
  per stock microbatch, to append to TRL's logs.

Everything else (loader, plans, step, meeting, automatic cost, ``odc/*`` logs, checkpoints) is the runner's. Compiling
transformer blocks or swapping in fused kernels hooks into ``PackRunner.prepare_model`` (once, before training) and
:meth:`OdcRunner.forward_backward` (every microbatch's forward and backward run inside it). A MoE model's router loss,
a mean over each microbatch, is weighted in :mod:`ds_odc.integrations._router_loss`.

Busy time is :mod:`ds_odc.training.metrics`' definition: the step's wall time less the wait at ODC's fence.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Protocol, Sequence

import torch
import torch.distributed as dist
from accelerate.utils.memory import clear_device_cache
from transformers.utils import logging

from ds_odc.balancer.autocost import AutoCost, CostUpdate, rank_rows
from ds_odc.balancer.cost import CostModel
from ds_odc.balancer.options import BalancerOptions, choose_cost
from ds_odc.integrations._hf_privates import set_sync_gradients, trl_step_context
from ds_odc.integrations._metrics import BalanceMeter
from ds_odc.integrations._setup import deepspeed_config_of
from ds_odc.integrations._stock_metrics import SlotMetrics, combine
from ds_odc.training.metrics import StepClock, StepRecord, record_from_rows
from ds_odc.training.sequence_parallel import SequenceParallel
from ds_odc.zero.engine import tag_minibatch, wait_seconds
from ds_odc.zero.minibatch import MinibatchTag

logger = logging.get_logger(__name__)

__all__: list[str] = []

BALANCER_STATE_NAME = "ds_odc_balancer.json"  # in every checkpoint folder: where the balancer stands


@dataclass(frozen=True)
class Microbatch:
    """One microbatch in flight, handed by the runner to the trainer's loss.

    Attributes:
        inputs: what the trainer's collator made of its samples: model inputs (a dict of tensors, on the device once
            ``odc_prepare_step`` has run), or a trainer's own record (GRPO: the rollout samples).
        sample_ids: its samples (dataset rows, or a rollout's global sample ids), in the order ``inputs`` holds them.
        slots: per sample, its stock microbatch: the accumulation step in which the stock trainer, fed the same
            minibatch, trains it. TRL's per-microbatch metrics are recorded under it.
        metrics: where the loss records TRL's metrics for the step (combined over ranks at the meeting).
        label_tokens: its loss tokens, as the stock Trainer counts them (``None``: not counted).
        step_label_tokens: the loss tokens of the whole optimizer step on all ranks (``None``: no labels anywhere).
        step_samples: the samples of the whole optimizer step on all ranks (a per-sample mean loss divides by it).
        split: this rank's :class:`~ds_odc.training.sequence_parallel.SplitSlice` of a sample split over a group of
            ranks (``lb-mini-sp``), or ``None``.
        num_items_in_batch: what the stock trainer's loss divides by, as it would get it for this step (the
            Trainer's global label-token count, TRL GRPO's item count of the generation batch), or ``None``.
    """

    inputs: Any
    sample_ids: tuple[int, ...]
    slots: tuple[int, ...] = ()
    metrics: SlotMetrics | None = field(default=None, compare=False)
    label_tokens: int | None = None
    step_label_tokens: int | None = None
    step_samples: int | None = None
    split: Any = None
    num_items_in_batch: Any = field(default=None, compare=False)

    @property
    def sample_share(self) -> float:
        """This microbatch's share of the step's samples (a split sample's slice counts ``1 / g`` of it): how much a
        per-microbatch mean computed on it weighs in the step (see [Note: per-microbatch means] in
        :mod:`ds_odc.integrations._router_loss`)."""
        if not self.step_samples:
            raise RuntimeError("ds_odc: this microbatch does not know how many samples its step trains")
        samples = 1.0 / len(self.split.ranks) if self.split is not None else float(len(self.sample_ids))
        return samples / self.step_samples


@dataclass(frozen=True)
class StepTimes:
    """This rank's share of one optimizer step: summed loss of its microbatches, and its timings."""

    loss: torch.Tensor
    busy_s: float
    step_s: float
    microbatches: int


class StepTrainer(Protocol):
    """What an :class:`OdcRunner` needs from the trainer it runs steps for (besides the ``Trainer``'s own ``args``,
    ``model``, ``model_wrapped``, ``accelerator`` and ``compute_loss_context_manager``). :class:`RunsOdcSteps` gives
    the defaults of the optional two; a trainer over a dataset also makes microbatches (``odc_collator``, see
    ``OdcTrainer``)."""

    def odc_prepare_step(self, model, microbatches: list[Microbatch]) -> list[Microbatch]:
        """At the start of a step, inside its clock, on every rank (also one with no microbatch): what all of this
        rank's microbatches need first. Returns the microbatches to train."""

    def odc_loss(self, model, mb: Microbatch) -> torch.Tensor:
        """The loss of one microbatch, weighted so that the sum over the step's microbatches on all ranks is the
        stock loss (times the world size: ZeRO averages over ranks)."""

    def odc_step_metrics(self, minibatch: Sequence[int], metrics: dict[str, list[float]]) -> None:
        """After the step's meeting: what ``odc_loss`` recorded, combined over ranks, one value per stock microbatch.
        ``minibatch``: the step's samples on all ranks, in the order the stock trainer trains them."""


class StepRunner:
    """ODC off: every hook runs the stock trainer method handed to it."""

    enabled = False

    def train_dataloader(self, stock: Callable):
        return stock()

    def total_train_batch_size(self, args, stock: Callable) -> int:
        return stock(args)

    def batch_samples(self, epoch_iterator, num_batches: int, device, stock: Callable):
        return stock(epoch_iterator, num_batches, device)

    def training_step(self, model, inputs, num_items_in_batch, stock: Callable) -> torch.Tensor:
        return stock(model, inputs, num_items_in_batch)

    def floating_point_ops(self, inputs, stock: Callable) -> int:
        return stock(inputs)

    def generate(self, stock: Callable[[], tuple]) -> tuple:
        return stock()

    def resume_from(self, checkpoint):
        """``resume_from_checkpoint`` as ``Trainer.train`` is to get it."""
        return checkpoint

    def save(self, folder: str) -> None:
        """After the Trainer saved a checkpoint into ``folder``."""

    def log(self, logs: dict[str, float]) -> None:
        """Before the Trainer logs ``logs``."""


class OdcRunner(StepRunner):
    """ODC on: the step, the meeting, the automatic cost, the ``odc/*`` logs. Subclasses say where a step's
    microbatches come from, and choose the cost (:meth:`choose_cost`) once they know the model and the loader."""

    enabled = True

    def __init__(self, trainer: StepTrainer, options: BalancerOptions) -> None:
        self.trainer = trainer
        self.options = options
        self.meter = BalanceMeter(trainer.args.world_size)
        self.cost: CostModel | AutoCost | None = None
        self.sp: SequenceParallel | None = None  # groups of ranks for split samples (lb-mini-sp), created once
        # The ds_config keeps the caller's accumulation steps (filled in by TrainingArguments); ODC marks every
        # boundary itself, so the count is not used. Accelerate would adopt it anyway, with a "Gradient accumulation
        # steps mismatch" warning against the trainer's 1: give it the value now.
        ds_steps = deepspeed_config_of(trainer.args).get("gradient_accumulation_steps")
        if isinstance(ds_steps, int):
            trainer.accelerator.gradient_accumulation_steps = ds_steps

    # -- the cost: chosen here, fed here ----------------------------------------------------------------------------
    def choose_cost(self, lag: int = 0) -> CostModel | AutoCost:
        """The runner's cost, from ``options.cost`` and the model's config
        (:func:`~ds_odc.balancer.options.choose_cost`, the one place a choice becomes a cost); ``lag``: the minibatches
        the plans run ahead of training (loader workers). Whatever plans with it (the sampler, the rollout planner)
        gets this object, and only :meth:`observe` feeds it."""
        self.cost = choose_cost(self.options.cost, getattr(self.trainer.model, "config", None), lag=lag)
        if isinstance(self.cost, AutoCost) and self.cost.lag < lag:
            raise ValueError(f"the AutoCost's lag={self.cost.lag} is below the {lag} minibatches the loader draws "
                             f"ahead (dataloader_num_workers x prefetch factor): a resumed run would plan "
                             f"differently; pass AutoCost(..., lag={lag})")
        return self.cost

    def observe(self, record: StepRecord) -> CostUpdate | None:
        """Feed the step's per-rank numbers to the automatic cost; every rank gets the same record, so the same refit
        and the same next plans."""
        return self.cost.observe(*rank_rows(record)) if isinstance(self.cost, AutoCost) else None

    # -- the step ---------------------------------------------------------------------------------------------------
    def run(self, model, microbatches: Sequence[Microbatch], tag: MinibatchTag, *, load: tuple[int, float],
            num_samples: int, minibatch: Sequence[int], metrics: SlotMetrics,
            generation: tuple[float, int] = (0.0, 0)) -> StepTimes:
        """One optimizer step of this rank (see the module docstring): the trainer's ``odc_prepare_step``, every
        microbatch through :meth:`forward_backward`, the optimizer step every rank takes whatever its count, the
        meeting, and the trainer's ``odc_step_metrics``. ``tag``: which minibatch this is, checked at the step against
        every other rank's; ``load``: this rank's (tokens, sum of squared sample lengths); ``num_samples``: the step's
        samples on all ranks; ``minibatch``: those samples in the order the stock trainer trains them (for
        ``odc_step_metrics``); ``metrics``: where the microbatches' losses record TRL's metrics; ``generation``: this
        rank's generation seconds and new tokens since the last step. Returns this rank's times."""
        trainer = self.trainer
        engine = trainer.model_wrapped  # the DeepSpeedEngine
        tag_minibatch(engine, epoch=tag.epoch, step=tag.step, label_tokens=tag.label_tokens)
        clock = StepClock()
        clock.start()
        microbatches = trainer.odc_prepare_step(model, list(microbatches))
        total = torch.zeros((), device=trainer.args.device)
        for mb in microbatches:
            set_sync_gradients(trainer.accelerator, False)
            total = total + self.forward_backward(model, mb)
        set_sync_gradients(trainer.accelerator, True)
        engine.set_gradient_accumulation_boundary(True)
        engine.step()
        busy, step_time = clock.finish(wait_seconds(engine))
        times = StepTimes(total, busy, step_time, len(microbatches))
        everyone = self.meet(times, *load, num_samples, payload=metrics.records, generation=generation)
        trainer.odc_step_metrics(minibatch, combine(everyone))
        return times

    def microbatch_context(self, model, mb: Microbatch) -> ContextManager:
        """What a microbatch's forward and backward run inside (both: gradient checkpointing recomputes the forward in
        the backward): a split sample's group attention over :attr:`sp`'s groups, and what TRL's trainers wrap their
        ``training_step`` in."""
        stack = contextlib.ExitStack()
        if mb.split is not None:
            stack.enter_context(self.sp.run(mb.split))
        stack.enter_context(trl_step_context(self.trainer))
        return stack

    def forward_backward(self, model, mb: Microbatch) -> torch.Tensor:
        """Forward and backward of one microbatch, inside :meth:`microbatch_context`: the trainer's ``odc_loss`` (in
        its loss context), then the backward, as the stock ``training_step`` runs them (with gradient sync off, this
        backward neither marks a boundary nor steps). Returns the detached loss. Every microbatch of an ODC step runs
        here."""
        trainer = self.trainer
        with self.microbatch_context(model, mb):
            model.train()
            with trainer.compute_loss_context_manager():
                loss = trainer.odc_loss(model, mb)
            every = trainer.args.torch_empty_cache_steps
            if every is not None and trainer.state.global_step % every == 0:
                clear_device_cache()
            trainer.accelerator.backward(loss, scale_wrt_gas=False)
            return loss.detach()

    def meet(self, times: StepTimes, tokens: int, sq_tokens: float, num_samples: int, payload: Any = None,
             generation: tuple[float, int] = (0.0, 0)) -> list[Any]:
        """After the step, where every rank is: one all-gather of every rank's numbers and ``payload``; the same
        :class:`StepRecord` on every rank feeds the automatic cost and the balance metrics. Returns every rank's
        ``payload``, in rank order."""
        mine = ([0.0, times.busy_s, times.step_s, float(times.microbatches), float(tokens), float(sq_tokens)],
                [float(generation[0]), int(generation[1])], payload)
        ranks = [mine] if not dist.is_initialized() else [None] * dist.get_world_size()
        if dist.is_initialized():
            dist.all_gather_object(ranks, mine)
        record = record_from_rows([r[0] for r in ranks], num_samples)
        update = self.observe(record)
        if update is not None:
            record.cost = update.as_dict()
        self.meter.add(record, generation=(max(r[1][0] for r in ranks), sum(r[1][1] for r in ranks))
                       if any(r[1][0] > 0 for r in ranks) else None)
        return [r[2] for r in ranks]

    # -- logs and checkpoints ---------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float]) -> None:
        if "loss" in logs:
            logs.update(self.meter.summary())
            self.meter.reset()

    def resume_from(self, checkpoint):
        return resolve_checkpoint(self.trainer.args.output_dir, checkpoint)


class RunsOdcSteps:
    """Mixed into a ds_odc trainer, before the ``Trainer`` class; its ``__init__`` sets :attr:`odc_runner` (a
    :class:`StepRunner` until then). The hooks every trainer shares (checkpoints, logs) hand their stock version to
    the runner; each trainer overrides its per-step ``Trainer`` methods in its own module, beside its runner. Gives the
    defaults of :class:`StepTrainer`'s optional members."""

    odc_runner: StepRunner = StepRunner()

    @property
    def odc(self) -> bool:
        """Whether this trainer trains with ODC (the DeepSpeed config turns ``odc`` on)."""
        return self.odc_runner.enabled

    def odc_prepare_step(self, model, microbatches: list[Microbatch]) -> list[Microbatch]:
        """See :class:`StepTrainer`; here: the microbatches as they are."""
        return microbatches

    def odc_step_metrics(self, minibatch: Sequence[int], metrics: dict[str, list[float]]) -> None:
        """See :class:`StepTrainer`; here: nothing."""

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        return super().train(self.odc_runner.resume_from(resume_from_checkpoint), *args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call=_internal_call)
        if _internal_call:  # checkpoints (the Trainer's internal call) also record where the balancer stands
            self.odc_runner.save(output_dir)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        self.odc_runner.log(logs)
        super().log(logs, *args, **kwargs)


def resolve_checkpoint(output_dir: str, resume) -> str | None:
    """``resume_from_checkpoint`` as the Trainer reads it: ``True`` = the last checkpoint in ``output_dir``."""
    if isinstance(resume, bool):
        if not resume:
            return None
        from transformers.trainer_utils import get_last_checkpoint
        found = get_last_checkpoint(output_dir)
        if found is None:
            raise ValueError(f"No valid checkpoint found in output directory ({output_dir})")
        return found
    return resume or None


def save_balancer_state(folder: str, state: dict) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, BALANCER_STATE_NAME), "w") as f:
        json.dump(state, f, indent=1)


def load_balancer_state(folder: str) -> dict | None:
    path = os.path.join(folder, BALANCER_STATE_NAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)
