"""Training a split sample: the ranks of its group run it together with sequence parallelism.

``lb-mini-sp`` (:mod:`ds_odc.balancer.sp`) gives a sample that no single rank can take to a group of ``g = u * r``
ranks (any power of two), and each member trains its slice of the tokens. Inside every attention layer:

* the ``u`` *Ulysses* ranks (consecutive members; ``u`` as far as the model's heads allow) run DeepSpeed's
  ``UlyssesSPAttentionHF``: an all-to-all trades their sequence slices for heads, so each attends over the tokens of
  all ``u`` with ``h / u`` heads, and another brings the output back;
* with ``r > 1`` *ring* ranks (members ``u`` apart), the tokens of the ``u`` are only part of the sample: ring
  attention (:mod:`ds_odc.training.context_parallel`) gathers the keys and values of the whole sample over the
  ring and attends each query to every earlier key of its document; the sample is laid out head-and-tail over the
  ring so every member does the same causal work.

With ``r == 1`` each member holds one contiguous slice and the inner attention is ``ds_odc_varlen``. Under ODC nothing
else is collective:
the members fetch parameters and push gradients one-sidedly like any other microbatch, and their partial gradients
add up at the owners. Only the members of a group meet, for that sample only, while every other rank trains its own
microbatches.

``import ds_odc.training.sequence_parallel`` registers ``attn_implementation="ds_odc_sp"`` with transformers: the
``ds_odc_varlen`` attention (padding-free rows, one causal attention per document), run through Ulysses over the
group of the split sample being trained, if any. Build the model with it, then::

    sp = SequenceParallel(SplitPolicy.from_hf_config(model.config), timeout_s=odc_timeout_s)  # every rank
    for batch in sampler:                                  # planner="lb-mini-sp"
        weight = global_mean_weight(batch.num_label_tokens, world_size)
        for i, mb in enumerate(batch.microbatches):
            engine.set_gradient_accumulation_boundary(i == len(batch.microbatches) - 1)
            if mb[0] in batch.splits:                      # a split sample: this rank's slice of it
                piece = sp.slice(dataset[mb[0]], batch.splits[mb[0]])
                with sp.run(piece):                        # forward AND backward inside
                    logits = engine(input_ids=piece.input_ids, position_ids=piece.position_ids).logits
                    engine.backward(slice_loss_sum(logits, piece) * weight, scale_wrt_gas=False)
            else:
                ...                                        # as for any other microbatch
            engine.step()

Positions and labels: each slice keeps the global position ids of its tokens (rotary embeddings see the true
positions; the document boundaries come from them, computed once for the whole sample, :class:`SplitLayout`), and
the next-token labels are shifted over the *whole* sample before it is cut (``shift_labels``), so the label of a
slice's last token is not lost. A sample is padded to a multiple of ``g`` tokens (``2g`` with a ring); the padding
is a document of its own after the real tokens, with no labels, so causal attention keeps it out of every real
token's context and it adds no loss and no gradient. The loss weight is that of any microbatch (``W / N``): the
members' slice losses add up to the sample's loss sum.

Refused, by name: a model whose attention is not ``ds_odc_sp`` (each rank would attend within its own slice); a
group that is not an aligned block of an allowed size, or a plan made with another policy; with a ring, attention
dropout, sliding windows, softcapping, sink tokens and non-causal attention.

A member that dies or never arrives makes the others fail within ``timeout_s`` (the groups' process-group timeout),
with an error naming the group and the members that did not arrive or did not finish, instead of hanging.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F

from ds_odc.training.attention import register as register_attention
from ds_odc.training.attention import varlen_attention_forward
from ds_odc.training.loss import IGNORE_INDEX
from ds_odc.balancer.plan import SplitSample
from ds_odc.balancer.sp import SplitPolicy
from ds_odc.training.context_parallel import SplitLayout, ring_attention
from ds_odc.ops.transport import FenceTimeout, OdcError

__all__ = ["SequenceParallel", "SplitSlice", "SplitSampleError", "slice_loss_sum"]

ATTENTION_NAME = "ds_odc_sp"
_STORE_REPLY_S = 5.0


class SplitSampleError(FenceTimeout):
    """A split sample's group did not complete: a member did not arrive, died, or stalled (``missing_ranks``)."""

    def __init__(self, message: str, group: Sequence[int], missing_ranks: Sequence[int] = ()):
        super().__init__(message, missing_ranks)
        self.group = list(group)


