"""Split samples (lb-mini-sp) trained under ZeRO-3 + ODC on CPU ranks, against one process training the same
minibatches. Each test launches ranks through ``_support.launch.launch`` (hard timeout, short process-group timeout)
running a scenario of ``split_worker.py``; rank 0 reports numbers, asserted here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _support.launch import REPO, cpu_env, launch
from _support.tolerance import SCALAR_ULPS, assert_within, compare

WORKER = Path(__file__).with_name("split_worker.py")
pytestmark = pytest.mark.slow


def run(nproc, *args, timeout=240):
    return launch(WORKER, nproc, [str(a) for a in args], timeout=timeout).check().result


def _check_equivalence(r, world):
    """Parameters and losses after 3 SGD steps against the one-process reference, within the bounds of
    tests/_support/tolerance.py (the reference: its own distance from float64); every step had a split sample; in
    some step the ranks ran different numbers of microbatches."""
    assert r["moved"] > 1e-2, r  # the steps changed the parameters: an equality after no update proves nothing
    assert len(r["losses"]) == len(r["ref_losses"]) == 3, r
    loss_diff = max(abs(got - want) / abs(want) for got, want in zip(r["losses"], r["ref_losses"]))
    assert_within(compare("parameters vs one process (max over tensors, relative)", r["max_rel_diff"],
                          r["ref_rounding"]),
                  compare("losses vs one process (max, relative)", loss_diff, r["ref_loss_rounding"],
                          ulps=SCALAR_ULPS))
    assert all(split for split in r["splits"]), r  # every step had a split sample
    counts = r["counts"]  # per rank, microbatches per step (a split sample's slice counts as one)
    assert any(len({counts[rank][step] for rank in range(world)}) > 1 for step in range(len(counts[0]))), counts


def test_two_ranks_llama_split_sample_with_checkpointing_and_chunked_loss():
    """A 40-token sample split over ranks [0, 1] (one KV head: Ulysses replicates it), packed short samples around
    it, activation checkpointing (attention recomputed over the group in the backward), the model's chunked loss
    from shift_labels and num_items_in_batch (docs/SEQUENCE_PARALLEL.md's loop): 3 SGD steps."""
    r = run(2, "train", "--model", "llama", "--checkpointing", "--chunked-loss")["llama"]
    _check_equivalence(r, 2)
    assert r["splits"][0] == [[0, [0, 1], "2x1"]]
    assert "no attention layer ran over the group [0, 1]" in r["refused"] and "ds_odc_sp" in r["refused"], r


def test_four_ranks_qwen2_pairs_and_a_group_of_four():
    """Ranks [0, 1] train a split sample while ranks 2 and 3 train short ones, with different microbatch counts; in
    the last step an 80-token sample goes to all four ranks (two KV heads replicated to four) and the 40-token one to
    [0, 1] after it: nested groups, met in the plan's order."""
    r = run(4, "train", "--model", "qwen2", timeout=300)["qwen2"]
    _check_equivalence(r, 4)
    assert r["splits"][0] == [[0, [0, 1], "2x1"]]
    assert r["splits"][2] == [[0, [0, 1, 2, 3], "4x1"], [1, [0, 1], "2x1"]]


def test_eight_ranks_ring_and_ulysses_times_ring_groups_of_2_4_and_8():
    """One launch, two models, activation checkpointing: a tiny Qwen2 whose 3 heads Ulysses cannot share, so its
    groups of 2, 4 and 8 are rings (keys and values gathered over the group, head-tail chunks), and a tiny Llama
    with 2 heads, whose groups of 4 and 8 are 2 Ulysses ranks x 2 or 4 ring ranks. Samples of 160, 80 and 40
    tokens split while the other ranks train short ones with different microbatch counts."""
    results = run(8, "train", "--model", "qwen2-ring,llama-2x", "--checkpointing", timeout=420)
    ring, mixed = results["qwen2-ring"], results["llama-2x"]
    for r in (ring, mixed):
        _check_equivalence(r, 8)
    assert ring["splits"][0] == [[0, list(range(8)), "1x8"], [1, [0, 1], "1x2"]]
    assert ring["splits"][1] == [[0, [0, 1, 2, 3], "1x4"], [1, [4, 5], "1x2"], [2, [6, 7], "1x2"]]
    assert mixed["splits"][0] == [[0, list(range(8)), "2x4"], [1, [0, 1], "2x1"]]
    assert mixed["splits"][1][0] == [0, [0, 1, 2, 3], "2x2"]


def test_absent_member_fails_its_partner_naming_it():
    r = launch(WORKER, 2, ["member_fails", "--timeout", "6"], timeout=120, launcher="plain")
    err = r.results[-1]
    assert err["error_type"] == "SplitSampleError" and err["missing"] == [1] and err["group"] == [0, 1], err
    assert "ranks [1] did not arrive" in err["error"] and "timeout_s" in err["error"], err
    assert 5 < err["after_s"] < 30, err  # the group's timeout, not gloo's 30-minute default


def test_dead_member_of_a_ring_fails_its_partner_at_once():
    """The ring's all-gather of keys and values, not Ulysses' all-to-all, meets the dead member first."""
    r = launch(WORKER, 2, ["member_fails", "--model", "qwen2-ring", "--timeout", "20", "--kill"], timeout=120,
               launcher="plain")
    err = r.results[-1]
    assert err["error_type"] == "SplitSampleError" and err["missing"] == [1], err
    assert err["after_s"] < 15, err  # a closed connection is noticed at once, well before the 20 s timeout


def test_efficiency_benchmark_runs_on_cpu(tmp_path):
    """benchmarks/split_efficiency.py at a tiny scale (the numbers mean nothing on CPU; the GPU run measures them)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "benchmarks" / "split_efficiency.py"), "--model", "tiny", "--lengths", "64", "--repeats", "1",
           "--deepspeed", str(REPO / "ds_configs" / "zero3_odc_fp32_cpu.json"), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads((tmp_path / "split_efficiency.json").read_text())["rows"]
    assert [r["shape"] for r in rows] == ["2x1", "1x2"]  # Ulysses alone, then ring alone
    assert all(r["length"] == 64 and r["alone_s"] > 0 and r["efficiency"] > 0 for r in rows), rows
