"""Training arguments whose name differs between the transformers versions ds_odc supports.

transformers 5.24 renamed ``gradient_checkpointing`` to ``activation_checkpointing`` (the old name still works there,
with a deprecation warning); earlier releases (5.17, 4.57) know only the old name. :func:`activation_checkpointing`
gives the keyword argument the installed version expects, for ``TrainingArguments`` and TRL's configs alike."""

from __future__ import annotations

__all__ = ["activation_checkpointing"]


def activation_checkpointing(on: bool) -> dict[str, bool]:
    """``{"activation_checkpointing": on}`` where ``TrainingArguments`` has that field, else
    ``{"gradient_checkpointing": on}``: spread it into a ``TrainingArguments`` / ``SFTConfig`` / ``GRPOConfig`` /
    ``DPOConfig`` call."""
    from transformers import TrainingArguments
    fields = getattr(TrainingArguments, "__dataclass_fields__", {})
    return {"activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing": bool(on)}
