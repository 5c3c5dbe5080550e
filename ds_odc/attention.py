"""Attention over padding-free rows: each document attends only to itself, at the cost of its own length.

``import ds_odc.attention`` registers ``attn_implementation="ds_odc_varlen"`` with transformers. A row packs several
documents (``PackedCollator``, transformers' ``DataCollatorWithFlattening``, TRL's ``padding_free=True``); their
boundaries come, in this order of preference, from

* ``cu_seq_lens_q`` / ``max_length_q`` (the flash-attention keyword arguments those collators return: passed to the
  model, they reach every attention call without any host work per layer), or
* ``position_ids`` that restart (a new document wherever the position does not grow by one), computed once per
  forward and reused by every layer and by the recomputation of activation checkpointing.

Kernels (:func:`set_kernel`): ``"varlen"`` is torch's ``torch.nn.attention.varlen.varlen_attn`` (the flash kernel
over all documents of the row in one launch; CUDA, fp16/bf16; grouped-query attention without repeating k/v; no
per-shape planning on the host, unlike cuDNN's sdpa). ``"sdpa"`` runs ``scaled_dot_product_attention`` once per
document (any device and dtype; on CPU the same computation as the model on each document alone). ``"auto"``
(default): ``varlen`` where it can run, else ``sdpa``.

``restrict_sdpa_backends``: limit the kernels torch's ``scaled_dot_product_attention`` may choose from.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["ATTENTION_NAME", "DocumentBoundaries", "register", "set_kernel", "kernel_for", "varlen_attention_forward",
           "boundaries_from_position_ids", "restrict_sdpa_backends"]

ATTENTION_NAME = "ds_odc_varlen"
Kernel = Literal["auto", "varlen", "sdpa"]
_KERNELS = ("auto", "varlen", "sdpa")
_kernel: Kernel = "auto"


@dataclass(frozen=True)
class DocumentBoundaries:
    """Where the documents of a flattened batch start: ``cu_seqlens`` (int32, on the device, first 0, last the token
    count), the longest document, and the lengths on the host when known (the ``sdpa`` kernel needs them)."""

    cu_seqlens: torch.Tensor
    max_length: int
    lengths: tuple[int, ...] | None = None

    def host_lengths(self) -> tuple[int, ...]:
        if self.lengths is not None:
            return self.lengths
        return _host_lengths(self.cu_seqlens)


# Host copies of boundary tensors, so that every layer (and checkpoint recomputation) of one forward reads the same
# tensor without another device-to-host copy. Keyed weakly: entries go when the batch does.
_host_cache: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
_position_cache: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def _host_lengths(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    hit = _host_cache.get(cu_seqlens)
    if hit is None or hit[0] != cu_seqlens._version:
        hit = (cu_seqlens._version, tuple(int(n) for n in torch.diff(cu_seqlens.cpu()).tolist()))
        _host_cache[cu_seqlens] = hit
    return hit[1]


def boundaries_from_position_ids(position_ids: torch.Tensor) -> DocumentBoundaries:
    """Document boundaries of a ``[B, T]`` batch flattened to ``B*T`` tokens: a document starts at every row start and
    wherever the position does not grow by one (transformers' rule for packed rows). One host copy per tensor."""
    hit = _position_cache.get(position_ids)
    if hit is not None and hit[0] == position_ids._version:
        return hit[1]
    pos = position_ids.detach().reshape(position_ids.shape[0], -1).cpu()
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    start_index = torch.nonzero(starts.reshape(-1)).reshape(-1)
    cu = torch.cat([start_index, torch.tensor([pos.numel()])]).to(torch.int32)
    lengths = tuple(int(n) for n in torch.diff(cu).tolist())
    found = DocumentBoundaries(cu.to(position_ids.device, non_blocking=True), max(lengths), lengths)
    _position_cache[position_ids] = (position_ids._version, found)
    return found


def _boundaries(query: torch.Tensor, kwargs: dict) -> DocumentBoundaries:
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        if kwargs.get("cu_seq_lens_k") is not None and kwargs["cu_seq_lens_k"] is not cu \
                and not torch.equal(kwargs["cu_seq_lens_k"], cu):
            raise ValueError("ds_odc_varlen: cu_seq_lens_k differs from cu_seq_lens_q; only self-attention over the "
                             "same documents is supported")
        cu = cu.reshape(-1).to(device=query.device, dtype=torch.int32)
        max_length = kwargs.get("max_length_q")
        if max_length is None:
            lengths = _host_lengths(cu)
            return DocumentBoundaries(cu, max(lengths), lengths)
        return DocumentBoundaries(cu, int(max_length))
    position_ids = kwargs.get("position_ids")
    batch, _, tokens, _ = query.shape
    if position_ids is None:  # no packing information: every row is one document
        cu = torch.arange(0, (batch + 1) * tokens, tokens, dtype=torch.int32, device=query.device)
        return DocumentBoundaries(cu, tokens, (tokens,) * batch)
    if position_ids.shape[0] != batch:  # one row of positions for the whole batch (the model's default arange)
        position_ids = position_ids.expand(batch, -1)
    return boundaries_from_position_ids(position_ids)


def _varlen_kernel():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, False
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def kernel_for(query: torch.Tensor) -> str:
    """The kernel :func:`varlen_attention_forward` uses for this query under the current :func:`set_kernel` choice."""
    varlen_runs = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and _varlen_kernel()[0] is not None
    if _kernel == "varlen" and not varlen_runs:
        raise ValueError(f"ds_odc_varlen: the 'varlen' kernel needs torch.nn.attention.varlen (torch >= 2.10), a CUDA "
                         f"device and fp16/bf16; got {query.device} {query.dtype}. Use set_kernel('auto') or 'sdpa'.")
    if _kernel == "auto":
        return "varlen" if varlen_runs else "sdpa"
    return _kernel


def set_kernel(kernel: Kernel) -> None:
    """Choose the kernel of ``ds_odc_varlen`` for the process: ``"auto"``, ``"varlen"`` or ``"sdpa"``."""
    global _kernel
    if kernel not in _KERNELS:
        raise ValueError(f"ds_odc_varlen kernel {kernel!r}: choose one of {_KERNELS}")
    _kernel = kernel


def _per_document_sdpa(query, key, value, lengths, scaling, causal):
    """``query``: ``[1, H, T, D]``; k/v ``[1, KV, T, D]``; one sdpa per document, outputs concatenated along T."""
    gqa = query.shape[1] != key.shape[1]
    if len(lengths) == 1:
        return F.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scaling, enable_gqa=gqa)
    parts = [F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scaling, enable_gqa=gqa)
             for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2))]
    return torch.cat(parts, dim=2)


