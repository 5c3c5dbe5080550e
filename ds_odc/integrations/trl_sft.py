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
``num_items_in_batch``, which ``OdcTrainer`` makes the global label-token count. A MoE model's router auxiliary loss,
a mean over each microbatch, is weighted by the share of the step's samples the microbatch holds, and logged
(``aux_loss``) as that weighted mean per stock microbatch (see [Note: per-microbatch means] in
:mod:`ds_odc.integrations._router_loss`).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Sequence

import numpy as np
import torch
from trl import SFTTrainer

from ds_odc.integrations._hf_privates import (TRL_SFT_PRIVATES, add_trl_train_tokens, check_trl, check_trl_instance,
                                              rank_local_collectives, redirected_trl_metrics, trl_train_metrics)
from ds_odc.integrations._runner import Microbatch
from ds_odc.integrations.transformers import OdcTrainer

__all__ = ["OdcSFTTrainer"]

check_trl(SFTTrainer, TRL_SFT_PRIVATES)

RECONSTRUCTED = ("entropy", "mean_token_accuracy", "num_tokens")


class OdcSFTTrainer(OdcTrainer, SFTTrainer):
    """``trl.SFTTrainer`` that trains with ODC + LB-Mini when the DeepSpeed config turns ``odc`` on (see the module
    docstring; balancer arguments as ``OdcTrainer``'s). Adds to ``OdcTrainer`` SFT's collator and the reconstruction
    of SFTTrainer's metrics."""

    def __init__(self, model=None, args=None, *trainer_args, microbatch_collator="trainer",
                 packed_attention: bool | None = None, **kwargs):
        if packed_attention is None:  # SFT's padding-free rows: each document attends to itself, no dense mask
            packed_attention = bool(getattr(args, "padding_free", False))
        super().__init__(model, args, *trainer_args, microbatch_collator=microbatch_collator,
                         packed_attention=packed_attention, **kwargs)
        if self.odc:
            check_trl_instance(self, TRL_SFT_PRIVATES)

    def odc_loss(self, model, mb: Microbatch) -> torch.Tensor:
        """``OdcTrainer``'s loss (SFTTrainer's ``compute_loss``, a MoE router loss weighted once there), its metrics
        gathered rank-locally and recorded per sample for the stock microbatches."""
        with redirected_trl_metrics(self, defaultdict(list), keep_token_count=True) as scratch, \
                rank_local_collectives(self.accelerator), _forward_outputs(self.model) as outputs:
            loss = super().odc_loss(model, mb)
        self._odc_record(mb, outputs[-1], scratch)
        return loss

    def _odc_record(self, mb: Microbatch, outputs, scratch) -> None:
        """Each sample's entropy sum, correct and label tokens, under the stock accumulation step it belongs to."""
        ids, metrics = list(mb.sample_ids), mb.metrics
        stats = torch.stack([outputs.entropy.detach().float(), outputs.is_top1.float(), outputs.label_mask.float()])
        if stats.shape[1] == 1 and len(ids) > 1:  # one padding-free row: output t scores token t + 1
            lengths = self.odc_pack_sampler.sampler.lengths[ids]
            sample = np.searchsorted(np.cumsum(lengths), np.arange(1, stats.shape[2] + 1), side="right")
            owner = torch.as_tensor(np.minimum(sample, len(ids)), device=stats.device)  # len(ids): padding
            sums = stats.new_zeros((3, len(ids) + 1)).index_add_(1, owner, stats[:, 0])[:, :len(ids)]
        else:  # one sample per row
            sums = stats.sum(2)
        for (entropy, correct, valid), slot in zip(sums.T.tolist(), mb.slots):
            metrics.add_mean("entropy", slot, entropy, valid)
            metrics.add_mean("mean_token_accuracy", slot, correct, valid)
        weight = 1.0 / len(mb.split.ranks) if mb.split is not None else 1.0  # a split sample's slice: its share
        for value in scratch.get("aux_loss", ()):  # the microbatch's router loss, for each of its samples
            for slot in mb.slots:
                metrics.add_mean("aux_loss", slot, value * weight, weight)
        metrics.slot = 0
        for name, values in scratch.items():  # anything else SFTTrainer logs: mean over ranks
            if name not in RECONSTRUCTED and name != "aux_loss":
                for value in values:
                    metrics.add(name, value)

    def odc_step_metrics(self, minibatch: Sequence[int], metrics: dict[str, list[float]]) -> None:
        logged = trl_train_metrics(self)
        for name, values in metrics.items():
            logged[name].extend(values)
        logged["num_tokens"] = [add_trl_train_tokens(self, self._odc_stock_tokens(minibatch))]

    def _odc_stock_tokens(self, minibatch: Sequence[int]) -> int:
        """Tokens SFTTrainer counts for this minibatch: per stock microbatch (``B`` consecutive samples of the
        minibatch), the padding-free row's width, or the real tokens of a padded batch."""
        lengths = self.odc_pack_sampler.sampler.lengths
        G, B = len(minibatch), self.args.per_device_train_batch_size
        multiple = self.args.pad_to_multiple_of if self.args.padding_free else None
        total = 0
        for start in range(0, G, B):
            n = int(lengths[minibatch[start:start + B]].sum())
            total += -(-n // multiple) * multiple if multiple else n
        return total


@contextlib.contextmanager
def _forward_outputs(model):
    """The outputs of every forward of ``model`` inside the block (TRL's fused LM head returns per-token entropy,
    top-1 hits and the label mask), in a list."""
    outputs: list = []
    handle = model.register_forward_hook(lambda module, args, output: outputs.append(output))
    try:
        yield outputs
    finally:
        handle.remove()
