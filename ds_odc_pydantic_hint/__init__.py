"""When DeepSpeed rejects ``zero_optimization.odc`` because ds_odc was not imported, say so in the error.

Without ``import ds_odc``, DeepSpeed's ZeRO config model does not know the ``odc`` key and pydantic reports
``odc: Extra inputs are not permitted``, which does not say what to do. This pydantic plugin (registered under the
``pydantic`` entry point group, so pydantic loads it in every process of the environment) watches that one model,
DeepSpeed's ``DeepSpeedZeroConfig``, and adds a note naming the fix to exactly that error. Nothing else changes:
the exception is the same object, of the same type, with the same message; every other model gets no handler (no
cost per validation); DeepSpeed is neither imported nor patched. ``PYDANTIC_DISABLE_PLUGINS=ds_odc`` turns it off.

A separate top-level package on purpose: importing anything under ``ds_odc`` runs ``ds_odc/__init__``, which teaches
DeepSpeed the ``odc`` key.
"""

from __future__ import annotations

WATCHED = ("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig")
HINT = ("ds_odc: `odc` is ds_odc's key, and DeepSpeed read this config without it: add `import ds_odc` before "
        "DeepSpeed reads the config (before deepspeed.initialize, deepspeed.zero.Init and "
        "TrainingArguments(deepspeed=...)). `python -m ds_odc check CONFIG.json` validates a config.")


def rejects_odc_key(error) -> bool:
    return any(e["type"] == "extra_forbidden" and tuple(e["loc"]) == ("odc",) for e in error.errors())


class _AddHint:
    """Validation event handler for ``DeepSpeedZeroConfig`` (pydantic calls ``on_error`` before re-raising)."""

    def on_error(self, error) -> None:
        if rejects_odc_key(error) and HINT not in getattr(error, "__notes__", ()):
            error.add_note(HINT)


class OdcKeyHintPlugin:
    """The pydantic plugin: a handler for DeepSpeed's ZeRO config model only."""

    def new_schema_validator(self, schema, schema_type, schema_type_path, schema_kind, config, plugin_settings):
        if (schema_type_path.module, schema_type_path.name) == WATCHED:
            return _AddHint(), None, None
        return None, None, None


plugin = OdcKeyHintPlugin()
