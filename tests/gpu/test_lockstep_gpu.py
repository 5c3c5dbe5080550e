"""Lock-step meetings (``zero_optimization.odc.lockstep``) on GPUs: the kernel meeting of the NVSHMEM transport's
peer-pointer path, in one launch of tests/zero/lockstep_worker.py at 2 ranks (a GPU each when there are two, else
sharing GPU 0), started without an agent so that every rank reports its own error:

* lockstep ODC trains what stock ZeRO-3 trains (drop-in loop, GAS 2, fp32, SGD), within the bound of
  tests/_support/tolerance.py (stock's own distance from float64);
* every block meets before its forward and after its backward, the same count in every microbatch, counted on the
  device path (``odc_lockstep.on_device``);
* a rank delayed before each microbatch holds the other in the meetings: the device's time in them grows by about the
  delay, while plain ODC waits at the fence;
* a rank that runs a microbatch fewer: the other's meeting kernel times out on the device clock and its next fence
  raises FenceTimeout naming it; the rank itself, timed out at the fence, sees from the meeting counters that it is
  behind and names itself.

    python -m pytest tests/gpu/test_lockstep_gpu.py -q
"""

from __future__ import annotations

import pytest

from _launch import REPO, rank_params, run_plain_ranks  # tests/gpu is on sys.path (rootdir conftest)
from _support.tolerance import SCALAR_ULPS, assert_within, compare

WORKER = REPO / "tests" / "zero" / "lockstep_worker.py"
DELAY_S = 0.3
TIMEOUT_S = 15.0
MARGIN_S = 25.0  # the rest of a tiny model's step, and gloo's error path

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def loss_distance(losses: list[float], reference: list[float]) -> float:
    assert len(losses) == len(reference) and losses, (losses, reference)
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


@pytest.mark.parametrize("nproc", rank_params(2))
def test_lockstep_on_gpu(nvshmem_op, nproc):
    run = run_plain_ranks(WORKER, ["--delay", DELAY_S, "--fewer", 1, "--timeout", TIMEOUT_S], nproc, deadline_s=420)
    r = next((x for x in run.results if "max_rel_diff" in x), None)
    assert r is not None, f"rank 0 reported nothing\n{run.log[-8000:]}"
    assert r["optimizer"] == "OdcOptimizer" and r["transport"] == "nvshmem", r
    assert_within(compare("lockstep vs stock on GPU: parameters (max over tensors, relative)", r["max_rel_diff"],
                          r["stock_vs_ref"]),
                  compare("lockstep vs stock on GPU: rank 0's microbatch losses (max, relative)",
                          loss_distance(r["loss_lockstep"], r["loss_stock"]),
                          loss_distance(r["loss_stock"], r["loss_ref"]), ulps=SCALAR_ULPS))
    assert r["head_calls_differ"], r  # the ranks' rows apply the head a different number of times: test_lockstep.py
    assert all(c["meetings"] == 2 * (r["fetch_units"] - 1) - 1 for c in r["per_microbatch"]), r
    assert all(s["lockstep"]["on_device"] for s in r["steps"]), r["steps"]
    assert r["odc_meetings"] == 0
    delayed = DELAY_S * len(r["per_microbatch"]) / len(r["steps"])
    for step in r["delayed_lockstep"]:  # the device's time in the meetings (summed over streams: at least the wait)
        assert step["lockstep"]["wait_s"] >= 0.6 * delayed, r["delayed_lockstep"]
    for step in r["delayed_odc"]:
        assert step["wait_s"] >= 0.6 * delayed, r["delayed_odc"]
    errors = {x["rank"]: x for x in run.results if "rank" in x}
    assert sorted(errors) == [0, 1], run.log[-8000:]
    assert errors[0]["error_type"] == "FenceTimeout" and errors[0]["missing"] == [1], errors[0]
    assert "lock-step meeting" in errors[0]["error"], errors[0]
    assert errors[1]["error_type"] == "LockstepMismatch" and errors[1]["missing"] == [1], errors[1]
    for err in errors.values():
        assert err["step"] == 0 and err["after_s"] <= TIMEOUT_S + MARGIN_S, err
    assert all(code not in (None, 0) for code in run.codes.values()), run.codes
