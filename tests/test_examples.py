"""The main job (examples/compare.py -> examples/sft.py) on 2 CPU ranks: four modes, one loss curve."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_odc.testing import cpu_env

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_stock_and_odc_modes_give_the_same_loss_curve(tmp_path):
    """stock+local-sort, stock+lb-micro, odc+lb-micro, odc+lb-mini: 5 steps, fp32, losses agree to 1e-4 relative
    (measured 3e-8), and lb-mini really gives the ranks different microbatch counts."""
    out = tmp_path / "runs.json"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "compare.py"), "--json", str(out)],
                          env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads(out.read_text())
    assert runs["max_rel_loss_diff"] < 1e-4
    assert "largest relative loss difference" in proc.stdout
    uneven = [len({r["microbatches"] for r in step["per_rank"]}) > 1 for step in runs["runs"]["odc + lb-mini"]["steps"]]
    assert any(uneven), "lb-mini should give the ranks different microbatch counts in some step"
    for label, run in runs["runs"].items():
        assert len(run["steps"]) == 5
        for step in run["steps"]:
            assert {"loss", "samples_per_s", "tokens_per_s", "bubble_rate", "step_time_s", "peak_mem_bytes",
                    "per_rank"} <= set(step)
            assert {"busy_s", "wait_s", "microbatches", "tokens"} <= set(step["per_rank"][0])
            assert 0.0 <= step["bubble_rate"] < 1.0


def test_lb_mini_without_odc_is_refused():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(ROOT / "examples" / "sft.py"), "--deepspeed", str(ROOT / "ds_configs" / "zero3_fp32_cpu.json"),
           "--balancer", "lb-mini", "--steps", "1"]
    proc = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "only ODC can run" in proc.stdout + proc.stderr
