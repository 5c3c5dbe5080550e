"""OdcTrainer on 2 CPU ranks: exact global-token-mean semantics against the stock Trainer, metrics, resume.

The equality bounds are those of tests/_support/tolerance.py: ODC's distance from the stock Trainer + ZeRO-3 against
stock's own distance from the same training in float64 (the stock Trainer through DDP on the same ranks); a
microbatch weighted 1.5 instead of 1 must land far outside them (test_a_wrong_weight_is_caught).
"""

from __future__ import annotations

import os

import pytest

from _hf_workload import equal_to
from _support.launch import launch
from _support.tolerance import assert_caught, assert_within, compare_logs

WORKER = os.path.join(os.path.dirname(__file__), "hf_worker.py")


def rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def equivalence():
    return launch(WORKER, 2, ["equivalence"], timeout=240).check().result


def test_odc_lb_mini_matches_stock_zero3_loss_curve(equivalence):
    loss = equivalence["loss"]
    assert equivalence["global_steps"] == [4, 4, 4]
    assert equivalence["optimizer"] == "OdcOptimizer" and equivalence["stock_optimizer"] != "OdcOptimizer"
    assert equivalence["fp64_run"] == ["torch.float64", "AcceleratedOptimizer"], equivalence["fp64_run"]
    assert_within(*equal_to(equivalence, "odc"))  # the gradient norms too: same gradients, not only the same loss
    assert loss["stock"][-1] < loss["stock"][0]  # it trained
    # ...with OdcTrainer's defaults for packed rows: ds_odc_varlen attention and the chunked loss (stock: sdpa, logits)
    assert equivalence["odc_attention"] == "ds_odc_varlen" and equivalence["odc_chunked_loss"]
    # ...and its attention planned once, before the first step, for the longest sample (within the 48-token budget)
    assert equivalence["planned_attention"] == [[min(equivalence["longest_sample"], 48), equivalence["odc_dtype"], 0]]


def test_a_wrong_weight_is_caught(equivalence):
    """The planted error: OdcTrainer again with one microbatch of rank 0 weighted 1.5 (its gradient counted half
    again) lands far outside the bound of the gradient norms."""
    assert_caught(*(c for c in equal_to(equivalence, "planted") if "grad_norm" in c.what))


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
    # One short line per step, ODC's balance numbers in it, not the Trainer's ~1,000-character dict.
    line = next(line for line in out.stdout.splitlines() if line.startswith("step 3/3  loss "))
    assert "samples/s " in line and " s/step (bubble " in line and len(line) < 160, line
    assert "'odc/bubble'" not in out.stdout, out.stdout[-2000:]
    logs = out.stdout + out.stderr
    assert "Gradient accumulation steps mismatch" not in logs, logs[-3000:]
    assert "all_gather_into_tensor` is deprecated" not in logs and "reduce_scatter_tensor` is deprecated" not in logs


def test_trl_example_runs_on_cpu(tmp_path):
    pytest.importorskip("trl")
    example = os.path.join(os.path.dirname(EXAMPLE), "trl_sft.py")
    out = launch(example, 2, ["--max-steps", "2", "--output-dir", str(tmp_path)], timeout=180).check()
    assert "done: 2 steps" in out.stdout and "(bubble " in out.stdout, out.stdout[-2000:]


def test_trl_sft_logs_equal_stock_sft_trainer():
    """OdcSFTTrainer (uneven packs) against TRL's SFTTrainer with stock ZeRO-3 and the same arguments, fed the
    minibatches in the plan's order: every metric SFTTrainer logs (loss, grad_norm, entropy, mean_token_accuracy,
    num_tokens, ...) at every step, within the bounds of tests/_support/tolerance.py."""
    pytest.importorskip("trl")
    out = launch(WORKER, 2, ["sft"], timeout=300).check().result
    assert out["optimizers"] == ["OdcOptimizer", "DeepSpeedZeroOptimizer_Stage3"]
    assert out["odc_attention"] == "ds_odc_varlen" and out["fp64_dtype"] == "torch.float64"
    assert any(len(set(c)) > 1 for c in out["microbatch_counts"]), out["microbatch_counts"]
    odc, stock = out["odc"], out["stock"]
    assert len(odc) == len(stock) == 4
    for mine, theirs in zip(odc, stock):
        assert set(mine) == set(theirs), set(mine) ^ set(theirs)
        assert {"loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens"} <= set(mine)
    assert_within(*compare_logs("odc", odc, stock, out["fp64"], default_scale=1e-6))  # not parameters: see equal_to


def test_stock_trainer_with_the_optimizer_on_the_host():
    """transformers' Trainer, offload_optimizer to the CPU (torch's AdamW there), equal counts: "odc": true logs the
    same loss and gradient norm as stock ZeRO-3 with the same offload at every step, within stock's own distance from
    a float64 run (tests/_support/tolerance.py)."""
    out = launch(WORKER, 2, ["offload"], timeout=240).check().result
    assert out["stock"]["offloaded"] and out["odc"]["offloaded"] and out["odc"]["optimizer"] == "OdcOptimizer", out
    assert_within(*equal_to(out, "odc"))
    assert out["moved"] > 1e-2, out  # it trained (parameters: AdamW's rounding is heavy-tailed, see equal_to)
