"""Loss weighting for a different number of microbatches (or samples) on every rank.

ZeRO averages gradients over the W data-parallel ranks, and DeepSpeed's ``engine.backward`` divides by the configured
``gradient_accumulation_steps``. When ranks run different numbers of microbatches neither is the right normaliser.
The right one is the global count N of what the loss averages over (tokens, or samples) in the whole minibatch,
which every rank knows from the plan (``ds_odc.balancer.Plan.num_tokens``) without communication:

    loss_for_backward = (sum of per-token losses in this microbatch) * W / N
    engine.backward(loss_for_backward, scale_wrt_gas=False)

Summed over all microbatches of all ranks and divided by W (ZeRO's averaging), the gradient is exactly that of the
global mean loss over the minibatch, however its samples are spread over ranks and microbatches. With a Hugging Face
model the same weighting is ``model(..., labels=labels, num_items_in_batch=N / W).loss`` (the loss sum divided by
``num_items_in_batch``).

The loss without the logits: a 64k-token row times a 152k vocabulary is 40 GB of fp32 logits.
:func:`chunked_causal_lm_loss` applies the LM head to a few thousand positions at a time and recomputes each chunk's
logits in the backward (activation checkpointing of the chunk), so at most one chunk of logits exists at once; it
is one ordinary autograd graph, so FSDP2 and tied embeddings need nothing special, and ZeRO-3 only the head's weight
shared with the loss. :func:`use_chunked_loss` makes a Hugging Face causal LM compute its training loss that way.

[Note: the LM head under ZeRO-3]
The number of chunks follows the row's length, so it differs between ranks. Called as a module once per chunk, the
head would make stock ZeRO-3 all-gather its weight a different number of times on every rank (until DeepSpeed has
traced the model): a collective mismatch, which gloo reports and NCCL may hang on. So the chunked loss reads the
head's weight directly, as Liger's fused loss does, and :func:`share_head_with_loss` registers it as an external
parameter of the model itself (DeepSpeed's public ``register_external_parameter``): it is fetched with the model's
forward, and again as the model's backward begins, where the chunks are recomputed, the same number of times on
every rank (unregistered, DeepSpeed would register it itself at the first read inside a forward and gather it
there); its gradient is reduced (stock) or pushed (ODC) like any other. With tied embeddings it is the
embedding's weight, which the same registration covers. Without DeepSpeed (FSDP2, plain training) the registration
changes nothing.
"""

from __future__ import annotations

import types
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["global_mean_weight", "token_loss_sum", "count_loss_tokens", "use_chunked_loss", "share_head_with_loss"]

IGNORE_INDEX = -100  # the label of a position that adds no loss: cross_entropy's default, as transformers and TRL use
DEFAULT_CHUNK_TOKENS = 4096


