"""OdcTrainer on 2 CPU ranks: exact global-token-mean semantics against the stock Trainer, metrics, resume."""

from __future__ import annotations

import os

import pytest

from _support.launch import launch

WORKER = os.path.join(os.path.dirname(__file__), "hf_worker.py")
REL_TOL = 1e-4


def rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def equivalence():
    return launch(WORKER, 2, ["equivalence"], timeout=240).check().result


def test_odc_lb_mini_matches_stock_zero3_loss_curve(equivalence):
    loss, norm = equivalence["loss"], equivalence["grad_norm"]
    assert equivalence["global_steps"] == [4, 4, 4]
    assert equivalence["optimizer"] == "OdcOptimizer" and equivalence["stock_optimizer"] != "OdcOptimizer"
    assert rel_diff(loss["odc"], loss["stock"]) <= REL_TOL, loss
    assert rel_diff(norm["odc"], norm["stock"]) <= REL_TOL, norm  # same gradients, not only the same loss
    assert loss["stock"][-1] < loss["stock"][0]  # it trained
    # ...with OdcTrainer's defaults for packed rows: ds_odc_varlen attention and the chunked loss (stock: sdpa, logits)
    assert equivalence["odc_attention"] == "ds_odc_varlen" and equivalence["odc_chunked_loss"]


def test_packs_were_uneven(equivalence):
    # The comparison above only means something if LB-Mini gave the ranks different microbatch counts somewhere.
    counts = equivalence["microbatch_counts"]
    assert len(counts) == 4 and all(None not in c for c in counts)
    assert any(len(set(c)) > 1 for c in counts), counts


def test_odc_off_is_the_stock_trainer(equivalence):
    loss, norm = equivalence["loss"], equivalence["grad_norm"]
    assert loss["odc_off"] == loss["stock"] and norm["odc_off"] == norm["stock"]


def test_balance_metrics_are_logged(equivalence):
    bubbles, rates = equivalence["bubble"], equivalence["samples_per_second"]
    assert len(bubbles) == 4 and all(0.0 <= b < 1.0 for b in bubbles), bubbles
    assert all(r > 0 for r in rates), rates
    assert equivalence["train_samples"] == 8  # per_device 2 x GAS 2 x 2 ranks per optimizer step


def test_resume_continues_with_the_same_losses():
    out = launch(WORKER, 2, ["resume"], timeout=240).check().result
    assert out["saved_state"]["epoch"] == 0 and out["saved_state"]["step"] == 3
    assert out["saved_state"]["planner"] == "lb-mini" and out["saved_state"]["world_size"] == 2
    assert out["saved_state"]["auto_cost"]["observed"] == 3  # the automatic cost's fit resumes with the data order
    assert out["cost_logged"], "odc/cost_* (the automatic cost) should reach the logs"
    full = [out["full"][str(s)] for s in (4, 5, 6)]
    resumed = [out["resumed"][str(s)] for s in (4, 5, 6)]
    assert rel_diff(resumed, full) <= 1e-6, (resumed, full)
    assert out["epochs"] == [1.5, 1.5]  # crossed into the second epoch (4 steps per epoch)
    # The restored sampler started at minibatch 3: minibatches 0-2 of epoch 0 were skipped without re-planning.
    planned = [tuple(p) for p in out["planned"]]
    assert (0, 3) in planned and not any(e == 0 and s < 3 for e, s in planned), planned


EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf_trainer_sft.py")


def test_example_runs_on_cpu(tmp_path):
    """...with warnings shown as a user sees them: none about accumulation steps or DeepSpeed's deprecated calls."""
    out = launch(EXAMPLE, 2, ["--max-steps", "3", "--output-dir", str(tmp_path)], timeout=180,
                 env={"PYTHONWARNINGS": "default"}).check()
    assert "done: 3 steps" in out.stdout, out.stdout[-2000:]
    assert "odc/bubble" in out.stdout  # the balance metrics reach the console logs
    logs = out.stdout + out.stderr
    assert "Gradient accumulation steps mismatch" not in logs, logs[-3000:]
    assert "all_gather_into_tensor` is deprecated" not in logs and "reduce_scatter_tensor` is deprecated" not in logs


def test_trl_example_runs_on_cpu(tmp_path):
    pytest.importorskip("trl")
    example = os.path.join(os.path.dirname(EXAMPLE), "trl_sft.py")
    out = launch(example, 2, ["--max-steps", "2", "--output-dir", str(tmp_path)], timeout=180).check()
    assert "done: 2 steps" in out.stdout and "odc/bubble" in out.stdout, out.stdout[-2000:]


def test_trl_sft_logs_equal_stock_sft_trainer():
    """OdcSFTTrainer (uneven packs) against TRL's SFTTrainer with stock ZeRO-3 and the same arguments, fed the
    minibatches in the plan's order: every metric SFTTrainer logs (loss, grad_norm, entropy, mean_token_accuracy,
    num_tokens, ...) at every step, to 1e-5 relative (observed about 1e-7)."""
    pytest.importorskip("trl")
    out = launch(WORKER, 2, ["sft"], timeout=300).check().result
    assert out["optimizers"] == ["OdcOptimizer", "DeepSpeedZeroOptimizer_Stage3"]
    assert out["odc_attention"] == "ds_odc_varlen"
    assert any(len(set(c)) > 1 for c in out["microbatch_counts"]), out["microbatch_counts"]
    odc, stock = out["odc"], out["stock"]
    assert len(odc) == len(stock) == 4
    for mine, theirs in zip(odc, stock):
        assert set(mine) == set(theirs), set(mine) ^ set(theirs)
        assert {"loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens"} <= set(mine)
        far = {k: abs(mine[k] - theirs[k]) / max(abs(theirs[k]), 1e-6) for k in mine}
        assert max(far.values()) <= 1e-5, far


def test_stock_trainer_with_the_optimizer_on_the_host():
    """transformers' Trainer, offload_optimizer to the CPU (torch's AdamW there), equal counts: "odc": true logs the
    same loss and gradient norm as stock ZeRO-3 with the same offload at every step, and ends at its parameters."""
    out = launch(WORKER, 2, ["offload"], timeout=240).check().result
    assert out["stock"]["offloaded"] and out["odc"]["offloaded"] and out["odc"]["optimizer"] == "OdcOptimizer", out
    assert rel_diff(out["odc"]["loss"], out["stock"]["loss"]) <= REL_TOL, out  # measured 0
    assert rel_diff(out["odc"]["grad_norm"], out["stock"]["grad_norm"]) <= REL_TOL, out  # measured 4e-7
    assert out["params_rel_diff"] <= REL_TOL and out["moved"] > 1e-2, out  # measured 2e-8
