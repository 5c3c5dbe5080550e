"""PEFT LoRA adapters in OdcTrainer, OdcSFTTrainer, OdcGRPOTrainer and OdcDPOTrainer with gradient checkpointing,
against the stock trainer with stock ZeRO-3 (see lora_worker.py): adapters and logged values within the bound of
``tests/_support/tolerance.py`` (stock's own distance from float64), only adapter gradients pushed, adapters saved and
resumed exactly, GRPO's and DPO's reference model the base model (adapters disabled) as in TRL."""

from __future__ import annotations

import os

import pytest

from _support.launch import launch
from _support.lora import (DPO_REWARDS, DPO_SCALES, GRPO_SCALES, check_equal_to_stock, check_only_adapters_pushed,
                           uneven)
from _support.tolerance import assert_caught, compare, compare_logs

pytest.importorskip("peft")
pytest.importorskip("trl")

WORKER = os.path.join(os.path.dirname(__file__), "lora_worker.py")


@pytest.fixture(scope="module")
def two_ranks():
    return launch(WORKER, 2, ["trainer,sft,grpo,dpo"], timeout=600).check().result


@pytest.fixture(scope="module")
def three_ranks():
    return launch(WORKER, 3, ["sft"], timeout=300).check().result


# -- OdcTrainer --------------------------------------------------------------------------------------------------------
def test_trainer_adapters_equal_stock(two_ranks):
    case = two_ranks["trainer"]
    assert case["optimizer"] == "OdcOptimizer" and case["stock_moved"] > 1e-2, case["stock_moved"]
    assert case["chunked_loss_on_base_model"]  # OdcTrainer's chunked loss sits under the PeftModel
    assert uneven(case["microbatches"]), case["microbatches"]
    check_equal_to_stock(case)


def test_trainer_planted_error_is_caught(two_ranks):
    case = two_ranks["trainer"]  # one microbatch of rank 0 weighted 1.5 instead of 1
    assert_caught(compare("planted adapters", case["adapters"]["planted"], case["adapters"]["fp64"]))


def test_trainer_pushes_adapter_gradients_only(two_ranks):
    check_only_adapters_pushed(two_ranks["trainer"]["pushes"])


def test_trainer_saves_the_trained_adapters(two_ranks):
    saved = two_ranks["trainer"]["saved"]
    assert saved["keys_match"] and saved["max_abs_diff"] == 0.0, saved


def test_trainer_resumes_adapters_exactly(two_ranks):
    out = two_ranks["trainer"]["resume"]
    assert out["started_elsewhere"] > 0.1  # the resumed trainer's adapters began elsewhere: the checkpoint won
    assert out["losses"][1] == out["losses"][0], out["losses"]
    assert out["adapters"] == 0.0, out


# -- OdcSFTTrainer -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ranks", ["two_ranks", "three_ranks"])
def test_sft_adapters_and_logs_equal_stock(ranks, request):
    case = request.getfixturevalue(ranks)["sft"]
    assert case["optimizer"] == "OdcOptimizer" and case["lora_b_norm"] > 1e-2
    assert uneven(case["microbatches"]), case["microbatches"]
    assert {"loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens"} <= set(case["logs"]["odc"][0])
    check_equal_to_stock(case)
    check_only_adapters_pushed(case["pushes"])


# -- OdcGRPOTrainer ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["packed", "padded"])
def test_grpo_adapters_and_logs_equal_stock(two_ranks, variant):
    case = two_ranks["grpo"]
    assert case["lora_b_norm"] > 1e-2
    assert uneven(case["microbatches"][variant]), case["microbatches"][variant]
    # The reference model is the base model with the adapters disabled, as in TRL: no copy is built, and the KL to it
    # (which grows once the adapters move) equals stock's at every step.
    assert case["ref_model"] == [True] * 4
    assert max(entry["kl"] for entry in case["logs"]["stock"]) > 1e-6
    check_equal_to_stock(case, variant, scales=GRPO_SCALES)
    check_only_adapters_pushed(case["pushes"][variant])


def test_grpo_resumes_adapters_exactly(two_ranks):
    out = two_ranks["grpo"]["resume"]
    assert out["losses"][1] == out["losses"][0], out["losses"]
    assert out["adapters"] == 0.0, out


