"""benchmarks/dpo.py end to end at CPU scale: stock DPOTrainer (padded and padding_free), DPOTrainer unsharded (plain)
and OdcDPOTrainer (padded and padding-free) train the same pairs and report their timings."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from _support.launch import cpu_env

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_dpo_benchmark_on_cpu(tmp_path):
    pytest.importorskip("trl")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "dpo.py"), "--out", str(tmp_path), "--model", "tiny",
           "--steps", "2", "--mode-timeout", "240"]
    proc = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "dpo.json").read_text())
    assert set(results) == {"stock", "stock-padding-free", "plain", "odc-padded", "odc-packed"}
    for mode, r in results.items():
        assert r["step_s"] > 0 and r["pairs_per_s"] > 0 and len(r["steps"]) == 2, (mode, r)
        assert abs(r["loss"][0] - math.log(2)) <= 1e-5, (mode, r["loss"])  # the policy starts as its reference
    assert results["odc-packed"]["microbatches"] and results["odc-padded"]["microbatches"], results
    # plain is DPOTrainer without DeepSpeed: the same AdamW step on the same gradients, so at step 2 (which moved the
    # loss 2.7e-5 away from log 2) stock's loss again
    assert results["stock"]["wrapped_model"] == "DeepSpeedEngine" != results["plain"]["wrapped_model"], results
    assert abs(results["plain"]["loss"][1] - results["stock"]["loss"][1]) <= 1e-6, results
    table = (tmp_path / "dpo.md").read_text()
    assert "vs plain" in table and "| plain |" in table, table
    assert table.count("x |") >= 15 and "command: python benchmarks/dpo.py" in table, table
