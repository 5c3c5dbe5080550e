"""The simulator's table says the unit of its times: tokens, FLOPs or seconds, as the cost model makes them."""

import pytest

from ds_odc.balancer.simulate import main

BASE = ["--preset", "baselines-longtail", "--ranks", "4", "--minibatch-size", "2", "--max-tokens", "0", "--steps", "2",
        "--plan-cost", "given"]


@pytest.mark.parametrize("cost,unit,meaning", [
    ([], "tokens", "times in tokens, not seconds"),
    (["--cost", "quadratic", "--model-config", "qwen2.5-1.5b"], "FLOPs", "times in training FLOPs, not seconds"),
    (["--cost", "quadratic", "--model-config", "qwen2.5-1.5b", "--tflops", "400"], "s", "times in seconds"),
    (["--cost", "fitted", "--cost-coeffs", "1e-4,0,0.01"], "s", "times in seconds (the fitted cost's unit)"),
])
def test_every_time_in_the_table_carries_its_unit(cost, unit, meaning, capsys):
    assert main(BASE + cost) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"step time ({unit})" in lines[1], lines[1]
    assert any(line.startswith(meaning) for line in lines), lines
    bound = next(line for line in lines if line.startswith("balance bound:"))
    assert bound.split("(bubble")[0].endswith(f" {unit} "), bound
