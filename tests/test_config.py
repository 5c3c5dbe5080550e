"""The ``odc`` config key: accepted forms, validation, and stock behaviour without it (in-process, no ranks)."""

import types

import pydantic
import pytest

import ds_odc  # noqa: F401  (installs the key)
from deepspeed.runtime.zero.config import get_zero_config

from ds_odc.zero.validate import validate_engine


def test_bool_shorthand_and_sub_dict():
    assert get_zero_config({"zero_optimization": {"stage": 3, "odc": True}}).odc.enabled
    cfg = get_zero_config({"zero_optimization": {"stage": 3, "odc": {"enabled": True, "transport": "shm",
                                                                      "timeout_s": 12}}}).odc
    assert (cfg.enabled, cfg.transport, cfg.timeout_s) == (True, "shm", 12)


def test_without_odc_key_odc_is_off():
    assert not get_zero_config({"zero_optimization": {"stage": 3}}).odc.enabled
    assert not get_zero_config({"zero_optimization": {"stage": 3, "odc": False}}).odc.enabled


@pytest.mark.parametrize("bad", [{"enabled": True, "trasport": "shm"}, {"transport": "tcp"}, {"timeout_s": 0}])
def test_bad_odc_values_are_errors(bad):
    with pytest.raises(pydantic.ValidationError) as err:
        get_zero_config({"zero_optimization": {"stage": 3, "odc": bad}})
    assert "odc" in str(err.value)


@pytest.mark.parametrize("value", ["yes", "true", 1, ["shm"]])
def test_an_odc_value_of_the_wrong_kind_is_told_what_the_key_takes(value):
    with pytest.raises(pydantic.ValidationError) as err:
        get_zero_config({"zero_optimization": {"stage": 3, "odc": value}})
    message = str(err.value)
    keys = ", ".join(sorted(ds_odc.OdcConfig.model_fields))  # bootstrap, deterministic, enabled, ...
    assert ("\nzero_optimization.odc\n  Input should be true (on, with the defaults), false, or an object with the "
            f"keys {keys} [") in message, message
    assert "OdcConfig" not in message, message
    with pytest.raises(pydantic.ValidationError) as err:  # DeepSpeed's own sub-objects: told their keys too
        get_zero_config({"zero_optimization": {"stage": 3, "offload_param": "cpu"}})
    assert "zero_optimization.offload_param\n  Input should be an object with the keys buffer_count, " in str(err.value)


def test_odc_defaults_to_plain_linear_and_block_fetch_unless_told_otherwise():
    odc = get_zero_config({"zero_optimization": {"stage": 3, "odc": True}})
    assert odc.memory_efficient_linear is False and odc.odc.fetch_unit == "block"
    assert get_zero_config({"zero_optimization": {"stage": 3}}).memory_efficient_linear is True
    chosen = get_zero_config({"zero_optimization": {"stage": 3, "memory_efficient_linear": True,
                                                    "odc": {"fetch_unit": "module"}}})
    assert chosen.memory_efficient_linear is True and chosen.odc.fetch_unit == "module"


def test_lockstep_is_off_by_default_and_refused_with_hybrid_sharding():
    assert get_zero_config({"zero_optimization": {"stage": 3, "odc": True}}).odc.lockstep is False
    assert get_zero_config({"zero_optimization": {"stage": 3, "odc": {"lockstep": True}}}).odc.lockstep is True
    with pytest.raises(pydantic.ValidationError) as err:
        get_zero_config({"zero_optimization": {"stage": 3, "odc": {"lockstep": True, "shard_size": 2}}})
    message = str(err.value)
    assert "zero_optimization.odc\n" in message, message
    assert "zero_optimization.odc.lockstep" in message and "zero_optimization.odc.shard_size" in message, message


