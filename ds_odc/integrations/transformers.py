"""``OdcTrainer``: the Hugging Face ``Trainer`` with ODC and LB-Mini, switched on by the ds_config, and its step-runner.

With ``"zero_optimization": {"stage": 3, "odc": true}`` in ``TrainingArguments(deepspeed=...)``, every optimizer step
trains one global minibatch of ``per_device_train_batch_size * gradient_accumulation_steps * world_size`` samples,
split over the ranks by LB-Mini (:mod:`ds_odc.balancer`): each rank gets a different number of microbatches (0
included), each microbatch at most ``max_tokens_per_microbatch`` tokens. Without ``odc`` every method below defers to
the stock ``Trainer``.

How it plugs in (see docs/HF_TRAINER.md): the trainer picks its step-runner once, in ``__init__`` (a
:class:`PackRunner` with ODC, :class:`~ds_odc.integrations._runner.StepRunner`'s stock methods without), and adds what
is its own, a collator and a loss (:class:`~ds_odc.integrations._runner.StepTrainer`):

* the train loader yields one *pack* per optimizer step: this rank's microbatches of the step, from the same global
  plan on every rank (no communication). ``TrainingArguments.gradient_accumulation_steps`` becomes 1 on the trainer's
  copy of the args, so the Trainer's own loop runs exactly one ``training_step`` per optimizer step;
* ``get_batch_samples`` counts the pack's label tokens and sums them over ranks (the Trainer's one all-gather per
  step), so ``num_items_in_batch`` is the global token count and the loss the global token mean, as stock;
* ``training_step`` hands the pack to :meth:`PackRunner.train`, which makes each of its microbatches a
  :class:`~ds_odc.integrations._runner.Microbatch` and runs the step
  (:meth:`~ds_odc.integrations._runner.OdcRunner.run`): gradient sync off for every microbatch (ODC pushes gradients
  as they come), each microbatch's ``odc_loss`` and backward, then DeepSpeed's step at an explicit accumulation
  boundary, where ranks meet.

Overridden public ``Trainer`` methods: ``get_train_dataloader``, ``get_total_train_batch_size``,
``get_batch_samples``, ``training_step``, ``floating_point_ops``, ``log``, ``train``, ``save_model``. The Trainer and
Accelerate privates it needs besides (``_prepare_inputs``, ``_remove_unused_columns``, ``_loss_shifts_labels``,
``save_model``'s ``_internal_call``, Accelerate's ``_set_sync_gradients``) are listed, with the reason for each, in
:mod:`ds_odc.integrations._hf_privates` and checked when this module is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Sequence

import numpy as np
import torch
from transformers import Trainer
from transformers.utils import logging

import ds_odc
from ds_odc.balancer.options import BalancerOptions
from ds_odc.balancer.sampler import BalancedBatchSampler
from ds_odc.balancer.sp import SplitPolicy
from ds_odc.config import odc_config_from_ds_config
from ds_odc.integrations._hf_privates import (check_transformers, loss_shifts_labels, match_accelerate_backend,
                                              prepare_inputs, remove_unused_columns)
from ds_odc.integrations._metrics import BalanceMeter
from ds_odc.integrations._packs import (SPLIT_INPUTS_KEY, Pack, PackBatchSampler, PackCollator, PackDataset,
                                        PackLoader, SplitInputs, dataset_lengths, describe_row)
from ds_odc.integrations._router_loss import weighted_router_loss
from ds_odc.integrations._runner import (BALANCER_STATE_NAME, Microbatch, OdcRunner, RunsOdcSteps, StepRunner,
                                         load_balancer_state, save_balancer_state)
from ds_odc.integrations._setup import (balancer_options, deepspeed_config_of, odc_enabled, one_pack_per_step,
                                        underlying_model, warn_of_unread_balancer_block, with_split_policy)
from ds_odc.integrations._stock_metrics import SlotMetrics
from ds_odc.training.attention import ATTENTION_NAME, plan_buckets, remember_host_boundaries
from ds_odc.training.collate import PackedCollator
from ds_odc.training.kernels import training_args_for_kernels
from ds_odc.training.loss import DEFAULT_CHUNK_TOKENS, count_loss_tokens, use_chunked_loss
from ds_odc.training.sequence_parallel import ATTENTION_NAME as SP_ATTENTION_NAME
from ds_odc.training.sequence_parallel import SequenceParallel
from ds_odc.zero.minibatch import MinibatchTag

ds_odc.patch()  # the `odc` key must parse before TrainingArguments / zero.Init read the ds_config
check_transformers()

logger = logging.get_logger(__name__)

__all__ = ["OdcTrainer"]


class OdcTrainer(RunsOdcSteps, Trainer):
    """``transformers.Trainer`` that trains with ODC + LB-Mini when the ds_config turns ``odc`` on.

    Extra keyword arguments (all optional):
        balancer_planner: ``"lb-mini"`` (default; variable microbatches per rank), or the collective-compatible
            ``"lb-micro"`` / ``"local-sort"`` (same count on every rank) for comparisons.
        max_tokens_per_microbatch: token budget of one microbatch; ``None`` = one sample per microbatch.
        length_column: dataset column with the token lists (``"input_ids"``) or with precomputed lengths.
        balancer_cost: cost model that LB-Mini balances: ``"auto"`` (default: starts from the model's shape and is
            refitted every step from the measured busy times; its coefficients are logged as ``odc/cost_*``),
            ``"tokens"``, ``"quadratic"`` (the model config's FLOPs), a CostModel, or an AutoCost (other fit
            settings).
        oversize: what to do with samples longer than the budget: ``"error"``, ``"truncate"`` or ``"skip"``.
        split_policy: with ``balancer_planner="lb-mini-sp"`` (samples no rank can take alone split over groups of
            ranks), the :class:`~ds_odc.balancer.sp.SplitPolicy`; default: from the model config's heads, with the
            launcher's ``LOCAL_WORLD_SIZE`` ranks per node. The model then attends with ``ds_odc_sp``.
        balancer: all of the above as one :class:`~ds_odc.balancer.options.BalancerOptions`, instead of the keywords.
        microbatch_collator: how a microbatch (a list of samples) becomes model inputs: ``"packed"`` (one padding-free
            row, :class:`~ds_odc.training.collate.PackedCollator`), ``"trainer"`` (the ``data_collator``), or a
            callable. Default: the ``data_collator`` if one was passed, else ``"packed"``.
        packed_attention: run attention as ``ds_odc_varlen`` (:mod:`ds_odc.training.attention`: each document of a packed
            row attends to itself only, no dense mask, no per-length planning). ``None`` (default): when the rows
            are packed (``"packed"`` collator) and the model uses ``sdpa`` or ``eager``.
        loss_chunk_tokens: with ODC, compute the training loss this many positions at a time without the full
            logits (:func:`ds_odc.training.loss.use_chunked_loss`; not when a label smoother, ``compute_loss_func`` or
            another library's patched forward needs the logits). ``None`` or 0: the model's own loss.
    """

    odc_microbatch_collator: Any  # "packed", "trainer" or a callable: see odc_collator()

    def __init__(self, model=None, args=None, *trainer_args, balancer_planner: str = "lb-mini",
                 max_tokens_per_microbatch: int | None = None, length_column: str = "input_ids",
                 balancer_cost: Any = "auto", oversize: str = "error", microbatch_collator: Any = None,
                 packed_attention: bool | None = None, loss_chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
                 split_policy: SplitPolicy | None = None, balancer: BalancerOptions | None = None, **trainer_kwargs):
        ds_odc.patch()
        options = balancer_options(balancer, balancer_planner=balancer_planner,
                                   max_tokens_per_microbatch=max_tokens_per_microbatch, length_column=length_column,
                                   balancer_cost=balancer_cost, oversize=oversize, split_policy=split_policy)
        warn_of_unread_balancer_block(args, type(self).__name__)
        odc = args is not None and odc_enabled(args)
        if odc:
            args, samples_per_rank = one_pack_per_step(args)
        user_collator = trainer_kwargs.get("data_collator", trainer_args[0] if trainer_args else None)
        args = training_args_for_kernels(args)  # torch_compile + use_liger_kernel: Liger's layer kernels off
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        match_accelerate_backend(self.args)
        if microbatch_collator is None:
            microbatch_collator = "trainer" if user_collator is not None else "packed"
        self.odc_microbatch_collator = microbatch_collator
        options = with_split_policy(options, getattr(self.model, "config", None))
        self.odc_runner = (PackRunner(self, options, samples_per_rank=samples_per_rank,
                                      packed_attention=packed_attention, loss_chunk_tokens=loss_chunk_tokens)
                           if odc else StepRunner())

    @property
    def odc_pack_sampler(self):
        """The loader's :class:`~ds_odc.integrations._packs.PackBatchSampler` (``.sampler``: the balancer), once
        ``get_train_dataloader`` has built it with ODC; else ``None``."""
        return getattr(self.odc_runner, "pack_sampler", None)

    # -- what a trainer adds: a collator and a loss --------------------------------------------------------------------
    def odc_collator(self):
        """How a microbatch (a list of samples) becomes model inputs (``microbatch_collator``)."""
        choice = self.odc_microbatch_collator
        if callable(choice):
            return choice
        if choice == "trainer":
            return self.data_collator
        if choice == "packed":
            pad = getattr(self.processing_class, "pad_token_id", None)
            return PackedCollator(pad_token_id=pad if pad is not None else 0)
        raise ValueError(f"ds_odc: microbatch_collator must be 'packed', 'trainer' or a callable, got {choice!r}")

    def odc_prepare_step(self, model, microbatches: list[Microbatch]) -> list[Microbatch]:
        """At the start of an ODC step, on every rank (also one with no microbatch): the microbatches' inputs on the
        device (the Trainer's ``_prepare_inputs``)."""
        return [replace(mb, inputs=prepare_inputs(self, mb.inputs)) for mb in microbatches]

    def odc_loss(self, model, mb: Microbatch) -> torch.Tensor:
        """The loss of one microbatch of an ODC step: the trainer's ``compute_loss`` of its inputs, as a share of the
        step's global token mean (a MoE model's router loss weighted once: :mod:`~ds_odc.integrations._router_loss`)."""
        num_items_in_batch = mb.num_items_in_batch
        reweight = num_items_in_batch is None and mb.step_label_tokens is not None and mb.label_tokens is not None
        scale = 1.0
        if reweight:
            # The model averages over this microbatch's tokens only (it takes no num_items_in_batch): reweight it to
            # its share of the global token mean, times W for ZeRO's averaging over ranks.
            scale = mb.label_tokens / max(mb.step_label_tokens, 1)
            if self.args.average_tokens_across_devices:
                scale *= self.args.world_size
        with weighted_router_loss(self, mb, loss_scale=scale if reweight else None):
            loss = self.compute_loss(model, mb.inputs, num_items_in_batch=num_items_in_batch)
        return loss * scale if reweight else loss

    # -- the Trainer's per-step methods, handed to the runner ----------------------------------------------------------
    def get_train_dataloader(self):
        return self.odc_runner.train_dataloader(super().get_train_dataloader)

    def get_total_train_batch_size(self, args) -> int:
        return self.odc_runner.total_train_batch_size(args, super().get_total_train_batch_size)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        return self.odc_runner.batch_samples(epoch_iterator, num_batches, device, super().get_batch_samples)

    def training_step(self, model, inputs, num_items_in_batch=None):
        return self.odc_runner.training_step(model, inputs, num_items_in_batch, super().training_step)

    def floating_point_ops(self, inputs) -> int:
        return self.odc_runner.floating_point_ops(inputs, super().floating_point_ops)

    def _prepare_inputs(self, inputs):
        moved = super()._prepare_inputs(inputs)
        if isinstance(inputs, Mapping) and isinstance(moved, Mapping):
            remember_host_boundaries(inputs, moved)  # ds_odc_varlen needs the lengths on the host: no sync for them
        return moved


class PackRunner(OdcRunner):
    """ODC on, for a trainer over a map-style dataset: the loader yields one :class:`~._packs.Pack` per optimizer
    step, this rank's microbatches of it, from the same global plan on every rank (no communication).

    The trainer (an :class:`OdcTrainer`) provides ``odc_collator()``, ``odc_microbatch_collator`` (its collator
    choice) and the members of :class:`~ds_odc.integrations._runner.StepTrainer`."""

    def __init__(self, trainer: OdcTrainer, options: BalancerOptions, *, samples_per_rank: int,
                 packed_attention: bool | None, loss_chunk_tokens: int | None) -> None:
        super().__init__(trainer, options)
        self.samples_per_rank = samples_per_rank
        self.pack_sampler: PackBatchSampler | None = None  # built with the loader
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
            sampler = BalancedBatchSampler(lengths, world_size=args.world_size, rank=args.process_index,
                                           minibatch_size=self.samples_per_rank, seed=seed, drop_last=True,
                                           model_config=model_config, sq_lengths=sq_lengths,
                                           cost=self.choose_cost(lag),
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
        # split the packs between ranks again. Batches move to the device at the step (odc_prepare_step).
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

    def floating_point_ops(self, inputs, stock) -> int:
        if isinstance(inputs, Pack):
            return sum(stock(mb) for mb in inputs.microbatches)
        return stock(inputs)

    # -- the step ---------------------------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch, stock) -> torch.Tensor:
        if not isinstance(inputs, Pack):  # not one of the loader's packs (a user's own call): the stock step
            return stock(model, inputs, num_items_in_batch)
        return self.train(model, inputs, num_items_in_batch)

    def train(self, model, pack: Pack, num_items_in_batch) -> torch.Tensor:
        """One optimizer step: this rank's microbatches of ``pack``, through
        :meth:`~ds_odc.integrations._runner.OdcRunner.run` (which ends with the trainer's step metrics)."""
        self._check_position(pack)
        if not self._attention_planned:
            self._attention_planned = True
            self.plan_attention()
        metrics = SlotMetrics()
        times = self.run(model, self.microbatches(pack, metrics, num_items_in_batch),
                         MinibatchTag(pack.epoch, pack.step, pack.step_label_tokens),
                         load=self.pack_sampler.sampler.load(pack.sample_ids, pack.splits),
                         num_samples=pack.num_samples, minibatch=self.minibatch_ids(pack), metrics=metrics)
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

    def microbatches(self, pack: Pack, metrics: SlotMetrics, num_items_in_batch=None) -> list[Microbatch]:
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
                                  split=piece, num_items_in_batch=num_items_in_batch))
        return out

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
