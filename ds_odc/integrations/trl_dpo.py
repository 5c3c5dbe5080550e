"""``OdcDPOTrainer``: TRL's ``DPOTrainer`` with ODC + LB-Mini over preference pairs.

With ``"zero_optimization": {"stage": 3, "odc": true}`` in ``DPOConfig(deepspeed=...)`` (or in an ``accelerate
launch`` config's ``deepspeed_config_file``), every optimizer step trains one global minibatch of
``per_device_train_batch_size * gradient_accumulation_steps * world_size`` pairs, planned by LB-Mini
(:class:`~ds_odc.integrations.transformers.OdcTrainer`'s step): a pair (prompt, chosen and rejected completion) is one
sample, never split across ranks or microbatches, whose cost is both of its sequences' (``ds_odc_pair_tokens`` and
``seq_lengths``, columns added to the train dataset); each rank trains its share in as many microbatches as it needs
(0 included), each within ``max_tokens_per_microbatch``. A microbatch is TRL's padded rows or, with
``DPOConfig(padding_free=True)``, one padding-free row (:mod:`ds_odc.integrations._pairs`, attention
``ds_odc_varlen``). Without ``odc`` in the config every method is DPOTrainer's, ``padding_free`` included (TRL 1.16
falls back to padded batches there).

The reference model's log-probabilities of a step's pairs are computed on the same rows as the policy's, at the start
of the step (:meth:`OdcDPOTrainer.odc_prepare_step`): TRL's reference model is a stock ZeRO-3 engine, whose every
forward gathers parameters with collectives, so every rank runs as many reference forwards as the rank with the most
microbatches (two-token forwards past its own). With ``precompute_ref_log_probs=True`` TRL computes them before
training, in its own batches, and the step reads them from the dataset. With LoRA adapters (``peft_config`` or a
``PeftModel``) and no ``ref_model``, the reference is TRL's: the policy's base model with the adapters disabled (or
the frozen copy of a ``PeftModel``'s initial adapter TRL names "ref"), through the policy's own ODC forwards, which
wait for no other rank: each rank runs only its own.

The loss equals TRL's for every loss type whose value is a mean over the pairs of a microbatch (the default
``sigmoid`` and all but ``aot``, ``aot_unpaired`` and ``sft``, which are refused): within each ODC microbatch, TRL's own
``_compute_loss`` runs on each group of pairs that shared a stock microbatch (the stock trainer with the same
arguments, fed this minibatch in the plan's order, trains accumulation step ``k`` on its pairs
``[k * W * B, (k + 1) * W * B)``), its model (and reference model) serving the per-token outputs of the microbatch's
one forward, and is weighted by ``pairs * W / G`` (``G`` pairs in the minibatch, ``W`` ranks): summed over all ranks,
and averaged by ZeRO over ranks, that is TRL's per-pair mean whatever rank trains which pair. TRL's metrics
(``rewards/*``, ``logps/*``, ``logits/*``, ``entropy``, ``mean_token_accuracy``, ``num_tokens``) are reconstructed for
the stock microbatches (:mod:`ds_odc.integrations._stock_metrics`): the logs show what stock DPOTrainer logs.

The TRL privates this relies on (``_compute_loss``, ``_metrics``, ``_total_train_tokens``, and ``_precompute_engine``,
the inference engine TRL leaves around the policy after precomputing with it: released, see
:func:`~ds_odc.zero.engine.destroy_engine`) are listed with their reasons in :mod:`ds_odc.integrations._hf_privates`
and checked when this module is imported or the trainer built (tested with trl 1.16). See docs/HF_TRAINER.md.
"""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict
from dataclasses import replace
from typing import Any, Sequence

import numpy as np
import torch
from transformers import ProcessorMixin
from trl import DPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

from ds_odc.balancer.lengths import lengths_from_dataset
from ds_odc.integrations._hf_privates import (TRL_DPO_PRIVATES, add_trl_train_tokens, check_trl, check_trl_instance,
                                              rank_local_collectives, redirected_trl_metrics,
                                              release_precompute_engine, router_loss_enabled, trl_loss,
                                              trl_train_metrics)
from ds_odc.integrations._completions import packed_attention
from ds_odc.integrations._pairs import (PAIRS_KEY, PER_TOKEN_OUTPUTS, REFERENCE_KEY, PairCollator, PairRows,
                                        ReferenceLogps, ServedOutputs, idle_rows)