@dataclass(frozen=True)
class SplitSlice:
    """One member's slice of a split sample (tensors ``[1, L / g]``, padded to equal slices).

    Attributes:
        input_ids, position_ids: this slice's tokens and their positions in the whole sample.
        shift_labels: the label of each position (the next token of the whole sample, ``-100`` where none).
        ranks: the group; ``member`` this rank's place in it.
        sample_tokens: tokens of the whole sample, before padding.
        layout: which tokens each member holds and where the sample's documents start (the group's shape,
            Ulysses x ring, included).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: torch.Tensor
    ranks: tuple[int, ...]
    member: int
    sample_tokens: int
    layout: SplitLayout

    @property
    def num_label_tokens(self) -> int:
        return int((self.shift_labels != IGNORE_INDEX).sum())

    def to(self, device: torch.device | str) -> "SplitSlice":
        """The same slice with its tensors on ``device``."""
        return dataclasses.replace(self, input_ids=self.input_ids.to(device),
                                   position_ids=self.position_ids.to(device),
                                   shift_labels=self.shift_labels.to(device))


def slice_sample(sample: Mapping[str, Any] | torch.Tensor, ranks: Sequence[int], member: int, *,
                 ulysses: int | None = None, pad_token_id: int = 0) -> SplitSlice:
    """Slice ``member`` of a sample split over ``ranks``: a dict with ``input_ids`` and optional ``labels`` and
    ``position_ids`` (a packed row of several documents keeps its restarting positions), or a tensor of token ids.
    ``ulysses``: how many members share heads (default: all, Ulysses alone); the rest is the ring
    (:class:`~ds_odc.training.context_parallel.SplitLayout`). Labels, like ``PackedCollator``'s, are aligned with
    the inputs and shifted here, over the whole sample."""
    fields = {"input_ids": sample} if isinstance(sample, torch.Tensor) else sample
    ids = torch.as_tensor(fields["input_ids"], dtype=torch.long).reshape(-1)
    n, g = ids.numel(), len(ranks)
    u = g if ulysses is None else int(ulysses)
    if n == 0:
        raise ValueError("slice_sample: the sample has no tokens")
    if not 0 <= member < g:
        raise ValueError(f"slice_sample: member {member} of a group of {g}")
    if u < 1 or g % u:
        raise ValueError(f"slice_sample: a group of {g} ranks cannot have Ulysses groups of {u}")
    labels = fields.get("labels")
    labels = ids if labels is None else torch.as_tensor(labels, dtype=torch.long).reshape(-1).to(ids.device)
    positions = fields.get("position_ids")
    positions = (torch.arange(n, device=ids.device) if positions is None
                 else torch.as_tensor(positions, dtype=torch.long).reshape(-1).to(ids.device))
    if labels.numel() != n or positions.numel() != n:
        raise ValueError(f"slice_sample: input_ids has {n} tokens, labels {labels.numel()}, position_ids "
                         f"{positions.numel()}")
    shift = F.pad(labels[1:], (0, 1), value=IGNORE_INDEX)
    padded = SplitLayout.padded_length(n, u, g // u)
    pad = padded - n
    starts = torch.ones(n, dtype=torch.bool)  # a document starts wherever the position does not grow by one
    starts[1:] = positions[1:].cpu() != positions[:-1].cpu() + 1
    bounds = torch.nonzero(starts).reshape(-1).tolist() + [n]
    documents = tuple(b - a for a, b in zip(bounds[:-1], bounds[1:])) + ((pad,) if pad else ())
    if pad:  # a document of its own after the real tokens: positions restart, no labels
        ids = torch.cat([ids, ids.new_full((pad,), pad_token_id)])
        positions = torch.cat([positions, torch.arange(pad, device=ids.device)])
        shift = torch.cat([shift, shift.new_full((pad,), IGNORE_INDEX)])
    layout = SplitLayout(documents, u, g // u)
    mine = layout.member_index(member, device=ids.device)
    return SplitSlice(ids[mine][None], positions[mine][None], shift[mine][None], tuple(int(r) for r in ranks),
                      member, n, layout)


def slice_loss_sum(logits: torch.Tensor, piece: SplitSlice) -> torch.Tensor:
    """Sum of next-token cross-entropy over this slice's labels (fp32). Multiply by
    ``ds_odc.global_mean_weight(num_label_tokens, world_size)`` as for any microbatch."""
    labels = piece.shift_labels.to(logits.device).reshape(-1)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels, ignore_index=IGNORE_INDEX,
                           reduction="sum")


class _Active:
    """The split sample being trained on this rank: its groups (Ulysses and ring), its layout, and one Ulysses
    attention per head layout."""

    def __init__(self, ranks: tuple[int, ...], layout: SplitLayout, member: int, ulysses_group, ring_group):
        self.ranks, self.layout = ranks, layout
        self.ring_rank = member // layout.ulysses
        self.ulysses_group, self.ring_group = ulysses_group, ring_group
        self.ulysses: dict[tuple, Any] = {}
        self.calls = 0  # attention layers run over the group: none means the model does not use ds_odc_sp

    def attention(self, module, query: torch.Tensor, key: torch.Tensor):
        """The attention function for this sample: Ulysses over its Ulysses group around the inner attention
        (``ds_odc_varlen`` over the whole sample, or with a ring, :func:`ring_attention` over it)."""
        inner = varlen_attention_forward if self.layout.ring == 1 else self._ring
        if self.layout.ulysses == 1:
            return inner
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        batch, heads, _, head_dim = query.shape
        kv_heads = key.shape[1]
        shape = (batch, heads, kv_heads, head_dim)
        found = self.ulysses.get(shape)
        if found is None:
            config = getattr(module, "config", None)
            found = self.ulysses[shape] = UlyssesSPAttentionHF(
                attn=inner, batch_size=batch, attn_head_count=heads, attn_head_size=head_dim,
                kv_head_count=kv_heads, num_hidden_layers=int(getattr(config, "num_hidden_layers", 1) or 1),
                process_group=self.ulysses_group, seq_length_is_variable=True)
        return found

    def _ring(self, module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              sliding_window: int | None = None, softcap: float | None = None, **kwargs):
        if dropout or sliding_window is not None or softcap is not None or kwargs.get("s_aux") is not None:
            raise ValueError(f"ds_odc_sp: ring attention supports neither attention dropout, sliding windows, "
                             f"softcapping nor sink tokens (got dropout={dropout}, sliding_window={sliding_window}, "
                             f"softcap={softcap}); this model cannot be split over more ranks than its heads allow")
        if not getattr(module, "is_causal", True):
            raise ValueError("ds_odc_sp: ring attention is causal only; this model's attention is not")
        out = ring_attention(query, key, value, self.layout, self.ring_rank, self.ring_group, scaling)
        return out, None


_active: _Active | None = None


def sp_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, **kwargs):
    """The transformers attention function ``ds_odc_sp``: ``ds_odc_varlen``, through Ulysses over the group of the
    split sample being trained (:meth:`SequenceParallel.run`), or directly when none is."""
    active = _active
    if active is None:
        return varlen_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None:
        raise ValueError("ds_odc_sp: a split sample is one padding-free row; it got an attention_mask")
    if any(kwargs.get(k) is not None for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")):
        raise ValueError("ds_odc_sp: pass a split sample's documents as position_ids only (SplitSlice.position_ids): "
                         "cu_seq_lens describe this rank's slice, not the sample the group attends over")
    if kwargs.get("position_ids") is None:
        raise ValueError("ds_odc_sp: a split sample needs position_ids (SplitSlice.position_ids) in the model call")
    active.calls += 1
    saved = getattr(module, "num_key_value_groups", None)
    try:  # Ulysses rewrites num_key_value_groups when it replicates KV heads; this module also runs unsplit rows
        return active.attention(module, query, key)(module, query, key, value, None, **kwargs)
    finally:
        if saved is not None:
            module.num_key_value_groups = saved


def register() -> str:
    """Register ``ds_odc_sp`` with transformers' attention and mask interfaces (idempotent); returns the name."""
    return register_attention(ATTENTION_NAME, sp_attention_forward)


