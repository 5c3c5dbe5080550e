"""Attention over padding-free rows: each document attends only to itself, at the cost of its own length.

``import ds_odc.training.attention`` registers ``attn_implementation="ds_odc_varlen"`` with transformers. A row packs
several documents (``PackedCollator``, transformers' ``DataCollatorWithFlattening``, TRL's ``padding_free=True``);
their boundaries come, in this order of preference, from

* ``cu_seq_lens_q`` / ``max_length_q`` (the flash-attention keyword arguments those collators return: passed to the
  model, they reach every attention call without any host work per layer), or
* ``position_ids`` that restart (a new document wherever the position does not grow by one), computed once per
  forward and reused by every layer and by the recomputation of activation checkpointing.

Kernels, chosen per model (:func:`use_kernel`): ``"varlen"`` is torch's ``torch.nn.attention.varlen.varlen_attn``
(the flash kernel over all documents of the row in one launch; CUDA, fp16/bf16; grouped-query attention without
repeating k/v; no per-shape planning on the host, unlike cuDNN's sdpa). ``"sdpa"`` runs
``scaled_dot_product_attention`` once per document (any device and dtype; on CPU the same computation as the model
on each document alone). ``"bucketed"`` runs each long document (``long_document`` tokens or more) through sdpa
padded at its end to one of a few bucket lengths (at most 12.5% longer; exact under the causal mask, since no real
token attends to a later one), so that a kernel that plans per shape (cuDNN's, the fastest on Hopper for long
documents) plans once per bucket instead of once per length; the shorter documents between them go together through
``varlen`` (``sdpa`` per document where ``varlen`` cannot run). ``"auto"`` (default): ``bucketed`` on a GPU where
``varlen`` runs, else ``sdpa``.

:func:`limit_sdpa_backends`: the kernels torch's ``scaled_dot_product_attention`` may choose from inside one model's
attention layers (any attention implementation), leaving the rest of the process alone.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["use_kernel", "varlen_attention_forward", "plan_buckets", "limit_sdpa_backends"]

ATTENTION_NAME = "ds_odc_varlen"
Kernel = Literal["auto", "varlen", "sdpa", "bucketed"]
_KERNELS = ("auto", "varlen", "sdpa", "bucketed")
LONG_DOCUMENT = 6144  # tokens; where cuDNN's sdpa per document overtook varlen on an H200 (benchmarks/attention.py)
_CHOICE = "ds_odc_attention_kernel"  # the attribute use_kernel() sets on a model's modules


@dataclass(frozen=True)
class DocumentBoundaries:
    """Where the documents of a flattened batch start: ``cu_seqlens`` (int32, on the device, first 0, last the token
    count), the longest document, and the lengths on the host when known (the ``sdpa`` kernel needs them)."""

    cu_seqlens: torch.Tensor
    max_length: int
    lengths: tuple[int, ...] | None = None
    given: torch.Tensor | None = None  # the caller's boundary tensor, which every layer of one forward passes again

    def host_lengths(self) -> tuple[int, ...]:
        if self.lengths is not None:
            return self.lengths
        return _host_lengths(self.cu_seqlens if self.given is None else self.given)


# Host copies of boundary tensors, so that every layer (and checkpoint recomputation) of one forward reads the same
# tensor without another device-to-host copy. Keyed weakly: entries go when the batch does.
_host_cache: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
_position_cache: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def _host_lengths(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    hit = _host_cache.get(cu_seqlens)
    if hit is None or hit[0] != cu_seqlens._version:
        hit = (cu_seqlens._version, tuple(int(n) for n in torch.diff(cu_seqlens.reshape(-1).cpu()).tolist()))
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


def remember_host_boundaries(host: Mapping[str, Any], moved: Mapping[str, Any]) -> None:
    """After a batch was copied to the device (``moved``, from ``host``): note the document lengths its boundary
    tensors hold, so that no layer waits on a device-to-host copy (which would drain the queue at every forward)."""
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        src, dst = host.get(name), moved.get(name)
        if torch.is_tensor(src) and torch.is_tensor(dst) and dst is not src and not src.is_cuda:
            _host_cache[dst] = (dst._version, _host_lengths(src))
    if moved.get("cu_seq_lens_q") is not None:
        return  # every layer takes the documents from cu_seq_lens_q: boundaries from positions would go unread
    src, dst = host.get("position_ids"), moved.get("position_ids")
    if torch.is_tensor(src) and torch.is_tensor(dst) and dst is not src and not src.is_cuda and src.dim() == 2:
        found = boundaries_from_position_ids(src)
        cu = found.cu_seqlens.pin_memory() if dst.is_cuda else found.cu_seqlens
        _position_cache[dst] = (dst._version, DocumentBoundaries(cu.to(dst.device, non_blocking=True),
                                                                 found.max_length, found.lengths))


def _boundaries(query: torch.Tensor, kwargs: dict) -> DocumentBoundaries:
    given = kwargs.get("cu_seq_lens_q")
    if given is not None:
        if kwargs.get("cu_seq_lens_k") is not None and kwargs["cu_seq_lens_k"] is not given \
                and not torch.equal(kwargs["cu_seq_lens_k"], given):
            raise ValueError("ds_odc_varlen: cu_seq_lens_k differs from cu_seq_lens_q; only self-attention over the "
                             "same documents is supported")
        cu = given.reshape(-1).to(device=query.device, dtype=torch.int32)
        max_length = kwargs.get("max_length_q")
        if max_length is None:  # keyed by the collator's tensor: one host copy per forward
            lengths = _host_lengths(given)
            return DocumentBoundaries(cu, max(lengths), lengths, given)
        return DocumentBoundaries(cu, int(max_length), given=given)
    position_ids = kwargs.get("position_ids")
    batch, _, tokens, _ = query.shape
    if position_ids is None:  # no packing information: every row is one document
        cu = torch.arange(0, (batch + 1) * tokens, tokens, dtype=torch.int32, device=query.device)
        return DocumentBoundaries(cu, tokens, (tokens,) * batch)
    if position_ids.shape[0] != batch:  # one row of positions for the whole batch (the model's default arange)
        position_ids = position_ids.expand(batch, -1)
    return boundaries_from_position_ids(position_ids)


def _find_varlen_kernel():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, False
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


_VARLEN_KERNEL = _find_varlen_kernel()  # once per process: read at every layer call, and traced under compilation


def _varlen_kernel():
    return _VARLEN_KERNEL


def _varlen_runs(query: torch.Tensor) -> bool:
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and _varlen_kernel()[0] is not None


@dataclass(frozen=True)
class KernelChoice:
    """How ``ds_odc_varlen`` computes one model's attention: ``kernel`` (``"auto"``, ``"varlen"``, ``"sdpa"`` or
    ``"bucketed"``) and ``long_document``: from this length on, ``bucketed`` (and ``auto``) give a document its own
    padded sdpa call (``benchmarks/attention.py --sweep`` measures where sdpa overtakes ``varlen``)."""

    kernel: Kernel = "auto"
    long_document: int = LONG_DOCUMENT

    def __post_init__(self):
        if self.kernel not in _KERNELS:
            raise ValueError(f"ds_odc_varlen kernel {self.kernel!r}: choose one of {_KERNELS}")
        if self.long_document < 1:
            raise ValueError(f"ds_odc_varlen long_document={self.long_document}: give a length of 1 token or more")

    def resolve(self, query: torch.Tensor, causal: bool = True) -> str:
        """The kernel :func:`varlen_attention_forward` runs for this query under this choice."""
        if self.kernel == "varlen" and not _varlen_runs(query):
            raise ValueError(f"ds_odc_varlen: the 'varlen' kernel needs torch.nn.attention.varlen (torch >= 2.10), a "
                             f"CUDA device and fp16/bf16; got {query.device} {query.dtype}. Choose 'auto' or 'sdpa' "
                             "(use_kernel, --attention-kernel).")
        if self.kernel == "auto":
            return "bucketed" if causal and _varlen_runs(query) else "sdpa"
        if self.kernel == "bucketed" and not causal:  # padding is exact only when no real token sees the padding
            return "varlen" if _varlen_runs(query) else "sdpa"
        return self.kernel


_DEFAULT_CHOICE = KernelChoice()


def use_kernel(model: torch.nn.Module, kernel: Kernel = "auto", long_document: int = LONG_DOCUMENT) -> KernelChoice:
    """Choose how ``ds_odc_varlen`` computes ``model``'s attention (see :class:`KernelChoice`); other models in the
    process keep theirs. Recorded on every module of the model, since transformers hands the attention function the
    layer that calls it, whatever the architecture names it; a module never chosen for uses ``KernelChoice()``."""
    choice = KernelChoice(kernel, int(long_document))
    for module in model.modules():
        setattr(module, _CHOICE, choice)
    return choice


def kernel_choice(module: torch.nn.Module) -> KernelChoice:
    """The :class:`KernelChoice` ``ds_odc_varlen`` uses in ``module`` (a model, or one of its layers)."""
    return module.__dict__.get(_CHOICE, _DEFAULT_CHOICE)


def bucket_length(length: int) -> int:
    """``length`` rounded up to the next of 8 buckets per power of two (at most 12.5% longer, so attention costs at
    most ~27% more): 49 shapes cover 2k..128k tokens."""
    step = 1 << max(0, length.bit_length() - 4)
    return -(-length // step) * step


@dataclass(frozen=True)
class _Segment:
    """Tokens ``[start, end)`` of the row: one long document (``padded_to`` its bucket), or a run of short ones."""
    start: int
    end: int
    padded_to: int | None = None
    lengths: tuple[int, ...] = ()
    cu_seqlens: torch.Tensor | None = None  # of the run of short documents, when it goes through varlen


@functools.lru_cache(maxsize=64)  # one plan per row, reused by every layer and by checkpoint recomputation
def _bucketed_plan(lengths: tuple[int, ...], long_document: int, varlen_device: torch.device | None):
    segments, run, start = [], [], 0

    def close_run(end):
        if run:
            cu = None
            if varlen_device is not None:  # from pinned memory: no wait for the work already queued
                cu = torch.tensor([0, *itertools.accumulate(run)], dtype=torch.int32).pin_memory()
                cu = cu.to(varlen_device, non_blocking=True)
            segments.append(_Segment(end - sum(run), end, lengths=tuple(run), cu_seqlens=cu))
            run.clear()

    for n in lengths:
        if n >= long_document:
            close_run(start)
            segments.append(_Segment(start, start + n, padded_to=bucket_length(n)))
        else:
            run.append(n)
        start += n
    close_run(start)
    return tuple(segments)


def _bucketed(query, key, value, lengths, scaling, use_varlen: bool, long_document: int):
    """Causal attention only: ``[1, H, T, D]`` in, ``[T, H, D]`` out."""
    plan = _bucketed_plan(tuple(lengths), long_document, query.device if use_varlen else None)
    gqa = query.shape[1] != key.shape[1]
    parts = []
    for seg in plan:
        q, k, v = (x[:, :, seg.start:seg.end] for x in (query, key, value))
        if seg.padded_to is not None:
            pad = (0, 0, 0, seg.padded_to - (seg.end - seg.start))
            q, k, v = (F.pad(x, pad) if pad[3] else x.contiguous() for x in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
            parts.append(out[0, :, :seg.end - seg.start].transpose(0, 1))
        elif seg.cu_seqlens is not None:
            parts.append(_varlen(q, k, v, seg.cu_seqlens, max(seg.lengths), scaling, True))
        else:
            parts.append(_per_document_sdpa(q, k, v, list(seg.lengths), scaling, True)[0].transpose(0, 1))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _per_document_sdpa(query, key, value, lengths, scaling, causal):
    """``query``: ``[1, H, T, D]``; k/v ``[1, KV, T, D]``; one sdpa per document, outputs concatenated along T."""
    gqa = query.shape[1] != key.shape[1]
    if len(lengths) == 1:
        return F.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scaling, enable_gqa=gqa)
    parts = [F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scaling, enable_gqa=gqa)
             for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2))]
    return torch.cat(parts, dim=2)


def _varlen(query, key, value, cu_seqlens: torch.Tensor, max_length: int, scaling, causal):
    """torch's varlen flash attention on ``[T, H, D]`` views of the ``[1, H, T, D]`` inputs."""
    varlen_attn, takes_gqa = _varlen_kernel()
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    extra = {"enable_gqa": True} if takes_gqa and q.shape[1] != k.shape[1] else {}
    # Older signatures have no enable_gqa: the flash kernel itself takes fewer k/v heads than q heads.
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_length, max_length,
                       scale=scaling, window_size=(-1, 0) if causal else (-1, -1), **extra)


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """The transformers attention function ``ds_odc_varlen``: ``query`` ``[B, H, T, D]``, ``key``/``value``
    ``[B, KV, T, D]``; returns ``([B, T, H, D], None)``.

    Under ``torch.compile`` (``ds_odc.training.compile``) the kernels that read document lengths on the host run
    outside the graph (a graph break: compiled code cannot read a device tensor's values on the host without a
    recompile per row); the ``varlen`` kernel chosen explicitly (``use_kernel(model, "varlen")``), with the
    boundaries given as ``cu_seq_lens_q`` and ``max_length_q``, stays in the graph."""
    if torch.compiler.is_compiling():
        if _varlen_in_graph(module, query, attention_mask, dropout, sliding_window, softcap, kwargs):
            cu_seqlens = kwargs["cu_seq_lens_q"].reshape(-1).to(torch.int32)
            batch, heads, tokens, dim = query.shape
            if batch > 1:
                query, key, value = (x.transpose(0, 1).reshape(1, x.shape[1], batch * tokens, dim)
                                     for x in (query, key, value))
            out = _varlen(query, key, value, cu_seqlens, kwargs["max_length_q"], scaling,
                          getattr(module, "is_causal", True))
            return out.reshape(batch, tokens, heads, dim).contiguous(), None
        return _attention_outside_graph(module, query, key, value, attention_mask, dropout, scaling, sliding_window,
                                        softcap, **kwargs)
    return _attention(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, **kwargs)