from ds_odc.integrations._runner import Microbatch
from ds_odc.integrations._setup import odc_enabled
from ds_odc.integrations._stock_metrics import SlotMetrics
from ds_odc.integrations.transformers import OdcTrainer

__all__ = ["OdcDPOTrainer"]

check_trl(DPOTrainer, TRL_DPO_PRIVATES)

PAIR_TOKENS = "ds_odc_pair_tokens"  # the train dataset column LB-Mini reads a pair's cost from
# TRL's loss types whose value is a mean over the pairs of a microbatch, of a term of each pair alone.
PER_PAIR_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
                   "apo_down", "discopop", "sigmoid_norm")
# What TRL averages each logged metric over, within a microbatch on all ranks: its pairs, or the completion tokens
# (TRL's shifted completion mask) of its chosen / rejected / all sequences. num_tokens is a running count.
METRIC_COUNTS = {"rewards/chosen": "pairs", "rewards/rejected": "pairs", "rewards/accuracies": "pairs",
                 "rewards/margins": "pairs", "logps/chosen": "pairs", "logps/rejected": "pairs",
                 "entropy": "tokens", "logits/chosen": "chosen", "logits/rejected": "rejected",
                 "mean_token_accuracy": "chosen"}


def _refusals(args, trainer_kwargs: dict) -> list[str]:
    """Options OdcDPOTrainer cannot run with ODC, each with what to change (those the arguments tell)."""
    out = []
    unpaired = [t for t in args.loss_type if t not in PER_PAIR_LOSSES]
    if unpaired:
        out.append(f"loss_type={unpaired} (its value over a microbatch is not a mean of per-pair terms: 'aot' sorts "
                   "the microbatch's pairs, 'sft' averages over its tokens; LB-Mini regroups the pairs. Supported: "
                   f"{list(PER_PAIR_LOSSES)})")
    if args.sync_ref_model:
        out.append("sync_ref_model=True (not tested with ODC yet: set sync_ref_model=False)")
    if isinstance(trainer_kwargs.get("processing_class"), ProcessorMixin):
        out.append("a vision-language processing_class (image inputs are not planned by LB-Mini yet)")
    return out


def _refuse(refused: list[str]) -> None:
    if refused:
        raise ValueError("ds_odc: OdcDPOTrainer with zero_optimization.odc does not support "
                         + "; ".join(refused) + ". Change these options or turn ODC off.")


class _DPOTrainerArgsSecond(DPOTrainer):
    """``DPOTrainer`` built with ``args`` second, as ``Trainer`` is (``OdcTrainer`` passes it so), and the reference
    model as a keyword."""

    def __init__(self, model, args=None, *trainer_args, ref_model=None, **trainer_kwargs):
        DPOTrainer.__init__(self, model, ref_model, args, *trainer_args, **trainer_kwargs)


