"""Packed collation: several samples in one row without attention or loss across their boundaries.

A microbatch ``[s_0, s_1, ...]`` becomes one row of shape ``[1, T]``:

* ``input_ids``: the samples concatenated;
* ``position_ids``: ``0..len(s_j)-1`` for every sample, restarting at each boundary;
* ``labels``: the given labels (or a copy of ``input_ids``) with ``-100`` at the *first* token of every sample;
* ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32, ``[0, len(s_0), len(s_0) + len(s_1), ..., T]``) and
  ``max_length_q`` / ``max_length_k`` (a Python int): the document boundaries, under the names transformers'
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` and TRL's ``padding_free=True`` use. Passed to the
  model with the rest, they reach every attention call, so a varlen kernel (``ds_odc.training.attention``,
  ``flash_attention_2``) needs no host work per layer to find the documents. ``return_flash_attn_kwargs=False``
  leaves them out (for a model whose forward takes no extra keyword arguments).

Why the first token: Hugging Face causal-LM losses shift labels left (logit at position ``t`` is scored against
``labels[t + 1]``), so masking ``labels[start_j]`` stops the last token of sample ``j-1`` from being trained to
predict the first token of sample ``j``.

No ``attention_mask`` is returned.  With ``attention_mask=None``, no KV cache, and position ids that restart,
transformers 5.x detects the packed format (``masking_utils.find_packed_sequence_indices``) and builds a
per-document causal mask; on CPU this works for ``"sdpa"``, ``"eager"`` and ``"flex_attention"`` (verified in
tests/balancer/test_packing.py), and on GPU the flash-attention varlen path uses the same position ids.  **Call the
model with ``use_cache=False``** (or set ``config.use_cache = False``): when a cache object exists transformers
skips packed-sequence detection and the samples silently attend to each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ds_odc.training import attention
from ds_odc.training.loss import IGNORE_INDEX

__all__ = ["PackedCollator", "on_device"]


@dataclass(frozen=True)
class PackedCollator:
    """Collate a microbatch of samples (dicts with ``"input_ids"`` and optional ``"labels"``) into one packed row.

    Args:
        pad_token_id: token used when ``pad_to_multiple_of`` pads the row.
        pad_to_multiple_of: pad ``T`` up to a multiple (padding is its own pseudo-sample: positions restart, labels
            are ``-100``, so it neither attends to real tokens nor adds loss).  ``None``: no padding.
        return_flash_attn_kwargs: also return the document boundaries (``cu_seq_lens_q/k``, ``max_length_q/k``).
    """

    pad_token_id: int = 0
    pad_to_multiple_of: int | None = None
    return_flash_attn_kwargs: bool = True

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not samples:
            raise ValueError("PackedCollator got an empty microbatch")
        ids, pos, labels = [], [], []
        for s in samples:
            x = torch.as_tensor(s["input_ids"], dtype=torch.long).reshape(-1)
            if x.numel() == 0:
                raise ValueError("PackedCollator got a sample with no tokens")
            given = s.get("labels")
            y = x.clone() if given is None else torch.as_tensor(given, dtype=torch.long).reshape(-1).clone()
            if y.shape != x.shape:
                raise ValueError(f"labels shape {tuple(y.shape)} differs from input_ids shape {tuple(x.shape)}")
            y[0] = IGNORE_INDEX
            ids.append(x)
            labels.append(y)
            pos.append(torch.arange(x.numel(), dtype=torch.long))
        total = sum(x.numel() for x in ids)
        if self.pad_to_multiple_of:
            pad = -total % self.pad_to_multiple_of
            if pad:
                ids.append(torch.full((pad,), self.pad_token_id, dtype=torch.long))
                labels.append(torch.full((pad,), IGNORE_INDEX, dtype=torch.long))
                pos.append(torch.arange(pad, dtype=torch.long))
        row = {
            "input_ids": torch.cat(ids)[None],
            "position_ids": torch.cat(pos)[None],
            "labels": torch.cat(labels)[None],
        }
        if self.return_flash_attn_kwargs:
            lengths = torch.tensor([x.numel() for x in ids], dtype=torch.int32)
            cu_seq_lens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
            row.update(cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens, max_length_q=int(lengths.max()),
                       max_length_k=int(lengths.max()))
        return row


def on_device(row: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """A collated microbatch on ``device`` (tensors moved, Python ints such as ``max_length_q`` kept), its document
    boundaries remembered on the host so that no attention layer copies them back (``ds_odc_varlen``)."""
    moved = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in row.items()}
    attention.remember_host_boundaries(row, moved)
    return moved
