"""OdcGRPOTrainer against stock GRPOTrainer + stock ZeRO-3 on 2 and 3 CPU ranks (see grpo_worker.py): padded and
padding-free training, every loss type, with a reference model (beta > 0), two passes over each generation batch and
a generation batch of two optimizer steps; parameters, losses and every metric TRL logs, at every step.

The bounds are those of tests/_support/tolerance.py: ODC's distance from stock against stock's own distance from the
same training in float64 (stock TRL through DDP on the same ranks). ODC's microbatches are not stock's, so neither
are the reduction orders (and a padded prompt's RoPE positions): rounding, amplified by the steps, most by vespo,
whose sequence weights are exponentials of summed log-ratios. The steps moved the parameters by 1-4% (asserted), so
a wrong weight lands orders of magnitude above the bound (test_a_missing_microbatch_is_caught).
"""

from __future__ import annotations

import os

import pytest

from _support.launch import launch
from _support.tolerance import assert_caught, assert_within, compare, compare_logs, logs_reference

pytest.importorskip("trl")
pytestmark = pytest.mark.slow

WORKER = os.path.join(os.path.dirname(__file__), "grpo_worker.py")
LOSS_TYPES = ["grpo", "dapo", "bnpo", "dr_grpo", "luspo", "sapo", "cispo", "vespo"]
# The size a logged value's difference is taken relative to: |value|, but at least 1 for the loss and the KL, which
# are sums of terms of order 1 that nearly cancel (signed advantages; exp(d) - d - 1 of log-ratios d near 0, whose
# rounding is that of its terms, not of the small result), and METRIC_SCALE for the rest (a clip ratio of a few
# tokens sits near 0).
METRIC_SCALE = 1e-6
SCALES = {"loss": 1.0, "kl": 1.0}


@pytest.fixture(scope="module")
def two_ranks():
    return launch(WORKER, 2, ["equivalence", "--refusals", "--resume", "--planted"], timeout=900).check().result


@pytest.fixture(scope="module")
def three_ranks():
    return launch(WORKER, 3, ["equivalence"], timeout=900).check().result


def comparisons(result: dict, variant: str, launch: dict) -> list:
    """ODC (``variant``) against stock: parameters after the steps, and every logged value at every step, each with
    stock's distance from float64 as the reference distance (for the logged values: the largest over every case of
    the ``launch``, see tests/_support/tolerance.py)."""
    logs, params = result["logs"], result["param_diff"]
    reference = max(logs_reference(case["logs"]["stock"], case["logs"]["fp64"], SCALES, METRIC_SCALE)
                    for case in launch["cases"].values())
    return [compare(f"{variant}: parameters (max over tensors of |odc - stock| / |stock|)", params[variant],
                    params["fp64"]),
            *compare_logs(variant, logs[variant], logs["stock"], logs["fp64"], scales=SCALES, default_scale=METRIC_SCALE,
                          reference=reference)]


def check_case(launch: dict, case: str, variant: str) -> None:
    result = launch["cases"][case]
    assert result["optimizers"]["stock"] == "DeepSpeedZeroOptimizer_Stage3"
    assert result["optimizers"][variant] == "OdcOptimizer"
    assert result["dtypes"]["fp64"] == "torch.float64" and "DeepSpeed" not in result["optimizers"]["fp64"], result
    assert result["stock_moved"] >= 1e-2, result["stock_moved"]
    assert {"kl", "entropy", "loss", "reward"} <= set().union(*result["logs"][variant])
    assert_within(*comparisons(result, variant, launch))


@pytest.mark.parametrize("variant", ["packed", "padded"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_two_ranks_equal_stock_trl(two_ranks, loss_type, variant):
    check_case(two_ranks, loss_type, variant)


@pytest.mark.parametrize("variant", ["packed", "padded"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_three_ranks_equal_stock_trl(three_ranks, loss_type, variant):
    check_case(three_ranks, loss_type, variant)


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


def test_a_missing_microbatch_is_caught(two_ranks):
    """The planted error: ODC padding-free with the first microbatch of rank 0 left out of the gradient (its forward
    and backward still run) lands far outside the bound of the parameters."""
    case = two_ranks["cases"]["grpo"]
    assert case["optimizers"]["planted"] == "OdcOptimizer"
    assert_caught(compare("planted: parameters", case["param_diff"]["planted"], case["param_diff"]["fp64"]))


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
    check_case(two_ranks, "checkpointing", variant)
