"""A rollout batch re-planned across ranks: who trains which completion, and the one exchange that moves them.

After generation every rank holds the completions it generated (its *generation batch*: ``rows`` samples, in
*slots* of ``B`` rows, one slot per accumulation step of the stock trainer). LB-Mini then spreads each optimizer
step's samples (``gas`` slots of every rank) over the ranks by cost, so each rank trains a share of about equal
work with its own number of microbatches: packed rows of at most ``max_tokens`` tokens (padding-free), or padded
microbatches of at most ``max_tokens`` rows x padded width. Lengths are gathered once per generation batch; every
rank computes every plan from them (no communication), and one ``all_to_all_single`` moves each sample's tensors
(tokens, masks, advantages, old/reference log-probs) to the rank that trains it, for all the optimizer steps of the
batch at once.

Per-sample tensors travel as float64 (exact for token ids below 2**53 and for fp32/bf16 values) and come back in
their own dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ds_odc.balancer.options import planning_cost
from ds_odc.balancer.planners import plan_minibatch

__all__: list[str] = []

PROMPT_IDS = "prompt_ids"
PROMPT_MASK = "prompt_mask"
COMPLETION_MASK = "completion_mask"
TOOL_MASK = "tool_mask"


@dataclass
class RolloutPlan:
    """The plan of one generation batch, identical on every rank.

    ``steps[j][r]``: the global sample ids rank ``r`` trains in optimizer step ``j`` of the batch, in microbatches.
    Global id of local row ``i`` of rank ``r``: ``r * rows + i``; its stock microbatch is ``(r, i // B)``, in the
    stock trainer's accumulation step (its *slot*) ``i // B`` of the generation batch.
    """

    world: int
    rows: int
    batch_rows: int  # B: rows of one stock microbatch
    prompt_len: np.ndarray
    completion_len: np.ndarray
    loss_tokens: np.ndarray
    steps: list[list[list[list[int]]]] = field(default_factory=list)

    def owner(self) -> np.ndarray:
        """Rank that trains each global sample (any step)."""
        out = np.full(self.world * self.rows, -1, dtype=np.int64)
        for step in self.steps:
            for rank, microbatches in enumerate(step):
                for mb in microbatches:
                    out[mb] = rank
        return out

    def stock_microbatch(self, g: int) -> tuple[int, int]:
        """(rank that generated sample ``g``, slot): the stock trainer trains ``g`` on that rank in its accumulation
        step (its *slot*) ``i // B`` of the generation batch, ``i`` being ``g``'s row there."""
        return g // self.rows, (g % self.rows) // self.batch_rows

    def stock_microbatch_loss_tokens(self, g: int) -> int:
        """Loss tokens of the stock microbatch that sample ``g`` belongs to."""
        start = (g // self.batch_rows) * self.batch_rows
        return int(self.loss_tokens[start:start + self.batch_rows].sum())

    def load(self, microbatches: list[list[int]]) -> tuple[int, float]:
        """(tokens, sum of squared sample lengths) of these microbatches, unpadded: what the cost model plans with."""
        ids = np.asarray([g for mb in microbatches for g in mb], dtype=np.int64)
        total = (self.prompt_len[ids] + self.completion_len[ids]).astype(np.float64)
        return int(total.sum()), float((total * total).sum())


@dataclass
class Sample:
    """One completion on the rank that trains it: its tensors, unpadded (prompt ``p`` tokens, completion ``c``)."""

    gid: int
    prompt_ids: torch.Tensor
    completion: dict[str, torch.Tensor]  # completion-aligned fields, each of length c
    per_sample: dict[str, torch.Tensor]  # one value (or row) per sample


def _lengths(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    prompt_len = batch[PROMPT_MASK].sum(1)
    mask = batch[COMPLETION_MASK]
    present = torch.arange(1, mask.shape[1] + 1, device=mask.device) * (mask != 0)
    completion_len = present.max(1).values  # trailing padding dropped; interior zeros (masked tokens) kept
    loss_mask = mask if TOOL_MASK not in batch else mask * batch[TOOL_MASK]
    return prompt_len, completion_len, loss_mask.sum(1)


def pack_padded(ids: list[int], prompt_len: np.ndarray, completion_len: np.ndarray,
                max_tokens: int) -> list[list[int]]:
    """Microbatches of padded rows with ``rows x (max prompt + max completion) <= max_tokens``: samples longest
    first, each microbatch filled while the padded size fits (a sample larger than the budget gets its own)."""
    order = sorted(ids, key=lambda g: (-(int(prompt_len[g]) + int(completion_len[g])), g))
    out: list[list[int]] = []
    current: list[int] = []
    width_p = width_c = 0
    for g in order:
        p, c = int(prompt_len[g]), int(completion_len[g])
        wp, wc = max(width_p, p), max(width_c, c)
        if current and (len(current) + 1) * (wp + wc) > max_tokens:
            out.append(current)
            current, wp, wc = [], p, c
        current.append(g)
        width_p, width_c = wp, wc
    if current:
        out.append(current)
    return out


def plan_rollout(batch: dict, *, world: int, batch_rows: int, gas: int, planner: str, cost,
                 max_tokens: int | None, packed: bool, group=None) -> RolloutPlan:
    """Gather every sample's lengths (one all-gather) and plan every optimizer step of the generation batch.

    ``packed``: microbatches are padding-free rows of at most ``max_tokens`` tokens (LB-Mini packs them, counting
    the cost model's per-microbatch cost); otherwise LB-Mini shares the samples out and each rank packs its share
    into padded microbatches of at most ``max_tokens`` rows x padded width (:func:`pack_padded`). ``max_tokens``
    ``None``: the size of the largest microbatch the stock trainer runs on this batch, rows x padded width. A sample
    larger than the budget gets a microbatch of its own. ``cost``: as :func:`~ds_odc.balancer.options.choose_cost`
    chose it; an ``AutoCost`` plans with its latest fit."""
    cost = planning_cost(cost)
    rows = batch[PROMPT_IDS].shape[0]
    if rows % (batch_rows * gas):
        raise ValueError(f"ds_odc: the generation batch has {rows} rows per rank, not a whole number of optimizer "
                         f"steps of {gas} x {batch_rows}")
    local = torch.stack(_lengths(batch), dim=1).to(torch.int64)
    every = torch.empty((world * rows, 3), dtype=torch.int64, device=local.device)
    dist.all_gather_into_tensor(every, local.contiguous(), group=group)
    every = every.cpu().numpy()
    plan = RolloutPlan(world, rows, batch_rows, every[:, 0], every[:, 1], every[:, 2])
    total = plan.prompt_len + plan.completion_len
    if max_tokens is None:
        max_tokens = stock_microbatch_size(plan)
    step_rows = batch_rows * gas
    for j in range(rows // step_rows):
        ids = [r * rows + i for r in range(world) for i in range(j * step_rows, (j + 1) * step_rows)]
        if packed:
            budget = max(int(max_tokens), int(total[ids].max()))
            shares = plan_minibatch(total[ids].tolist(), world, planner=planner, cost=cost, max_tokens=budget)
            plan.steps.append([[[ids[k] for k in mb] for mb in shares.microbatches[r]] for r in range(world)])
        else:
            shares = plan_minibatch(total[ids].tolist(), world, planner=planner, cost=cost)
            plan.steps.append([pack_padded([ids[k] for k in shares.rank_samples(r)], plan.prompt_len,
                                           plan.completion_len, max_tokens) for r in range(world)])
    return plan


def stock_microbatch_size(plan: RolloutPlan) -> int:
    """Rows x padded width of the largest microbatch the stock trainer runs on the plan's generation batch (it pads
    each rank's whole generation batch to one width, its longest prompt plus its longest completion)."""
    widths = [int(plan.prompt_len[r * plan.rows:(r + 1) * plan.rows].max()
                  + plan.completion_len[r * plan.rows:(r + 1) * plan.rows].max()) for r in range(plan.world)]
    return plan.batch_rows * max(widths)


def _is_completion_field(key: str) -> bool:
    return key in ("completion_ids", COMPLETION_MASK, TOOL_MASK) or key.endswith("per_token_logps")


def _schema(batch: dict, skip: set[str]) -> tuple[list[str], list[str]]:
    """Field names by kind: completion-aligned (2-D, width of the completions) and per-sample (1-D, or one column:
    a width-1 field is per-sample unless its name says it is per token, as when every completion has one token)."""
    width = batch[COMPLETION_MASK].shape[1]
    completion, per_sample = [], []
    for key, value in batch.items():
        if key in skip or not isinstance(value, torch.Tensor) or value.ndim == 0:
            continue
        if value.ndim == 2 and value.shape[1] == width and (width > 1 or _is_completion_field(key)):
            completion.append(key)
        elif value.ndim == 1 or (value.ndim == 2 and value.shape[1] == 1):
            per_sample.append(key)
        else:
            raise ValueError(f"ds_odc: cannot move the rollout field {key!r} of shape {tuple(value.shape)} between "
                             "ranks (multimodal inputs are not supported with ODC yet)")
    return sorted(completion), sorted(per_sample)


def exchange(batch: dict, plan: RolloutPlan, rank: int, group=None) -> dict[int, Sample]:
    """Send each local sample to the rank that trains it; returns this rank's samples by global id."""
    completion_keys, per_sample_keys = _schema(batch, {PROMPT_IDS, PROMPT_MASK})
    per_width = {k: (1 if batch[k].ndim == 1 else batch[k].shape[1]) for k in per_sample_keys}
    dtypes = {k: batch[k].dtype for k in [PROMPT_IDS, *completion_keys, *per_sample_keys]}
    device = batch[PROMPT_IDS].device
    owner = plan.owner()
    width_p = batch[PROMPT_IDS].shape[1]

    def record_size(g: int) -> int:
        return int(plan.prompt_len[g] + len(completion_keys) * plan.completion_len[g] + sum(per_width.values()))

    first = rank * plan.rows
    send_order = sorted(range(first, first + plan.rows), key=lambda g: (owner[g], g))
    pieces = []
    for g in send_order:
        i, p, c = g - first, int(plan.prompt_len[g]), int(plan.completion_len[g])
        pieces.append(batch[PROMPT_IDS][i, width_p - p:])
        pieces += [batch[k][i, :c] for k in completion_keys]
        pieces += [batch[k][i].reshape(-1) for k in per_sample_keys]
    send = torch.cat([t.to(torch.float64) for t in pieces]) if pieces else torch.zeros(0, dtype=torch.float64,
                                                                                        device=device)
    send_sizes = [sum(record_size(g) for g in send_order if owner[g] == d) for d in range(plan.world)]
    mine = [g for g in range(plan.world * plan.rows) if owner[g] == rank]  # by source rank, then id: send order
    recv_sizes = [sum(record_size(g) for g in mine if g // plan.rows == s) for s in range(plan.world)]
    received = torch.empty(sum(recv_sizes), dtype=torch.float64, device=device)
    dist.all_to_all_single(received, send.to(device), output_split_sizes=recv_sizes, input_split_sizes=send_sizes,
                           group=group)
    out, at = {}, 0
    for g in mine:
        p, c = int(plan.prompt_len[g]), int(plan.completion_len[g])
        prompt = received[at:at + p].to(dtypes[PROMPT_IDS])
        at += p
        completion = {}
        for k in completion_keys:
            completion[k] = received[at:at + c].to(dtypes[k])
            at += c
        per_sample = {}
        for k in per_sample_keys:
            n = per_width[k]
            value = received[at:at + n].to(dtypes[k])
            per_sample[k] = value if batch[k].ndim == 2 else value.reshape(())
            at += n
        out[g] = Sample(g, prompt, completion, per_sample)
    return out


def _pad_to(n: int, multiple: int | None) -> int:
    return n if not multiple else -(-n // multiple) * multiple


def collate(samples: list[Sample], pad_token_id: int, pad_to_multiple_of: int | None = None) -> dict:
    """One padded microbatch in the stock trainer's layout: prompts left-padded, completions right-padded."""
    width_p = _pad_to(max(len(s.prompt_ids) for s in samples), pad_to_multiple_of)
    width_c = _pad_to(max(1, max(len(s.completion[COMPLETION_MASK]) for s in samples)), pad_to_multiple_of)
    n = len(samples)
    first = samples[0]
    device = first.prompt_ids.device
    prompt_ids = torch.full((n, width_p), pad_token_id, dtype=first.prompt_ids.dtype, device=device)
    prompt_mask = torch.zeros((n, width_p), dtype=torch.long, device=device)
    out = {PROMPT_IDS: prompt_ids, PROMPT_MASK: prompt_mask}
    for key, value in first.completion.items():
        fill = pad_token_id if key == "completion_ids" else 0
        out[key] = torch.full((n, width_c), fill, dtype=value.dtype, device=device)
    for row, sample in enumerate(samples):
        p = len(sample.prompt_ids)
        prompt_ids[row, width_p - p:] = sample.prompt_ids
        prompt_mask[row, width_p - p:] = 1
        for key, value in sample.completion.items():
            out[key][row, :len(value)] = value
    for key in first.per_sample:
        out[key] = torch.stack([s.per_sample[key] for s in samples])
    return out
