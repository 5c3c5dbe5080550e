"""Trainer integrations of ds_odc.

``from ds_odc.integrations.transformers import OdcTrainer`` (or ``from ds_odc.integrations import OdcTrainer``): the
Hugging Face ``Trainer`` with ODC + LB-Mini. See docs/HF_TRAINER.md. Imported lazily so ``import ds_odc`` never
pulls in transformers.
"""

from __future__ import annotations

__all__ = ["OdcTrainer"]


def __getattr__(name: str):
    if name == "OdcTrainer":
        from ds_odc.integrations.transformers import OdcTrainer
        return OdcTrainer
    raise AttributeError(name)
