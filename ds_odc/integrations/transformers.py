"""``OdcTrainer``: the Hugging Face ``Trainer`` with ODC and LB-Mini, switched on by the ds_config.

With ``"zero_optimization": {"stage": 3, "odc": true}`` in ``TrainingArguments(deepspeed=...)``, every optimizer step
trains one global minibatch of ``per_device_train_batch_size * gradient_accumulation_steps * world_size`` samples,
split over the ranks by LB-Mini (:mod:`ds_odc.balancer`): each rank gets a different number of microbatches (0
included), each microbatch at most ``max_tokens_per_microbatch`` tokens. Without ``odc`` every method below defers to
the stock ``Trainer``.

How it plugs in (see docs/HF_TRAINER.md):

* the train loader yields one *pack* per optimizer step: this rank's microbatches of the step, from the same global
  plan on every rank (no communication). ``TrainingArguments.gradient_accumulation_steps`` becomes 1 on the trainer's
  copy of the args, so the Trainer's own loop runs exactly one ``training_step`` per optimizer step;
* ``get_batch_samples`` counts the pack's label tokens and sums them over ranks (the Trainer's one all-gather per
  step), so ``num_items_in_batch`` is the global token count and the loss the global token mean, as stock;
* ``training_step`` runs the pack's microbatches through the stock ``training_step`` with gradient sync off (ODC
  pushes gradients as they come), then takes DeepSpeed's step at an explicit accumulation boundary: ranks meet there
  (the step loop and the logs are shared with ``OdcGRPOTrainer``: :mod:`ds_odc.integrations._step`).

Overridden public ``Trainer`` methods: ``get_train_dataloader``, ``get_total_train_batch_size``,
``get_batch_samples``, ``training_step``, ``compute_loss``, ``floating_point_ops``, ``log``, ``train``,
``save_model``. The Trainer and Accelerate privates it needs besides (``_prepare_inputs``,
``_remove_unused_columns``, ``_loss_shifts_labels``, ``save_model``'s ``_internal_call``, Accelerate's
``_set_sync_gradients``) are listed, with the reason for each, in :mod:`ds_odc.integrations._hf_privates` and
checked when this module is imported.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Mapping
from typing import Any

import torch
from transformers import Trainer
from transformers.utils import logging

import ds_odc
from ds_odc.training.collate import PackedCollator
from ds_odc.balancer.lengths import lengths_from_dataset, sq_lengths_from_dataset
from ds_odc.balancer.planners import get_planner
from ds_odc.balancer.sampler import BalancedBatchSampler
from ds_odc.balancer.sp import SplitPolicy
from ds_odc.config import odc_config_from_ds_config
from ds_odc.balancer.checks import check_label_lengths
from ds_odc.integrations._hf_privates import (check_transformers, loss_shifts_labels, match_accelerate_backend,
                                              remove_unused_columns)
from ds_odc.integrations._metrics import BalanceMeter
from ds_odc.integrations._packs import Pack, PackBatchSampler, PackCollator, PackDataset
from ds_odc.integrations._step import (BALANCER_STATE_NAME, OdcStep, load_balancer_state, resolve_checkpoint,
                                       save_balancer_state)
from ds_odc.training.attention import ATTENTION_NAME, remember_host_boundaries
from ds_odc.training.loss import DEFAULT_CHUNK_TOKENS, count_loss_tokens, use_chunked_loss
from ds_odc.training.sequence_parallel import ATTENTION_NAME as SP_ATTENTION_NAME
from ds_odc.training.sequence_parallel import SequenceParallel, slice_sample

ds_odc.patch()  # the `odc` key must parse before TrainingArguments / zero.Init read the ds_config
check_transformers()

logger = logging.get_logger(__name__)

__all__ = ["OdcTrainer", "odc_enabled", "deepspeed_config_of", "BALANCER_STATE_NAME"]


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
    return config is not None and bool(odc_config_from_ds_config(config).enabled)


class OdcTrainer(OdcStep, Trainer):
    """``transformers.Trainer`` that trains with ODC + LB-Mini when the ds_config turns ``odc`` on.

    Extra keyword arguments (all optional):
        balancer_planner: ``"lb-mini"`` (default; variable microbatches per rank), or the collective-compatible
            ``"lb-micro"`` / ``"local-sort"`` (same count on every rank) for comparisons.
        max_tokens_per_microbatch: token budget of one microbatch; ``None`` = one sample per microbatch.
        length_column: dataset column with the token lists (``"input_ids"``) or with precomputed lengths.
        balancer_cost: cost model that LB-Mini balances: ``"auto"`` (default: starts from the model's shape and is
            refitted every step from the measured busy times; its coefficients are logged as ``odc/cost_*``),
            ``"tokens"``, ``"quadratic"`` (the model config's FLOPs) or a CostModel.
        oversize: what to do with samples longer than the budget: ``"error"``, ``"truncate"`` or ``"skip"``.
        microbatch_collator: how a microbatch (a list of samples) becomes model inputs: ``"packed"`` (one padding-free
            row, :class:`~ds_odc.training.collate.PackedCollator`), ``"trainer"`` (the ``data_collator``), or a
            callable. Default: the ``data_collator`` if one was passed, else ``"packed"``.
        packed_attention: run attention as ``ds_odc_varlen`` (:mod:`ds_odc.training.attention`: each document of a packed
            row attends to itself only, no dense mask, no per-length planning). ``None`` (default): when the rows
            are packed (``"packed"`` collator) and the model uses ``sdpa`` or ``eager``.
        split_policy: with ``balancer_planner="lb-mini-sp"`` (samples no rank can take alone split over groups of
            ranks), the :class:`~ds_odc.balancer.sp.SplitPolicy`; default: from the model config's heads, with the
            launcher's ``LOCAL_WORLD_SIZE`` ranks per node. The model then attends with ``ds_odc_sp``.
        loss_chunk_tokens: with ODC, compute the training loss this many positions at a time without the full
            logits (:func:`ds_odc.training.loss.use_chunked_loss`; not when a label smoother, ``compute_loss_func`` or
            another library's patched forward needs the logits). ``None`` or 0: the model's own loss.
    """

    def __init__(self, model=None, args=None, *trainer_args, balancer_planner: str = "lb-mini",
                 max_tokens_per_microbatch: int | None = None, length_column: str = "input_ids",
                 balancer_cost: Any = "auto", oversize: str = "error", microbatch_collator: Any = None,
                 packed_attention: bool | None = None, loss_chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
                 split_policy: SplitPolicy | None = None, **trainer_kwargs):
        ds_odc.patch()
        self.odc = args is not None and odc_enabled(args)
        if self.odc:
            # Samples per rank per optimizer step, as the stock Trainer counts them; the loader then yields one pack
            # per step, so the Trainer's own accumulation must be 1 (on a copy: the caller's args stay as given).
            self.odc_samples_per_rank = args.per_device_train_batch_size * args.gradient_accumulation_steps
            args = copy.copy(args)
            args.gradient_accumulation_steps = 1
        user_collator = trainer_kwargs.get("data_collator", trainer_args[0] if trainer_args else None)
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        match_accelerate_backend(self.args)
        if self.odc:
            # The ds_config keeps the caller's accumulation steps (filled in by TrainingArguments); ODC marks every
            # boundary itself, so the count is not used. Accelerate would adopt it anyway, with a "Gradient
            # accumulation steps mismatch" warning against this trainer's 1: give it the value now.
            ds_steps = deepspeed_config_of(args).get("gradient_accumulation_steps")
            if isinstance(ds_steps, int):
                self.accelerator.gradient_accumulation_steps = ds_steps
        self.odc_balancer = dict(planner=balancer_planner, max_tokens=max_tokens_per_microbatch, cost=balancer_cost,
                                 oversize=oversize)
        self.odc_split: SplitPolicy | None = None  # how samples split over groups of ranks, for planners that do
        if get_planner(balancer_planner).splits:
            self.odc_split = split_policy or SplitPolicy.from_hf_config(
                self.model.config, ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", 8)))
            self.odc_balancer["split"] = self.odc_split
        self.odc_sp: SequenceParallel | None = None
        self.odc_length_column = length_column
        if microbatch_collator is None:
            microbatch_collator = "trainer" if user_collator is not None else "packed"
        self.odc_microbatch_collator = microbatch_collator
        if self.odc:
            self._odc_prepare_model(packed_attention, loss_chunk_tokens)
        self.odc_pack_sampler: PackBatchSampler | None = None
        self.odc_meter: BalanceMeter | None = None
        self._odc_resume_dir: str | None = None
        self._odc_position: tuple[int, int] | None = None  # (epoch, next step) after the last trained pack
        self._odc_global_label_tokens: torch.Tensor | None = None
        self._odc_pack_microbatch: dict | None = None  # the raw microbatch compute_loss is working on
        self._odc_pack_ids: list[int] | None = None  # the dataset rows of that microbatch, in order

    def _odc_prepare_model(self, packed_attention: bool | None, loss_chunk_tokens: int | None) -> None:
        model, config = self.model, getattr(self.model, "config", None)
        current = getattr(config, "_attn_implementation", None)
        # Split samples attend over their group (ds_odc_sp, which is ds_odc_varlen for every other microbatch).
        target = SP_ATTENTION_NAME if self.odc_split is not None else ATTENTION_NAME
        if packed_attention is None:
            packed_attention = (self.odc_microbatch_collator == "packed" and current in ("sdpa", "eager")
                                or self.odc_split is not None and current in ("sdpa", "eager", ATTENTION_NAME))
        if packed_attention and current != target:
            model.set_attn_implementation(target)
            logger.info(f"ds_odc: attention {current} -> {target} for packed rows")
        wants_logits = self.label_smoother is not None or self.compute_loss_func is not None
        if loss_chunk_tokens and not wants_logits and "forward" not in vars(model):
            try:
                use_chunked_loss(model, chunk_tokens=loss_chunk_tokens)
            except ValueError as e:  # not a plain causal LM: keep its own loss
                logger.info(f"ds_odc: keeping the model's own loss ({e})")

    # -- data ---------------------------------------------------------------------------------------------------------
    def _odc_collate_fn(self):
        choice = self.odc_microbatch_collator
        if callable(choice):
            return choice
        if choice == "trainer":
            return self.data_collator
        if choice == "packed":
            pad = getattr(self.processing_class, "pad_token_id", None)
            return PackedCollator(pad_token_id=pad if pad is not None else 0)
        raise ValueError(f"ds_odc: microbatch_collator must be 'packed', 'trainer' or a callable, got {choice!r}")

    def get_train_dataloader(self):
        if not self.odc:
            return super().get_train_dataloader()
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        dataset = self.train_dataset
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            raise ValueError("ds_odc: LB-Mini plans whole minibatches from sample lengths, so OdcTrainer with ODC needs "
                             "a map-style train_dataset with a length column")
        # Before column removal drops a length column; every sample is checked here, before the first step.
        lengths, sq_lengths = _dataset_lengths(dataset, self.odc_length_column)
        if self.args.remove_unused_columns and hasattr(dataset, "column_names"):
            dataset = remove_unused_columns(self, dataset)  # what the stock loader does
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        workers = self.args.dataloader_num_workers
        # Loader workers draw minibatches ahead of training: plans then use a fit that many steps older, the same
        # in an uninterrupted and a resumed run.
        lag = workers * (self.args.dataloader_prefetch_factor or 2) if workers > 0 else 0
        try:
            sampler = BalancedBatchSampler(lengths, world_size=self.args.world_size, rank=self.args.process_index,
                                           minibatch_size=self.odc_samples_per_rank, seed=seed, drop_last=True,
                                           model_config=getattr(self.model, "config", None), sq_lengths=sq_lengths,
                                           cost_lag=lag, describe_sample=lambda i: _describe_row(dataset, i),
                                           **self.odc_balancer)
        except ValueError as err:
            hint = (" (here minibatch_size = per_device_train_batch_size x gradient_accumulation_steps)"
                    if "global minibatch" in str(err) else "")
            raise ValueError(f"ds_odc: {err}{hint}") from None
        self.odc_pack_sampler = PackBatchSampler(sampler)
        split_inputs = None
        if self.odc_split is not None:
            if self.odc_sp is None:  # the groups, once: every rank creates those it belongs to
                timeout_s = odc_config_from_ds_config(deepspeed_config_of(self.args)).timeout_s
                self.odc_sp = SequenceParallel(self.odc_split, timeout_s=timeout_s)
            pad = getattr(self.processing_class, "pad_token_id", None)
            split_inputs = _SplitInputs(self.odc_split, self.args.process_index, pad if pad is not None else 0)
        self._odc_restore_balancer()
        self.odc_meter = BalanceMeter(self.args.world_size)
        report = sampler.data_report
        self.odc_meter.data = {"odc/truncated_samples": float(report.truncated.size),
                               "odc/skipped_samples": float(report.skipped.size)}
        if report.message() and self.args.process_index == 0:
            logger.warning(report.message())
        # Not passed through accelerator.prepare: the sampler is already rank-aware, and a sharding wrapper would
        # split the packs between ranks again. Batches move to the device in training_step (_prepare_inputs).
        return _PackLoader(
            PackDataset(dataset),
            batch_sampler=self.odc_pack_sampler,
            collate_fn=PackCollator(self._odc_collate_fn(), split_inputs),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory and torch.cuda.is_available(),
            persistent_workers=self.args.dataloader_persistent_workers and self.args.dataloader_num_workers > 0,
            prefetch_factor=self.args.dataloader_prefetch_factor if self.args.dataloader_num_workers > 0 else None,
        )

    def get_total_train_batch_size(self, args) -> int:
        if not self.odc:
            return super().get_total_train_batch_size(args)
        return self.odc_samples_per_rank * args.world_size

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if not self.odc:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        packs = []
        for _ in range(num_batches):
            try:
                packs.append(next(epoch_iterator))
            except StopIteration:
                break
        if not packs:
            return packs, None
        # Every rank holds a pack (same plan length), so this gather is one per step on every rank, like stock's.
        shifted = loss_shifts_labels(self)
        local = [sum(count_loss_tokens(mb, shifted=shifted) for p in packs for mb in p.microbatches),
                 float(any("labels" in mb or "shift_labels" in mb for p in packs for mb in p.microbatches))]
        counts = torch.tensor(local, dtype=torch.float64, device=device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            counts = self.accelerator.gather(counts).reshape(-1, 2).sum(0)
        if counts[1] == 0:  # no labels anywhere: the model computes its loss its own way, as stock
            self._odc_global_label_tokens = None
            return packs, None
        self._odc_global_label_tokens = counts[0].to(torch.long)
        passes_count = self.model_accepts_loss_kwargs or self.compute_loss_func is not None
        return packs, (self._odc_global_label_tokens if passes_count else None)

    # -- the step -----------------------------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self.odc or not isinstance(inputs, Pack):
            return super().training_step(model, inputs, num_items_in_batch)
        pack = inputs
        self._odc_check_position(pack)

        def train_one(microbatch):
            # compute_loss reweights by the microbatch's label tokens when the model cannot (and subclasses read
            # which samples it holds)
            self._odc_pack_microbatch, self._odc_pack_ids = microbatch
            piece = self._odc_pack_microbatch.pop(SPLIT_INPUTS_KEY, None)  # this rank's slice of a split sample
            with self.odc_sp.run(piece) if piece is not None else contextlib.nullcontext():
                return super(OdcTrainer, self).training_step(model, self._odc_model_inputs(self._odc_pack_microbatch),
                                                             num_items_in_batch)

        payload = self._odc_begin_step(pack)
        times = self._odc_train_step(zip(pack.microbatches, pack.sample_ids), train_one)
        self._odc_pack_microbatch = self._odc_pack_ids = None
        tokens, sq_tokens = self.odc_pack_sampler.sampler.load(pack.sample_ids, pack.splits)
        everyone = self._odc_meet(times, tokens, sq_tokens, pack.num_samples, payload=payload)
        self._odc_end_step(pack, everyone)
        self._odc_position = (pack.epoch, pack.step + 1)
        return times.loss.detach()

    def _odc_begin_step(self, pack: Pack):
        """Before a pack's microbatches: what this rank sends to the others at the step (see ``_odc_end_step``)."""
        return None

    def _odc_end_step(self, pack: Pack, everyone: list) -> None:
        """After the step's meeting, with every rank's ``_odc_begin_step`` object (filled during the step)."""

    def _odc_observe_cost(self, record):
        # Every rank gets every rank's numbers: the same record, so the same cost refit and the same next plans.
        return self.odc_pack_sampler.sampler.observe(record)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if not (self.odc and model.training and num_items_in_batch is None and self._odc_global_label_tokens is not None
                and getattr(self, "_odc_pack_microbatch", None) is not None):
            return out
        # The model averaged over this microbatch's tokens only (it takes no num_items_in_batch): reweight it to its
        # share of the global token mean, times W for ZeRO's averaging over ranks.
        loss = out[0] if return_outputs else out
        n_local = count_loss_tokens(self._odc_pack_microbatch, shifted=loss_shifts_labels(self))
        scale = n_local / max(int(self._odc_global_label_tokens), 1)
        if self.args.average_tokens_across_devices:
            scale *= self.args.world_size
        loss = loss * scale
        return (loss, out[1]) if return_outputs else loss

    def _prepare_inputs(self, inputs):
        moved = super()._prepare_inputs(inputs)
        if isinstance(inputs, Mapping) and isinstance(moved, Mapping):
            remember_host_boundaries(inputs, moved)  # ds_odc_varlen needs the lengths on the host: no sync for them
        return moved

    def _odc_model_inputs(self, mb: dict) -> dict:
        # A packed row (position ids restart, no attention mask) gets per-sample causal masks only without a KV
        # cache; models default to use_cache=True from their config, which would let samples attend to each other.
        config = getattr(self.model, "config", None)
        if "position_ids" in mb and "attention_mask" not in mb and getattr(config, "use_cache", False):
            return {**mb, "use_cache": False}
        return mb

    def floating_point_ops(self, inputs) -> int:
        if isinstance(inputs, Pack):
            return sum(super(OdcTrainer, self).floating_point_ops(mb) for mb in inputs.microbatches)
        return super().floating_point_ops(inputs)

    def _odc_check_position(self, pack: Pack) -> None:
        """One pack per optimizer step, in plan order: anything else means the loader and the Trainer disagree."""
        per_epoch = len(self.odc_pack_sampler)
        expected = divmod(self.state.global_step, per_epoch)
        if (pack.epoch, pack.step) != expected:
            raise RuntimeError(f"ds_odc: the Trainer is at optimizer step {self.state.global_step} (epoch {expected[0]},"
                               f" minibatch {expected[1]}) but the loader gave minibatch {pack.step} of epoch "
                               f"{pack.epoch}")

    # -- checkpoints ------------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if self.odc:
            resume_from_checkpoint = resolve_checkpoint(self.args.output_dir, resume_from_checkpoint)
        self._odc_resume_dir = resume_from_checkpoint or None
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call=_internal_call)
        # Checkpoints (the Trainer's internal call) also record where the balancer stands.
        if self.odc and _internal_call and self._odc_position is not None and self.args.should_save:
            save_balancer_state(output_dir, self.odc_pack_sampler.state_at(*self._odc_position))

    def _odc_restore_balancer(self) -> None:
        if not self._odc_resume_dir:
            return
        state = load_balancer_state(self._odc_resume_dir)
        if state is None:
            logger.warning(f"ds_odc: {self._odc_resume_dir} has no {BALANCER_STATE_NAME}; the Trainer's data "
                           "skipping re-plans the skipped minibatches")
            return
        if self.args.ignore_data_skip:  # the user asked to restart the data order: only check compatibility
            self.odc_pack_sampler.sampler.load_state_dict({**state, "step": 0})
            return
        self.odc_pack_sampler.resume(state)
        logger.info(f"ds_odc: balancer resumes at epoch {state['epoch']}, minibatch {state['step']}")


SPLIT_INPUTS_KEY = "ds_odc_split"  # in a split sample's model inputs: the SplitSlice, taken out before the forward


class _SplitInputs:
    """A split sample's model inputs on this rank: its slice (``slice_sample``), labels already shifted over the whole
    sample; ``labels`` switch the model's loss on and ``shift_labels`` replace them. Plain data, so loader workers
    can run it."""

    def __init__(self, policy: SplitPolicy, rank: int, pad_token_id: int) -> None:
        self.policy, self.rank, self.pad_token_id = policy, rank, pad_token_id

    def __call__(self, sample: Any, ranks: tuple[int, ...]) -> dict[str, Any]:
        piece = slice_sample(sample, ranks, ranks.index(self.rank), ulysses=self.policy.ulysses_size(len(ranks)),
                             pad_token_id=self.pad_token_id)
        return {"input_ids": piece.input_ids, "position_ids": piece.position_ids, "labels": piece.shift_labels,
                "shift_labels": piece.shift_labels, SPLIT_INPUTS_KEY: piece}


class _PackLoader(torch.utils.data.DataLoader):
    """A DataLoader whose ``set_epoch`` reaches the pack sampler (the Trainer calls it at every epoch start)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


def _dataset_lengths(dataset, column: str):
    """(lengths, sums of squared document lengths or None) of every sample, labels checked against input_ids."""
    describe = lambda i: _describe_row(dataset, i)  # noqa: E731
    if hasattr(dataset, "column_names"):  # datasets.Dataset: read the columns as Arrow, not row by row
        if column not in dataset.column_names:
            raise ValueError(f"ds_odc: length_column {column!r} is not a column of the train dataset "
                             f"({dataset.column_names})")
        lengths = lengths_from_dataset(dataset, column)
        if "labels" in dataset.column_names and column == "input_ids":
            check_label_lengths(lengths, lengths_from_dataset(dataset, "labels"), describe)
        sq = sq_lengths_from_dataset(dataset) if "seq_lengths" in dataset.column_names else None
        return lengths, sq
    lengths, labels = [], []
    for i in range(len(dataset)):
        row = dataset[i]
        value = row[column]
        lengths.append(int(value) if isinstance(value, int) else len(value))
        labels.append(len(row["labels"]) if column == "input_ids" and "labels" in row else lengths[-1])
    check_label_lengths(lengths, labels, describe)
    return lengths, None


def _describe_row(dataset, index: int) -> str:
    """``row N of the train dataset: input_ids [1, 2, 3, ...] (5 items), ...`` for error messages."""
    row = dataset[index]
    parts = []
    for key, value in list(row.items())[:4] if hasattr(row, "items") else []:
        if isinstance(value, (list, tuple)) or hasattr(value, "shape"):
            items = list(value[:3]) if not hasattr(value, "shape") else value.reshape(-1)[:3].tolist()
            parts.append(f"{key} {items}{' ...' if len(value) > 3 else ''} ({len(value)} items)")
        else:
            text = repr(value)
            parts.append(f"{key} {text[:40]}{'...' if len(text) > 40 else ''}")
    return f"row {index} of the train dataset" + (": " + ", ".join(parts) if parts else "")