def _subgroup_list(policy: SplitPolicy, world_size: int) -> list[tuple[int, ...]]:
    """Every sub-group any rank may need, in one global order, each once: per allowed group size ``g`` of shape
    ``u`` x ``r``, per aligned block, its ``r`` Ulysses groups (``u`` consecutive ranks) and its ``u`` ring groups
    (``r`` ranks ``u`` apart); a part of one rank needs no group."""
    seen: dict[tuple[int, ...], None] = {}
    for g in policy.group_sizes(world_size):
        u = policy.ulysses_size(g)
        for first in range(0, world_size // g * g, g):
            block = range(first, first + g)
            if u > 1:
                seen.update((tuple(block[j:j + u]), None) for j in range(0, g, u))
            if g // u > 1:
                seen.update((tuple(block[i::u]), None) for i in range(u))
    return list(seen)


class SequenceParallel:
    """The process groups of every group a split plan may use, and the switch that trains a split sample.

    Construct it on every rank, with the same policy the plans use, after ``torch.distributed`` is initialised
    (e.g. by ``ds_odc.training.distributed.init_distributed``). For every allowed group size ``g`` (aligned blocks
    of ``g`` ranks) of shape ``u`` x ``r`` (:meth:`SplitPolicy.ulysses_size`), each rank creates the sub-groups it
    belongs to: the ``u`` consecutive ranks that share heads, and the ``r`` ranks ``u`` apart that exchange keys and
    values; all with ``timeout_s`` as their timeout, reused for every split sample. ``timeout_s``: use
    ``zero_optimization.odc.timeout_s`` (``odc_config_from_ds_config(ds_config)``).
    """

    def __init__(self, policy: SplitPolicy | None = None, *, timeout_s: float = 300.0, backend: str | None = None):
        import torch.distributed as dist

        from ds_odc.ops.meeting import Meeting
        if not dist.is_initialized():
            raise RuntimeError("SequenceParallel: initialise torch.distributed first (ds_odc.training.distributed."
                               "init_distributed())")
        self.policy = policy or SplitPolicy()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout_s = float(timeout_s)
        self.sizes = self.policy.group_sizes(self.world_size)
        self._groups: dict[tuple[int, ...], Any] = {}
        # Every rank walks the same list of sub-groups in the same order and creates those it belongs to, so two
        # ranks that share several sub-groups create them in the same order (each creation waits for its members).
        for ranks in _subgroup_list(self.policy, self.world_size):
            if self.rank in ranks:
                self._groups[ranks] = dist.new_group(list(ranks), timeout=timedelta(seconds=self.timeout_s),
                                                     backend=backend, use_local_synchronization=True)
        # A store every rank reaches, where members post their arrival at (and completion of) each split sample, so
        # that a failed group can name who is missing (gloo's own errors name no rank).
        self._store = Meeting(None, self.timeout_s).store
        self._runs: dict[tuple[int, ...], int] = {}

    def shape(self, ranks: Sequence[int]) -> tuple[int, int]:
        """(Ulysses ranks, ring ranks) of the group ``ranks``, which must be an aligned block of an allowed size that
        contains this rank."""
        key = tuple(int(r) for r in ranks)
        g = len(key)
        aligned = g in self.sizes and key == tuple(range(key[0], key[0] + g)) and key[0] % g == 0
        if self.rank not in key or not aligned:
            why = ("this rank is not one of them" if self.rank not in key else
                   f"groups are aligned blocks of {list(self.sizes)} ranks (SplitPolicy.group_sizes)")
            raise ValueError(f"ds_odc: rank {self.rank} has no sequence-parallel group {list(key)}: {why}. Plan with "
                             "the same SplitPolicy as this SequenceParallel")
        u = self.policy.ulysses_size(g)
        return u, g // u

    def slice(self, sample: Mapping[str, Any] | torch.Tensor, split: "Sequence[int] | SplitSample", *,
              pad_token_id: int = 0, device: torch.device | str | None = None) -> SplitSlice:
        """This rank's slice of ``sample`` split over ``split`` (a plan's ``SplitSample``, or its ranks; see
        :func:`slice_sample`), on ``device``."""
        ranks = tuple(split.ranks if isinstance(split, SplitSample) else (int(r) for r in split))
        u, _ = self.shape(ranks)  # refuse a group this rank cannot run before any work
        if isinstance(split, SplitSample) and split.ulysses != u:
            raise ValueError(f"ds_odc: the plan splits sample {split.index} as {split.shape} (Ulysses x ring), but "
                             f"this SequenceParallel's policy gives a group of {split.size} the shape {u}x"
                             f"{split.size // u}. Plan with the same SplitPolicy as this SequenceParallel")
        piece = slice_sample(sample, ranks, ranks.index(self.rank), ulysses=u, pad_token_id=pad_token_id)
        return piece if device is None else piece.to(device)

    def _subgroups(self, piece: SplitSlice) -> tuple[Any, Any]:
        """The Ulysses and ring process groups (``None`` where that part has one rank) of ``piece``'s group."""
        u, r = self.shape(piece.ranks)
        if (u, r) != (piece.layout.ulysses, piece.layout.ring):
            raise ValueError(f"ds_odc: the slice was cut for a {piece.layout.ulysses}x{piece.layout.ring} group, but "
                             f"this SequenceParallel runs a group of {len(piece.ranks)} as {u}x{r}: slice it with "
                             "SequenceParallel.slice")
        j, i = divmod(piece.member, u)
        ulysses = self._groups[piece.ranks[j * u:(j + 1) * u]] if u > 1 else None
        ring = self._groups[piece.ranks[i::u]] if r > 1 else None
        return ulysses, ring


    @contextlib.contextmanager
    def run(self, piece: SplitSlice) -> Iterator[None]:
        """Train ``piece``: inside, attention of a ``ds_odc_sp`` model runs over the piece's group. Put the forward
        *and* the backward inside (the backward exchanges gradients over the group, and activation checkpointing
        recomputes attention there). Raises :class:`SplitSampleError` naming the members that did not arrive or
        finish when a collective of the group fails or times out (``timeout_s``)."""
        global _active
        if _active is not None:
            raise RuntimeError("ds_odc: SequenceParallel.run is already active on this rank (one split sample at a "
                               "time)")
        ranks = piece.ranks
        ulysses_group, ring_group = self._subgroups(piece)
        count = self._runs.get(ranks, 0) + 1
        self._runs[ranks] = count
        self._post(ranks, count, "arrived")
        active = _active = _Active(ranks, piece.layout, piece.member, ulysses_group, ring_group)
        try:
            yield
        except RuntimeError as err:
            if isinstance(err, OdcError):
                raise
            raise self._failure(ranks, count, err) from err
        finally:
            _active = None
        if active.calls == 0:
            raise ValueError(f"ds_odc: no attention layer ran over the group {list(ranks)} inside "
                             "SequenceParallel.run, so each rank attended over its own slice only. Build the model "
                             f"with attn_implementation=\"{ATTENTION_NAME}\" (import ds_odc.training.sequence_parallel "
                             "first) and run its forward inside run()")
        self._post(ranks, count, "done")

    # -- naming who is missing -------------------------------------------------------------------------------------
    def _key(self, ranks: tuple[int, ...], count: int, what: str, rank: int) -> str:
        return f"ds_odc/sp/{ranks[0]}-{ranks[-1]}/{count}/{what}/{rank}"

    def _post(self, ranks: tuple[int, ...], count: int, what: str) -> None:
        if self._store is not None:
            with contextlib.suppress(Exception):  # the store only improves error messages
                self._store.set(self._key(ranks, count, what, self.rank), "1")
                if count > 2:  # keys of older samples of this group are no longer needed
                    self._store.delete_key(self._key(ranks, count - 2, what, self.rank))

    def _posted(self, ranks: tuple[int, ...], count: int, what: str) -> list[int] | None:
        """Members (other than this rank) that have not posted ``what``; None if the store cannot tell."""
        if self._store is None:
            return None
        try:
            self._store.set_timeout(timedelta(seconds=_STORE_REPLY_S))
            return [r for r in ranks if r != self.rank and not self._store.check([self._key(ranks, count, what, r)])]
        except Exception:  # noqa: BLE001 - the store's host may be the rank that died
            return None

    def _failure(self, ranks: tuple[int, ...], count: int, err: Exception) -> SplitSampleError:
        absent = self._posted(ranks, count, "arrived")
        unfinished = self._posted(ranks, count, "done")
        if absent:
            who, missing = f"ranks {absent} did not arrive", absent
        elif unfinished:
            who, missing = f"ranks {unfinished} arrived but did not finish (died or stalled)", unfinished
        else:
            who, missing = "a member did not arrive or died", []
        backend = " ".join(str(err).split())[:300]
        return SplitSampleError(
            f"ds_odc: rank {self.rank}: the sequence-parallel group {list(ranks)} training a split sample failed: "
            f"{who}. A member that is not there within timeout_s={self.timeout_s:g} s fails its group; look at the "
            f"logs of those ranks, and if their work before this sample is legitimately longer, raise "
            f"zero_optimization.odc.timeout_s. (backend said: {backend})", ranks, missing)


try:  # registering needs transformers; the rest of this module does not
    register()
except ImportError:  # pragma: no cover - transformers not installed
    pass
