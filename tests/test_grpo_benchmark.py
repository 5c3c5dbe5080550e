"""benchmarks/grpo.py end to end at CPU scale: stock, unsharded (plain) and ODC's trainers run on the same rollouts and
report their timings."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _support.launch import cpu_env

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
    """The partitions' pair at two ranks: ODC's lock-step baseline (equal counts, per-block meetings) trains the same
    losses as ODC + lb-mini, and both report how much of their steps the ranks spent waiting for each other."""
    pytest.importorskip("trl")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "grpo.py"), "--out", str(tmp_path), "--model", "tiny",
           "--ranks", "2", "--modes", "odc-packed,lockstep-packed", "--steps", "2", "--mode-timeout", "240"]
    proc = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "grpo.json").read_text())
    odc, lockstep = results["odc-packed"], results["lockstep-packed"]
    for r in (odc, lockstep):
        assert 0.0 <= r["wait_share"] < 1.0 and all("wait_s" in step for step in r["steps"]), r
    assert all(abs(a - b) <= 1e-5 * max(abs(b), 1.0) for a, b in zip(lockstep["loss"], odc["loss"], strict=True))
    table = (tmp_path / "grpo.md").read_text()
    assert f"| {lockstep['wait_share']:.1%} |" in table, table


def test_grpo_benchmark_refuses_plain_on_several_ranks(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "grpo.py"), "--out", str(tmp_path), "--model", "tiny",
           "--modes", "stock,plain/compiled", "--ranks", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--ranks 1" in proc.stderr, proc.stderr
    assert not any(tmp_path.iterdir())  # refused before the model is saved