def global_mean_weight(global_count: int, world_size: int) -> float:
    """The factor that turns a microbatch's loss *sum* into its share of the global mean (see module docstring)."""
    if global_count <= 0:
        raise ValueError(f"ds_odc: the minibatch has {global_count} loss tokens/samples; a global mean over nothing "
                         "is undefined. Skip this minibatch (every rank must skip it) or check the data.")
    return world_size / global_count


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Sum of next-token cross-entropy over the label tokens of a causal-LM batch (labels shifted like HF does)."""
    shift_logits = logits[..., :-1, :].contiguous().float()
    shift_labels = labels[..., 1:].contiguous()
    return F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1),
                           ignore_index=ignore_index, reduction="sum")


def count_loss_tokens(batch: Mapping[str, Any] | torch.Tensor, *, shifted: bool = True,
                      ignore_index: int = IGNORE_INDEX) -> int:
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


def chunked_causal_lm_loss(hidden_states: torch.Tensor, lm_head: torch.nn.Module, labels: torch.Tensor | None = None,
                           *, shift_labels: torch.Tensor | None = None, num_items_in_batch: Any = None,
                           ignore_index: int = IGNORE_INDEX, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> torch.Tensor:
    """transformers' causal-LM loss (``ForCausalLMLoss``) computed from the last hidden states, ``chunk_tokens``
    positions at a time: the next-token cross-entropy in fp32, summed, divided by ``num_items_in_batch`` when given,
    else averaged over the label tokens. ``shift_labels`` (already aligned with the positions) replace ``labels``.
    ``lm_head``: a ``torch.nn.Linear``, whose weight and bias are read directly (see [Note: the LM head under
    ZeRO-3])."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if not isinstance(lm_head, torch.nn.Linear):
        raise ValueError(f"ds_odc: the chunked loss reads the LM head's weight, so the head must be a torch.nn.Linear, "
                         f"not {type(lm_head).__name__} (adapters on the head?); train without the chunked loss "
                         "(loss_chunk_tokens 0)")
    if shift_labels is None:
        if labels is None:
            raise ValueError("chunked_causal_lm_loss needs labels or shift_labels")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    targets = shift_labels.reshape(-1).to(hidden.device)
    if targets.numel() != hidden.shape[0]:
        raise ValueError(f"labels have {targets.numel()} positions, hidden states {hidden.shape[0]}")

    weight, bias = lm_head.weight, lm_head.bias

    def chunk_loss_sum(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.linear(h, weight, bias).float(), y, ignore_index=ignore_index, reduction="sum")

    recompute = torch.is_grad_enabled() and hidden.requires_grad
    total = None
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, y = hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        part = checkpoint(chunk_loss_sum, h, y, use_reentrant=False) if recompute else chunk_loss_sum(h, y)
        total = part if total is None else total + part
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def use_chunked_loss(model: torch.nn.Module, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> torch.nn.Module:
    """Make a Hugging Face causal LM compute its *training* loss with :func:`chunked_causal_lm_loss`: when called in
    training mode with ``labels`` (or ``shift_labels``) it returns the loss and ``logits=None``. In eval mode, without
    labels, or asked for a MoE model's router logits, it is the model's own forward (whose loss includes the router
    loss). Returns the model (changed in place); refuses a model whose config adds the router loss always."""
    config = getattr(model, "config", None)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is None or decoder is model or not isinstance(head, torch.nn.Linear):
        raise ValueError(f"use_chunked_loss: {type(model).__name__} is not a causal LM with a decoder and a linear "
                         "LM head")
    for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, key, None) not in (None, 1.0):
            raise ValueError(f"use_chunked_loss: {type(model).__name__} transforms its logits ({key}); the chunked "
                             "loss would skip that. Train it without use_chunked_loss.")
    if "forward" in vars(model):
        raise ValueError("use_chunked_loss: this model's forward is already replaced (by another library's fused "
                         "LM head?); keep that one")
    if getattr(config, "output_router_logits", False):
        raise ValueError(f"use_chunked_loss: {type(model).__name__} adds its MoE router loss to its loss "
                         "(output_router_logits), which the chunked loss would leave out")
    model.forward = types.MethodType(_chunked_forward, model)
    model.ds_odc_loss_chunk_tokens = chunk_tokens
    share_head_with_loss(model)
    return model


def share_head_with_loss(model: torch.nn.Module) -> bool:
    """Make the LM head's weight (tied or not) and bias, if any, present wherever ``model``'s own forward (and its
    backward) runs under ZeRO-3, as a loss that reads them directly needs (see [Note: the LM head under ZeRO-3]).
    Idempotent; returns whether a weight was registered (``False`` for a model without an output embedding, or
    without DeepSpeed installed)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.nn.Parameter):
        return False
    try:
        import deepspeed  # deepspeed.zero is an attribute of the package, not a module to import from
    except ImportError:  # pragma: no cover - nothing to coordinate without DeepSpeed
        return False
    for param in (weight, getattr(head, "bias", None)):
        if isinstance(param, torch.nn.Parameter):
            deepspeed.zero.register_external_parameter(model, param)
    return True


def _chunked_forward(self, input_ids=None, labels=None, *args, shift_labels=None, num_items_in_batch=None,
                     ignore_index: int = IGNORE_INDEX, **kwargs):
    if not self.training or (labels is None and shift_labels is None) or args or kwargs.get("output_router_logits"):
        return type(self).forward(self, input_ids, *args, labels=labels, num_items_in_batch=num_items_in_batch,
                                  **({"shift_labels": shift_labels} if shift_labels is not None else {}), **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast
    kwargs.pop("logits_to_keep", None)
    outputs = self.get_decoder()(input_ids=input_ids, **kwargs)
    loss = chunked_causal_lm_loss(outputs.last_hidden_state, self.get_output_embeddings(), labels,
                                  shift_labels=shift_labels, num_items_in_batch=num_items_in_batch,
                                  ignore_index=ignore_index, chunk_tokens=self.ds_odc_loss_chunk_tokens)
    return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=outputs.hidden_states,
                                  attentions=outputs.attentions)