def _varlen_in_graph(module, query, attention_mask, dropout, sliding_window, softcap, kwargs) -> bool:
    """Whether a compiled graph can hold this attention call: the ``varlen`` kernel, chosen explicitly, on a device
    where it runs, with the boundaries as tensors and nothing that the eager path would refuse."""
    return (kernel_choice(module).kernel == "varlen" and _varlen_runs(query) and attention_mask is None
            and not dropout and sliding_window is None and softcap is None and kwargs.get("s_aux") is None
            and kwargs.get("cu_seq_lens_q") is not None and kwargs.get("max_length_q") is not None)
    # cu_seq_lens_k is taken to equal cu_seq_lens_q (self-attention; the collators return one tensor for both):
    # comparing them would read device values on the host, which the eager path does once per forward.


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
               softcap=None, **kwargs):
    if attention_mask is not None:
        raise ValueError("ds_odc_varlen takes padding-free rows (documents concatenated, position ids restarting, no "
                         "padding): this batch has padding in its attention_mask. Collate with "
                         "ds_odc.training.collate.PackedCollator, transformers' DataCollatorWithFlattening or TRL's "
                         "padding_free=True, or use attn_implementation='sdpa' for padded batches.")
    if dropout or sliding_window is not None or softcap is not None or kwargs.get("s_aux") is not None:
        raise ValueError(f"ds_odc_varlen supports neither attention dropout, sliding windows, softcapping nor sink "
                         f"tokens (got dropout={dropout}, sliding_window={sliding_window}, softcap={softcap}); "
                         "use attn_implementation='sdpa' for this model")
    causal = getattr(module, "is_causal", True)
    choice = kernel_choice(module)
    kernel = choice.resolve(query, causal)
    bounds = _boundaries(query, kwargs)
    varlen_runs = _varlen_runs(query)
    if kernel == "bucketed" and bounds.max_length < choice.long_document and varlen_runs:
        kernel = "varlen"  # no long document: one launch, and no need for the lengths on the host
    batch, heads, tokens, dim = query.shape
    if batch > 1:  # flatten the rows into one sequence of documents
        query, key, value = (x.transpose(0, 1).reshape(1, x.shape[1], batch * tokens, dim) for x in (query, key, value))
    if kernel == "varlen":
        out = _varlen(query, key, value, bounds.cu_seqlens, bounds.max_length, scaling, causal)  # [B*T, H, D]
    elif kernel == "bucketed":
        out = _bucketed(query, key, value, bounds.host_lengths(), scaling, varlen_runs, choice.long_document)
    else:
        out = _per_document_sdpa(query, key, value, list(bounds.host_lengths()), scaling, causal)[0].transpose(0, 1)
    return _one_layout(out).view(batch, tokens, heads, dim), None


