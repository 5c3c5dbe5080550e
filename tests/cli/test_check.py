"""``python -m ds_odc check`` reports every refusal that ``deepspeed.initialize`` would raise for an ODC config and
that the config alone decides: both run the rules of ds_odc.zero.validate (``CONFIG_RULES``), enumerated here with
each rule's own examples (tests/zero/test_zero_odc.py plants them in a real ``deepspeed.initialize``)."""

import copy
import json
import types

import pytest

import ds_odc  # noqa: F401  (installs the key)
from ds_odc.__main__ import main
from ds_odc.cli.check import check
from ds_odc.zero.validate import CONFIG_RULES, read_config, validate_engine

BASE = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "odc": True}}
CASES = [(rule, example) for rule in CONFIG_RULES for example in rule.examples]


def planted(example: dict) -> dict:
    config = copy.deepcopy(BASE)
    for key, value in example.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) and key in config else value
    return config


def initialize_refusal(ds_config: dict) -> str:
    """What the hook ``deepspeed.initialize`` runs (ds_odc's ``prepare_engine`` -> ``validate_engine``) raises for an
    engine of this config; the engine-only checks that follow the config's rules pass on this stand-in."""
    engine = types.SimpleNamespace(_config=read_config(ds_config), has_moe_layers=False, mpu=None)
    with pytest.raises(ValueError) as err:
        validate_engine(engine, optimizer=object())
    return str(err.value)


def test_the_base_config_passes_every_rule():
    assert len(CASES) >= 19 and check(BASE).problems == []


@pytest.mark.parametrize("rule,example", CASES, ids=[f"{r.refusal.__name__}-{json.dumps(e)}" for r, e in CASES])
def test_check_reports_what_initialize_refuses(rule, example):
    config = planted(example)
    refusal = rule.refusal(read_config(config))
    assert refusal is not None, f"{rule.refusal.__name__} does not refuse its own example {example}"
    assert check(config).problems == [str(refusal)] == [initialize_refusal(config)]


def test_the_command_lists_every_problem_and_names_each_key(tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(planted({"zero_optimization": {"offload_param": {"device": "cpu"}, "reduce_scatter":
                                                              False}, "train_batch_size": "auto"})))
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert "deepspeed.initialize will refuse this config under ODC (2 problems)" in err, err
    assert "zero_optimization.offload_param is not supported" in err and "zero_optimization.reduce_scatter" in err
    path.write_text(json.dumps(BASE))
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "valid; ODC on" in out and "left to deepspeed.initialize" in out, out
