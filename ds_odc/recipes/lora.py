"""The LoRA adapters the examples and benchmarks train with ``--lora RANK``: one recipe, so every engine and trainer
compared in one call gets the same adapters."""

from __future__ import annotations

__all__ = ["lora_config"]


def lora_config(rank: int | None):
    """PEFT's ``LoraConfig`` with adapters of ``rank`` (alpha ``2 x rank``, no dropout) on every linear layer but the
    LM head; ``None`` for ``rank`` 0 or ``None`` (train the whole model)."""
    if not rank:
        return None
    from peft import LoraConfig
    return LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear")


def with_adapters(model, rank: int):
    """``model`` (a transformers model) with the adapters of :func:`lora_config` put into its layers, in the model's
    own dtype: PEFT would make them float32 in a bf16 model, while DeepSpeed trains them in the model's dtype, so
    every engine compared in one call computes them alike."""
    from peft import get_peft_model
    return get_peft_model(model, lora_config(rank), autocast_adapter_dtype=False)
