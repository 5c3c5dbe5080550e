"""``OdcTrainer``: the Hugging Face ``Trainer`` with ODC and LB-Mini, switched on by the ds_config.

With ``"zero_optimization": {"stage": 3, "odc": true}`` in ``TrainingArguments(deepspeed=...)``, every optimizer step
trains one global minibatch of ``per_device_train_batch_size * gradient_accumulation_steps * world_size`` samples,
split over the ranks by LB-Mini (:mod:`ds_odc.balancer`): each rank gets a different number of microbatches (0
included), each microbatch at most ``max_tokens_per_microbatch`` tokens. Without ``odc`` every method below defers to
the stock ``Trainer``.

How it plugs in (see docs/HF_TRAINER.md): the trainer picks its step-runner once, in ``__init__``
(:mod:`ds_odc.integrations._runner`: a :class:`~ds_odc.integrations._runner.PackRunner` with ODC, the stock methods
without), and adds what is its own, a collator and a loss:

* the train loader yields one *pack* per optimizer step: this rank's microbatches of the step, from the same global
  plan on every rank (no communication). ``TrainingArguments.gradient_accumulation_steps`` becomes 1 on the trainer's
  copy of the args, so the Trainer's own loop runs exactly one ``training_step`` per optimizer step;
* ``get_batch_samples`` counts the pack's label tokens and sums them over ranks (the Trainer's one all-gather per
  step), so ``num_items_in_batch`` is the global token count and the loss the global token mean, as stock;
* ``training_step`` runs the pack's microbatches through the stock ``training_step`` with gradient sync off (ODC
  pushes gradients as they come), each handed to ``compute_loss`` as a
  :class:`~ds_odc.integrations._runner.Microbatch`, then takes DeepSpeed's step at an explicit accumulation boundary:
  ranks meet there.

Overridden public ``Trainer`` methods: ``get_train_dataloader``, ``get_total_train_batch_size``,
``get_batch_samples``, ``training_step``, ``compute_loss``, ``floating_point_ops``, ``log``, ``train``,
``save_model``. The Trainer and Accelerate privates it needs besides (``_prepare_inputs``,
``_remove_unused_columns``, ``_loss_shifts_labels``, ``save_model``'s ``_internal_call``, Accelerate's
``_set_sync_gradients``) are listed, with the reason for each, in :mod:`ds_odc.integrations._hf_privates` and
checked when this module is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from transformers import Trainer

import ds_odc
from ds_odc.balancer.options import BalancerOptions
from ds_odc.balancer.sp import SplitPolicy
from ds_odc.integrations._hf_privates import check_transformers, match_accelerate_backend
from ds_odc.integrations._packs import PackLoader as _PackLoader  # noqa: F401  (the loader's former name here)
from ds_odc.integrations._runner import (BALANCER_STATE_NAME, Microbatch, PackRunner, RunsOdcSteps, StepRunner,
                                         balancer_options, deepspeed_config_of, odc_enabled, one_pack_per_step,
                                         router_loss_weight, with_split_policy)
from ds_odc.training.kernels import training_args_for_kernels
from ds_odc.training.attention import remember_host_boundaries
from ds_odc.training.collate import PackedCollator
from ds_odc.training.loss import DEFAULT_CHUNK_TOKENS

ds_odc.patch()  # the `odc` key must parse before TrainingArguments / zero.Init read the ds_config
check_transformers()

__all__ = ["OdcTrainer", "odc_enabled", "deepspeed_config_of", "BALANCER_STATE_NAME"]


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

    def odc_loss(self, model, mb: Microbatch, return_outputs: bool = False, num_items_in_batch=None):
        """The loss of one microbatch of an ODC step: the stock ``compute_loss`` of its inputs, as a share of the
        step's global token mean (a MoE model's router loss as a share of the step's samples)."""
        reweight = num_items_in_batch is None and mb.step_label_tokens is not None and mb.label_tokens is not None
        scale = 1.0
        if reweight:
            # The model averages over this microbatch's tokens only (it takes no num_items_in_batch): reweight it to
            # its share of the global token mean, times W for ZeRO's averaging over ranks.
            scale = mb.label_tokens / max(mb.step_label_tokens, 1)
            if self.args.average_tokens_across_devices:
                scale *= self.args.world_size
        # A MoE model adds its router loss once per microbatch: the stock Trainer weighs it alike in every microbatch
        # of B samples (divided by the accumulation steps when it divides the loss), so this one stands for n / B of
        # them (see [Note: per-microbatch means] in _runner).
        if not mb.step_samples:
            router = 1.0
        elif reweight:
            router = self.args.world_size * mb.sample_share / scale if scale else 0.0
        else:
            router = mb.sample_share * mb.step_samples / self.args.per_device_train_batch_size
        with router_loss_weight(self.model, router):
            out = super().compute_loss(model, mb.inputs, return_outputs=return_outputs,
                                       num_items_in_batch=num_items_in_batch)
        if not reweight:
            return out
        loss = (out[0] if return_outputs else out) * scale
        return (loss, out[1]) if return_outputs else loss

    def odc_prepare_step(self, model, microbatches: list[Microbatch]) -> list[Microbatch]:
        """At the start of an ODC step, on every rank (also one with no microbatch): what all of this rank's
        microbatches need computed first. Returns the microbatches to train (here: as they are)."""
        return microbatches

    def odc_step_metrics(self, pack, metrics: dict[str, list[float]]) -> None:
        """After a step's meeting: what ``odc_loss`` recorded, combined over ranks, one value per stock microbatch."""

    # -- where the Microbatch meets the stock Trainer ------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if isinstance(inputs, Microbatch):  # a microbatch of an ODC step, through the stock training_step
            return self.odc_loss(model, inputs, return_outputs, num_items_in_batch)
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    def _prepare_inputs(self, inputs):
        if isinstance(inputs, Microbatch):
            return replace(inputs, inputs=self._prepare_inputs(inputs.inputs))
        moved = super()._prepare_inputs(inputs)
        if isinstance(inputs, Mapping) and isinstance(moved, Mapping):
            remember_host_boundaries(inputs, moved)  # ds_odc_varlen needs the lengths on the host: no sync for them
        return moved
