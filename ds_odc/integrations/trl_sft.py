"""``OdcSFTTrainer``: TRL's ``SFTTrainer`` with ODC + LB-Mini (``OdcTrainer``), logging what stock SFTTrainer logs.

``class OdcSFTTrainer(OdcTrainer, SFTTrainer)``: the constructor is ``SFTTrainer``'s plus ``OdcTrainer``'s balancer
arguments, and each microbatch is collated by SFT's own collator (``microbatch_collator="trainer"``), which masks
prompts and builds padding-free rows with ``padding_free=True``. Without ``odc`` in the DeepSpeed config every
method is SFTTrainer's.

``SFTTrainer.compute_loss`` gathers its metrics (``entropy``, ``mean_token_accuracy``, ``num_tokens``) across ranks
on every microbatch, which deadlocks once ranks run different microbatch counts, and their per-microbatch values
depend on which samples shared a microbatch. Under ODC the gathers are rank-local; each sample's entropy, correct
tokens and label tokens are read from the microbatch's forward (TRL's fused LM head returns them per token), and at
the step, with the step's one all-gather, they are recombined for the stock grouping: the stock Trainer with the same
arguments, fed this minibatch in the plan's order, trains accumulation step ``k`` on its samples
``[k * W * B, (k + 1) * W * B)`` (``B = per_device_train_batch_size``, ``W`` ranks). So the logged values equal stock's
(:mod:`ds_odc.integrations._stock_metrics`). The loss and gradients are untouched: SFTTrainer normalises by
``num_items_in_batch``, which ``OdcTrainer`` makes the global label-token count.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
from trl import SFTTrainer

from ds_odc.integrations._hf_privates import TRL_SFT_PRIVATES, check_trl, check_trl_instance, rank_local_collectives
from ds_odc.integrations._stock_metrics import SlotMetrics, combine
from ds_odc.integrations.transformers import OdcTrainer

__all__ = ["OdcSFTTrainer"]

check_trl(SFTTrainer, TRL_SFT_PRIVATES)

RECONSTRUCTED = ("entropy", "mean_token_accuracy", "num_tokens")


class OdcSFTTrainer(OdcTrainer, SFTTrainer):
    """``trl.SFTTrainer`` that trains with ODC + LB-Mini when the DeepSpeed config turns ``odc`` on (see the module
    docstring; balancer arguments as ``OdcTrainer``'s)."""

    def __init__(self, model=None, args=None, *trainer_args, microbatch_collator="trainer",
                 packed_attention: bool | None = None, **kwargs):
        if packed_attention is None:  # SFT's padding-free rows: each document attends to itself, no dense mask
            packed_attention = bool(getattr(args, "padding_free", False))
        super().__init__(model, args, *trainer_args, microbatch_collator=microbatch_collator,
                         packed_attention=packed_attention, **kwargs)
        self._odc_outputs: list | None = None  # the fused forward's outputs while ODC trains a microbatch
        self._odc_slot_metrics: SlotMetrics | None = None
        if self.odc:
            check_trl_instance(self, TRL_SFT_PRIVATES)
            self.model.register_forward_hook(self._odc_keep_outputs)

    def _odc_keep_outputs(self, module, args, output):
        if self._odc_outputs is not None:
            self._odc_outputs.append(output)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids = self._odc_pack_ids
        if not (self.odc and model.training and ids is not None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        logged, tokens = self._metrics["train"], self._total_train_tokens
        self._metrics["train"], self._odc_outputs = defaultdict(list), []
        try:
            with rank_local_collectives(self.accelerator):
                out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            scratch, outputs = self._metrics["train"], self._odc_outputs
        finally:
            self._metrics["train"], self._total_train_tokens, self._odc_outputs = logged, tokens, None
        self._odc_record(inputs, ids, outputs[-1], scratch)
        return out

    def _odc_record(self, inputs, ids: list[int], outputs, scratch) -> None:
        """Each sample's entropy sum, correct and label tokens, under the stock accumulation step it belongs to."""
        metrics = self._odc_slot_metrics
        stats = torch.stack([outputs.entropy.detach().float(), outputs.is_top1.float(), outputs.label_mask.float()])
        if stats.shape[1] == 1 and len(ids) > 1:  # one padding-free row: output t scores token t + 1
            lengths = self.odc_pack_sampler.sampler.lengths[ids]
            sample = np.searchsorted(np.cumsum(lengths), np.arange(1, stats.shape[2] + 1), side="right")
            owner = torch.as_tensor(np.minimum(sample, len(ids)), device=stats.device)  # len(ids): padding
            sums = stats.new_zeros((3, len(ids) + 1)).index_add_(1, owner, stats[:, 0])[:, :len(ids)]
        else:  # one sample per row
            sums = stats.sum(2)
        for (entropy, correct, valid), g in zip(sums.T.tolist(), ids):
            slot = self._odc_slot_of[g]
            metrics.add_mean("entropy", slot, entropy, valid)
            metrics.add_mean("mean_token_accuracy", slot, correct, valid)
        metrics.slot = 0
        for name, values in scratch.items():  # anything else SFTTrainer logs (the MoE aux loss): mean over ranks
            if name not in RECONSTRUCTED:
                for value in values:
                    metrics.add(name, value)

    def _odc_begin_step(self, pack):
        order = self.odc_pack_sampler.sampler.epoch_order(pack.epoch)
        G = pack.num_samples
        per_step = self.args.per_device_train_batch_size * self.args.world_size
        minibatch = order[pack.step * G:(pack.step + 1) * G].tolist()
        self._odc_slot_of = {g: i // per_step for i, g in enumerate(minibatch)}
        self._odc_slot_metrics = SlotMetrics()
        return self._odc_slot_metrics.records

    def _odc_end_step(self, pack, everyone) -> None:
        logged = self._metrics["train"]
        for name, values in combine(everyone).items():
            logged[name].extend(values)
        self._total_train_tokens += self._odc_stock_tokens(pack)
        logged["num_tokens"] = [self._total_train_tokens]

    def _odc_stock_tokens(self, pack) -> int:
        """Tokens SFTTrainer counts for this minibatch: per stock microbatch (``B`` consecutive samples of the
        minibatch), the padding-free row's width, or the real tokens of a padded batch."""
        lengths = self.odc_pack_sampler.sampler.lengths
        order = self.odc_pack_sampler.sampler.epoch_order(pack.epoch)
        G, B = pack.num_samples, self.args.per_device_train_batch_size
        minibatch = order[pack.step * G:(pack.step + 1) * G]
        multiple = self.args.pad_to_multiple_of if self.args.padding_free else None
        total = 0
        for start in range(0, G, B):
            n = int(lengths[minibatch[start:start + B]].sum())
            total += -(-n // multiple) * multiple if multiple else n
        return total
