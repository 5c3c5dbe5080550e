"""Single-process checks of the step-runner's choices (no distributed run, no training): the balancer options a
trainer builds from its keywords, the split policy it fills in, and the runner it picks."""

from __future__ import annotations

import pytest

from ds_odc.balancer import BalancerOptions, QuadraticCost, SplitPolicy
from ds_odc.integrations._runner import Microbatch, StepRunner
from ds_odc.integrations._setup import balancer_options, one_pack_per_step, with_split_policy

CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2}
LOOSE = dict(balancer_planner="lb-mini", max_tokens_per_microbatch=None, length_column="input_ids",
             balancer_cost="auto", oversize="error", split_policy=None)


def test_the_keywords_become_one_options_record():
    cost = QuadraticCost(a=1.0, b=0.1)
    options = balancer_options(None, **{**LOOSE, "max_tokens_per_microbatch": 64, "balancer_cost": cost,
                                        "oversize": "truncate", "length_column": "n"})
    assert options == BalancerOptions(max_tokens=64, cost=cost, oversize="truncate", length_column="n")
    given = BalancerOptions(planner="lb-micro", max_tokens=32)
    assert balancer_options(given, **LOOSE) is given  # the keywords at their defaults: the record wins
    with pytest.raises(ValueError, match="either as balancer=BalancerOptions.* drop max_tokens_per_microbatch, oversize"):
        balancer_options(given, **{**LOOSE, "max_tokens_per_microbatch": 16, "oversize": "skip"})
    with pytest.raises(ValueError, match="drop balancer_cost"):  # a cost model is never the default "auto"
        balancer_options(given, **{**LOOSE, "balancer_cost": QuadraticCost(a=1.0, b=0.0)})
    # Each error names the keyword as the caller wrote it, not the record's field.
    with pytest.raises(ValueError, match="^ds_odc: oversize='drop': unknown oversize policy 'drop'"):
        balancer_options(None, **{**LOOSE, "oversize": "drop"})
    with pytest.raises(ValueError, match="^ds_odc: balancer_planner='lb-maxi': unknown planner"):
        balancer_options(None, **{**LOOSE, "balancer_planner": "lb-maxi"})
    with pytest.raises(ValueError, match="^ds_odc: max_tokens_per_microbatch=0: max_tokens must be a positive int"):
        balancer_options(None, **{**LOOSE, "max_tokens_per_microbatch": 0})
    with pytest.raises(ValueError, match="^ds_odc: balancer_cost='flops': unknown cost model 'flops'"):
        balancer_options(None, **{**LOOSE, "balancer_cost": "flops"})
    with pytest.raises(ValueError, match="must be a ds_odc.balancer.BalancerOptions"):
        balancer_options({"planner": "lb-mini"}, **LOOSE)


def test_the_split_policy_is_filled_in_for_a_planner_that_splits(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    filled = with_split_policy(BalancerOptions(planner="lb-mini-sp"), CONFIG)
    assert filled.split == SplitPolicy.from_hf_config(CONFIG, ranks_per_node=4)
    mine = SplitPolicy(max_group_size=2)
    assert with_split_policy(BalancerOptions(planner="lb-mini-sp", split=mine), CONFIG).split is mine
    assert with_split_policy(BalancerOptions(split=mine), CONFIG).split is None  # lb-mini never splits


def test_odc_off_picks_the_stock_runner(tmp_path):
    """Without odc in the DeepSpeed config the trainer's runner hands every hook to the stock method."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from ds_odc.integrations.transformers import OdcTrainer

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=2,
                             gradient_accumulation_steps=3)
    data = [{"input_ids": torch.arange(1, 6)} for _ in range(4)]
    trainer = OdcTrainer(model, args, train_dataset=data, balancer=BalancerOptions(max_tokens=64))
    assert type(trainer.odc_runner) is StepRunner and not trainer.odc and trainer.odc_pack_sampler is None
    assert trainer.args.gradient_accumulation_steps == 3  # untouched: the stock loop accumulates
    assert trainer.get_total_train_batch_size(trainer.args) == 6
    copy, samples_per_rank = one_pack_per_step(args)  # what ODC would train with instead
    assert (copy.gradient_accumulation_steps, samples_per_rank, args.gradient_accumulation_steps) == (1, 6, 3)


def test_grpo_refuses_balancer_options_rollouts_cannot_use(tmp_path):
    pytest.importorskip("trl")
    from trl import GRPOConfig

    from ds_odc.integrations.trl_grpo import _refusals

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=4,
                      num_generations=4)
    assert _refusals(args, {}, BalancerOptions(max_tokens=64, cost="tokens")) == []
    refused = "; ".join(_refusals(args, {}, BalancerOptions(planner="lb-mini-sp", oversize="skip",
                                                            length_column="n")))
    assert "balancer_planner='lb-mini-sp'" in refused and "oversize='skip'" in refused and "length_column='n'" in refused


def test_a_microbatch_is_a_frozen_record():
    mb = Microbatch({"input_ids": None}, (3, 1), (0, 1), label_tokens=7, step_label_tokens=20, step_samples=8)
    with pytest.raises(Exception):
        mb.sample_ids = (1,)
    assert mb.split is None and mb.metrics is None


def test_a_trainer_warns_of_a_balancer_block_it_does_not_read():
    """A trainer plans with its keywords; a ``zero_optimization.odc.balancer`` block in its ds_config (read only by
    the stock loop) is named in a warning, not ignored without a word."""
    import types
    import warnings

    from ds_odc.integrations._setup import warn_of_unread_balancer_block

    def args(odc):
        config = {"zero_optimization": {"stage": 3, "odc": odc}}
        return types.SimpleNamespace(hf_deepspeed_config=types.SimpleNamespace(config=config))

    with pytest.warns(UserWarning, match="OdcTrainer plans with its own keywords and does not read "
                                         "zero_optimization.odc.balancer"):
        warn_of_unread_balancer_block(args({"balancer": {"max_tokens": 64}}), "OdcTrainer")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_of_unread_balancer_block(args(True), "OdcTrainer")
        warn_of_unread_balancer_block(args({"enabled": True, "timeout_s": 30}), "OdcTrainer")
        warn_of_unread_balancer_block(None, "OdcTrainer")
        warn_of_unread_balancer_block(types.SimpleNamespace(), "OdcTrainer")  # no DeepSpeed config