def _one_layout(out: torch.Tensor) -> torch.Tensor:
    """``out`` (``[B*T, H, D]``) as a contiguous tensor of its own, whichever kernel made it: code compiled after the
    attention's graph break guards on the strides of what crossed it, and on the tensor it is a view of, and would
    compile again for every kernel's layout (a lone long document's padded call gives a strided view). Where a copy
    is made here, the caller's reshape to ``[B, T, H * D]`` would have made it."""
    if out.is_contiguous() and out._base is None:
        return out
    return out.clone(memory_format=torch.contiguous_format)


# Under compilation: the whole eager attention as one opaque call (its host reads and per-document loops would
# otherwise be traced, and recompiled for every new set of document lengths).
_attention_outside_graph = torch.compiler.disable(_attention)


def bucket_lengths(longest: int, shortest: int = LONG_DOCUMENT) -> list[int]:
    """Every bucket a document of ``shortest`` (a kernel choice's ``long_document``) to ``longest`` tokens can fall
    in."""
    n, found = bucket_length(shortest), []
    while n <= bucket_length(longest):
        found.append(n)
        n = bucket_length(n + 1)
    return found


def _attend_one_document(q, k, v, *, length, scaling, long_document):
    return _bucketed(*(x.transpose(1, 2) for x in (q, k, v)), (length,), scaling, True, long_document)[None]


