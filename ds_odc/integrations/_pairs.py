"""Preference pairs as the rows of one ODC microbatch, and each stock microbatch's share of them as TRL's DPO loss reads
a batch.

A pair is one sample (a prompt, a chosen and a rejected completion): LB-Mini never splits it across ranks or
microbatches. TRL's collator (``DataCollatorForPreference``) lays ``n`` pairs out as ``2n`` padded rows, the ``n``
chosen sequences (prompt + chosen completion) then the ``n`` rejected ones, with a ``completion_mask``; it also
truncates each sequence to ``max_length``. :class:`PairCollator` keeps that layout (``packed=False``) or, padding-free
(``packed=True``), puts the same ``2n`` sequences back to back in one row: position ids restart at every sequence,
``cu_seq_lens_*`` carry the boundaries that the ``ds_odc_varlen`` attention reads (each sequence attends to itself
only, at the cost of its own length), and the labels are the completion tokens, less each sequence's first token (in a
padded row nothing predicts it either).

The model's per-token outputs (TRL's fused LM head: output ``t`` scores token ``t + 1``) of either layout are cut back
into padded rows for any subset of the pairs by :meth:`PairRows.select`: the inputs and outputs TRL's loss would have
seen had the subset been its whole batch. :class:`ServedOutputs` hands those outputs to TRL's loss in place of a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ds_odc.training.loss import IGNORE_INDEX

__all__: list[str] = []

PAIRS_KEY = "ds_odc_pairs"  # in a microbatch's inputs: its PairRows
REFERENCE_KEY = "ds_odc_reference"  # ... and, once computed, the reference model's ReferenceLogps
PER_TOKEN_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs")  # of TRL's fused LM head
_PADDED_KEYS = ("input_ids", "attention_mask", "completion_mask")
_PER_PAIR_KEYS = ("ref_chosen_logps", "ref_rejected_logps")  # precomputed reference log-probs (TRL's columns)
_NOT_MODEL_INPUTS = ("completion_mask", "labels", *_PER_PAIR_KEYS, PAIRS_KEY, REFERENCE_KEY)


@dataclass(frozen=True)
class PairRows:
    """How a microbatch holds its ``pairs`` pairs: TRL's padded rows, or one packed row of the ``2n`` sequences (chosen
    ones first) with these ``lengths``."""

    pairs: int
    packed: bool
    lengths: tuple[int, ...] = ()

    def model_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The forward's keyword arguments (for TRL's fused LM head: with the labels it scores)."""
        out = {k: v for k, v in inputs.items() if k not in _NOT_MODEL_INPUTS}
        out["labels"] = (inputs["labels"] if self.packed
                         else inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, IGNORE_INDEX))
        out["use_cache"] = False
        return out

    def select(self, inputs: dict[str, Any], pairs: Sequence[int], per_token: dict[str, torch.Tensor]
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The padded batch of the pairs ``pairs`` (positions in this microbatch), in TRL's layout, and their rows of
        the per-token outputs (each ``rows x (width - 1)``, zero past a sequence's end) from this microbatch's."""
        if not self.packed:
            rows = torch.tensor([*pairs, *(self.pairs + i for i in pairs)], device=inputs["input_ids"].device)
            batch = {k: inputs[k].index_select(0, rows) for k in _PADDED_KEYS}
            outputs = {k: v.index_select(0, rows) for k, v in per_token.items()}
        else:
            sequences = [*pairs, *(self.pairs + i for i in pairs)]
            starts = torch.tensor([0, *self.lengths]).cumsum(0)[sequences]
            lengths = torch.tensor([self.lengths[s] for s in sequences])
            width = int(lengths.max())
            at = torch.arange(width)
            real = at[None, :] < lengths[:, None]
            total = int(sum(self.lengths))
            # Token p of a sequence sits at its start + p; its output p (scoring token p + 1) at the same place of the
            # row's shifted outputs. Positions past a sequence's end read an appended fill slot.
            tokens = torch.where(real, starts[:, None] + at[None, :], total)
            scored = torch.where(at[None, :-1] < (lengths[:, None] - 1), starts[:, None] + at[None, :-1], total - 1)
            device = inputs["input_ids"].device
            tokens, scored = tokens.to(device), scored.to(device)
            batch = {"input_ids": _take(inputs["input_ids"], tokens), "attention_mask": real.long().to(device),
                     "completion_mask": _take(inputs["completion_mask"], tokens)}
            outputs = {k: _take(v, scored) for k, v in per_token.items()}
        index = torch.tensor(list(pairs), device=inputs["input_ids"].device)
        for key in _PER_PAIR_KEYS:
            if key in inputs:
                batch[key] = inputs[key].index_select(0, index)
        return batch, outputs


def _take(row: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``row`` (one row, ``1 x N``) read at ``index`` (2-D), where ``N`` stands for a zero (``False``) slot."""
    flat = row.reshape(-1)
    return torch.cat([flat, flat.new_zeros(1)])[index]


class PairCollator:
    """A list of preference samples -> one microbatch's inputs: ``collate``'s padded rows (TRL's
    ``DataCollatorForPreference``, or a collator with its output: ``input_ids``, ``attention_mask``,
    ``completion_mask``, chosen rows first, each row's real tokens contiguous), or with ``packed`` those rows as one
    padding-free row. Plain data, so loader workers can run it."""

    def __init__(self, collate: Callable[[list], dict[str, Any]], packed: bool) -> None:
        self.collate, self.packed = collate, packed

    def __call__(self, samples: list) -> dict[str, Any]:
        batch = dict(self.collate(samples))
        n = len(samples)
        if batch["input_ids"].shape[0] != 2 * n:
            raise ValueError(f"ds_odc: the DPO data collator made {batch['input_ids'].shape[0]} rows of {n} pairs; "
                             "expected a chosen and a rejected row per pair")
        if not self.packed:
            batch[PAIRS_KEY] = PairRows(n, packed=False)
            return batch
        unknown = sorted(set(batch) - {*_PADDED_KEYS, *_PER_PAIR_KEYS})
        if unknown:
            raise ValueError(f"ds_odc: the DPO data collator returned {unknown}, which padding-free rows do not carry; "
                             "use padding_free=False or a collator with TRL's DataCollatorForPreference outputs")
        real = batch["attention_mask"].bool()
        lengths = real.sum(1).tolist()
        positions = torch.cat([torch.arange(k) for k in lengths])
        completion = batch["completion_mask"][real]
        ids = batch["input_ids"][real]
        labels = ids.masked_fill((completion == 0) | (positions == 0), IGNORE_INDEX)
        bounds = torch.tensor([0, *lengths]).cumsum(0, dtype=torch.int32)
        out = {"input_ids": ids[None], "position_ids": positions[None], "labels": labels[None],
               "completion_mask": completion[None], "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds,
               "max_length_q": max(lengths), "max_length_k": max(lengths),
               PAIRS_KEY: PairRows(n, packed=True, lengths=tuple(lengths))}
        out.update({k: batch[k] for k in _PER_PAIR_KEYS if k in batch})
        return out


@dataclass(frozen=True)
class ReferenceLogps:
    """The reference model's per-token log-probabilities of a microbatch's rows, as the model's outputs lay them out.
    (Not a tensor in the inputs: moving inputs to the device would cast it to the engine's dtype.)"""

    log_probs: torch.Tensor


def idle_rows(pad_token_id: int, device) -> dict[str, Any]:
    """A two-token forward with one scored position: what a rank runs when the others still run reference forwards."""
    ids = torch.full((1, 2), pad_token_id, dtype=torch.long, device=device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(), "use_cache": False}


@dataclass(frozen=True)
class ServedOutputs:
    """Per-token outputs already computed by a microbatch's forward, handed to TRL's loss in place of the model: calling
    it returns them (as TRL's fused LM head would), after checking they belong to the batch it is called with."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    aux_loss: Any = None

    def __call__(self, input_ids: torch.Tensor, **kwargs) -> "ServedOutputs":
        rows, width = input_ids.shape
        if self.log_probs.shape != (rows, width - 1):
            raise RuntimeError(f"ds_odc: served per-token outputs of shape {tuple(self.log_probs.shape)} for a batch "
                               f"of {rows} x {width} tokens")
        return self
