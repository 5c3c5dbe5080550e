"""OdcDPOTrainer against stock DPOTrainer + stock ZeRO-3 on 2 and 3 CPU ranks (see dpo_worker.py): padded and
padding-free microbatches, uneven microbatch counts per rank, the default loss, every per-pair loss type with
truncated sequences, precomputed reference log-probs with length- and WPO-weighted pairs; parameters and every metric
TRL logs, at every step. A run that loses one pair must fail the same checks.

The yardstick is stock TRL in float64 under DDP on the same minibatches and microbatches: stock ZeRO-3 in fp32 is some
distance from it (rounding, which the DPO loss amplifies: rewards are small differences of summed log-probs), and ODC
must be no farther than a small multiple of that distance (:func:`bound`)."""

from __future__ import annotations

import math
import os

import pytest

from _support.launch import launch
from _support.tolerance import SCALAR_ULPS, Comparison, assert_caught, compare

pytest.importorskip("trl")
pytestmark = pytest.mark.slow

WORKER = os.path.join(os.path.dirname(__file__), "dpo_worker.py")
CASES = ("sigmoid", "losses", "precomputed", "precomputed_self")
CASES_3 = CASES[:3]  # at 3 ranks (CPU time): the reference precomputed by the policy itself runs at 2 only
VARIANTS = ("odc_padded", "odc_packed")

# Bounds: tests/_support/tolerance.py's, with both runs measured against the float64 run: a run passes when its
# distance from it is at most FACTOR times stock ZeRO-3's (measured the same way, in the same launch) plus one unit
# of roundoff (SCALAR_ULPS for logged values). Measured (4 cases, 2 and 3 ranks): ODC's parameters at 0.5-1.6x
# stock's distance, its metrics at up to 2.4x stock's largest; the run that loses a pair at 1e5x.


@pytest.fixture(scope="module")
def two_ranks():
    return launch(WORKER, 2, ["equivalence", "--planted", "--refusals"], timeout=900).check().result


@pytest.fixture(scope="module")
def three_ranks():
    args = ["equivalence", "--cases", ",".join(CASES_3), "--runs", "fp64,stock,odc_padded,odc_packed"]
    return launch(WORKER, 3, args, timeout=900).check().result


def metric_errors(logs: list[dict], reference: list[dict]) -> dict[str, float]:
    """Per logged key, the largest distance of ``logs`` from ``reference`` over the steps, relative to the key's
    largest magnitude in ``reference``. A key logged by one of them only is infinitely far. Not compared:
    ``rewards/accuracies`` (the share of pairs whose chosen reward beats the rejected one) at a step where the
    reference's margins are rounding noise: the first step of a policy that is its own reference, whose log-probs
    were precomputed in other rows than it trains on."""
    assert len(logs) == len(reference) >= 4, (len(logs), len(reference))
    scale = {k: max(abs(e[k]) for e in reference if k in e) for k in set().union(*reference)}
    out: dict[str, float] = {}
    for mine, theirs in zip(logs, reference):
        for key in set(mine) | set(theirs):
            if key not in mine or key not in theirs or math.isnan(mine[key]) != math.isnan(theirs[key]):
                out[key] = math.inf
                continue
            if key == "rewards/accuracies" and abs(theirs["rewards/margins"]) <= 1e-6 * scale["rewards/margins"]:
                continue
            far = 0.0 if math.isnan(theirs[key]) else abs(mine[key] - theirs[key]) / max(scale[key], 1e-30)
            out[key] = max(out.get(key, 0.0), far)
    return out


def too_far(case: dict, run: str) -> list[Comparison]:
    """What of ``run`` is farther from the float64 run than stock's distance allows (tests/_support/tolerance.py).
    The parameters are measured against stock's parameters' distance; each metric against stock's largest metric
    distance (one rounding level for the whole log: the distance of one metric alone is itself a rounding accident)."""
    checks = [compare(f"{run} parameters from float64", case["params"][run], case["params"]["stock"])]
    stock = max(metric_errors(case["logs"]["stock"], case["logs"]["fp64"]).values())
    checks += [compare(f"{run} logged {key!r} from float64", far, stock, ulps=SCALAR_ULPS)
               for key, far in metric_errors(case["logs"][run], case["logs"]["fp64"]).items()]
    return [c for c in checks if not c.holds]


def check_case(case: dict, run: str) -> None:
    assert case["optimizers"]["stock"] == "DeepSpeedZeroOptimizer_Stage3"
    assert case["optimizers"]["fp64"] == "NoneType"  # DDP, no DeepSpeed
    assert case["optimizers"][run] == "OdcOptimizer"
    assert case["moved"] >= 5e-3, case["moved"]  # training moved the parameters: rounding is not all there is
    keys = set(case["logs"][run][0])
    assert {"loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy",
            "num_tokens"} <= keys, sorted(keys)
    assert not too_far(case, run), "\n".join(map(str, too_far(case, run)))


@pytest.mark.parametrize("run", VARIANTS)
@pytest.mark.parametrize("name", CASES)
def test_two_ranks_equal_stock_trl(two_ranks, name, run):
    check_case(two_ranks["cases"][name], run)


@pytest.mark.parametrize("run", VARIANTS)
@pytest.mark.parametrize("name", CASES_3)
def test_three_ranks_equal_stock_trl(three_ranks, name, run):
    check_case(three_ranks["cases"][name], run)


def test_stock_padding_free_is_stock(two_ranks):
    # TRL 1.16 trains padding_free=True on padded batches (with a warning): the same run as stock's, which the checks
    # above compare ODC with.
    for case in two_ranks["cases"].values():
        assert case["params"]["stock_padding_free"] == case["params"]["stock"]
        assert case["logs"]["stock_padding_free"] == case["logs"]["stock"]


def test_odc_off_is_stock(two_ranks):
    # OdcDPOTrainer without "odc" in the DeepSpeed config: every method is DPOTrainer's.
    for case in two_ranks["cases"].values():
        assert case["optimizers"]["odc_off"] == "DeepSpeedZeroOptimizer_Stage3"
        assert case["params"]["odc_off"] == case["params"]["stock"]
        assert case["logs"]["odc_off"] == case["logs"]["stock"]


def test_ranks_trained_uneven_microbatch_counts(two_ranks, three_ranks):
    for result in (two_ranks, three_ranks):
        for name, case in result["cases"].items():
            for run in VARIANTS:
                counts = case["microbatches"][run]
                assert any(len(set(step)) > 1 for step in counts), (result["world"], name, run, counts)


def test_padding_free_rows_attend_per_sequence(two_ranks):
    attention = two_ranks["cases"]["sigmoid"]["attention"]
    assert attention["odc_packed"] == "ds_odc_varlen" and attention["odc_padded"] == attention["stock"] == "sdpa"


def test_a_lost_pair_fails_the_checks(two_ranks):
    """The planted error: one pair of one microbatch never reaches the loss. The checks above must catch it."""
    case = two_ranks["cases"]["sigmoid"]
    assert_caught(compare("a lost pair: parameters from float64", case["params"]["odc_dropped"],
                          case["params"]["stock"]), margin=100)


def test_unsupported_options_are_refused_by_name(two_ranks):
    refused = two_ranks["refusals"]
    for option, message in refused.items():
        assert message.startswith("ds_odc: OdcDPOTrainer with zero_optimization.odc does not support"), message
        assert option in message, (option, message)
