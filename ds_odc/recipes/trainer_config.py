"""The DeepSpeed config the Trainer examples hand to ``TrainingArguments(deepspeed=...)``: ZeRO-3 with every batch size
"auto" (the Trainer fills them in), 16-bit weights gathered when a model is saved, ODC on or off; and whether
``accelerate launch`` with a DeepSpeed config file chose the config instead."""

from __future__ import annotations

import os

__all__ = ["accelerate_chose_deepspeed", "zero3_config"]


def accelerate_chose_deepspeed() -> bool:
    """True under ``accelerate launch`` with a DeepSpeed config file: its ``deepspeed_config_file`` decides (ODC or
    not), and the script passes no config of its own."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def zero3_config(odc: bool, zero: dict | None = None, **top) -> dict:
    """ZeRO-3 (``zero``: more ``zero_optimization`` keys; ``top``: more top-level keys) with ``"odc": true`` when
    ``odc``."""
    zero = {"stage": 3, "overlap_comm": False, "stage3_gather_16bit_weights_on_model_save": True, **(zero or {})}
    if odc:
        zero["odc"] = True
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": zero,
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, **top}
