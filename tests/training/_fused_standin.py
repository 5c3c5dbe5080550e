"""A CPU stand-in for Liger's fused linear cross-entropy (Liger needs Triton, absent on CPU), with the same access
pattern that breaks ZeRO-3: the causal LM's forward reads ``lm_head.weight`` directly, never calling the ``lm_head``
module, and the loss's gradients are computed during the forward and only scaled in the backward."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index):
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        with torch.enable_grad():
            loss = F.cross_entropy((h @ w.t()).float(), targets, ignore_index=ignore_index, reduction="sum")
            grad_h, grad_w = torch.autograd.grad(loss, (h, w))
        ctx.save_for_backward(grad_h, grad_w)
        return loss.detach()

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out, grad_w * grad_out, None, None


def _fused_forward(self, input_ids=None, labels=None, **kwargs):
    from transformers.modeling_outputs import CausalLMOutputWithPast
    num_items_in_batch = kwargs.get("num_items_in_batch")
    hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state  # Liger passes every keyword on, this too
    shift = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    weight = self.lm_head.weight  # outside any module forward, as Liger reads it
    if weight.numel() == 0:
        raise RuntimeError("fused loss: lm_head.weight is empty here (a ZeRO-3 shard): it was not fetched")
    loss = _FusedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, shift, -100)
    loss = loss / (num_items_in_batch if num_items_in_batch is not None else (shift != -100).sum())
    return CausalLMOutputWithPast(loss=loss, logits=None)


def use_fused_standin(model: torch.nn.Module) -> None:
    """Replace ``model.forward`` by the stand-in, as Liger's ``apply_liger_kernel_to_*(model=...)`` does."""
    model.forward = types.MethodType(_fused_forward, model)
