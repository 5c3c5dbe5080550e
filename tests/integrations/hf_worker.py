"""Distributed OdcTrainer scenarios, launched by test_hf_trainer.py through ``_support.launch.launch``.

Usage: hf_worker.py SCENARIO; rank 0 prints one ODC_RESULT line.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile

import ds_odc  # noqa: F401  (the `odc` key must parse before any TrainingArguments)
from _support.launch import emit
from ds_odc.training.distributed import shutdown_and_exit

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "zero"))
from worker import init_ranks  # noqa: E402  (CPU ranks, or GPU ranks under tests/gpu)
from _hf_workload import logged, tiny_llama, token_dataset, training_args  # noqa: E402


def shared_tmpdir() -> str:
    import torch.distributed as dist
    box = [tempfile.mkdtemp(prefix="odc_hf_")] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def scenario_equivalence():
    """Same global minibatches, three ways: OdcTrainer with ODC + LB-Mini (uneven packs), the stock Trainer with
    stock ZeRO-3 (one sample per microbatch, GAS = samples per rank), and OdcTrainer with ODC off (must be stock)."""
    from transformers import Trainer

    from ds_odc.training.collate import PackedCollator
    from ds_odc.integrations.transformers import OdcTrainer

    import torch.distributed as dist
    world = dist.get_world_size()
    per_device, gas, steps = 2, 2, 4
    data = token_dataset(per_device * gas * world * steps)
    base = tiny_llama()
    models = {name: copy.deepcopy(base) for name in ("odc", "stock", "odc_off")}  # before any TrainingArguments
    tmp = shared_tmpdir()

    odc = OdcTrainer(models["odc"], training_args(f"{tmp}/odc", odc=True, per_device_train_batch_size=per_device,
                                                  gradient_accumulation_steps=gas),
                     train_dataset=data, max_tokens_per_microbatch=48, balancer_cost="tokens")  # uneven packs
    odc.train()

    # The stock Trainer gets the epoch's minibatches in LB-Mini's global order, one sample per microbatch:
    # with per_device 1 and GAS = samples per rank, step s consumes exactly samples [s*G, (s+1)*G) of that order.
    order = odc.odc_pack_sampler.sampler.epoch_order(0)
    ordered = data.select(order.tolist())
    stock_args = dict(per_device_train_batch_size=1, gradient_accumulation_steps=per_device * gas,
                      train_sampling_strategy="sequential")
    stock = Trainer(models["stock"], training_args(f"{tmp}/stock", odc=False, **stock_args),
                    train_dataset=ordered, data_collator=PackedCollator())
    stock.train()
    off = OdcTrainer(models["odc_off"], training_args(f"{tmp}/off", odc=False, **stock_args),
                     train_dataset=ordered, data_collator=PackedCollator())
    off.train()

    counts = [[entry.get(f"odc/microbatches_rank{r}") for r in range(world)] for entry in odc.state.log_history
              if "odc/bubble" in entry]
    if dist.get_rank() == 0:
        emit({
            "loss": {"odc": logged(odc, "loss"), "stock": logged(stock, "loss"), "odc_off": logged(off, "loss")},
            "grad_norm": {"odc": logged(odc, "grad_norm"), "stock": logged(stock, "grad_norm"),
                          "odc_off": logged(off, "grad_norm")},
            "bubble": logged(odc, "odc/bubble"),
            "samples_per_second": logged(odc, "odc/samples_per_second"),
            "microbatch_counts": counts,
            "optimizer": type(odc.model_wrapped.optimizer).__name__,
            "odc_attention": odc.model.config._attn_implementation,
            "odc_chunked_loss": "forward" in vars(odc.model),
            "stock_optimizer": type(stock.model_wrapped.optimizer).__name__,
            "global_steps": [odc.state.global_step, stock.state.global_step, off.state.global_step],
            "train_samples": odc.get_total_train_batch_size(odc.args),
        })


def scenario_resume():
    """6 steps over a 4-step epoch, checkpoint at step 3; a fresh trainer resumed from it must log the same losses."""
    from ds_odc.integrations.transformers import BALANCER_STATE_NAME, OdcTrainer

    import torch.distributed as dist
    base = tiny_llama()
    first, second = copy.deepcopy(base), tiny_llama(seed=7)  # the resumed model starts elsewhere: the checkpoint must win
    data = token_dataset(16)
    tmp = shared_tmpdir()
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


def scenario_split():
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
    tmp = shared_tmpdir()
    common = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2)
    split = OdcTrainer(models["split"], training_args(f"{tmp}/split", odc=True, **common), train_dataset=data,
                       balancer_planner="lb-mini-sp", max_tokens_per_microbatch=48, balancer_cost="tokens")
    split.train()
    whole = OdcTrainer(models["whole"], training_args(f"{tmp}/whole", odc=True, **common), train_dataset=data,
                       balancer_planner="lb-mini", balancer_cost="tokens")
    whole.train()
    sampler = split.odc_pack_sampler.sampler
    splits = sum(len(sampler.minibatch(step).splits) for step in range(len(sampler)))
    if dist.get_rank() == 0:
        emit({"loss": {"split": logged(split, "loss"), "whole": logged(whole, "loss")},
              "grad_norm": {"split": logged(split, "grad_norm"), "whole": logged(whole, "grad_norm")},
              "attention": split.model.config._attn_implementation, "split_samples": splits,
              "truncated": int(sampler.data_report.truncated.size)})


def main():
    init_ranks(timeout_s=60)
    globals()[f"scenario_{sys.argv[1]}"]()
    shutdown_and_exit()


if __name__ == "__main__":
    main()
