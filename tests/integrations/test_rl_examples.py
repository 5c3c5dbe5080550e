"""The GRPO, DPO and TRL SFT examples started the way TRL users start them: ``accelerate launch --config_file`` with a
ZeRO-3 accelerate config whose ``deepspeed_config_file`` turns ODC on (2 CPU ranks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from _support.launch import cpu_env

pytest.importorskip("trl")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "ds_configs" / "accelerate_zero3_odc_cpu.yaml"


def accelerate_launch(script: str, *args: str, timeout: float = 300) -> str:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
           str(ROOT / "examples" / script), *args]
    proc = subprocess.run(cmd, env=cpu_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def test_grpo_example_under_accelerate_launch(tmp_path):
    out = accelerate_launch("grpo.py", "--max-steps", "2", "--output-dir", str(tmp_path), "--log-dicts")
    assert "done: 2 steps (odc + lb-mini)" in out, out[-2000:]
    for key in ("odc/microbatches_rank1", "odc/bubble", "odc/generation_tokens_per_second", "odc/step_wait_seconds"):
        assert key in out, key


def test_trl_sft_example_under_accelerate_launch(tmp_path):
    out = accelerate_launch("trl_sft.py", "--max-steps", "2", "--output-dir", str(tmp_path))
    assert "done: 2 steps" in out and "(bubble " in out, out[-2000:]


def test_dpo_example_under_accelerate_launch(tmp_path):
    out = accelerate_launch("dpo.py", "--max-steps", "5", "--output-dir", str(tmp_path), "--log-dicts")
    assert "done: 5 steps (odc + lb-mini)" in out, out[-2000:]  # the automatic cost is fitted after a few steps
    for key in ("odc/microbatches_rank1", "odc/bubble", "odc/cost_b", "rewards/accuracies", "logps/chosen"):
        assert key in out, key