def _varlen(query, key, value, bounds: DocumentBoundaries, scaling, causal):
    """torch's varlen flash attention on ``[T, H, D]`` views of the ``[1, H, T, D]`` inputs."""
    varlen_attn, takes_gqa = _varlen_kernel()
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    extra = {"enable_gqa": True} if takes_gqa and q.shape[1] != k.shape[1] else {}
    # Older signatures have no enable_gqa: the flash kernel itself takes fewer k/v heads than q heads.
    return varlen_attn(q, k, v, bounds.cu_seqlens, bounds.cu_seqlens, bounds.max_length, bounds.max_length,
                       scale=scaling, window_size=(-1, 0) if causal else (-1, -1), **extra)


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """The transformers attention function ``ds_odc_varlen``: ``query`` ``[B, H, T, D]``, ``key``/``value``
    ``[B, KV, T, D]``; returns ``([B, T, H, D], None)``."""
    if attention_mask is not None:
        raise ValueError("ds_odc_varlen takes padding-free rows (documents concatenated, position ids restarting, no "
                         "padding): this batch has padding in its attention_mask. Collate with "
                         "ds_odc.balancer.collate.PackedCollator, transformers' DataCollatorWithFlattening or TRL's "
                         "padding_free=True, or use attn_implementation='sdpa' for padded batches.")
    if dropout or sliding_window is not None or softcap is not None or kwargs.get("s_aux") is not None:
        raise ValueError(f"ds_odc_varlen supports neither attention dropout, sliding windows, softcapping nor sink "
                         f"tokens (got dropout={dropout}, sliding_window={sliding_window}, softcap={softcap}); "
                         "use attn_implementation='sdpa' for this model")
    causal = getattr(module, "is_causal", True)
    bounds = _boundaries(query, kwargs)
    batch, heads, tokens, dim = query.shape
    if batch > 1:  # flatten the rows into one sequence of documents
        query, key, value = (x.transpose(0, 1).reshape(1, x.shape[1], batch * tokens, dim) for x in (query, key, value))
    if kernel_for(query) == "varlen":
        out = _varlen(query, key, value, bounds, scaling, causal)[None]  # [1, B*T, H, D]
    else:
        out = _per_document_sdpa(query, key, value, list(bounds.host_lengths()), scaling, causal).transpose(1, 2)
    return out.reshape(batch, tokens, heads, dim), None


def _mask_for_varlen(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                     attention_mask=None, **kwargs):
    """transformers' mask hook for ``ds_odc_varlen``: no mask to build; only a padding mask is passed on (as the
    flash-attention implementations do), so that a padded batch is refused instead of silently mixed."""
    from transformers.masking_utils import flash_attention_mask
    return flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask=attention_mask)


def register() -> str:
    """Register ``ds_odc_varlen`` with transformers' attention and mask interfaces (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(ATTENTION_NAME, varlen_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, _mask_for_varlen)
    return ATTENTION_NAME


_SDPA_SWITCHES = {"flash": "enable_flash_sdp", "efficient": "enable_mem_efficient_sdp", "cudnn": "enable_cudnn_sdp",
                  "math": "enable_math_sdp"}


def restrict_sdpa_backends(backends: str | None) -> None:
    """Let sdpa use only the comma-listed kernels (``flash``, ``efficient``, ``cudnn``, ``math``), process-wide.

    ``None`` or ``""`` leaves torch's choice alone. cuDNN builds a plan on the host for every new sequence length,
    which variable-length training pays at every layer call."""
    if not backends:
        return
    allowed = {b.strip() for b in backends.split(",") if b.strip()}
    unknown = allowed - _SDPA_SWITCHES.keys()
    if unknown:
        raise ValueError(f"sdpa backends: unknown {sorted(unknown)}; choose from {sorted(_SDPA_SWITCHES)}")
    for name, switch in _SDPA_SWITCHES.items():
        getattr(torch.backends.cuda, switch)(name in allowed)


try:  # registering needs transformers; the rest of this module does not
    register()
except ImportError:  # pragma: no cover - transformers not installed
    pass
