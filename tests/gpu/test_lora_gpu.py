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
from _support.tolerance import assert_within, compare
from _support.lora import DPO_SCALES, GRPO_SCALES, check_equal_to_stock, check_only_adapters_pushed, uneven

pytest.importorskip("peft")
pytest.importorskip("trl")
pytestmark = [pytest.mark.gpu, pytest.mark.slow]

WORKER = Path(__file__).resolve().parents[1] / "integrations" / "lora_worker.py"


@pytest.mark.parametrize("nproc", rank_params(2))
def test_lora_adapters_equal_stock_on_gpu(nvshmem_op, nproc):
    check_all(launch_gpu(WORKER, nproc, ["trainer,sft,grpo,dpo"], timeout=540).check().result)


def check_resumed(name: str, case: dict, loss_scale: float = 0.0) -> None:
    """The resumed run against the uninterrupted one. On CUDA, peers' pushes land as atomic adds in arrival order, so
    the accumulated sums round differently from run to run (on the CPU they are exact): the two runs may differ by
    that rounding, bounded by stock's own distance from float64, never by a lost or repeated step."""
    out = case["resume"]
    assert out.get("started_elsewhere", 1.0) > 0.1, out  # adapters that began elsewhere: the checkpoint won
    full, resumed = ([*x.values()] if isinstance(x, dict) else x for x in out["losses"])
    assert len(full) == len(resumed) > 0, out
    losses = max(abs(a - b) / max(abs(b), loss_scale) for a, b in zip(resumed, full))
    reference = case["adapters"]["fp64"]
    assert_within(compare(f"{name}: resumed adapters", out["adapters"], reference),
                  compare(f"{name}: resumed losses", losses, reference))


def check_all(r: dict) -> None:
    """The CPU tests' checks on every trainer's case (tests/_support/lora.py)."""
    for name in ("trainer", "sft", "dpo"):
        assert r[name]["optimizer"] == "OdcOptimizer", (name, r[name]["optimizer"])
    check_equal_to_stock(r["trainer"])
    check_equal_to_stock(r["sft"])
    for variant in ("packed", "padded"):
        check_equal_to_stock(r["grpo"], variant, scales=GRPO_SCALES)
        check_only_adapters_pushed(r["grpo"]["pushes"][variant])
    for run in ("odc", "peft_model"):
        check_equal_to_stock(r["dpo"], run, scales=DPO_SCALES)
        check_only_adapters_pushed(r["dpo"]["pushes"][run])
    for name in ("trainer", "sft"):
        check_only_adapters_pushed(r[name]["pushes"])
    for name in ("trainer", "dpo"):
        saved = r[name]["saved"]
        assert saved["keys_match"] and saved["max_abs_diff"] == 0.0, (name, saved)
    for name in ("trainer", "grpo", "dpo"):
        check_resumed(name, r[name], loss_scale=GRPO_SCALES["loss"] if name == "grpo" else 0.0)
    assert uneven(r["sft"]["microbatches"]), r["sft"]["microbatches"]
