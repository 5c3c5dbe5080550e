"""The optimizer on the host (``"offload_optimizer": {"device": "cpu"}``) and states put away
(``engine.offload_states()`` / ``reload_states()``) under ODC, on CPU ranks: against stock ZeRO-3 with the same
offload, one process computing the same minibatches (fp32 and float64), and DeepSpeed's own test sequence for
``offload_states``.

Bounds are the suite's (tests/_support/tolerance.py): a distance from the run it must equal may be at most ``FACTOR``
times how far rounding moved that run itself from the float64 answer, plus one fp32 unit.
"""

from pathlib import Path

import pytest

from _support.launch import launch
from _support.tolerance import assert_caught, assert_within, compare

HERE = Path(__file__).parent
WORKER, OFFLOAD_WORKER = HERE / "worker.py", HERE / "offload_worker.py"
pytestmark = pytest.mark.slow

def run(script, nproc, *args, timeout=300):
    return launch(script, nproc, [str(a) for a in args], timeout=timeout).check().result


@pytest.mark.parametrize("nproc,optimizer", [(2, "sgd"), (3, "adamw")])
def test_offloaded_optimizer_matches_stock_with_the_same_offload(nproc, optimizer):
    """Equal counts (the drop-in loop), both optimizers on the host, clipping active: ODC from stock within stock's
    own rounding, and both as close to the float64 answer."""
    r = run(WORKER, nproc, "equal", "--offload", "both", "--optimizer", optimizer, "--clip", 0.05)
    assert r["optimizers"] == ["DeepSpeedZeroOptimizer_Stage3", "OdcOptimizer"] and r["offloaded"] == [True, True], r
    # measured 9e-8 (SGD), 2e-6 (AdamW) from stock; stock 1.3e-7 (SGD), 1.1e-5 (AdamW) from float64
    assert_within(compare("ODC from stock, parameters", r["max_rel_diff"], r["stock_vs_ref"]),
                  compare("ODC from float64, parameters", r["odc_vs_ref"], r["stock_vs_ref"]))


@pytest.mark.parametrize("nproc", [2, 3])
def test_offloaded_optimizer_with_sampler_counts_matches_one_process(nproc):
    """LB-Mini's plan gives the ranks different microbatch counts; with the optimizer on the host and clipping
    active, ODC is as close to the float64 answer as one fp32 process is, and equals ODC with the optimizer on the
    device bit for bit (the copies to the host and back are exact, the step the same arithmetic). A rank's dropped
    microbatch is far outside the bound."""
    r = run(OFFLOAD_WORKER, nproc, "sampler", "--steps", 4)
    assert r["offloaded"] and r["host_step_ran"], r
    assert any(len(set(c)) > 1 for c in r["counts"]), r["counts"]  # the comparison needs uneven counts somewhere
    assert r["grad_norm"] > 10 * 0.05  # clipping was active
    assert_within(compare("offloaded ODC from float64", r["offload_vs_ref64"], r["ref32_vs_ref64"]),  # 5.4e-8 both
                  compare("offloaded ODC from one fp32 process", r["offload_vs_ref32"], r["ref32_vs_ref64"]))
    assert r["bits_differ"] == 0, r
    assert_caught(compare("a dropped microbatch, from float64", r["planted_vs_ref64"], r["ref32_vs_ref64"]), margin=100)


def test_offloaded_optimizer_resumes_from_a_checkpoint_exactly(tmp_path):
    """Uneven counts, AdamW on the host (its state in the checkpoint): resuming equals the uninterrupted run."""
    r = run(WORKER, 2, "checkpoint", "--counts", "3,1", "--clip", 0.05, "--offload", "odc", "--dir", tmp_path)
    assert r["max_rel_diff"] == 0.0, r


def test_gradient_apis_with_the_optimizer_on_the_host():
    """DeepSpeed's gradient and parameter APIs between backward and step (read, written, dropped) give stock ZeRO-3's
    answers with ODC's optimizer on the host, as without offload. (Stock with offload_optimizer itself keeps
    averaged_gradients empty, so stock without offload is the reference.)"""
    result = launch(HERE / "dropin_worker.py", 2, ["apis", "--offload", "odc"], timeout=300).check().result
    for rank, diffs in enumerate(result["ranks"]):
        assert all(v > 1e-3 for v in diffs.pop("stock_moved").values()), diffs
        worst = {k: v for k, v in diffs.items() if not v < 1e-5}  # measured <= 9e-8, as without offload
        assert not worst, (rank, worst, diffs)


STATES = ["hp_params", "lp_params", "optim_states", "lp_grads", "contiguous_grad_buffer", "all"]


@pytest.fixture(scope="module")
def states():
    return run(OFFLOAD_WORKER, 2, "states", timeout=600)


@pytest.mark.parametrize("include", STATES)
def test_offload_states_round_trip_is_exact(states, include):
    """DeepSpeed's offload_states test sequence (each include option, pinned or not, blocking or not; a training
    step before each), ODC next to stock: every state comes back bit for bit, lp_params and lp_grads really leave
    ODC's shared memory (its pages read as zeros while offloaded), and training goes on to where stock's does."""
    pinnings = ("pin0-nb0", "pin1-nb1") if include in ("lp_params", "lp_grads", "all") else ("pin1-nb1",)
    for pinning in pinnings:  # ODC's own paths both ways; the states stock moves for ODC too, one way
        case = states["cases"][f"{include}-{pinning}"]
        odc, stock = case["odc"], case["stock"]
        assert odc["changed"] == [] and stock["changed"] == [], case
        assert odc["offloaded_states_left"] == [] == stock["offloaded_states_left"], case
        for where in ("devices_offloaded", "devices_reloaded"):  # ODC has no contiguous gradient bucket to move
            assert odc[where].pop("contiguous_grad_buffer") == [], case
            stock[where].pop("contiguous_grad_buffer")
            assert odc[where] == stock[where], case
        for state in ("lp_params", "lp_grads"):
            if include in (state, "all"):
                assert odc["given_back"][state], (state, case)
    assert states["stock_moved"] > 1e-2
    assert states["odc_vs_stock"] < 1e-5, states  # AdamW, fp32, as without offload_states (measured 1.8e-7)


def test_offload_states_with_the_optimizer_on_the_host_in_bf16():
    """With offload_optimizer DeepSpeed offloads only lp_params (the rest already lives on the host): ODC's bf16
    shards leave shared memory and come back exactly."""
    r = run(OFFLOAD_WORKER, 2, "states", "--include", "all", "--bf16", "--offload-optimizer", timeout=400)
    for name, case in r["cases"].items():
        assert case["odc"]["changed"] == [] == case["stock"]["changed"], (name, case)
        assert case["odc"]["given_back"]["lp_params"], (name, case)
    assert r["odc_vs_stock"] < 1e-2, r  # bf16 resolution (measured 1.1e-3)


def test_offload_states_refused_where_memory_cannot_be_given_back():
    """A transport that cannot give symmetric memory back (NVSHMEM, simulated on CPU) refuses lp_params and lp_grads
    with a message naming them and what to include instead; hp_params and optim_states still move and training goes
    on."""
    r = run(OFFLOAD_WORKER, 2, "refused")
    for name in ("all", "lp_params", "lp_grads"):
        assert r[name].startswith("OdcError: ds_odc: engine.offload_states() cannot move"), r[name]
        assert "include=" in r[name] and "optim_states" in r[name], r[name]
    assert "lp_params" in r["all"] and "lp_grads" in r["all"]
    assert "lp_grads" not in r["lp_params"].split("Leave them out")[0]
    assert r["trains_after"] > 1e-3