class OdcDPOTrainer(OdcTrainer, _DPOTrainerArgsSecond):
    """``trl.DPOTrainer`` that trains with ODC + LB-Mini when the DeepSpeed config turns ``odc`` on (see the module
    docstring). The constructor is ``DPOTrainer``'s plus ``OdcTrainer``'s balancer arguments
    (``max_tokens_per_microbatch``: the tokens of a microbatch's pairs, both sequences of each; ``None``: one pair per
    microbatch; ``length_column`` defaults to :data:`PAIR_TOKENS`)."""

    odc_padding_free: bool = False  # ODC trains padding-free rows (DPOConfig.padding_free)
    odc_pair_tokens: np.ndarray | None = None  # tokens of each train pair, both sequences (as TRL truncates them)

    def __init__(self, model, ref_model=None, args=None, *trainer_args, length_column: str = PAIR_TOKENS,
                 **trainer_kwargs):
        odc = args is not None and odc_enabled(args)
        packed = False
        if odc:
            _refuse(_refusals(args, trainer_kwargs))
            packed = bool(args.padding_free)
            # ODC builds the padding-free rows itself; TRL 1.16's own padding_free falls back to padding, with a warning
            args = copy.copy(args)
            args.padding_free = False
        super().__init__(model, args, *trainer_args, ref_model=ref_model, length_column=length_column,
                         microbatch_collator="trainer", packed_attention=packed, loss_chunk_tokens=None,
                         **trainer_kwargs)
        if not self.odc:
            return
        check_trl_instance(self, TRL_DPO_PRIVATES)
        options = self.odc_runner.options
        refused = []
        if options.spec.splits:
            refused.append(f"balancer_planner={options.planner!r} (a pair trains whole on one rank: use 'lb-mini')")
        if options.oversize == "truncate":
            refused.append("oversize='truncate' (a pair is not cut to the microbatch budget: shorten sequences with "
                           "DPOConfig.max_length, or use oversize='skip' or 'error')")
        if router_loss_enabled(self):
            refused.append("the MoE router auxiliary loss (a per-microbatch term: set router_aux_loss_coef=0)")
        _refuse(refused)
        release_precompute_engine(self)  # its hooks on the policy would gather with collectives in ODC's forwards
        self.odc_padding_free = packed
        self.train_dataset, self.odc_pair_tokens = pair_lengths(self.train_dataset, self.args.max_length)
        _check_budget(self.odc_pair_tokens, options.max_tokens, options.oversize)

    # -- what a trainer adds: a collator, the reference log-probs and a loss ------------------------------------------
    def odc_collator(self):
        """TRL's collator (``data_collator``: truncation, chosen rows then rejected rows), its rows packed into one
        padding-free row when ``padding_free``."""
        return PairCollator(self.data_collator, packed=self.odc_padding_free)

    def odc_prepare_step(self, model, microbatches: list[Microbatch]) -> list[Microbatch]:
        """The microbatches' inputs on the device and the reference model's per-token log-probabilities of every
        microbatch of the step, on its rows (unless precomputed). A separate reference model is a stock ZeRO-3 engine:
        its forwards gather parameters with collectives, so each rank runs as many as the rank with the most
        microbatches."""
        microbatches = super().odc_prepare_step(model, microbatches)
        if self.precompute_ref_logps:
            return microbatches
        forwards = len(microbatches)
        if self.ref_model is not None and self.args.world_size > 1:
            counts = self.accelerator.gather(torch.tensor([forwards], device=self.args.device))
            forwards = int(counts.max())
        out = []
        with torch.no_grad(), self.compute_loss_context_manager():
            for mb in microbatches:
                rows: PairRows = mb.inputs[PAIRS_KEY]
                logps = self._odc_reference_logps(rows.model_inputs(mb.inputs), rows.packed)
                out.append(replace(mb, inputs={**mb.inputs, REFERENCE_KEY: ReferenceLogps(logps)}))
            pad = self.processing_class.pad_token_id
            for _ in range(forwards - len(microbatches)):
                self._odc_reference_logps(idle_rows(pad if pad is not None else 0, self.args.device), packed=False)
        return out

    def _odc_reference_logps(self, inputs: dict[str, Any], packed: bool) -> torch.Tensor:
        """One reference forward (TRL's choice of reference: ``ref_model``, or the PEFT policy with its adapter off)."""
        reference, policy = self.ref_model, contextlib.ExitStack()
        if reference is None:  # a PeftModel without a ref_model: TRL's reference is the base model (or "ref" adapter)
            reference = self.model
            unwrapped = self.accelerator.unwrap_model(self.model)
            policy.enter_context(disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs))
            policy.enter_context(use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None))
        with policy, packed_attention(reference) if packed else contextlib.nullcontext():
            return reference(**inputs, fused_lm_head=True).log_probs

    def odc_loss(self, model, mb: Microbatch) -> torch.Tensor:
        """One forward of the microbatch; then TRL's loss of each group of its pairs that shared a stock microbatch,
        weighted by ``pairs * W / G``."""
        inputs = mb.inputs
        rows: PairRows = inputs[PAIRS_KEY]
        outputs = model(**rows.model_inputs(inputs), fused_lm_head=True)
        per_token = {k: getattr(outputs, k) for k in PER_TOKEN_OUTPUTS if getattr(outputs, k, None) is not None}
        reference: ReferenceLogps | None = inputs.get(REFERENCE_KEY)
        if reference is not None:
            per_token["reference"] = reference.log_probs
        groups: dict[int, list[int]] = {}
        for position, slot in enumerate(mb.slots):
            groups.setdefault(slot, []).append(position)
        scale = self.args.world_size / mb.step_samples
        loss = per_token["log_probs"].new_zeros(())
        for slot, pairs in groups.items():
            batch, served = rows.select(inputs, pairs, per_token)
            reference_outputs = served.pop("reference", None)
            term, logged = self._odc_stock_loss(ServedOutputs(**served), reference_outputs, batch)
            loss = loss + term * (len(pairs) * scale)
            _record(mb.metrics, slot, logged, batch, len(pairs))
        return loss

    def _odc_stock_loss(self, served: ServedOutputs, reference: torch.Tensor | None, batch: dict[str, torch.Tensor]):
        """TRL's loss (a mean over the batch's pairs) and the metrics it logged, of a batch whose forwards are served,
        computed rank-locally."""
        ref_model = self.ref_model
        if reference is not None:
            self.ref_model = ServedOutputs(reference)
        try:
            with redirected_trl_metrics(self, defaultdict(list), keep_token_count=True) as scratch, \
                    rank_local_collectives(self.accelerator):
                term = trl_loss(self, served, batch, False)
        finally:
            self.ref_model = ref_model
        return term, scratch

    def odc_step_metrics(self, minibatch: Sequence[int], metrics: dict[str, list[float]]) -> None:
        """TRL's metrics of the step, one value per stock microbatch, and the minibatch's tokens."""
        logged = trl_train_metrics(self)
        for name, values in metrics.items():
            logged[name].extend(values)
        logged["num_tokens"] = [add_trl_train_tokens(self, int(self.odc_pair_tokens[minibatch].sum()))]


