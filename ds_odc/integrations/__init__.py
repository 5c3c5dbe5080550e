"""Trainer integrations of ds_odc.

``from ds_odc.integrations import OdcTrainer`` (the Hugging Face ``Trainer`` with ODC + LB-Mini, docs/HF_TRAINER.md),
``OdcSFTTrainer`` (TRL's ``SFTTrainer`` on top of ``OdcTrainer``), ``OdcDPOTrainer`` (TRL's ``DPOTrainer``, LB-Mini over
preference pairs), ``OdcGRPOTrainer`` (TRL's ``GRPOTrainer`` with lockstep-free generation and LB-Mini over rollouts,
docs/RL.md) and ``lockstep_free`` (generation under ZeRO-3 + ODC without collectives); ``match_accelerate_backend(args)`` lets a
stock trainer gather over gloo when several ranks share one GPU (ds_odc's trainers do it themselves);
``show_log_lines(trainer)`` prints one short line per logging step instead of the whole log dict. Imported
lazily so ``import ds_odc`` never pulls in transformers or TRL.
"""

from __future__ import annotations

__all__ = ["OdcTrainer", "OdcSFTTrainer", "OdcDPOTrainer", "OdcGRPOTrainer", "lockstep_free",
           "match_accelerate_backend", "activation_checkpointing", "LogLines", "show_log_lines"]

_WHERE = {"OdcTrainer": "ds_odc.integrations.transformers", "OdcSFTTrainer": "ds_odc.integrations.trl_sft",
          "OdcDPOTrainer": "ds_odc.integrations.trl_dpo",
          "OdcGRPOTrainer": "ds_odc.integrations.trl_grpo",
          "lockstep_free": "ds_odc.integrations.generation",
          "match_accelerate_backend": "ds_odc.integrations._hf_privates",
          "activation_checkpointing": "ds_odc.integrations.arguments",
          "LogLines": "ds_odc.integrations.log_lines", "show_log_lines": "ds_odc.integrations.log_lines"}


def __getattr__(name: str):
    if name in _WHERE:
        import importlib
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(name)
