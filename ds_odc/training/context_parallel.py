"""Attention across more ranks than the heads allow: context parallelism for the ring part of a split sample.

A sample split over ``g = u * r`` ranks is ``u`` Ulysses ranks (DeepSpeed's ``UlyssesSPAttentionHF``: all-to-alls
that trade sequence for heads, as far as the model's heads allow) times ``r`` *ring* ranks that each hold part of
the sequence and must see every earlier key. This module is the ring part:

* **Layout** (:class:`SplitLayout`). The sample, padded, is cut into ``2r`` chunks; ring rank ``j`` holds chunks
  ``j`` and ``2r - 1 - j`` (head and tail), so every ring rank does the same share of causal attention; the ``u``
  Ulysses ranks of ring rank ``j`` hold consecutive slices of those tokens, which Ulysses' all-to-all joins back.
* **Exchange.** Every ring rank gathers the keys and values of the whole sample (an all-gather over the ring ranks;
  its backward sums the key and value gradients back to their owners with a reduce-scatter). Only ``k`` and ``v``
  move, for the Ulysses rank's own KV heads, which is cheap with grouped-query attention.
* **Attention.** Each local query chunk attends, document by document, to the keys from its document's start up to
  itself: ``scaled_dot_product_attention`` with a lower-right causal mask (``torch.nn.attention.bias``), which
  torch runs as a flash or memory-efficient kernel on a GPU and as masked attention on CPU. The loss and gradients
  are those of the unsplit sample up to floating-point order.

Why by hand: torch's context parallelism (``torch.distributed.tensor.experimental.context_parallel``) dispatches
only the CUDA flash, efficient and cuDNN attention ops, so it cannot run on CPU ranks over gloo (where the tests
run), it attends within one causal document per row (a split sample may pack several), and it shards through
DTensor over a device mesh of its own rather than inside an existing Ulysses group. DeepSpeed offers Ulysses
(used for the head part) and FPDT (CUDA flash-attention only), but no ring. What is written here is the all-gather,
the layout and the per-document masks; the kernels and the Ulysses exchange are torch's and DeepSpeed's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.attention.bias import causal_lower_right

__all__: list[str] = []


@dataclass(frozen=True)
class SplitLayout:
    """Which tokens of a (padded) split sample each member holds, and where its documents start.

    Attributes:
        documents: lengths of the sample's documents, in order, the padding (a document of its own) last; their
            sum is the padded length.
        ulysses, ring: the group's shape, ``ulysses`` x ``ring`` members (member ``m`` is Ulysses rank ``m %
            ulysses`` of ring rank ``m // ulysses``).
    """

    documents: tuple[int, ...]
    ulysses: int
    ring: int

    @staticmethod
    def padded_length(tokens: int, ulysses: int, ring: int) -> int:
        """The sample's length padded so every member holds as many tokens (and, with a ring, every chunk is a
        whole number of Ulysses slices)."""
        unit = ulysses * ring * (2 if ring > 1 else 1)
        return -(-tokens // unit) * unit

    @property
    def tokens(self) -> int:
        return sum(self.documents)

    @property
    def size(self) -> int:
        return self.ulysses * self.ring

    def ring_ranges(self, j: int) -> tuple[tuple[int, int], ...]:
        """The token ranges ring rank ``j`` holds, in its order: chunks ``j`` and ``2r - 1 - j`` (one range
        without a ring)."""
        if self.ring == 1:
            return ((0, self.tokens),)
        c = self.tokens // (2 * self.ring)
        tail = 2 * self.ring - 1 - j
        return ((j * c, (j + 1) * c), (tail * c, (tail + 1) * c))

    def member_ranges(self, member: int) -> tuple[tuple[int, int], ...]:
        """The token ranges member ``member`` holds: its Ulysses slice of its ring rank's tokens."""
        j, i = divmod(member, self.ulysses)
        per = self.tokens // self.size
        lo, hi = i * per, (i + 1) * per  # within the ring rank's tokens, in its order
        out, offset = [], 0
        for start, end in self.ring_ranges(j):
            a, b = max(lo, offset), min(hi, offset + end - start)
            if a < b:
                out.append((start + a - offset, start + b - offset))
            offset += end - start
        return tuple(out)

    def member_index(self, member: int, device=None) -> torch.Tensor:
        """Positions (into the padded sample) of member ``member``'s tokens, in its order."""
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.member_ranges(member)])


