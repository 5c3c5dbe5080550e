"""Lock-step meetings (``zero_optimization.odc.lockstep``, the collective baseline on ODC's own transport) on CPU
ranks: two launches of ``lockstep_worker.py``, one at 2 ranks (with a delayed rank) and one at 3 (with a rank that
runs a microbatch fewer), read by every test here.

The equality bound is that of tests/_support/tolerance.py: lockstep's distance from stock ZeRO-3 against stock's own
distance from the same steps in float64 (a planted error is shown to fall outside it in test_zero_odc.py). The
other checks each have their contrast in the same launch: plain ODC holds no lock-step meeting and its waiting shows
at the fence only.
"""

from pathlib import Path

import pytest

from _support.launch import launch
from _support.tolerance import SCALAR_ULPS, assert_within, compare

WORKER = Path(__file__).with_name("lockstep_worker.py")
DELAY_S = 0.3  # the last rank sleeps this long before each microbatch (2 per step) in the delay check
TIMEOUT_S = 20.0  # odc.timeout_s of the engine in which a rank runs a microbatch fewer
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    return launch(WORKER, 2, ["--delay", DELAY_S], timeout=300).check().result


@pytest.fixture(scope="module")
def three_ranks() -> list[dict]:
    """Every line the 3 ranks printed: rank 0's numbers, then each rank's error (independent processes, so that the
    first rank to fail does not take the others down before they report)."""
    run = launch(WORKER, 3, ["--fewer", 2, "--timeout", TIMEOUT_S], timeout=300, launcher="plain")
    assert any("max_rel_diff" in r for r in run.results), f"rank 0 reported nothing\n{run.stderr[-6000:]}"
    return run.results


def numbers(results: list[dict]) -> dict:
    return next(r for r in results if "max_rel_diff" in r)


def loss_distance(losses: list[float], reference: list[float]) -> float:
    assert len(losses) == len(reference) and losses, (losses, reference)
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


@pytest.mark.parametrize("ranks", ["two_ranks", "three_ranks"])
def test_lockstep_equals_stock_zero3(ranks, request):
    """The drop-in loop (GAS 2, SGD, 3 steps) with lockstep on trains what stock ZeRO-3 trains, up to the rounding of
    summing gradients in another order: the parameters, and every microbatch loss of rank 0."""
    r = request.getfixturevalue(ranks)
    r = numbers(r) if isinstance(r, list) else r
    assert r["optimizer"] == "OdcOptimizer" and r["transport"] == "shm", r
    assert r["moved"] > 1e-2, r  # the steps changed the model: agreeing means something
    assert_within(compare("lockstep vs stock: parameters (max over tensors, relative)", r["max_rel_diff"],
                          r["stock_vs_ref"]),
                  compare("lockstep vs stock: rank 0's microbatch losses (max, relative)",
                          loss_distance(r["loss_lockstep"], r["loss_stock"]),
                          loss_distance(r["loss_stock"], r["loss_ref"]), ulps=SCALAR_ULPS))


def test_every_block_meets_before_its_forward_and_after_its_backward(two_ranks):
    """Per microbatch: one lock-step meeting before the forward of each fetch unit that runs (the tiny model's 2
    blocks, and its embedding and final norm, which have parameters of their own; not the head, whose weight the
    chunked loss reads within the model's own forward) and one after the backward of each but the embedding (its
    input, token ids, has no gradient, so it has no backward), and no other: the same count in every microbatch, the
    first included, though DeepSpeed fetches module by module until it has traced the model and prefetches after,
    and though every rank's rows have other lengths, so that the loss applies the head a different number of times
    on each. Each step's tally counts its microbatches' meetings. Plain ODC holds none."""
    per_microbatch, steps, units = two_ranks["per_microbatch"], two_ranks["steps"], two_ranks["fetch_units"]
    assert units == 5, two_ranks["fetch_units"]  # embedding, 2 blocks, final norm, head
    assert two_ranks["head_calls_differ"], "no microbatch where the ranks' rows need different numbers of head calls"
    assert all(c["meetings"] == 2 * (units - 1) - 1 for c in per_microbatch), per_microbatch
    assert per_microbatch[0]["fetches"] != per_microbatch[1]["fetches"], per_microbatch  # the trace changed fetches
    gas = len(per_microbatch) // len(steps)
    for i, step in enumerate(steps):
        assert step["lockstep"]["meetings"] == sum(c["meetings"] for c in per_microbatch[i * gas:(i + 1) * gas]), steps
        assert not step["lockstep"]["on_device"]
    assert two_ranks["odc_meetings"] == 0
    assert all(s["lockstep"] is None for s in two_ranks["delayed_odc"]), two_ranks["delayed_odc"]


def test_a_delayed_rank_holds_the_others_in_the_lock_step_meetings(two_ranks):
    """Rank 1 sleeps before each microbatch. With lockstep, rank 0 waits for it at every microbatch, inside the
    lock-step meetings (which the host times, in ``odc_wait_s`` too), and hardly at the fence; with plain ODC rank 0
    runs on and waits at the fence only. Rank 0 computes its own microbatch meanwhile, so it waits a little less than
    the delay: the bounds leave half of it for that, on loaded cores."""
    delayed = DELAY_S * len(two_ranks["per_microbatch"]) / len(two_ranks["steps"])  # per step
    for step in two_ranks["delayed_lockstep"]:
        in_meetings = step["lockstep"]["wait_s"]
        assert in_meetings >= 0.6 * delayed, (delayed, two_ranks["delayed_lockstep"])
        assert step["wait_s"] - in_meetings <= 0.3 * delayed, (delayed, two_ranks["delayed_lockstep"])
    for step in two_ranks["delayed_odc"]:
        assert step["wait_s"] >= 0.6 * delayed, (delayed, two_ranks["delayed_odc"])


def test_a_rank_with_fewer_microbatches_is_named(three_ranks):
    """Rank 2 runs one microbatch fewer in the first step: it reaches the fence while the others meet in a lock-step
    meeting, and every rank raises at once (well within ``timeout_s``), naming rank 2, instead of the fence and the
    lock-step meeting completing each other."""
    errors = {r["rank"]: r for r in three_ranks if "rank" in r}
    assert sorted(errors) == [0, 1, 2], three_ranks
    for rank, err in errors.items():
        assert err["error_type"] == "LockstepMismatch" and err["missing"] == [2], err
        assert "rank 2 ran fewer microbatches" in err["error"] and "odc.lockstep" in err["error"], err
        assert err["step"] == 0 and err["after_s"] < TIMEOUT_S, err
    assert "at the fence at the optimizer step" in errors[2]["error"], errors[2]
