"""The step-runner: how every ds_odc trainer runs an optimizer step, chosen once when the trainer is built.

A Hugging Face ``Trainer`` calls ``training_step`` once per microbatch and lets Accelerate decide when to step. Under
ODC + LB-Mini one optimizer step has a different microbatch count on every rank (0 included), so ds_odc's trainers hand
each whole step to a runner, which owns

    pack -> forward/backward of each microbatch -> the optimizer step every rank takes (where ranks meet) -> one
    all-gather of every rank's numbers -> observe (the automatic cost, the balance meter, TRL's metrics)

* :class:`StepRunner`: ODC off. Every hook runs the stock trainer method handed to it (``stock``) and nothing else.
* :class:`OdcRunner`: ODC on, whatever feeds the step: :meth:`OdcRunner.step` (gradient sync off for every microbatch,
  as ODC pushes each microbatch's gradients during its backward; then one DeepSpeed step at an explicit accumulation
  boundary, on every rank), :meth:`OdcRunner.meet` (one all-gather: busy time, microbatches, tokens and TRL's metrics
  of every rank; the same :class:`~ds_odc.training.metrics.StepRecord` on every rank feeds the automatic cost and the
  ``odc/*`` metrics that :meth:`OdcRunner.log` adds to each training log line), checkpoints.
* :class:`PackRunner`: ODC on, for a map-style train dataset: one *pack* per optimizer step (:mod:`._packs`), planned
  by a :class:`~ds_odc.balancer.sampler.BalancedBatchSampler`. ``OdcTrainer`` and ``OdcSFTTrainer`` run on it; the GRPO
  trainer's runner plans generated rollouts instead (:mod:`.trl_grpo`).

:class:`RunsOdcSteps` is the mixin (placed before the ``Trainer`` class) whose ``Trainer`` methods hand their stock
version to the runner: trainers do not test a flag. The microbatch in flight is never stored on the trainer: the
runner hands it, as a frozen :class:`Microbatch` (its inputs, its sample ids and their stock microbatches, its label
tokens and the step's), to the trainer's loss: a :class:`PackRunner` through the stock ``training_step`` (whose
``_prepare_inputs`` and ``compute_loss`` pass it on), the GRPO trainer's runner directly.

How a trainer plugs in
----------------------
A trainer over a dataset (DPO over chosen + rejected pairs: :mod:`.trl_dpo`) subclasses ``OdcTrainer``, before the TRL
class (``class OdcDPOTrainer(OdcTrainer, DPOTrainer)``), and adds

* a collator, ``odc_collator()``: a list of samples -> the model inputs of one microbatch (LB-Mini plans samples, so a
  pair that is one sample is never split across ranks or microbatches); the sampler reads each sample's length from
  the ``length_column`` of :class:`~ds_odc.balancer.options.BalancerOptions`;
* a loss, ``odc_loss(model, mb, return_outputs, num_items_in_batch)``: the loss of one :class:`Microbatch`, weighted
  so that the sum over the step's microbatches on all ranks is the stock loss (times the world size: ZeRO averages
  over ranks); TRL's per-microbatch metrics are recorded in ``mb.metrics`` under each sample's ``mb.slots``;
* optionally ``odc_prepare_step(model, microbatches)``: at the start of the step, on every rank (also one with no
  microbatch), what all of this rank's microbatches need computed first (DPO: the reference model's log-probs, whose
  forwards a stock ZeRO-3 reference engine runs in step with the other ranks); returns the microbatches to train;
* optionally ``odc_step_metrics(pack, metrics)``: after the meeting, those metrics combined over ranks, one value per
  stock microbatch, to append to TRL's logs.

Everything else (loader, plans, step, meeting, automatic cost, ``odc/*`` logs, checkpoints) is the runner's. Compiling
transformer blocks or swapping in fused kernels hooks into :meth:`PackRunner.prepare_model` (once, before training)
and :meth:`OdcRunner.forward_backward` (every microbatch's forward and backward run inside it).

Busy time is :mod:`ds_odc.training.metrics`' definition: the step's wall time less the wait at ODC's fence.

[Note: per-microbatch means]
Most of a step's loss is a sum over samples or tokens, which ODC splits over any microbatches exactly. A term that is a
mean over one microbatch is not: the MoE router's auxiliary (load-balancing) loss multiplies, per expert, the share of
the microbatch's tokens routed to it by its mean router probability over those tokens. Stock adds it once per
microbatch, each of its ``W * gas`` microbatches of ``B`` samples weighted alike (TRL: ``coef * aux / gas``, before
ZeRO's average over the ``W`` ranks). Under ODC a microbatch of ``n`` of the step's ``G`` samples stands for ``n / B``
stock microbatches, so it gets their weight: ``coef * aux * W * n / G`` (:attr:`Microbatch.sample_share` is ``n / G``;
a slice of a sample split over ``g`` ranks counts ``1 / g``). Where ODC's microbatches are stock's (one sample per
microbatch on both sides, or the same groups) this is stock's loss; where LB-Mini groups other samples together, each
microbatch's term is still the model's own definition over that microbatch, and only the grouping differs (the term is
not additive over samples, so no regrouping reproduces stock's). The logged ``aux_loss`` is the same weighted mean,
per stock microbatch: each sample contributes the term of the microbatch that trained it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ContextManager, Sequence

import numpy as np
import torch
import torch.distributed as dist
from transformers.utils import logging

from ds_odc.balancer.autocost import AutoCost, CostUpdate, rank_rows
from ds_odc.balancer.cost import CostModel
from ds_odc.balancer.options import BalancerOptions, choose_cost
from ds_odc.balancer.sampler import BalancedBatchSampler
from ds_odc.balancer.sp import SplitPolicy
from ds_odc.config import odc_config_from_ds_config
from ds_odc.integrations._hf_privates import loss_shifts_labels, remove_unused_columns, set_sync_gradients
from ds_odc.integrations._metrics import BalanceMeter
from ds_odc.integrations._packs import (SPLIT_INPUTS_KEY, Pack, PackBatchSampler, PackCollator, PackDataset,
                                        PackLoader, SplitInputs, dataset_lengths, describe_row)
from ds_odc.integrations._stock_metrics import SlotMetrics, combine
from ds_odc.training.attention import ATTENTION_NAME, plan_buckets
from ds_odc.training.loss import count_loss_tokens, use_chunked_loss
from ds_odc.training.metrics import StepClock, StepRecord, record_from_rows
from ds_odc.training.sequence_parallel import ATTENTION_NAME as SP_ATTENTION_NAME
from ds_odc.training.sequence_parallel import SequenceParallel
from ds_odc.zero.engine import odc_requested, tag_minibatch, wait_seconds

logger = logging.get_logger(__name__)

__all__ = ["Microbatch", "MinibatchPosition", "StepTimes", "StepRunner", "OdcRunner", "PackRunner", "RunsOdcSteps",
           "balancer_options", "with_split_policy", "underlying_model", "router_loss_weight", "odc_enabled",
           "deepspeed_config_of", "one_pack_per_step", "BALANCER_STATE_NAME", "resolve_checkpoint",
           "save_balancer_state", "load_balancer_state"]

BALANCER_STATE_NAME = "ds_odc_balancer.json"  # in every checkpoint folder: where the balancer stands


def deepspeed_config_of(args) -> dict | None:
    """The DeepSpeed config dict of ``TrainingArguments``: passed as ``deepspeed=...``, or the
    ``deepspeed_config_file`` of an ``accelerate launch`` config (Accelerate's DeepSpeed plugin holds it)."""
    config = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
    if not isinstance(config, dict):
        config = getattr(getattr(args, "deepspeed_plugin", None), "deepspeed_config", None)
    return config if isinstance(config, dict) else None


def odc_enabled(args) -> bool:
    """Whether ``TrainingArguments`` carry a DeepSpeed config with ``zero_optimization.odc`` on."""
    config = deepspeed_config_of(args)
    return config is not None and odc_requested(config)


# The trainers' loose balancer keywords and the BalancerOptions field each one sets.
_KEYWORDS = {"balancer_planner": "planner", "max_tokens_per_microbatch": "max_tokens", "balancer_cost": "cost",
             "oversize": "oversize", "split_policy": "split", "length_column": "length_column"}


def balancer_options(balancer: BalancerOptions | None = None, **keywords) -> BalancerOptions:
    """A trainer's :class:`BalancerOptions`: ``balancer`` as given, or built from the loose keywords (``balancer_planner``,
    ``max_tokens_per_microbatch``, ``balancer_cost``, ``oversize``, ``split_policy``, ``length_column``), which must
    then be left at their defaults. Errors name the keyword."""
    defaults = BalancerOptions()
    if balancer is not None:
        if not isinstance(balancer, BalancerOptions):
            raise ValueError(f"ds_odc: balancer must be a ds_odc.balancer.BalancerOptions, got {type(balancer).__name__}")
        given = [k for k, v in keywords.items() if _differs(v, getattr(defaults, _KEYWORDS[k]))]
        if given:
            raise ValueError(f"ds_odc: pass the balancer's options either as balancer=BalancerOptions(...) or as "
                             f"keywords, not both: drop {', '.join(given)} or set it in the BalancerOptions")
        return balancer
    try:
        return BalancerOptions(**{_KEYWORDS[k]: v for k, v in keywords.items()})
    except ValueError as err:
        raise ValueError(f"ds_odc: {err}") from None


def _differs(value: Any, default: Any) -> bool:
    return not (value is default or (type(value) is type(default) and value == default))


def one_pack_per_step(args):
    """``(args, samples per rank)``: a copy of ``TrainingArguments`` with ``gradient_accumulation_steps = 1`` (the
    loader yields one pack per optimizer step, so the Trainer's own loop must run one ``training_step`` per step; the
    caller's args stay as given), and the samples per rank per optimizer step, as the stock Trainer counts them."""
    samples_per_rank = args.per_device_train_batch_size * args.gradient_accumulation_steps
    args = copy.copy(args)
    args.gradient_accumulation_steps = 1
    return args, samples_per_rank


@dataclass(frozen=True)
class Microbatch:
    """One microbatch in flight, handed through the stock ``training_step`` to the trainer's loss.

    Attributes:
        inputs: what the trainer's collator made of its samples: model inputs (a dict of tensors; on the device once
            the trainer's ``_prepare_inputs`` has run), or a trainer's own record (GRPO: the rollout samples).
        sample_ids: its samples (dataset rows, or a rollout's global sample ids), in the order ``inputs`` holds them.
        slots: per sample, its stock microbatch: the accumulation step in which the stock trainer, fed the same
            minibatch, trains it. TRL's per-microbatch metrics are recorded under it.
        metrics: where the loss records TRL's metrics for the step (combined over ranks at the meeting).
        label_tokens: its loss tokens, as the stock Trainer counts them (``None``: not counted).
        step_label_tokens: the loss tokens of the whole optimizer step on all ranks (``None``: no labels anywhere).
        step_samples: the samples of the whole optimizer step on all ranks (a per-sample mean loss divides by it).
        split: this rank's :class:`~ds_odc.training.sequence_parallel.SplitSlice` of a sample split over a group of
            ranks (``lb-mini-sp``), or ``None``.
    """

    inputs: Any
    sample_ids: tuple[int, ...]
    slots: tuple[int, ...] = ()
    metrics: SlotMetrics | None = field(default=None, compare=False)
    label_tokens: int | None = None
    step_label_tokens: int | None = None
    step_samples: int | None = None
    split: Any = None

    @property
    def sample_share(self) -> float:
        """This microbatch's share of the step's samples (a split sample's slice counts ``1 / g`` of it): how much a
        per-microbatch mean computed on it weighs in the step (see [Note: per-microbatch means])."""
        if not self.step_samples:
            raise RuntimeError("ds_odc: this microbatch does not know how many samples its step trains")
        samples = 1.0 / len(self.split.ranks) if self.split is not None else float(len(self.sample_ids))
        return samples / self.step_samples


@dataclass(frozen=True)
class MinibatchPosition:
    """Which minibatch an optimizer step trains, as every rank must agree (``tag_minibatch``): its epoch and step in
    the plan, and the global label-token count its loss is normalised by, where known."""

    epoch: int | None
    step: int | None
    label_tokens: int | None = None


@dataclass(frozen=True)
class StepTimes:
    """This rank's share of one optimizer step: summed loss of its microbatches, and its timings."""

    loss: torch.Tensor
    busy_s: float
    step_s: float
    microbatches: int


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

    def resume_from(self, checkpoint):
        """``resume_from_checkpoint`` as ``Trainer.train`` is to get it."""
        return checkpoint

    def save(self, folder: str) -> None:
        """After the Trainer saved a checkpoint into ``folder``."""

    def log(self, logs: dict[str, float]) -> None:
        """Before the Trainer logs ``logs``."""


class OdcRunner(StepRunner):
    """ODC on: the step, the meeting, the automatic cost, the ``odc/*`` logs. Subclasses say where a step's
    microbatches come from and set :attr:`cost` (an ``AutoCost`` is fed every step's numbers)."""

    enabled = True

    def __init__(self, trainer, options: BalancerOptions) -> None:
        self.trainer = trainer
        self.options = options
        self.meter = BalanceMeter(trainer.args.world_size)
        self.cost: CostModel | AutoCost | None = None
        # The ds_config keeps the caller's accumulation steps (filled in by TrainingArguments); ODC marks every
        # boundary itself, so the count is not used. Accelerate would adopt it anyway, with a "Gradient accumulation
        # steps mismatch" warning against the trainer's 1: give it the value now.
        ds_steps = deepspeed_config_of(trainer.args).get("gradient_accumulation_steps")
        if isinstance(ds_steps, int):
            trainer.accelerator.gradient_accumulation_steps = ds_steps

    # -- one microbatch ---------------------------------------------------------------------------------------------
    def microbatch_context(self, model, mb: Microbatch) -> ContextManager:
        """What a microbatch's forward and backward run inside (both: gradient checkpointing recomputes the forward in
        the backward)."""
        return contextlib.nullcontext()

    def forward_backward(self, model, mb: Microbatch, train: Callable[[Microbatch], torch.Tensor]) -> torch.Tensor:
        """Forward and backward of one microbatch (``train``: the trainer's, returning the detached loss). Every
        microbatch of an ODC step runs here."""
        with self.microbatch_context(model, mb):
            return train(mb)

    # -- the step ---------------------------------------------------------------------------------------------------
    def prepare(self, model, microbatches: Sequence[Microbatch]) -> Sequence[Microbatch]:
        """Inside the step's clock, before its first microbatch, on every rank (also one with no microbatch): what
        the step computes for all of this rank's microbatches at once; returns the microbatches to train. Default:
        nothing."""
        return microbatches

    def step(self, model, microbatches: Sequence[Microbatch], train: Callable[[Microbatch], torch.Tensor],
             tag: MinibatchPosition) -> StepTimes:
        """:meth:`prepare`, every microbatch through :meth:`forward_backward`, then the optimizer step that every rank
        takes whatever its count. ``tag``: which minibatch this is, checked at the step against every other rank's."""
        trainer = self.trainer
        engine = trainer.model_wrapped  # the DeepSpeedEngine
        tag_minibatch(engine, epoch=tag.epoch, step=tag.step, label_tokens=tag.label_tokens)
        clock = StepClock()
        clock.start()
        microbatches = self.prepare(model, microbatches)
        total = torch.zeros((), device=trainer.args.device)
        for mb in microbatches:
            set_sync_gradients(trainer.accelerator, False)
            total = total + self.forward_backward(model, mb, train)
        set_sync_gradients(trainer.accelerator, True)
        engine.set_gradient_accumulation_boundary(True)
        engine.step()
        busy, step_time = clock.finish(wait_seconds(engine))
        return StepTimes(total, busy, step_time, len(microbatches))

    def meet(self, times: StepTimes, tokens: int, sq_tokens: float, num_samples: int, payload: Any = None,
             generation: tuple[float, int] = (0.0, 0)) -> list[Any]:
        """After the step, where every rank is: one all-gather of every rank's numbers and ``payload``; the same
        :class:`StepRecord` on every rank feeds the automatic cost and the balance metrics. ``generation``: this
        rank's generation seconds and new tokens since the last step. Returns every rank's ``payload``, in rank
        order."""
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

    def observe(self, record: StepRecord) -> CostUpdate | None:
        """Feed the step's per-rank numbers to the automatic cost; every rank gets the same record, so the same refit
        and the same next plans."""
        return self.cost.observe(*rank_rows(record)) if isinstance(self.cost, AutoCost) else None

    def log(self, logs: dict[str, float]) -> None:
        if "loss" in logs:
            logs.update(self.meter.summary())
            self.meter.reset()

    def resume_from(self, checkpoint):
        return resolve_checkpoint(self.trainer.args.output_dir, checkpoint)


class PackRunner(OdcRunner):
    """ODC on, for a trainer over a map-style dataset: the loader yields one :class:`~._packs.Pack` per optimizer
    step, this rank's microbatches of it, from the same global plan on every rank (no communication).

    The trainer provides ``odc_collator()``, ``odc_loss(...)`` (reached through its stock ``training_step``, see the
    module docstring), ``odc_prepare_step(model, microbatches)``, ``odc_step_metrics(pack, metrics)`` and
    ``odc_microbatch_collator`` (its collator choice)."""

    def __init__(self, trainer, options: BalancerOptions, *, samples_per_rank: int, packed_attention: bool | None,
                 loss_chunk_tokens: int | None) -> None:
        super().__init__(trainer, options)
        self.samples_per_rank = samples_per_rank
        self.pack_sampler: PackBatchSampler | None = None  # built with the loader
        self.sp: SequenceParallel | None = None  # groups of ranks for split samples, created once
        self.resume_dir: str | None = None
        self.position: tuple[int, int] | None = None  # (epoch, next step) after the last trained pack
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, its sample order)
        self._longest_document: int | None = None  # of the data, within the token budget: set with the loader
        self._attention_planned = False
        self.prepare_model(trainer.model, packed_attention, loss_chunk_tokens)

    def prepare_model(self, model, packed_attention: bool | None, loss_chunk_tokens: int | None) -> None:
        """Once, before training: attention over packed rows (each document attends to itself) and the chunked loss."""
        trainer, config = self.trainer, getattr(model, "config", None)
        current = getattr(config, "_attn_implementation", None)
        split = self.options.split is not None
        # Split samples attend over their group (ds_odc_sp, which is ds_odc_varlen for every other microbatch).
        target = SP_ATTENTION_NAME if split else ATTENTION_NAME
        if packed_attention is None:
            packed_attention = (trainer.odc_microbatch_collator == "packed" and current in ("sdpa", "eager")
                                or split and current in ("sdpa", "eager", ATTENTION_NAME))
        if packed_attention and current != target:
            model.set_attn_implementation(target)
            logger.info(f"ds_odc: attention {current} -> {target} for packed rows")
        wants_logits = trainer.label_smoother is not None or trainer.compute_loss_func is not None
        # Under PEFT the adapters live inside the base model's layers and the PeftModel's forward calls the base
        # model's: the chunked loss replaces the base model's forward (or keeps TRL's fused LM head there).
        base = underlying_model(model)
        if loss_chunk_tokens and not wants_logits and "forward" not in vars(base):
            try:
                use_chunked_loss(base, chunk_tokens=loss_chunk_tokens)
            except ValueError as e:  # not a plain causal LM: keep its own loss
                logger.info(f"ds_odc: keeping the model's own loss ({e})")

    # -- data -------------------------------------------------------------------------------------------------------
    def train_dataloader(self, stock):
        trainer, args = self.trainer, self.trainer.args
        if trainer.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        dataset = trainer.train_dataset
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            raise ValueError("ds_odc: LB-Mini plans whole minibatches from sample lengths, so OdcTrainer with ODC needs "
                             "a map-style train_dataset with a length column")
        # Before column removal drops a length column; every sample is checked here, before the first step.
        lengths, sq_lengths = dataset_lengths(dataset, self.options.length_column)
        self._longest_document = min(int(np.max(lengths, initial=0)), self.options.max_tokens or np.iinfo(np.int64).max)
        if args.remove_unused_columns and hasattr(dataset, "column_names"):
            dataset = remove_unused_columns(trainer, dataset)  # what the stock loader does
        seed = args.data_seed if args.data_seed is not None else args.seed
        workers = args.dataloader_num_workers
        # Loader workers draw minibatches ahead of training: plans then use a fit that many steps older, the same
        # in an uninterrupted and a resumed run.
        lag = workers * (args.dataloader_prefetch_factor or 2) if workers > 0 else 0
        model_config = getattr(trainer.model, "config", None)
        try:
            self.cost = choose_cost(self.options.cost, model_config, lag=lag)
            if isinstance(self.cost, AutoCost) and self.cost.lag < lag:
                raise ValueError(f"the AutoCost's lag={self.cost.lag} is below the {lag} minibatches the loader draws "
                                 f"ahead (dataloader_num_workers x prefetch factor): a resumed run would plan "
                                 f"differently; pass AutoCost(..., lag={lag})")
            sampler = BalancedBatchSampler(lengths, world_size=args.world_size, rank=args.process_index,
                                           minibatch_size=self.samples_per_rank, seed=seed, drop_last=True,
                                           model_config=model_config, sq_lengths=sq_lengths, cost=self.cost,
                                           describe_sample=lambda i: describe_row(dataset, i),
                                           **self.options.sampler_options())
        except ValueError as err:
            hint = (" (here minibatch_size = per_device_train_batch_size x gradient_accumulation_steps)"
                    if "global minibatch" in str(err) else "")
            raise ValueError(f"ds_odc: {err}{hint}") from None
        self.pack_sampler = PackBatchSampler(sampler)
        self._order = None
        split_inputs = None
        if self.options.split is not None:
            if self.sp is None:  # the groups, once: every rank creates those it belongs to
                timeout_s = odc_config_from_ds_config(deepspeed_config_of(args)).timeout_s
                self.sp = SequenceParallel(self.options.split, timeout_s=timeout_s)
            pad = getattr(trainer.processing_class, "pad_token_id", None)
            split_inputs = SplitInputs(self.options.split, args.process_index, pad if pad is not None else 0)
        self._restore_balancer()
        self.meter = BalanceMeter(args.world_size)
        report = sampler.data_report
        self.meter.data = {"odc/truncated_samples": float(report.truncated.size),
                           "odc/skipped_samples": float(report.skipped.size)}
        if report.message() and args.process_index == 0:
            logger.warning(report.message())
        # Not passed through accelerator.prepare: the sampler is already rank-aware, and a sharding wrapper would
        # split the packs between ranks again. Batches move to the device in training_step (_prepare_inputs).
        return PackLoader(
            PackDataset(dataset),
            batch_sampler=self.pack_sampler,
            collate_fn=PackCollator(trainer.odc_collator(), split_inputs),
            num_workers=workers,
            pin_memory=args.dataloader_pin_memory and torch.cuda.is_available(),
            persistent_workers=args.dataloader_persistent_workers and workers > 0,
            prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
        )

    def total_train_batch_size(self, args, stock) -> int:
        return self.samples_per_rank * args.world_size

    def batch_samples(self, epoch_iterator, num_batches, device, stock):
        trainer = self.trainer
        packs = []
        for _ in range(num_batches):
            try:
                packs.append(next(epoch_iterator))
            except StopIteration:
                break
        if not packs:
            return packs, None
        # Every rank holds a pack (same plan length), so this gather is one per step on every rank, like stock's.
        shifted = loss_shifts_labels(trainer)
        for pack in packs:
            pack.label_tokens = [count_loss_tokens(mb, shifted=shifted) for mb in pack.microbatches]
        local = [sum(sum(p.label_tokens) for p in packs),
                 float(any("labels" in mb or "shift_labels" in mb for p in packs for mb in p.microbatches))]
        counts = torch.tensor(local, dtype=torch.float64, device=device)
        if trainer.args.average_tokens_across_devices and trainer.args.world_size > 1:
            counts = trainer.accelerator.gather(counts).reshape(-1, 2).sum(0)
        if counts[1] == 0:  # no labels anywhere: the model computes its loss its own way, as stock
            return packs, None
        total = counts[0].to(torch.long)
        for pack in packs:
            pack.step_label_tokens = int(total)
        passes_count = trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None
        return packs, (total if passes_count else None)

    # -- the step ---------------------------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch, stock) -> torch.Tensor:
        if not isinstance(inputs, Pack):
            return stock(model, inputs, num_items_in_batch)
        pack = inputs
        self._check_position(pack)
        if not self._attention_planned:
            self._attention_planned = True
            self.plan_attention()
        metrics = SlotMetrics()
        # Each microbatch goes through the stock training_step (its _prepare_inputs, loss context and backward), which
        # hands the Microbatch to the trainer's compute_loss.
        times = self.step(model, self.microbatches(pack, metrics), lambda mb: stock(model, mb, num_items_in_batch),
                          MinibatchPosition(pack.epoch, pack.step, pack.step_label_tokens))
        tokens, sq_tokens = self.pack_sampler.sampler.load(pack.sample_ids, pack.splits)
        everyone = self.meet(times, tokens, sq_tokens, pack.num_samples, payload=metrics.records)
        self.trainer.odc_step_metrics(pack, combine(everyone))
        self.position = (pack.epoch, pack.step + 1)
        return times.loss.detach()

    def plan_attention(self) -> None:
        """Once, before the first step (outside its clock): cuDNN's plans for every bucket of long documents the data
        can bring (``ds_odc.training.attention.plan_buckets``; nothing to do off CUDA or without ``ds_odc_varlen``),
        so that the first steps, and the automatic cost fitted from them, run at the speed of later ones."""
        model = underlying_model(self.trainer.model)
        attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if attention != ATTENTION_NAME or self._longest_document is None:
            return
        dtype = next(model.parameters()).dtype
        shapes, seconds = plan_buckets(model, self._longest_document, self.trainer.args.device, dtype)
        if shapes and self.trainer.args.process_index == 0:
            logger.info(f"ds_odc: planned {shapes} bucketed attention shapes up to {self._longest_document} tokens "
                        f"in {seconds:.1f} s")

    def prepare(self, model, microbatches: Sequence[Microbatch]) -> Sequence[Microbatch]:
        return self.trainer.odc_prepare_step(model, microbatches)

    def microbatches(self, pack: Pack, metrics: SlotMetrics) -> list[Microbatch]:
        """The pack's microbatches as the loss gets them."""
        slot_of = self.stock_slots(pack)
        config = getattr(self.trainer.model, "config", None)
        out = []
        for i, (raw, ids) in enumerate(zip(pack.microbatches, pack.sample_ids)):
            inputs = dict(raw)
            piece = inputs.pop(SPLIT_INPUTS_KEY, None)  # this rank's slice of a split sample
            # A packed row (position ids restart, no attention mask) gets per-sample causal masks only without a KV
            # cache; models default to use_cache=True from their config, which would let samples attend to each other.
            if "position_ids" in inputs and "attention_mask" not in inputs and getattr(config, "use_cache", False):
                inputs["use_cache"] = False
            out.append(Microbatch(inputs, tuple(ids), tuple(slot_of[g] for g in ids), metrics,
                                  label_tokens=pack.label_tokens[i] if i < len(pack.label_tokens) else None,
                                  step_label_tokens=pack.step_label_tokens, step_samples=pack.num_samples,
                                  split=piece))
        return out

    def microbatch_context(self, model, mb: Microbatch) -> ContextManager:
        return self.sp.run(mb.split) if mb.split is not None else contextlib.nullcontext()

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The dataset indices of ``epoch`` in the order its minibatches are cut from (kept for the epoch)."""
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, self.pack_sampler.sampler.epoch_order(epoch))
        return self._order[1]

    def minibatch_ids(self, pack: Pack) -> np.ndarray:
        """The pack's global minibatch, in the sampler's order: what the stock trainer trains in this step."""
        G = pack.num_samples
        return self.epoch_order(pack.epoch)[pack.step * G:(pack.step + 1) * G]

    def stock_slots(self, pack: Pack) -> dict[int, int]:
        """Each sample's stock microbatch: the stock Trainer with the same arguments, fed this minibatch in the plan's
        order, trains accumulation step ``k`` on its samples ``[k * W * B, (k + 1) * W * B)`` (``B`` =
        ``per_device_train_batch_size``, ``W`` ranks)."""
        per_step = self.trainer.args.per_device_train_batch_size * self.trainer.args.world_size
        return {g: i // per_step for i, g in enumerate(self.minibatch_ids(pack).tolist())}

    def _check_position(self, pack: Pack) -> None:
        """One pack per optimizer step, in plan order: anything else means the loader and the Trainer disagree."""
        per_epoch = len(self.pack_sampler)
        global_step = self.trainer.state.global_step
        expected = divmod(global_step, per_epoch)
        if (pack.epoch, pack.step) != expected:
            raise RuntimeError(f"ds_odc: the Trainer is at optimizer step {global_step} (epoch {expected[0]},"
                               f" minibatch {expected[1]}) but the loader gave minibatch {pack.step} of epoch "
                               f"{pack.epoch}")

    # -- checkpoints ------------------------------------------------------------------------------------------------
    def resume_from(self, checkpoint):
        checkpoint = super().resume_from(checkpoint)
        self.resume_dir = checkpoint or None
        return checkpoint

    def save(self, folder: str) -> None:
        if self.position is not None and self.trainer.args.should_save:
            save_balancer_state(folder, self.pack_sampler.state_at(*self.position))

    def _restore_balancer(self) -> None:
        if not self.resume_dir:
            return
        state = load_balancer_state(self.resume_dir)
        if state is None:
            logger.warning(f"ds_odc: {self.resume_dir} has no {BALANCER_STATE_NAME}; the Trainer's data "
                           "skipping re-plans the skipped minibatches")
            return
        if self.trainer.args.ignore_data_skip:  # the user asked to restart the data order: only check compatibility
            self.pack_sampler.sampler.load_state_dict({**state, "step": 0})
            return
        self.pack_sampler.resume(state)
        logger.info(f"ds_odc: balancer resumes at epoch {state['epoch']}, minibatch {state['step']}")


def underlying_model(model):
    """The model whose forward computes the loss: a PEFT model's base model (its adapters live inside that model's
    layers), else ``model`` itself."""
    from accelerate.utils import is_peft_model
    return model.get_base_model() if is_peft_model(model) else model


@contextlib.contextmanager
def router_loss_weight(model, factor: float):
    """Inside the block, a MoE model that adds its router auxiliary loss to its own loss (``output_router_logits``
    in its config) weighs it ``factor`` times its coefficient (``router_aux_loss_coef``, which Hugging Face's MoE
    causal LMs read in every forward); any other model is left alone."""
    base = underlying_model(model)
    coef = getattr(base, "router_aux_loss_coef", None)
    if coef is None or not getattr(getattr(base, "config", None), "output_router_logits", False):
        yield
        return
    base.router_aux_loss_coef = coef * factor
    try:
        yield
    finally:
        base.router_aux_loss_coef = coef


def with_split_policy(options: BalancerOptions, model_config) -> BalancerOptions:
    """``options`` with the split policy its planner uses: the given one or, for a planner that splits samples, one
    from the model config's heads with the launcher's ``LOCAL_WORLD_SIZE`` ranks per node; ``None`` otherwise."""
    if not options.spec.splits:
        return replace(options, split=None)
    if options.split is not None:
        return options
    return replace(options, split=SplitPolicy.from_hf_config(
        model_config, ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", 8))))


class RunsOdcSteps:
    """Mixed into a ``Trainer`` subclass, before the ``Trainer`` class; its ``__init__`` sets :attr:`odc_runner`
    (a :class:`StepRunner` until then). Each method below hands its stock version to the runner."""

    odc_runner: StepRunner = StepRunner()

    @property
    def odc(self) -> bool:
        """Whether this trainer trains with ODC (the DeepSpeed config turns ``odc`` on)."""
        return self.odc_runner.enabled

    def get_train_dataloader(self):
        return self.odc_runner.train_dataloader(super().get_train_dataloader)

    def get_total_train_batch_size(self, args) -> int:
        return self.odc_runner.total_train_batch_size(args, super().get_total_train_batch_size)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        return self.odc_runner.batch_samples(epoch_iterator, num_batches, device, super().get_batch_samples)

    def training_step(self, model, inputs, num_items_in_batch=None):
        return self.odc_runner.training_step(model, inputs, num_items_in_batch, super().training_step)

    def floating_point_ops(self, inputs) -> int:
        if isinstance(inputs, Pack):
            return sum(super(RunsOdcSteps, self).floating_point_ops(mb) for mb in inputs.microbatches)
        return super().floating_point_ops(inputs)

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