def plan_buckets(model: torch.nn.Module, longest: int, device: torch.device, dtype: torch.dtype) -> tuple[int, float]:
    """Run attention of one layer of ``model`` (a transformers model) once per bucket up to ``longest`` tokens,
    forward and backward, as training will: cuDNN plans each shape now instead of during the first steps (tens of ms
    of host time per new shape, with the GPU waiting). Returns (shapes planned, seconds). A no-op where the model's
    kernel choice is not ``bucketed`` on this device.

    torch keeps cuDNN's attention plans per thread, and training runs attention on two: the forward on the caller's
    (with autograd, or without it under reentrant activation checkpointing), and the backward and the recomputed
    forward of activation checkpointing on autograd's device thread. Each shape is planned on both, in every variant."""
    config, choice = model.config, kernel_choice(model)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    probe = torch.empty(0, device=device, dtype=dtype)
    if choice.resolve(probe) != "bucketed" or not _varlen_runs(probe):
        return 0, 0.0
    started, buckets = time.perf_counter(), bucket_lengths(longest, choice.long_document)
    for n in buckets:
        length = max(n - 1, choice.long_document)  # padded to n, as nearly every document of this bucket is
        q, k, v = (torch.zeros(1, length, h, head_dim, device=device, dtype=dtype, requires_grad=True)
                   for h in (heads, kv_heads, kv_heads))
        attend = functools.partial(_attend_one_document, length=length, scaling=head_dim ** -0.5,
                                   long_document=choice.long_document)
        with torch.no_grad():
            attend(q, k, v)
        out = checkpoint(attend, q, k, v, use_reentrant=False)  # forward again, and backward, on autograd's thread
        out.backward(torch.ones_like(out))
    if buckets:
        torch.cuda.synchronize(device)
    return len(buckets), time.perf_counter() - started


