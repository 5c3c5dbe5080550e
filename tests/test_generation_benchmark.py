"""benchmarks/generation.py end to end at CPU scale: every mode runs, decodes the drawn lengths, and matches plain."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _support.launch import cpu_env

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_generation_benchmark_on_cpu(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "generation.py"), "--out", str(tmp_path), "--model", "tiny",
           "--prompts", "6", "--prompt-len", "24", "--max-new", "16", "--mode-timeout", "120"]
    proc = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "generation.json").read_text())
    assert set(results) == {"plain", "zero3-synced", "zero3-gather", "odc-block", "odc-full"}
    assert all(r["lengths_ok"] and r["tokens_per_second"] > 0 for r in results.values()), results
    table = (tmp_path / "generation.md").read_text()
    assert table.count("| yes |") == 4, table  # every sharded mode decoded exactly the unsharded model's tokens
