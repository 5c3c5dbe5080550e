"""Training a split sample: the ranks of its group run it together with Ulysses sequence parallelism.

``lb-mini-sp`` (:mod:`ds_odc.balancer.sp`) gives a sample that no single rank can take to a group of ``g`` ranks.
Each member trains one contiguous slice of its tokens; inside every attention layer DeepSpeed's
``UlyssesSPAttentionHF`` exchanges q, k and v over the group (all-to-all: sequence-sharded to head-sharded), attends
over the whole sequence with ``h / g`` heads, and exchanges the output back. Under ODC nothing else is collective:
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

Positions and labels: each slice keeps the global position ids of its tokens (Ulysses gathers them, so attention
sees the whole sample's documents), and the next-token labels are shifted over the *whole* sample before it is cut
(``shift_labels``), so the label of a slice's last token, the first token of the next slice, is not lost. A sample
is padded to a multiple of ``g`` tokens; the padding is a document of its own after the real tokens, with no labels,
so causal attention keeps it out of every real token's context and it adds no loss and no gradient. The loss weight
is that of any microbatch (``W / N``): the members' slice losses add up to the sample's loss sum.

A member that dies or never arrives makes the others fail within ``timeout_s`` (the groups' process-group timeout),
with an error naming the group and the members that did not arrive or did not finish, instead of hanging.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F

from ds_odc.training.attention import mask_for_varlen, varlen_attention_forward
from ds_odc.balancer.sp import SplitPolicy
from ds_odc.ops.transport import FenceTimeout, OdcError

__all__ = ["ATTENTION_NAME", "SequenceParallel", "SplitSlice", "SplitSampleError", "slice_sample", "slice_loss_sum",
           "register"]

ATTENTION_NAME = "ds_odc_sp"
IGNORE_INDEX = -100
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
        ranks: the group; ``member`` this rank's place in it (slice ``member`` of ``len(ranks)``).
        sample_tokens: tokens of the whole sample, before padding.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: torch.Tensor
    ranks: tuple[int, ...]
    member: int
    sample_tokens: int

    @property
    def num_label_tokens(self) -> int:
        return int((self.shift_labels != IGNORE_INDEX).sum())


def slice_sample(sample: Mapping[str, Any] | torch.Tensor, ranks: Sequence[int], member: int, *,
                 pad_token_id: int = 0) -> SplitSlice:
    """Slice ``member`` of a sample split over ``ranks``: a dict with ``input_ids`` and optional ``labels`` and
    ``position_ids`` (a packed row of several documents keeps its restarting positions), or a tensor of token ids.
    Labels, like ``PackedCollator``'s, are aligned with the inputs and shifted here, over the whole sample."""
    fields = {"input_ids": sample} if isinstance(sample, torch.Tensor) else sample
    ids = torch.as_tensor(fields["input_ids"], dtype=torch.long).reshape(-1)
    n, g = ids.numel(), len(ranks)
    if n == 0:
        raise ValueError("slice_sample: the sample has no tokens")
    if not 0 <= member < g:
        raise ValueError(f"slice_sample: member {member} of a group of {g}")
    labels = fields.get("labels")
    labels = ids if labels is None else torch.as_tensor(labels, dtype=torch.long).reshape(-1).to(ids.device)
    positions = fields.get("position_ids")
    positions = (torch.arange(n, device=ids.device) if positions is None
                 else torch.as_tensor(positions, dtype=torch.long).reshape(-1).to(ids.device))
    if labels.numel() != n or positions.numel() != n:
        raise ValueError(f"slice_sample: input_ids has {n} tokens, labels {labels.numel()}, position_ids "
                         f"{positions.numel()}")
    shift = F.pad(labels[1:], (0, 1), value=IGNORE_INDEX)
    size = -(-n // g)
    pad = size * g - n
    if pad:  # a document of its own after the real tokens: positions restart, no labels
        ids = torch.cat([ids, ids.new_full((pad,), pad_token_id)])
        positions = torch.cat([positions, torch.arange(pad, device=ids.device)])
        shift = torch.cat([shift, shift.new_full((pad,), IGNORE_INDEX)])
    part = slice(member * size, (member + 1) * size)
    return SplitSlice(ids[part][None], positions[part][None], shift[part][None], tuple(int(r) for r in ranks),
                      member, n)


def slice_loss_sum(logits: torch.Tensor, piece: SplitSlice) -> torch.Tensor:
    """Sum of next-token cross-entropy over this slice's labels (fp32). Multiply by
    ``ds_odc.global_mean_weight(num_label_tokens, world_size)`` as for any microbatch."""
    labels = piece.shift_labels.to(logits.device).reshape(-1)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels, ignore_index=IGNORE_INDEX,
                           reduction="sum")