def mask_for_varlen(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                    attention_mask=None, **kwargs):
    """transformers' mask hook for ``ds_odc_varlen``: no mask to build; only a padding mask is passed on (as the
    flash-attention implementations do), so that a padded batch is refused instead of silently mixed."""
    from transformers.masking_utils import flash_attention_mask
    return flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask=attention_mask)


def register(name: str = ATTENTION_NAME, forward=varlen_attention_forward) -> str:
    """Register ``forward`` (default: ``ds_odc_varlen``'s) under ``name`` with transformers' attention interface,
    with :func:`mask_for_varlen` as its mask (padding-free rows need none); idempotent; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, mask_for_varlen)
    return name


_SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                  "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def limit_sdpa_backends(model: torch.nn.Module, backends: str | None) -> None:
    """Let ``scaled_dot_product_attention`` use only the comma-listed kernels (``flash``, ``efficient``, ``cudnn``,
    ``math``) inside ``model``'s attention layers, whichever attention implementation they run; the rest of the
    process keeps torch's choice. ``None`` or ``""`` leaves the model alone. cuDNN builds a plan on the host for every
    new sequence length, which variable-length training pays at every layer call.

    Each attention layer (transformers names their classes ``<Model>Attention``) runs its forward inside
    ``torch.nn.attention.sdpa_kernel``, which sets and restores torch's backend flags: tens of microseconds of host
    time per call (90 us measured on a busy 2-core CPU host). The layer, not the transformer block: activation
    checkpointing recomputes the block's own forward during backward, which calls the attention layer again, so the
    recomputation picks the kernels the forward picked."""
    if not backends:
        return
    names = [b.strip() for b in backends.split(",") if b.strip()]
    unknown = sorted(set(names) - _SDPA_BACKENDS.keys())
    if unknown or not names:
        raise ValueError(f"sdpa backends {backends!r}: unknown {unknown}; give a comma list of "
                         f"{', '.join(_SDPA_BACKENDS)}")
    allowed = [_SDPA_BACKENDS[n] for n in dict.fromkeys(names)]
    layers = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    if not layers:
        raise ValueError(f"limit_sdpa_backends: {type(model).__name__} has no attention layers (modules whose class "
                         "name ends in 'Attention', as transformers names them), so there is nothing to limit; wrap "
                         "the model's calls in torch.nn.attention.sdpa_kernel yourself")
    for layer in layers:
        layer.forward = _within_sdpa_backends(layer.forward, allowed)


def _within_sdpa_backends(forward, allowed: list[SDPBackend]):
    @functools.wraps(forward)
    def limited(*args, **kwargs):
        with sdpa_kernel(allowed):
            return forward(*args, **kwargs)
    return limited


try:  # registering needs transformers; the rest of this module does not
    register()
except ImportError:  # pragma: no cover - transformers not installed
    pass
