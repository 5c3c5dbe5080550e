"""A Qwen3-MoE-shaped model with the router auxiliary loss on, in OdcTrainer, OdcSFTTrainer and OdcGRPOTrainer, against
the stock trainer + stock ZeRO-3 (see moe_worker.py).

Where every rank runs stock's microbatches (one sample per microbatch on both sides; LB-Mini with uneven counts or
``local-sort`` with equal ones) ODC equals stock within the bound of ``tests/_support/tolerance.py``, with experts that receive no
token in a microbatch. Where LB-Mini groups other samples than stock, the router loss (a per-microbatch mean) differs
by definition: the distance is measured and compared with stock's own distance between two microbatch sizes."""

from __future__ import annotations

import os

import pytest

from _support.launch import launch
from _support.tolerance import assert_within, compare, compare_logs

pytest.importorskip("trl")

WORKER = os.path.join(os.path.dirname(__file__), "moe_worker.py")
NOT_COMPARED = ("epoch", "step", "learning_rate")
GRPO_SCALES = {"loss": 1.0, "kl": 1.0}  # sums of order-1 terms that nearly cancel: their rounding is their terms'


@pytest.fixture(scope="module")
def two_ranks():
    return launch(WORKER, 2, ["trainer,sft,grpo"], timeout=600).check().result


@pytest.fixture(scope="module")
def three_ranks():
    return launch(WORKER, 3, ["trainer"], timeout=300).check().result


def check_equal_to_stock(case: dict, run: str, scales: dict | None = None) -> None:
    logs = case["logs"]
    assert len(logs[run]) == len(logs["stock"]) == 4
    keys = sorted({k for name in (run, "stock") for e in logs[name] for k in e} - set(NOT_COMPARED))
    assert_within(compare(f"{run} parameters", case["params"][run], case["params"]["fp64"]),
                  *compare_logs(run, logs[run], logs["stock"], logs["fp64"], keys, scales=scales))


def uneven(counts: list[list]) -> bool:
    return any(len(set(step)) > 1 for step in counts)


@pytest.mark.parametrize("ranks", ["two_ranks", "three_ranks"])
def test_trainer_equals_stock(ranks, request):
    case = request.getfixturevalue(ranks)["trainer"]
    assert case["own_loss"]  # the chunked loss would leave the router loss out: the model's own loss is kept
    assert case["stock_moved"] > 1e-2 and uneven(case["microbatches"]), case["microbatches"]
    check_equal_to_stock(case, "odc")


@pytest.mark.parametrize("run", ["odc", "local_sort", "per_module"])
def test_sft_equals_stock(two_ranks, run):
    case = two_ranks["sft"]
    assert case["stock_moved"] > 1e-2 and case["idle"][run]["idle"] > 0, case["idle"]  # some expert got no token
    assert uneven(case["microbatches"]["odc"]) and not uneven(case["microbatches"]["local_sort"])
    assert "aux_loss" in case["logs"][run][0]
    check_equal_to_stock(case, run)


@pytest.mark.parametrize("run", ["packed", "padded"])
def test_grpo_equals_stock(two_ranks, run):
    case = two_ranks["grpo"]
    assert case["optimizers"][run] == "OdcOptimizer" and case["stock_moved"] > 1e-2
    assert case["idle"][run]["idle"] > 0, case["idle"]
    assert uneven(case["microbatches"]["padded"]), case["microbatches"]
    assert "aux_loss" in case["logs"][run][0] and max(e["kl"] for e in case["logs"]["stock"]) > 1e-4
    check_equal_to_stock(case, run, scales=GRPO_SCALES)


@pytest.mark.parametrize("trainer, run", [("sft", "packed"), ("grpo", "packed")])
def test_other_grouping_moves_as_far_as_stock_itself_does(two_ranks, trainer, run):
    # LB-Mini packs other samples together than stock (here with two or four samples per microbatch) does: the router
    # loss differs, by far more than rounding, but no more than stock's own result moves when it trains one sample per
    # microbatch instead (the yardstick: the same data, weights and steps).
    case = two_ranks[trainer]
    grouping = case["grouping"]
    measured, yardstick = grouping["params"][run], grouping["params"]["stock_one_per_microbatch"]
    assert measured > 100 * compare("", 0.0, case["params"]["fp64"]).bound, grouping["params"]  # stock's rounding
    assert measured <= 2 * yardstick, grouping["params"]
