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


def test_unsharded_adapters_take_the_model_dtype():
    # TRL's peft_config makes adapters float32 in a bf16 model unless ZeRO-3 is on; the benchmarks' plain mode casts
    # them so that every mode trains bf16 adapters of the same initial values (the cast of each value, exactly).
    pytest.importorskip("peft")
    import torch
    from peft import get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ds_odc.recipes.lora import lora_config

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _modes import adapters_in_model_dtype
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    model = get_peft_model(Qwen2ForCausalLM(config).to(torch.bfloat16), lora_config(4))
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and {p.dtype for p in trainable.values()} == {torch.float32}  # PEFT's default upcast
    adapters_in_model_dtype(model)
    after = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert after.keys() == trainable.keys() and all("lora_" in n for n in after)
    for name, p in after.items():
        assert p.dtype == torch.bfloat16 and torch.equal(p, trainable[name].to(torch.bfloat16)), name
    assert lora_config(None) is lora_config(0) is None  # no --lora: the trainers get peft_config=None