def test_the_balancer_block_is_checked_where_it_is_written():
    zero = {"stage": 3, "odc": {"balancer": {"max_tokens": 4096}}}
    balancer = get_zero_config({"zero_optimization": zero}).odc.balancer
    assert (balancer.planner, balancer.max_tokens, balancer.cost, balancer.loss) == ("lb-mini", 4096, "auto",
                                                                                    "token_mean")
    assert get_zero_config({"zero_optimization": {"stage": 3, "odc": True}}).odc.balancer is None
    refused = {
        "lb-mini needs ODC": ({"enabled": False, "balancer": {}}, "turn ODC on"),
        "lb-mini cannot lock-step": ({"lockstep": True, "balancer": {}}, "choose 'lb-micro'"),
        "a misspelt key": ({"balancer": {"planer": "lb-micro"}}, "did you mean 'planner'?"),
        "an unknown planner": ({"balancer": {"planner": "lb-max"}}, "zero_optimization.odc.balancer.planner"),
        "a budget of 0": ({"balancer": {"max_tokens": 0}}, "zero_optimization.odc.balancer.max_tokens"),
    }
    for what, (odc, said) in refused.items():
        with pytest.raises(pydantic.ValidationError) as err:
            get_zero_config({"zero_optimization": {"stage": 3, "odc": odc}})
        assert said in str(err.value), (what, str(err.value))
    stock = get_zero_config({"zero_optimization": {"stage": 3, "odc": {"enabled": False,
                                                                      "balancer": {"planner": "lb-micro"}}}})
    assert stock.odc.balancer.planner == "lb-micro"  # collective-compatible planners balance stock ZeRO-3 too


def test_other_zero_keys_still_strict():
    with pytest.raises(pydantic.ValidationError):
        get_zero_config({"zero_optimization": {"stage": 3, "odc": True, "no_such_key": 1}})


TYPO = {"train_batch_size": 1, "zero_optimization": {"stage": 3, "odc": {"enabld": True}}}


def _where_deepspeed_reads_the_config():
    """The two places DeepSpeed parses a ds_config: ``deepspeed.initialize`` builds a ``DeepSpeedConfig``, and
    ``zero.Init`` builds one too, first thing (before it needs a process group)."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    def zero_init(config):
        with deepspeed.zero.Init(config_dict_or_path=config):
            pass
    return {"deepspeed.initialize": DeepSpeedConfig, "zero.Init": zero_init}


@pytest.mark.parametrize("where", ["deepspeed.initialize", "zero.Init"])
def test_a_misspelt_odc_key_is_named_as_written_with_the_closest_valid_one(where):
    with pytest.raises(pydantic.ValidationError) as err:
        _where_deepspeed_reads_the_config()[where](TYPO)
    message = str(err.value)
    assert "zero_optimization.odc.enabld\n" in message and "did you mean 'enabled'?" in message, message
    assert "OdcZeroConfig" not in message and "validation error for ds_config" in message, message
    wrong_value = {"zero_optimization": {"stage": 3, "offload_param": {"devicee": "cpu"}, "odc": {"timeout_s": -1}}}
    with pytest.raises(pydantic.ValidationError) as err:
        get_zero_config(wrong_value)
    message = str(err.value)
    assert "2 validation errors for ds_config" in message, message
    assert "zero_optimization.offload_param.devicee\n" in message and "did you mean 'device'?" in message, message
    assert "zero_optimization.odc.timeout_s\n  Input should be greater than 0" in message, message


def _engine(**ds_config):
    from ds_odc.zero.validate import read_config
    config = read_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "odc": True},
                          **ds_config})
    return types.SimpleNamespace(_config=config, has_moe_layers=False, mpu=None)


def test_validator_rejects_fp16_naming_the_option():
    import torch
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert validate_engine(_engine(), optimizer) is True
    with pytest.raises(ValueError, match="fp16.enabled"):
        validate_engine(_engine(fp16={"enabled": True}), optimizer)
    with pytest.raises(ValueError, match="deepcompile"):
        validate_engine(_engine(compile={"deepcompile": True}), optimizer)


def test_no_optimizer_means_no_odc_said_once_naming_the_model():
    """An engine without an optimizer (TRL's reference model, say) runs stock: one INFO line naming its model class
    (shown at DeepSpeed's log level info; its default is warning), not a warning per rank and per engine."""
    import logging

    import torch
    from deepspeed.utils import logger

    class ReferenceLM(torch.nn.Module):
        pass

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        for _ in range(2):
            engine = _engine()
            engine.module = ReferenceLM()
            assert validate_engine(engine, None) is False
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    said = [r for r in records if "no optimizer" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO, [r.getMessage() for r in records]
    assert "the engine of this ReferenceLM has no optimizer (an inference or reference model)" in said[0].getMessage()
