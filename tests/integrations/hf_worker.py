"""Distributed OdcTrainer scenarios, launched by test_hf_trainer.py through ``_support.launch.launch``.

Usage: hf_worker.py SCENARIO; rank 0 prints one ODC_RESULT line.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import ds_odc  # noqa: F401  (the `odc` key must parse before any TrainingArguments)
from _support.launch import emit
from ds_odc.training.distributed import shutdown_and_exit

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "zero"))
from worker import init_ranks  # noqa: E402  (CPU ranks, or GPU ranks under tests/gpu)
from _hf_workload import (ON_CPU, logged, shared_tmpdir, tiny_llama, token_dataset, training_args,  # noqa: E402
                          without_deepspeed)
from _support.tolerance import plant_wrong_weight  # noqa: E402



def scenario_equivalence(tmp: str):
    """Same global minibatches, three ways: OdcTrainer with ODC + LB-Mini (uneven packs), the stock Trainer with
    stock ZeRO-3 (one sample per microbatch, GAS = samples per rank), and OdcTrainer with ODC off (must be stock).
    On CPU ranks also: the stock Trainer in float64 through DDP (DeepSpeed refuses float64), whose distance from
    stock is the reference distance of the bounds (tests/_support/tolerance.py), and OdcTrainer again with one
    microbatch weighted 1.5 instead of 1 (the planted error those bounds must catch)."""
    from transformers import Trainer

    from ds_odc.training.collate import PackedCollator
    from ds_odc.integrations import match_accelerate_backend
    from ds_odc.integrations import transformers as odc_transformers
    from ds_odc.integrations.transformers import OdcTrainer

    import torch.distributed as dist
    world = dist.get_world_size()
    per_device, gas, steps = 2, 2, 4
    data = token_dataset(per_device * gas * world * steps)
    base = tiny_llama()
    models = {name: copy.deepcopy(base) for name in ("odc", "stock", "odc_off", "planted")}  # before TrainingArguments
    models["fp64"] = copy.deepcopy(base).double()

    def odc_trainer(name: str) -> OdcTrainer:
        return OdcTrainer(models[name], training_args(f"{tmp}/{name}", odc=True, per_device_train_batch_size=per_device,
                                                      gradient_accumulation_steps=gas),
                          train_dataset=data, max_tokens_per_microbatch=48, balancer_cost="tokens")  # uneven packs

    odc = odc_trainer("odc")
    planned, plan = [], odc_transformers.plan_buckets  # what OdcTrainer asks to plan before its first step

    def recorded(model, longest, device, dtype):
        planned.append([longest, str(dtype), odc.state.global_step])
        return plan(model, longest, device, dtype)

    odc_transformers.plan_buckets = recorded
    try:
        odc.train()
    finally:
        odc_transformers.plan_buckets = plan

    # The stock Trainer gets the epoch's minibatches in LB-Mini's global order, one sample per microbatch:
    # with per_device 1 and GAS = samples per rank, step s consumes exactly samples [s*G, (s+1)*G) of that order.
    order = odc.odc_pack_sampler.sampler.epoch_order(0)
    ordered = data.select(order.tolist())
    stock_args = dict(per_device_train_batch_size=1, gradient_accumulation_steps=per_device * gas,
                      train_sampling_strategy="sequential")
    stock = Trainer(models["stock"], training_args(f"{tmp}/stock", odc=False, **stock_args),
                    train_dataset=ordered, data_collator=PackedCollator())
    match_accelerate_backend(stock.args)  # stock, on one GPU shared over gloo
    stock.train()
    off = OdcTrainer(models["odc_off"], training_args(f"{tmp}/off", odc=False, **stock_args),
                     train_dataset=ordered, data_collator=PackedCollator())
    off.train()
    fp64 = planted = None
    if ON_CPU:
        with without_deepspeed():
            fp64 = Trainer(models["fp64"], training_args(f"{tmp}/fp64", odc=False, deepspeed=None, **stock_args),
                           train_dataset=ordered, data_collator=PackedCollator())
            fp64.train()
        planted = odc_trainer("planted")
        plant_wrong_weight(planted.accelerator, 1.5)
        planted.train()

    counts = [[entry.get(f"odc/microbatches_rank{r}") for r in range(world)] for entry in odc.state.log_history
              if "odc/bubble" in entry]
    if dist.get_rank() == 0:
        runs = {"odc": odc, "stock": stock, "odc_off": off, "fp64": fp64, "planted": planted}
        emit({
            "loss": {k: logged(t, "loss") for k, t in runs.items() if t is not None},
            "grad_norm": {k: logged(t, "grad_norm") for k, t in runs.items() if t is not None},
            "fp64_run": [str(next(fp64.model.parameters()).dtype), type(fp64.optimizer).__name__] if fp64 else None,
            "bubble": logged(odc, "odc/bubble"),
            "samples_per_second": logged(odc, "odc/samples_per_second"),
            "microbatch_counts": counts,
            "optimizer": type(odc.model_wrapped.optimizer).__name__,
            "odc_attention": odc.model.config._attn_implementation,
            "odc_chunked_loss": "forward" in vars(odc.model),
            "planned_attention": planned,
            "longest_sample": max(len(ids) for ids in data["input_ids"]),
            "odc_dtype": str(next(odc.model.parameters()).dtype),
            "stock_optimizer": type(stock.model_wrapped.optimizer).__name__,
            "global_steps": [odc.state.global_step, stock.state.global_step, off.state.global_step],
            "train_samples": odc.get_total_train_batch_size(odc.args),
        })


def scenario_resume(tmp: str):
    """6 steps over a 4-step epoch, checkpoint at step 3; a fresh trainer resumed from it must log the same losses."""
    from ds_odc.integrations.transformers import BALANCER_STATE_NAME, OdcTrainer

    import torch.distributed as dist
    base = tiny_llama()
    first, second = copy.deepcopy(base), tiny_llama(seed=7)  # the resumed model starts elsewhere: the checkpoint must win
    data = token_dataset(16)
    common = dict(per_device_train_batch_size=2, gradient_accumulation_steps=1, max_steps=6, save_strategy="steps",
                  save_steps=3)
    balancer = dict(max_tokens_per_microbatch=40)
    full = OdcTrainer(first, training_args(f"{tmp}/run", odc=True, **common), train_dataset=data, **balancer)
    full.train()
    with open(os.path.join(tmp, "run", "checkpoint-3", BALANCER_STATE_NAME)) as f:
        saved = json.load(f)
    planned = []

    class RecordingTrainer(OdcTrainer):
        """Records which minibatches get planned: the restored sampler must not re-plan the skipped ones."""

        def get_train_dataloader(self):
            loader = super().get_train_dataloader()
            sampler = self.odc_pack_sampler.sampler
            plan = sampler.minibatch
            sampler.minibatch = lambda step, epoch=None: planned.append((sampler.state_dict()["epoch"], step)) or plan(step, epoch)
            return loader

    resumed = RecordingTrainer(second, training_args(f"{tmp}/run", odc=True, **common), train_dataset=data, **balancer)
    resumed.train(resume_from_checkpoint=os.path.join(tmp, "run", "checkpoint-3"))
    # log_history comes back from the checkpoint (steps 1-3); steps 4-6 are the resumed run's own.
    by_step = {e["step"]: e["loss"] for e in resumed.state.log_history if "loss" in e}
    if dist.get_rank() == 0:
        emit({"full": {e["step"]: e["loss"] for e in full.state.log_history if "loss" in e},
              "resumed": by_step, "saved_state": saved, "planned": sorted(set(planned)),
              "cost_logged": any("odc/cost_c" in e for e in full.state.log_history),
              "epochs": [full.state.epoch, resumed.state.epoch]})


def pair_dataset(n: int, seed: int = 0):
    """Prompt/completion text pairs with long-tailed completion lengths (SFTTrainer trains the completions)."""
    import random

    from datasets import Dataset
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "odc", "zero", "rank", "step"]
    prompts = ["Q: " + " ".join(rng.choices(words, k=rng.randint(1, 4))) + "\nA:" for _ in range(n)]
    completions = [" " + " ".join(rng.choices(words, k=rng.choice([1, 1, 2, 3, 8]))) for _ in range(n)]
    return Dataset.from_dict({"prompt": prompts, "completion": completions})


def scenario_sft(tmp: str):
    """TRL's SFTTrainer, stock ZeRO-3, against OdcSFTTrainer (ODC + LB-Mini, uneven packs), same arguments, stock fed
    the minibatches in the plan's order: every metric SFTTrainer logs, at every step. On CPU ranks stock also trains
    in float64 through DDP: the reference distance (tests/_support/tolerance.py)."""
    import torch.distributed as dist
    from trl import SFTConfig, SFTTrainer

    from _hf_workload import ds_config
    from _rl_workload import char_tokenizer
    from ds_odc.integrations import match_accelerate_backend
    from ds_odc.integrations.trl_sft import OdcSFTTrainer

    tok = char_tokenizer()
    data = pair_dataset(64)
    base = tiny_llama(vocab=len(tok))
    models = {name: copy.deepcopy(base) for name in ("odc", "stock")}
    models["fp64"] = copy.deepcopy(base).double()

    def config(name: str, odc: bool, **extra):
        return SFTConfig(**{**dict(
            output_dir=f"{tmp}/{name}", per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
            learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
            logging_steps=1, save_strategy="no", report_to=[], use_cpu=ON_CPU, optim="adamw_torch",
            deepspeed=ds_config(odc), seed=0, disable_tqdm=True, dataloader_num_workers=0, max_length=None,
            padding_free=True, bf16=False, gradient_checkpointing=False), **extra})

    odc = OdcSFTTrainer(models["odc"], config("odc", True), train_dataset=data, processing_class=tok,
                        max_tokens_per_microbatch=80, balancer_cost="tokens")
    odc.train()
    order = odc.odc_pack_sampler.sampler.epoch_order(0).tolist()
    stock = SFTTrainer(models["stock"], config("stock", False, train_sampling_strategy="sequential"),
                       train_dataset=data.select(order), processing_class=tok)
    match_accelerate_backend(stock.args)
    stock.train()
    trainers = {"odc": odc, "stock": stock}
    if ON_CPU:
        with without_deepspeed():
            trainers["fp64"] = SFTTrainer(models["fp64"], config("fp64", False, train_sampling_strategy="sequential",
                                                                 deepspeed=None),
                                          train_dataset=data.select(order), processing_class=tok)
            trainers["fp64"].train()

    def logs(trainer):
        return [{k: v for k, v in e.items() if not k.startswith("odc/")} for e in trainer.state.log_history
                if "loss" in e]

    if dist.get_rank() == 0:
        emit({**{name: logs(t) for name, t in trainers.items()},
              "fp64_dtype": str(next(trainers["fp64"].model.parameters()).dtype) if ON_CPU else None,
              "microbatch_counts": [[e.get(f"odc/microbatches_rank{r}") for r in range(dist.get_world_size())]
                                    for e in odc.state.log_history if "odc/bubble" in e],
              "optimizers": [type(t.model_wrapped.optimizer).__name__ for t in (odc, stock)],
              "odc_attention": odc.model.config._attn_implementation})


def scenario_split(tmp: str):
    """OdcTrainer with balancer_planner="lb-mini-sp" and a 48-token budget on samples up to 90 tokens: these train
    whole, each split over both ranks (the model's attention becomes ds_odc_sp), against OdcTrainer with lb-mini and
    no budget (every sample whole on one rank) on the same minibatches."""
    from datasets import Dataset

    from ds_odc.integrations.transformers import OdcTrainer

    import torch
    import torch.distributed as dist
    short = list(token_dataset(28, min_len=4, max_len=30)["input_ids"])
    g = torch.Generator().manual_seed(7)
    long = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (90, 70, 81, 60)]
    data = Dataset.from_dict({"input_ids": short + long})
    base = tiny_llama()
    models = {name: copy.deepcopy(base) for name in ("split", "whole")}
    models["fp64"] = copy.deepcopy(base).double()
    common = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2)
    split = OdcTrainer(models["split"], training_args(f"{tmp}/split", odc=True, **common), train_dataset=data,
                       balancer_planner="lb-mini-sp", max_tokens_per_microbatch=48, balancer_cost="tokens")
    split.train()
    whole = OdcTrainer(models["whole"], training_args(f"{tmp}/whole", odc=True, **common), train_dataset=data,
                       balancer_planner="lb-mini", balancer_cost="tokens")
    whole.train()
    runs = {"split": split, "whole": whole}
    if ON_CPU:  # the reference: the stock Trainer in float64 (DDP), one sample per microbatch in lb-mini's order
        from transformers import Trainer

        from ds_odc.training.collate import PackedCollator
        ordered = data.select(whole.odc_pack_sampler.sampler.epoch_order(0).tolist())
        with without_deepspeed():
            runs["fp64"] = Trainer(models["fp64"], training_args(f"{tmp}/fp64", odc=False, deepspeed=None,
                                                                 per_device_train_batch_size=1,
                                                                 gradient_accumulation_steps=4,
                                                                 train_sampling_strategy="sequential"),
                                   train_dataset=ordered, data_collator=PackedCollator())
            runs["fp64"].train()
    sampler = split.odc_pack_sampler.sampler
    splits = sum(len(sampler.minibatch(step).splits) for step in range(len(sampler)))
    if dist.get_rank() == 0:
        emit({"loss": {k: logged(t, "loss") for k, t in runs.items()},
              "grad_norm": {k: logged(t, "grad_norm") for k, t in runs.items()},
              "attention": split.model.config._attn_implementation, "split_samples": splits,
              "truncated": int(sampler.data_report.truncated.size)})


def scenario_offload(tmp: str):
    """transformers' own Trainer with the optimizer on the host (``offload_optimizer``, torch's AdamW there), every
    rank running the configured accumulation steps: ``"odc": true`` against stock ZeRO-3 with the same offload, the
    logged loss and gradient norm of every step (bounded by stock's distance from the same Trainer in float64 through
    DDP, as scenario_equivalence) and the parameters at the end."""
    import torch
    import torch.distributed as dist
    from transformers import Trainer

    from _hf_workload import ds_config
    from ds_odc.integrations import match_accelerate_backend
    from ds_odc.training.collate import PackedCollator

    world, steps = dist.get_world_size(), 3
    data = token_dataset(2 * world * steps)
    base = tiny_llama()
    fp64_model = copy.deepcopy(base).double()
    args = dict(per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=steps,
                train_sampling_strategy="sequential")
    trainers, out = {}, {}
    for name in ("stock", "odc"):
        config = ds_config(odc=name == "odc")
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        config["zero_force_ds_cpu_optimizer"] = False  # torch's AdamW on the host, knowingly
        trainer = Trainer(copy.deepcopy(base), training_args(f"{tmp}/{name}", odc=False, deepspeed=config, **args),
                          train_dataset=data, data_collator=PackedCollator())
        match_accelerate_backend(trainer.args)
        trainer.train()
        import deepspeed
        params = list(trainer.model_wrapped.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            flat = torch.cat([p.detach().float().reshape(-1).clone() for p in params])
        optimizer = trainer.model_wrapped.optimizer
        trainers[name] = trainer
        out[name] = {"params": flat, "optimizer": type(optimizer).__name__,
                     "offloaded": bool(optimizer.offload_optimizer)}
    if ON_CPU:
        with without_deepspeed():
            trainers["fp64"] = Trainer(fp64_model, training_args(f"{tmp}/fp64", odc=False, deepspeed=None, **args),
                                       train_dataset=data, data_collator=PackedCollator())
            trainers["fp64"].train()
    initial = torch.cat([p.detach().float().reshape(-1) for p in base.parameters()])
    if dist.get_rank() == 0:
        stock, odc = out["stock"].pop("params"), out["odc"].pop("params")
        emit({**out, "params_rel_diff": float((odc - stock).norm() / stock.norm()),
              "moved": float((stock - initial).norm() / initial.norm()),
              "loss": {k: logged(t, "loss") for k, t in trainers.items()},
              "grad_norm": {k: logged(t, "grad_norm") for k, t in trainers.items()}})


def main():
    init_ranks(timeout_s=60)
    with shared_tmpdir("odc_hf_") as tmp:  # removed when the scenario is done
        globals()[f"scenario_{sys.argv[1]}"](tmp)
    shutdown_and_exit()


if __name__ == "__main__":
    main()