class _Active:
    """The split sample being trained on this rank: its group, and one Ulysses attention per head layout."""

    def __init__(self, group, ranks: tuple[int, ...]):
        self.group = group
        self.ranks = ranks
        self.ulysses: dict[tuple, Any] = {}
        self.calls = 0  # attention layers run over the group: none means the model does not use ds_odc_sp

    def attention(self, module, query: torch.Tensor, key: torch.Tensor):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        batch, heads, _, head_dim = query.shape
        kv_heads = key.shape[1]
        layout = (batch, heads, kv_heads, head_dim)
        found = self.ulysses.get(layout)
        if found is None:
            config = getattr(module, "config", None)
            found = self.ulysses[layout] = UlyssesSPAttentionHF(
                attn=varlen_attention_forward, batch_size=batch, attn_head_count=heads, attn_head_size=head_dim,
                kv_head_count=kv_heads, num_hidden_layers=int(getattr(config, "num_hidden_layers", 1) or 1),
                process_group=self.group, seq_length_is_variable=True)
        return found


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
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(ATTENTION_NAME, sp_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, mask_for_varlen)
    return ATTENTION_NAME


class SequenceParallel:
    """The process groups of every group a ``lb-mini-sp`` plan may use, and the switch that trains a split sample.

    Construct it on every rank, with the same policy, after ``torch.distributed`` is initialised (e.g. by
    ``ds_odc.training.distributed.init_distributed``). Each rank creates the groups it belongs to, one per allowed size (the
    aligned block of ``g`` ranks around it), with ``timeout_s`` as their timeout; they are reused for every split
    sample. ``timeout_s``: use ``zero_optimization.odc.timeout_s`` (``odc_config_from_ds_config(ds_config)``).
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
        for g in self.sizes:  # nested aligned blocks: every member creates them in the same order
            first = self.rank // g * g
            ranks = tuple(range(first, first + g))
            self._groups[ranks] = dist.new_group(list(ranks), timeout=timedelta(seconds=self.timeout_s),
                                                 backend=backend, use_local_synchronization=True)
        # A store every rank reaches, where members post their arrival at (and completion of) each split sample, so
        # that a failed group can name who is missing (gloo's own errors name no rank).
        self._store = Meeting(None, self.timeout_s).store
        self._runs: dict[tuple[int, ...], int] = {}

    def group(self, ranks: Sequence[int]):
        """The process group of ``ranks`` (an aligned block of an allowed size that contains this rank)."""
        key = tuple(int(r) for r in ranks)
        found = self._groups.get(key)
        if found is None:
            why = ("this rank is not one of them" if self.rank not in key else
                   f"groups are aligned blocks of {list(self.sizes)} ranks (SplitPolicy.group_sizes)")
            raise ValueError(f"ds_odc: rank {self.rank} has no sequence-parallel group {list(key)}: {why}. Plan with "
                             "the same SplitPolicy as this SequenceParallel")
        return found

    def slice(self, sample: Mapping[str, Any] | torch.Tensor, ranks: Sequence[int], *, pad_token_id: int = 0,
              device: torch.device | str | None = None) -> SplitSlice:
        """This rank's slice of ``sample`` split over ``ranks`` (see :func:`slice_sample`), on ``device``."""
        self.group(ranks)  # refuse a group this rank cannot run before any work
        piece = slice_sample(sample, ranks, list(ranks).index(self.rank), pad_token_id=pad_token_id)
        if device is None:
            return piece
        return SplitSlice(piece.input_ids.to(device), piece.position_ids.to(device), piece.shift_labels.to(device),
                          piece.ranks, piece.member, piece.sample_tokens)

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
        group = self.group(ranks)
        count = self._runs.get(ranks, 0) + 1
        self._runs[ranks] = count
        self._post(ranks, count, "arrived")
        active = _active = _Active(group, ranks)
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
                             f"with attn_implementation=\"{ATTENTION_NAME}\" (import ds_odc.training.sequence_parallel first) "
                             "and run its forward inside run()")
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
