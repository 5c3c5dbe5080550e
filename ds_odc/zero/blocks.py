"""Fetch unit: one transformer block per fetch, so that ZeRO-3's per-module host work runs once per block.

Stock ZeRO-3 hooks every submodule: each linear layer costs a fetch, a release and their bookkeeping on the host,
several times per microbatch (forward, recompute, backward). ODC's reads are one-sided, so nothing is gained by
fetching finer than the block the model runs anyway; DeepSpeed's "leaf module" flag (public:
``deepspeed.utils.set_z3_leaf_module``) makes it hook the block and fetch all of its parameters in one call.
Which modules are blocks is not decided here: the caller passes them (:func:`ds_odc.training.blocks.transformer_blocks`,
the one rule, which compiled blocks follow too).
"""

from __future__ import annotations

import torch
from deepspeed.utils import logger, set_z3_leaf_module, z3_leaf_module

__all__: list[str] = []


def _user_chose_leaves(zero_config) -> bool:
    """Whether the config sets DeepSpeed's ``leaf_module`` to anything but its defaults (which name MoE blocks)."""
    leaf = getattr(zero_config, "leaf_module", None)
    return leaf is not None and leaf != type(leaf)()


def _input_requires_grad(block: torch.nn.Module, args: tuple, kwargs: dict):
    """A block whose input needs no gradient (the first one, under a frozen embedding) would get its backward hooks
    called before its backward ran, so its parameters would be released too early; give it a leaf input that does.
    Only the hidden states (first argument, or ``hidden_states=``): a float attention mask requiring grad would cost
    an L x L gradient."""
    if not (block.training and torch.is_grad_enabled()):
        return None
    if args:
        hidden = args[0]
        if isinstance(hidden, torch.Tensor) and hidden.is_floating_point() and not hidden.requires_grad:
            return (hidden.detach().requires_grad_(), *args[1:]), kwargs
    else:
        hidden = kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.is_floating_point() and not hidden.requires_grad:
            return args, {**kwargs, "hidden_states": hidden.detach().requires_grad_()}
    return None


def fetch_by_block(blocks: list[torch.nn.Module], zero_config, fetch_unit: str) -> list[torch.nn.Module]:
    """Flag ``blocks``, the model's transformer blocks, as ZeRO-3 leaf modules (before the optimizer installs its
    hooks); returns those it flagged (none where ``fetch_unit`` is ``module``, the config names DeepSpeed's own leaf
    modules, or every block is a leaf already: a second engine around the same model)."""
    if fetch_unit != "block" or _user_chose_leaves(zero_config):
        return []
    blocks = [b for b in blocks if not z3_leaf_module(b)]
    if not blocks:
        logger.info("ds_odc: the model names no transformer blocks (_no_split_modules); fetching per module")
        return []
    for block in blocks:
        set_z3_leaf_module(block, True)
        block.register_forward_pre_hook(_input_requires_grad, prepend=True, with_kwargs=True)
    logger.info(f"ds_odc: fetching parameters per block: {len(blocks)} x {sorted({type(b).__name__ for b in blocks})}")
    return blocks
