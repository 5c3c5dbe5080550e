"""OdcGRPOTrainer against stock GRPOTrainer + stock ZeRO-3 on 2 and 3 CPU ranks (see grpo_worker.py): padded and
padding-free training, every loss type, with a reference model (beta > 0), two passes over each generation batch and
a generation batch of two optimizer steps; parameters, losses and every metric TRL logs, at every step."""

from __future__ import annotations

import math
import os

import pytest

from _support.launch import launch

pytest.importorskip("trl")
pytestmark = pytest.mark.slow

WORKER = os.path.join(os.path.dirname(__file__), "grpo_worker.py")
LOSS_TYPES = ["grpo", "dapo", "bnpo", "dr_grpo", "luspo", "sapo", "cispo", "vespo"]
# Parameters after 4 SGD steps, fp32, relative (per tensor, norm): measured 0.5-1.8e-6. ODC's microbatches are not
# stock's, so neither are the reduction orders (and a padded prompt's RoPE positions): rounding, amplified by the
# steps, most by vespo, whose sequence weights are exponentials of summed log-ratios. The steps moved the parameters
# by 1-4% (asserted), so a wrong weight would be four orders of magnitude above this.
PARAM_TOL = 2e-6
LOSS_TOL = 1e-5  # relative to max(|loss|, 1): a GRPO loss is a sum of signed terms that nearly cancel
METRIC_TOL = 1e-5  # relative, for every other metric TRL logs (kl, entropy, clip ratios, rewards, lengths, ...)
METRIC_FLOOR = 1e-6  # ... with this floor for metrics that sit near 0 (e.g. a clip ratio of a few tokens)


@pytest.fixture(scope="module")
def two_ranks():
    return launch(WORKER, 2, ["equivalence", "--refusals", "--resume"], timeout=900).check().result


@pytest.fixture(scope="module")
def three_ranks():
    return launch(WORKER, 3, ["equivalence"], timeout=900).check().result


def metric_diffs(odc: list[dict], stock: list[dict]) -> dict[str, float]:
    """Per logged key, the largest difference of ODC's value from stock's over the steps, in units of the
    tolerance (<= 1 passes). A key logged by only one of them counts as infinitely far."""
    assert len(odc) == len(stock) >= 4, (len(odc), len(stock))
    out = {}
    for mine, theirs in zip(odc, stock):
        for key in set(mine) | set(theirs):
            if key not in mine or key not in theirs:
                out[key] = math.inf
                continue
            a, b = mine[key], theirs[key]
            if key == "loss":
                far = abs(a - b) / max(abs(b), 1.0) / LOSS_TOL
            elif isinstance(b, float) and math.isnan(b):
                far = 0.0 if math.isnan(a) else math.inf
            else:
                far = abs(a - b) / max(abs(b), METRIC_FLOOR) / METRIC_TOL
            out[key] = max(out.get(key, 0.0), far)
    return out


def check_case(result: dict, variant: str) -> None:
    assert result["optimizers"]["stock"] == "DeepSpeedZeroOptimizer_Stage3"
    assert result["optimizers"][variant] == "OdcOptimizer"
    assert result["stock_moved"] >= 1e-2, result["stock_moved"]
    assert result["param_diff"][variant] <= PARAM_TOL, result["param_diff"]
    far = metric_diffs(result["logs"][variant], result["logs"]["stock"])
    assert {"kl", "entropy", "loss", "reward"} <= set(far), sorted(far)
    bad = {k: v for k, v in far.items() if v > 1.0}
    assert not bad, bad  # in units of the tolerance


@pytest.mark.parametrize("variant", ["packed", "padded"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_two_ranks_equal_stock_trl(two_ranks, loss_type, variant):
    check_case(two_ranks["cases"][loss_type], variant)


@pytest.mark.parametrize("variant", ["packed", "padded"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_three_ranks_equal_stock_trl(three_ranks, loss_type, variant):
    check_case(three_ranks["cases"][loss_type], variant)


def test_ranks_trained_uneven_microbatch_counts(two_ranks, three_ranks):
    for result in (two_ranks, three_ranks):
        for variant in ("packed", "padded"):
            counts = [step for case in result["cases"].values() for step in case["microbatches"][variant]]
            assert any(len(set(step)) > 1 for step in counts), (variant, counts)


def test_balance_and_cost_are_logged(two_ranks):
    keys = set(two_ranks["log_keys"])
    assert {"odc/bubble", "odc/microbatches_rank0", "odc/microbatches_rank1", "odc/step_wait_seconds",
            "loss", "reward", "entropy", "kl"} <= keys, sorted(keys)
    assert 0.0 <= two_ranks["last_log"]["odc/bubble"] < 1.0
    assert two_ranks["resume"]["cost_logged"]  # the automatic cost's coefficients (odc/cost_*)


def test_unsupported_options_are_refused_by_name(two_ranks):
    refused = two_ranks["refusals"]
    for option, message in refused.items():
        assert message.startswith("ds_odc: OdcGRPOTrainer with zero_optimization.odc does not support"), message
        assert option in message, (option, message)


def test_resume_plans_and_trains_as_the_uninterrupted_run(two_ranks):
    out = two_ranks["resume"]
    assert out["steps_run"] == [6, 2]  # the resumed trainer ran steps 5 and 6 only
    assert out["balancer_state_saved"] and out["cost_fitted_at_resume"]
    full, resumed = out["plans"]
    assert resumed[0] == full[4], (resumed[0], full[4])  # step 5 planned with the checkpoint's fitted cost
    assert out["loss_diff"] <= 1e-6 and out["param_diff"] <= 1e-6, out


@pytest.mark.parametrize("variant", ["packed", "padded"])
def test_gradient_checkpointing_recomputes_what_the_forward_ran(two_ranks, variant):
    # The backward recomputes each layer: on packed rows, with the packed attention (else the counts of saved tensors
    # differ and torch refuses, or the recomputation attends across documents).
    check_case(two_ranks["cases"]["checkpointing"], variant)
