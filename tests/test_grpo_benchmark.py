"""benchmarks/grpo.py end to end at CPU scale: stock, unsharded (plain) and ODC's trainers run on the same rollouts and
report their timings."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _support.launch import cpu_env
from _support.scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_grpo_benchmark_on_cpu(tmp_path):
    pytest.importorskip("trl")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "grpo.py"), "--out", str(tmp_path), "--model", "tiny",
           "--steps", "2", "--mode-timeout", "240"]
    proc = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "grpo.json").read_text())
    assert set(results) == {"stock", "plain", "odc-padded", "odc-packed"}
    for mode, r in results.items():
        assert r["training_s"] > 0 and r["step_s"] >= r["training_s"] and len(r["steps"]) == 2, (mode, r)
    # the same rollouts: both ODC modes train the stock run's losses (tiny fp32 model, first step exact up to rounding)
    first = results["stock"]["loss"][0]
    assert all(abs(results[m]["loss"][0] - first) <= 1e-5 * max(abs(first), 1.0) for m in results), results
    assert results["odc-packed"]["microbatches"], results["odc-packed"]
    # plain is TRL's trainer without DeepSpeed: same AdamW on the same gradients, so stock's loss at the second step too
    assert results["stock"]["wrapped_model"] == "DeepSpeedEngine" != results["plain"]["wrapped_model"], results
    assert all(abs(p - s) <= 1e-5 * max(abs(s), 1.0) for p, s in zip(results["plain"]["loss"],
                                                                      results["stock"]["loss"], strict=True)), results
    table = (tmp_path / "grpo.md").read_text()
    assert "training vs plain" in table and "| plain |" in table, table
    assert table.count("x |") >= 12 and "command: python benchmarks/grpo.py" in table, table


def test_grpo_lockstep_baseline_and_waits_on_cpu(tmp_path):
    """The partitions' modes at two ranks: ODC's lock-step baseline (equal counts, per-block meetings) and ODC with
    equal counts but no meetings train the same losses as ODC + lb-mini, the equal-count modes give every rank the
    same number of microbatches, and every mode reports how much of its steps the ranks spent waiting."""
    pytest.importorskip("trl")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "grpo.py"), "--out", str(tmp_path), "--model", "tiny",
           "--ranks", "2", "--modes", "odc-packed,odc-equal-packed,lockstep-packed", "--steps", "2",
           "--mode-timeout", "240", "--per-device-batch", "2"]
    proc = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "grpo.json").read_text())
    odc, equal, lockstep = results["odc-packed"], results["odc-equal-packed"], results["lockstep-packed"]
    for r in (odc, equal, lockstep):
        assert 0.0 <= r["wait_share"] < 1.0 and all("wait_s" in step for step in r["steps"]), r
    for r in (equal, lockstep):
        assert all(abs(a - b) <= 1e-5 * max(abs(b), 1.0) for a, b in zip(r["loss"], odc["loss"], strict=True))
        assert all(len(set(counts)) == 1 for counts in r["microbatches"]), r["microbatches"]
    table = (tmp_path / "grpo.md").read_text()
    assert f"| {lockstep['wait_share']:.1%} |" in table, table


def test_grpo_modes_set_their_planner_and_meetings():
    """Each ODC mode's trainer settings: the partitions' three packed modes differ in exactly the planner and the
    meetings, so their table splits ODC's gain into the two."""
    grpo = load_script(ROOT / "benchmarks" / "grpo.py")
    assert grpo.odc_settings("stock") is None and grpo.odc_settings("plain") is None
    assert grpo.odc_settings("odc-padded") == {"padding_free": False, "planner": "lb-mini", "lockstep": False}
    assert grpo.odc_settings("odc-packed") == {"padding_free": True, "planner": "lb-mini", "lockstep": False}
    assert grpo.odc_settings("odc-equal-packed") == {"padding_free": True, "planner": "lb-micro", "lockstep": False}
    assert grpo.odc_settings("lockstep-packed") == {"padding_free": True, "planner": "lb-micro", "lockstep": True}
    assert set(grpo.PARTITION_ALLOWED) == {m for m in grpo.MODES if m.endswith("-packed")}


def test_grpo_benchmark_refuses_plain_on_several_ranks(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "grpo.py"), "--out", str(tmp_path), "--model", "tiny",
           "--modes", "stock,plain/compiled", "--ranks", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--ranks 1" in proc.stderr, proc.stderr
    assert not any(tmp_path.iterdir())  # refused before the model is saved