@functools.lru_cache(maxsize=256)
def _pieces(layout: SplitLayout, j: int) -> tuple[tuple[int, int, int, int], ...]:
    """The attention calls of ring rank ``j``: ``(first query, end of queries, first key, end of keys)``, queries
    local (into the ring rank's tokens), keys global: each query chunk, document by document, attends from the
    document's start up to itself."""
    starts = [0]
    for n in layout.documents:
        starts.append(starts[-1] + n)
    pieces, local = [], 0
    for qs, qe in layout.ring_ranges(j):
        for d0, d1 in zip(starts[:-1], starts[1:]):
            a, b = max(qs, d0), min(qe, d1)
            if a < b:
                pieces.append((local + a - qs, local + b - qs, d0, b))
        local += qe - qs
    return tuple(pieces)


class _GatherSequence(torch.autograd.Function):
    """All-gather along a new leading dimension; the backward reduce-scatters (sums) the gradients back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        n = dist.get_world_size(group)
        out = x.new_empty(n * x.numel())  # flat buffers: every backend takes them
        _all_gather(out, x.contiguous().reshape(-1), group)
        return out.view(n, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(grad[0].numel())
        _reduce_scatter(out, grad.contiguous().reshape(-1), ctx.group)
        return out.view(grad.shape[1:]), None


def _all_gather(out: torch.Tensor, x: torch.Tensor, group) -> None:
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)


def _reduce_scatter(out: torch.Tensor, x: torch.Tensor, group) -> None:
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x, group=group)


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Every ring rank's ``x``, stacked along a new first dimension (differentiable: the backward sends each rank
    the sum of the gradients of its ``x``)."""
    return _GatherSequence.apply(x, group)


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: SplitLayout, ring_rank: int,
                   group, scaling: float | None = None) -> torch.Tensor:
    """Causal attention of ring rank ``ring_rank``'s queries over the whole split sample.

    ``query`` ``[1, H, T, D]`` and ``key``/``value`` ``[1, KV, T, D]`` hold the ring rank's tokens
    (:meth:`SplitLayout.ring_ranges`, after Ulysses joined its slices); ``group`` is the ring's process group, in
    ring rank order. Returns ``[1, T, H, D]``."""
    if query.shape[0] != 1:
        raise ValueError(f"ds_odc: a split sample is one row; attention got a batch of {query.shape[0]}")
    r = layout.ring
    c = layout.tokens // (2 * r)
    keys, values = gather_sequence(key, group), gather_sequence(value, group)  # [r, 1, KV, 2c, D]

    def natural(x: torch.Tensor) -> torch.Tensor:  # chunks 0 .. 2r-1 of the whole sample, in order
        return torch.cat([x[t, :, :, :c] for t in range(r)] + [x[2 * r - 1 - t, :, :, c:] for t in range(r, 2 * r)],
                         dim=2)

    k_all, v_all = natural(keys), natural(values)
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads != kv_heads:  # grouped-query attention: each KV head serves heads / kv_heads query heads
        k_all, v_all = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k_all, v_all))
    parts = []
    for q0, q1, k0, k1 in _pieces(layout, ring_rank):
        mask = causal_lower_right(q1 - q0, k1 - k0)  # query i sees keys up to its own position
        parts.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, q0:q1], k_all[:, :, k0:k1], v_all[:, :, k0:k1], attn_mask=mask, scale=scaling))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return out.transpose(1, 2)
