"""PEFT LoRA adapters on CUDA in all four ODC trainers (OdcTrainer, OdcSFTTrainer, OdcGRPOTrainer, OdcDPOTrainer,
gradient checkpointing on) against the stock trainer with stock ZeRO-3, at 2 ranks: the scenarios of
tests/integrations/lora_worker.py with the same checks as tests/integrations/test_lora.py (adapters and logged values
within stock's own distance from a float64 run, only adapter gradients pushed, adapters saved and resumed exactly),
on two GPUs or as two processes sharing GPU 0 (gloo, one NVSHMEM PE per process).

    python -m pytest tests/gpu/test_lora_gpu.py -q        # needs peft and trl (pip install 'trl>=1.16,<1.17' peft)
"""

from pathlib import Path

import pytest

from _launch import launch_gpu, rank_params  # tests/gpu is on sys.path (rootdir conftest)

pytest.importorskip("peft")
pytest.importorskip("trl")
pytestmark = [pytest.mark.gpu, pytest.mark.slow]

INTEGRATIONS = Path(__file__).resolve().parents[1] / "integrations"
WORKER = INTEGRATIONS / "lora_worker.py"


def checks():
    import sys
    sys.path.insert(0, str(INTEGRATIONS))
    import test_lora
    return test_lora


@pytest.mark.parametrize("nproc", rank_params(2))
def test_lora_adapters_equal_stock_on_gpu(nvshmem_op, nproc):
    check_all(launch_gpu(WORKER, nproc, ["trainer,sft,grpo,dpo"], timeout=540).check().result)


def check_all(r: dict) -> None:
    t = checks()
    for name in ("trainer", "sft", "dpo"):
        assert r[name]["optimizer"] == "OdcOptimizer", (name, r[name]["optimizer"])
    t.check_equal_to_stock(r["trainer"])
    t.check_equal_to_stock(r["sft"])
    for variant in ("packed", "padded"):
        t.check_equal_to_stock(r["grpo"], variant, scales=t.GRPO_SCALES)
        t.check_only_adapters_pushed(r["grpo"]["pushes"][variant])
    for run in ("odc", "peft_model"):
        t.check_equal_to_stock(r["dpo"], run, scales=t.DPO_SCALES)
    for name in ("trainer", "sft"):
        t.check_only_adapters_pushed(r[name]["pushes"])
    for run in ("odc", "peft_model"):
        t.check_only_adapters_pushed(r["dpo"]["pushes"][run])
    for name in ("trainer", "dpo"):
        saved = r[name]["saved"]
        assert saved["keys_match"] and saved["max_abs_diff"] == 0.0, (name, saved)
    for name in ("trainer", "grpo", "dpo"):
        out = r[name]["resume"]
        assert out["losses"][1] == out["losses"][0] and out["adapters"] == 0.0, (name, out)
    assert any(len(set(step)) > 1 for step in r["sft"]["microbatches"]), r["sft"]["microbatches"]
