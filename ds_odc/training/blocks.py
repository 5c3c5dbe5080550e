"""What a transformer block is: the one rule behind every use of a model's blocks, ZeRO-3's fetch unit
(:func:`ds_odc.zero.blocks.fetch_by_block` flags them as leaf modules) and compiled blocks
(:mod:`ds_odc.training.compile`). It imports no DeepSpeed, so FSDP2 and plain training use it as well.

A block is a module whose class, or a class its class derives from, is named in the model's ``_no_split_modules``
(Hugging Face models list their decoder layers there, for device maps and FSDP's wrap policy). Derived classes count
so that a block stays one after a tool re-classed it (FSDP2's ``fully_shard`` makes ``FSDP<Name>`` subclasses,
compiled blocks a subclass of the same name). Only the outermost count: a block inside another is part of it.
"""

from __future__ import annotations

import torch

__all__: list[str] = []


def block_classes(model: torch.nn.Module) -> set[str]:
    """Class names of the model's transformer blocks: Hugging Face models list them in ``_no_split_modules``."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer blocks (see the module docstring), in ``model.modules()`` order; empty for a model that
    names none."""
    names = block_classes(model)
    found = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)] if names else []
    inner = {id(sub) for m in found for sub in m.modules() if sub is not m}
    return [m for m in found if id(m) not in inner]
