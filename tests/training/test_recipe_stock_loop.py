"""The SFT recipe through DeepSpeed's own loop (``examples/sft.py --loop stock``) trains what the recipe's loop trains.

One launch at 2 CPU ranks, 3 minibatches of 4 samples (shuffled with a seed): the recipe's loop with ODC and lb-mini
is the run the others must equal; DeepSpeed's loop over the balancer key's loader with ODC and lb-mini (the same plan:
the same minibatches and microbatch counts, uneven in a step), with stock ZeRO-3 and lb-micro, and with ODC lock-step
and local-sort. Parameters and logged losses within the bound of tests/_support/tolerance.py, whose reference is the
recipe's own distance from a one-process float64 run of the same minibatches; a wrong weight on one microbatch of the
stock loop fails it. The options the balancer key cannot say are refused by name (in process).
"""

import argparse
import json
from pathlib import Path

import pytest

from _support.launch import launch
from _support.tolerance import assert_caught, assert_within, compare, compare_logs

WORKER = Path(__file__).with_name("recipe_loop_worker.py")
ROOT = Path(__file__).resolve().parents[2]
RECIPE, PLANTED = "recipe odc lb-mini", "planted: stock loop odc lb-mini, one weight 1.5x"
# 3 minibatches of 4; every fourth sample long, so that lb-mini gives the rank with a long one fewer samples
LENGTHS = [167, 48, 16, 28, 165, 43, 40, 42, 198, 25, 18, 43]


@pytest.mark.slow
def test_the_stock_loop_trains_what_the_recipe_loop_trains(tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(map(str, LENGTHS)) + "\n")
    r = launch(WORKER, 2, [lengths, tmp_path], timeout=300).check()
    out = r.result
    cases, recipe = out["cases"], out["cases"][RECIPE]
    float64_losses = [{"loss": x} for x in out["float64_losses"]]

    def logs(case: dict) -> list[dict]:
        return [{"loss": x} for x in case["losses"]]

    for name, case in cases.items():
        assert case["loop"] == ("recipe" if name == RECIPE else "stock"), (name, case)
        assert case["minibatches"] == recipe["minibatches"], (name, case)  # the same samples in each step
        assert case["moved"] > 1e-2, (name, case)  # the steps trained
    stock_lb_mini = cases["stock loop odc lb-mini"]
    assert stock_lb_mini["counts"] == recipe["counts"], stock_lb_mini  # the same plan, microbatch for microbatch
    assert any(len(set(counts)) > 1 for counts in recipe["counts"]), recipe["counts"]  # uneven in some step
    assert cases["stock loop stock-zero3 lb-micro"]["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    for name, case in cases.items():
        if name in (RECIPE, PLANTED):
            continue
        assert_within(compare(f"{name}: params vs the recipe's loop", case["params_vs_recipe"],
                              out["recipe_vs_float64"]),
                      *compare_logs(name, logs(case), logs(recipe), float64_losses))
    planted = cases[PLANTED]
    assert_caught(compare("planted: params vs the recipe's loop", planted["params_vs_recipe"], out["recipe_vs_float64"]))


@pytest.mark.parametrize("flags, ds_change, says", [
    (["--balancer", "lb-mini-sp"], None, "--balancer lb-mini-sp splits samples over groups of ranks"),
    (["--cost", "fitted", "--cost-coeffs", "1,0,0"], None, "--cost fitted (--cost-coeffs) is not one"),
    ([], {"balancer": {"planner": "lb-micro"}}, "remove it from the ds_config of --deepspeed"),
])
def test_what_the_balancer_key_cannot_say_is_refused(tmp_path, flags, ds_change, says):
    from ds_odc.recipes.sft import sft_argument_parser
    from ds_odc.recipes.train import engine_config
    config = json.loads((ROOT / "ds_configs" / "zero3_odc_fp32_cpu.json").read_text())
    config["zero_optimization"]["odc"].update(ds_change or {})
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    args = sft_argument_parser().parse_args(["--deepspeed", str(path), "--loop", "stock", *flags])
    with pytest.raises(SystemExit) as refused:
        engine_config(args)
    assert str(refused.value).startswith("--loop stock: ") and says in str(refused.value), refused.value
    assert "--loop recipe" in str(refused.value)
    engine_config(argparse.Namespace(**{**vars(args), "loop": "recipe"}))  # the recipe's loop takes them