# -- OdcDPOTrainer -----------------------------------------------------------------------------------------------------
DPO_LOGGED = {"loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
              "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy",
              "num_tokens"}


@pytest.mark.parametrize("run", ["odc", "peft_model"])
def test_dpo_adapters_and_logs_equal_stock(two_ranks, run):
    """``peft_config`` in padding-free rows, and a PeftModel in padded rows, against DPOTrainer with ``peft_config``."""
    case = two_ranks["dpo"]
    assert case["optimizer"] == "OdcOptimizer" and case["lora_b_norm"] > 1e-2
    assert uneven(case["microbatches"][run]), case["microbatches"][run]
    assert DPO_LOGGED <= set(case["logs"][run][0]), sorted(case["logs"][run][0])
    assert case["reference"][run]["checkpointing"] and case["reference"]["stock"]["checkpointing"]
    check_equal_to_stock(case, run, scales=DPO_SCALES)
    check_only_adapters_pushed(case["pushes"][run])


def test_dpo_reference_is_the_base_model(two_ranks):
    """No ``ref_model``, as TRL with PEFT: the reference log-probs are the base model's (adapters disabled; for a
    PeftModel, TRL's frozen copy of its initial adapter, named "ref", which is zero). The rewards (the policy's
    log-probs less the reference's) leave 0 once the adapters move and equal stock's at every step (the test above);
    an ODC run whose reference forwards leave the adapters on logs no reward and trains other adapters: caught."""
    case = two_ranks["dpo"]
    reference, logs = case["reference"], case["logs"]
    assert all(r["ref_model"] for r in reference.values()), reference  # no reference model built
    assert reference["odc"]["adapters"] == reference["stock"]["adapters"] == ["default"], reference
    assert reference["peft_model"]["adapters"] == ["default", "ref"], reference
    assert max(abs(e["rewards/margins"]) for e in logs["stock"]) > 1e-2
    assert_caught(compare("adapters, reference with adapters on", case["adapters"]["planted"],
                          case["adapters"]["fp64"]),
                  *compare_logs("reference with adapters on", logs["planted"], logs["stock"], logs["fp64"],
                                DPO_REWARDS, scales=DPO_SCALES))


def test_dpo_saves_the_trained_adapters(two_ranks):
    saved = two_ranks["dpo"]["saved"]
    assert saved["keys_match"] and saved["max_abs_diff"] == 0.0, saved


def test_dpo_resumes_adapters_exactly(two_ranks):
    out = two_ranks["dpo"]["resume"]
    assert out["started_elsewhere"] > 0.1  # the resumed trainer's adapters began elsewhere: the checkpoint won
    assert None not in out["losses"][0] and out["losses"][1] == out["losses"][0], out["losses"]
    assert out["adapters"] == 0.0, out


# -- the command line: examples/sft.py (benchmarks/e2e.py's SFT path) --------------------------------------------------
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_sft_recipe_trains_adapters(tmp_path):
    """examples/sft.py --lora on 2 CPU ranks: ODC with LB-Mini logs stock ZeRO-3's losses (lb-micro, the same
    minibatches), with gradient checkpointing."""
    import json
    losses = {}
    for config, planner in (("zero3_odc_fp32_cpu", "lb-mini"), ("zero3_fp32_cpu", "lb-micro")):
        metrics = tmp_path / f"{planner}.json"
        launch(os.path.join(ROOT, "examples", "sft.py"), 2, [
            "--deepspeed", os.path.join(ROOT, "ds_configs", f"{config}.json"), "--balancer", planner,
            "--length-scale", "0.004", "--max-tokens", "60", "--oversize", "truncate", "--minibatch-size", "4",
            "--num-samples", "48", "--steps", "3", "--lora", "4", "--gradient-checkpointing", "--quiet",
            "--metrics-json", str(metrics)], timeout=180).check()
        losses[planner] = [step["loss"] for step in json.loads(metrics.read_text())["steps"]]
    assert len(losses["lb-mini"]) == 3
    assert max(abs(a - b) for a, b in zip(losses["lb-mini"], losses["lb-micro"])) <= 1e-5, losses

