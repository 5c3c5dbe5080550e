"""Loss weighting for a different number of microbatches (or samples) on every rank.

ZeRO averages gradients over the W data-parallel ranks, and DeepSpeed's ``engine.backward`` divides by the configured
``gradient_accumulation_steps``. When ranks run different numbers of microbatches neither is the right normaliser.
The right one is the global count N of what the loss averages over (tokens, or samples) in the whole minibatch,
which every rank knows from the plan (``ds_odc.balancer.Plan.num_tokens``) without communication:

    loss_for_backward = (sum of per-token losses in this microbatch) * W / N
    engine.backward(loss_for_backward, scale_wrt_gas=False)

Summed over all microbatches of all ranks and divided by W (ZeRO's averaging), the gradient is exactly that of the
global mean loss over the minibatch, however its samples are spread over ranks and microbatches.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F


def global_mean_weight(global_count: int, world_size: int) -> float:
    """The factor that turns a microbatch's loss *sum* into its share of the global mean (see module docstring)."""
    if global_count <= 0:
        raise ValueError(f"ds_odc: the minibatch has {global_count} loss tokens/samples; a global mean over nothing "
                         "is undefined. Skip this minibatch (every rank must skip it) or check the data.")
    return world_size / global_count


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Sum of next-token cross-entropy over the label tokens of a causal-LM batch (labels shifted like HF does)."""
    shift_logits = logits[..., :-1, :].contiguous().float()
    shift_labels = labels[..., 1:].contiguous()
    return F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1),
                           ignore_index=ignore_index, reduction="sum")


def count_loss_tokens(batch: Mapping[str, Any] | torch.Tensor, *, shifted: bool = True,
                      ignore_index: int = -100) -> int:
    """Number of label tokens that enter a causal-LM loss, for one batch (a dict of model inputs) or a labels tensor.

    ``shift_labels`` in the batch are already aligned with the logits and counted as they are; ``labels`` are counted
    after the causal shift (``labels[..., 1:]``) unless ``shifted=False`` (a model whose loss does not shift). A batch
    without labels has 0."""
    if isinstance(batch, torch.Tensor):
        labels = batch
    elif "shift_labels" in batch:
        return int((batch["shift_labels"] != ignore_index).sum())
    else:
        labels = batch.get("labels")
        if labels is None:
            return 0
    return int(((labels[..., 1:] if shifted else labels) != ignore_index).sum())
