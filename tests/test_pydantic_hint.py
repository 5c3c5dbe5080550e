"""The pydantic plugin that names the fix when DeepSpeed rejects the ``odc`` key (ds_odc not imported).

End to end, through the installed entry point, in tests/test_packaging.py; here its decisions, in-process."""

from types import SimpleNamespace

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from ds_odc_pydantic_hint import HINT, WATCHED, plugin


class ZeroLike(BaseModel):
    model_config = ConfigDict(extra="forbid")
    stage: int = 0


def handlers_for(module: str, name: str):
    return plugin.new_schema_validator(None, None, SimpleNamespace(module=module, name=name), "BaseModel", None, {})


def error_of(**data) -> ValidationError:
    with pytest.raises(ValidationError) as caught:
        ZeroLike(**data)
    return caught.value


def test_only_deepspeeds_zero_config_gets_a_handler():
    assert handlers_for(*WATCHED)[0] is not None
    assert handlers_for("ds_odc.config", "OdcZeroConfig") == (None, None, None)
    assert handlers_for("deepspeed.runtime.config", "DeepSpeedConfig") == (None, None, None)


def test_the_hint_is_a_note_on_the_same_error_and_only_for_the_odc_key():
    handler = handlers_for(*WATCHED)[0]
    odc = error_of(stage=3, odc=True)
    message = str(odc)
    handler.on_error(odc)
    handler.on_error(odc)  # validated twice (DeepSpeed re-parses): one note
    assert odc.__notes__ == [HINT] and str(odc) == message

    for other in (error_of(stage=3, stagee=1), error_of(stage="x"), error_of(odc_extra=1)):
        handler.on_error(other)
        assert not getattr(other, "__notes__", None)
