"""Per-token log-probabilities of completions, from padding-free rows.

A GRPO loss needs, for every completion token, its log-probability under the policy (and under the old policy and
the reference model). Padded batches compute the whole ``rows x (longest prompt + longest completion)`` rectangle;
here each sample's prompt and completion go into one packed row, back to back, with position ids that restart at
every sample and the document boundaries (``cu_seq_lens_*``, as ``PackedCollator`` gives them) that the
``ds_odc_varlen`` attention reads, so every sample attends to itself only and costs its own length.

The row's labels are the completion tokens and nothing else. TRL's fused LM head (``fused_lm_head=True``) then
projects only the labelled positions, a few thousand at a time (on CUDA; elsewhere every position, still in chunks),
so the full ``tokens x vocab`` logits never exist, and returns their log-probabilities (and entropies), from which
:func:`score_completions` cuts each completion's own.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import torch

from ds_odc.training.attention import ATTENTION_NAME, remember_host_boundaries
from ds_odc.training.loss import IGNORE_INDEX

__all__: list[str] = []


@dataclass(frozen=True)
class PackedCompletions:
    """One packed row of samples: the model inputs, and where each completion's scores sit in the model's shifted
    outputs (position ``t`` of the outputs scores token ``t + 1``)."""

    inputs: dict
    starts: tuple[int, ...]
    lengths: tuple[int, ...]


def pack_completions(prompts: Sequence[torch.Tensor], completions: Sequence[torch.Tensor]) -> PackedCompletions:
    """``prompts[i]`` then ``completions[i]`` (1-D token tensors, no padding), for every sample, in one row."""
    if not prompts or len(prompts) != len(completions):
        raise ValueError(f"pack_completions: {len(prompts)} prompts for {len(completions)} completions")
    ids, positions, labels, starts, lengths, docs = [], [], [], [], [], []
    at = 0
    for prompt, completion in zip(prompts, completions):
        p, c = int(prompt.numel()), int(completion.numel())
        if p == 0:
            raise ValueError("ds_odc: a sample with an empty prompt cannot be scored in a packed row (its first "
                             "completion token has nothing to be predicted from); use padded microbatches")
        ids += [prompt, completion]
        positions.append(torch.arange(p + c, device=prompt.device))
        labels += [torch.full((p,), IGNORE_INDEX, dtype=completion.dtype, device=prompt.device), completion]
        starts.append(at + p - 1)
        lengths.append(c)
        docs.append(p + c)
        at += p + c
    host = torch.tensor([0, *docs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu = host.to(prompts[0].device)
    remember_host_boundaries({"cu_seq_lens_q": host}, {"cu_seq_lens_q": cu})  # no device-to-host copy per layer
    inputs = {
        "input_ids": torch.cat(ids).reshape(1, -1),
        "position_ids": torch.cat(positions).reshape(1, -1),
        "labels": torch.cat(labels).reshape(1, -1),
        "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(docs), "max_length_k": max(docs),
    }
    return PackedCompletions(inputs, tuple(starts), tuple(lengths))


def _config_of(model):
    module = getattr(model, "module", model)  # a DeepSpeedEngine holds the model as .module
    return getattr(module, "config", None)


@contextlib.contextmanager
def packed_attention(model):
    """Attention of ``model`` is ``ds_odc_varlen`` inside the block (the rows are packed) where it is ``sdpa`` or
    ``eager``, whose packed rows would need a dense mask; outside, what it was (generation runs the same model on
    padded batches). Flash attention reads the boundaries itself and is left alone. A forward whose backward recomputes
    layers (gradient checkpointing) must run its backward inside the block too, or the recomputation attends across
    documents."""
    config = _config_of(model)
    current = getattr(config, "_attn_implementation", None)
    if current not in ("sdpa", "eager"):
        yield
        return
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = current


def score_completions(model, row: PackedCompletions, compute_entropy: bool = False,
                      autocast=contextlib.nullcontext, router_loss: bool = False,
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, torch.Tensor | None]:
    """Each completion's per-token log-probabilities (and entropies) under ``model``, a causal LM with TRL's fused
    LM head, and with ``router_loss`` a MoE model's router auxiliary loss over the row's tokens (else ``None``); one
    forward of the packed row."""
    extra = {"output_router_logits": True} if router_loss else {}
    with packed_attention(model), autocast():
        outputs = model(**row.inputs, fused_lm_head=True, **extra)
    logps = outputs.log_probs.reshape(-1)
    entropy = outputs.entropy.reshape(-1) if compute_entropy else None
    cut = lambda x: [x[s:s + n] for s, n in zip(row.starts, row.lengths)]  # noqa: E731
    return cut(logps), (cut(entropy) if compute_entropy else None), (outputs.aux_loss if router_loss else None)
