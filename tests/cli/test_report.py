"""``python -m ds_odc`` (the environment report) and ``python -m ds_odc check CONFIG.json``."""

import json
import subprocess
import sys

import pytest
import torch

from ds_odc.__main__ import main
from ds_odc.config import OdcConfig
from ds_odc.cli.report import field_docs, odc_defaults


def line_of(report: str, name: str) -> str:
    found = [line for line in report.splitlines() if line.startswith(name + " ")]
    assert len(found) == 1, (name, report)
    return found[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU verdicts")
def test_report_on_cpu_names_shm_available_and_nvshmem_not_with_the_reason():
    proc = subprocess.run([sys.executable, "-m", "ds_odc"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = proc.stdout
    for name in ("torch", "deepspeed", "transformers", "NVSHMEM", "nvshmem4py"):
        line_of(report, name)
    assert "[OKAY]" in line_of(report, "shm (CPU ranks of one host)")
    nvshmem = report[report.index("nvshmem (CUDA ranks)"):]
    assert nvshmem.startswith("nvshmem (CUDA ranks) ") and "[NO]" in nvshmem.splitlines()[0]
    assert "CPU-only build; install a CUDA build of torch" in nvshmem.splitlines()[0]
    assert "[OKAY]" in line_of(report, "odc config key")
    assert "[OKAY]" in line_of(report, "kernel sources")
    assert line_of(report, "GPUs").endswith("none visible")
    for key in OdcConfig.model_fields:
        assert f"\n{key} = " in report
    assert "\x1b[" not in report  # no colour codes when stdout is not a terminal


def test_every_odc_key_has_a_default_and_a_meaning():
    docs = field_docs(OdcConfig)
    assert set(docs) == set(OdcConfig.model_fields)
    rows = {key: (default, meaning) for key, default, meaning in odc_defaults()}
    assert rows["transport"][0] == '"auto"' and rows["enabled"][0] == "true"
    assert all(len(meaning) > 20 for _, meaning in rows.values()), rows


def test_check_accepts_a_valid_config_and_names_a_misspelt_odc_key(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"train_batch_size": "auto", "zero_optimization": {
        "stage": 3, "odc": {"timeout_s": 60}, "stage3_prefetch_bucket_size": "auto"}}))
    assert main(["check", str(good)]) == 0
    assert '"timeout_s": 60.0' in capsys.readouterr().out

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 3, "odc": {"transprt": "shm"}}}))
    assert main(["check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "zero_optimization.odc.transprt\n" in err and "did you mean 'transport'?" in err, err
    assert "OdcZeroConfig" not in err

    stage2 = tmp_path / "stage2.json"
    stage2.write_text(json.dumps({"zero_optimization": {"stage": 2, "odc": True}}))
    assert main(["check", str(stage2)]) == 1
    assert "zero_optimization.stage=2 is not supported" in capsys.readouterr().err

    assert main(["check", str(tmp_path / "missing.json")]) == 2