def _record(metrics: SlotMetrics, slot: int, logged: dict[str, list[float]], batch: dict[str, torch.Tensor],
            pairs: int) -> None:
    """TRL's metrics of one group of pairs, each as the sum and count behind its mean (:data:`METRIC_COUNTS`), under
    the group's stock microbatch."""
    chosen, rejected = (int(n) for n in batch["completion_mask"][:, 1:].sum(1).reshape(2, -1).sum(1).tolist())
    counts = {"pairs": pairs, "chosen": chosen, "rejected": rejected, "tokens": chosen + rejected}
    for name, values in logged.items():
        if name == "num_tokens":
            continue
        if name not in METRIC_COUNTS:
            raise RuntimeError(f"ds_odc: TRL's DPO loss logged {name!r}, which OdcDPOTrainer cannot combine over "
                               "ranks; ds_odc is tested with trl 1.16")
        n = counts[METRIC_COUNTS[name]]
        for value in values:
            metrics.add_mean(name, slot, float(value) * n, n)


def _check_budget(pair_tokens: np.ndarray, budget: int | None, oversize: str) -> None:
    """Pairs longer than the microbatch budget, refused before anything trains (``oversize="error"``)."""
    over = np.flatnonzero(pair_tokens > budget) if budget is not None and oversize == "error" else ()
    if len(over):
        shown = ", ".join(str(int(i)) for i in over[:5]) + (", ..." if len(over) > 5 else "")
        raise ValueError(f"ds_odc: {len(over)} preference pairs of the train dataset (rows {shown}) are longer than "
                         f"max_tokens_per_microbatch={budget} (both sequences of a pair count; the longest has "
                         f"{int(pair_tokens.max())} tokens), and a pair is never split. Raise "
                         "max_tokens_per_microbatch, truncate the sequences with DPOConfig(max_length=...), or pass "
                         "oversize='skip' to leave those pairs out")


def pair_lengths(dataset, max_length: int | None):
    """``dataset`` (TRL-prepared: ``prompt_ids``, ``chosen_ids``, ``rejected_ids``) with :data:`PAIR_TOKENS` (both
    sequences' tokens, truncated at ``max_length`` as TRL's collator does) and ``seq_lengths`` (the two sequences,
    whose squares the attention cost reads), and the pair tokens as an array."""
    prompt, chosen, rejected = (lengths_from_dataset(dataset, c) for c in ("prompt_ids", "chosen_ids", "rejected_ids"))
    limit = np.iinfo(np.int64).max if max_length is None else int(max_length)
    sequences = np.stack([np.minimum(prompt + chosen, limit), np.minimum(prompt + rejected, limit)], axis=1)
    tokens = sequences.sum(1)
    for column in (PAIR_TOKENS, "seq_lengths"):
        if column in dataset.column_names:
            dataset = dataset.remove_columns(column)
    dataset = dataset.add_column(PAIR_TOKENS, tokens.tolist())
    dataset = dataset.add_column("seq_lengths", sequences.tolist())
    return dataset, tokens
