"""Packed collation: several samples in one row without attention or loss across their boundaries.

A microbatch ``[s_0, s_1, ...]`` becomes one row of shape ``[1, T]``:

* ``input_ids``: the samples concatenated;
* ``position_ids``: ``0..len(s_j)-1`` for every sample, restarting at each boundary;
* ``labels``: the given labels (or a copy of ``input_ids``) with ``-100`` at the *first* token of every sample.

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

__all__ = ["PackedCollator", "IGNORE_INDEX"]

IGNORE_INDEX = -100


@dataclass(frozen=True)
class PackedCollator:
    """Collate a microbatch of samples (dicts with ``"input_ids"`` and optional ``"labels"``) into one packed row.

    Args:
        pad_token_id: token used when ``pad_to_multiple_of`` pads the row.
        pad_to_multiple_of: pad ``T`` up to a multiple (padding is its own pseudo-sample: positions restart, labels
            are ``-100``, so it neither attends to real tokens nor adds loss).  ``None``: no padding.
    """

    pad_token_id: int = 0
    pad_to_multiple_of: int | None = None

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
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
        return {
            "input_ids": torch.cat(ids)[None],
            "position_ids": torch.cat(pos)[None],
            "labels": torch.cat(labels)[None],
        }
