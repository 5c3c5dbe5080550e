"""A Qwen3-MoE-shaped model with the router auxiliary loss on, in OdcSFTTrainer and OdcGRPOTrainer, against the stock
trainer + stock ZeRO-3 in the same launch; launched by test_moe.py through ``_support.launch.launch``.

The router auxiliary loss (Switch Transformer's load-balancing loss) is a per-microbatch quantity: the fraction of
the microbatch's tokens routed to each expert times its mean router probability. Where ODC's microbatches are stock's
(one sample per microbatch: stock with ``per_device_train_batch_size=1``; ODC with one sample per microbatch, whether
LB-Mini gives the ranks different counts or ``local-sort`` the same), the runs must be equal, within the bound of
``tests/_support/tolerance.py`` (stock's own distance from float64). Where LB-Mini packs other samples together than stock does,
the auxiliary term differs by definition; those runs are measured (``grouping``), not bounded.

The model has 8 experts, 2 per token, and short samples: in most microbatches some expert receives no token, whose
gradients (zero) must still arrive. fp32, SGD.

Usage: moe_worker.py SCENARIO[,SCENARIO...] (sft, grpo); rank 0 prints one ODC_RESULT line.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys

import ds_odc  # noqa: F401  (the `odc` key must parse before any TrainingArguments)
from _support.launch import emit
from ds_odc.training.distributed import shutdown_and_exit

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "zero"))
from _hf_workload import ON_CPU, ds_config, shared_tmpdir  # noqa: E402
from _hf_workload import without_deepspeed  # noqa: E402
from _workload import flat, full_params, max_rel_diff, rel_diff  # noqa: E402
from worker import init_ranks  # noqa: E402

AUX_COEF = 0.1  # large enough that the auxiliary term moves the router measurably in a few steps
EXPERTS, TOP_K = 8, 2


def tiny_qwen3_moe(vocab: int, seed: int = 0):
    """Random-init 2-layer Qwen3-MoE (8 experts, 2 per token) with the router loss on, outside any zero.Init."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=256,
                            output_router_logits=True, router_aux_loss_coef=AUX_COEF, tie_word_embeddings=False,
                            attn_implementation="sdpa", pad_token_id=0)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # Qwen3's router starts at zero (uniform routing); give it something to balance
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    return model


@contextlib.contextmanager
def counting_idle_experts(model):
    """How many (router call, expert) pairs received no token, over the block: the gradients of those experts
    are zero in that microbatch and must still arrive (and nothing wait for them)."""
    counts = {"calls": 0, "idle": 0}

    def hook(module, args, output):
        _, _, indices = output
        if module.training:
            counts["calls"] += 1
            counts["idle"] += EXPERTS - int(indices.unique().numel())

    handles = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers]
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def step_logs(trainer) -> list[dict]:
    return [{k: v for k, v in e.items() if not k.startswith("odc/") and k != "step_time"}
            for e in trainer.state.log_history if "loss" in e]


def microbatch_counts(trainer) -> list[list]:
    import torch.distributed as dist
    return [[e.get(f"odc/microbatches_rank{r}") for r in range(dist.get_world_size())]
            for e in trainer.state.log_history if "odc/bubble" in e]


def summary(runs: dict, initial: dict, stock: str = "stock") -> dict:
    import torch
    params = {name: full_params(t.model_wrapped, torch.float64) for name, t in runs.items()}
    routers = {name: {k: v for k, v in p.items() if "mlp.gate." in k} for name, p in params.items()}
    worst = {name: max(p, key=lambda k: rel_diff(p[k], params[stock][k])) for name, p in params.items()}
    return {"params": {name: max_rel_diff(p, params[stock]) for name, p in params.items()}, "worst": worst,
            "routers": {name: max_rel_diff(r, routers[stock]) for name, r in routers.items()},
            "stock_moved": rel_diff(flat(params[stock].values()), flat(initial.values())),
            "logs": {name: step_logs(t) for name, t in runs.items()}}


# -- OdcTrainer ----------------------------------------------------------------------------------------------------------
def scenario_trainer(tmp: str) -> dict:
    """OdcTrainer (the model's own loss, which adds the router loss; LB-Mini, one sample per microbatch, uneven
    counts) against the stock Trainer + stock ZeRO-3 and in float64, one sample per microbatch, in the plan's order."""
    import torch
    from transformers import Trainer

    from _hf_workload import VOCAB, token_dataset, training_args
    from ds_odc.integrations import match_accelerate_backend
    from ds_odc.integrations.transformers import OdcTrainer
    from ds_odc.training.collate import PackedCollator

    import torch.distributed as dist
    data = token_dataset(16 * dist.get_world_size(), min_len=2, max_len=40)  # 4 steps of 4 samples per rank: one epoch
    base = tiny_qwen3_moe(VOCAB)
    initial = full_params(base, torch.float64)
    # The Trainer adds the model's router loss in full in every microbatch (it divides nothing by the accumulation
    # steps once the model takes num_items_in_batch), so its weight depends on how many samples one holds: ODC takes
    # the same per_device_train_batch_size (1) as the stock run it is compared with.
    common = dict(optim="sgd", learning_rate=0.1, max_grad_norm=0.0, per_device_train_batch_size=1,
                  gradient_accumulation_steps=4)
    odc = OdcTrainer(copy.deepcopy(base), training_args(f"{tmp}/odc", odc=True, **common), train_dataset=data,
                     balancer_cost="tokens")
    odc.train()
    ordered = data.select(odc.odc_pack_sampler.sampler.epoch_order(0).tolist())
    stock_args = dict(train_sampling_strategy="sequential", **common)
    stock = Trainer(copy.deepcopy(base), training_args(f"{tmp}/stock", odc=False, **stock_args),
                    train_dataset=ordered, data_collator=PackedCollator())
    match_accelerate_backend(stock.args)
    stock.train()
    model64 = copy.deepcopy(base).double()
    model64.set_experts_implementation("eager")  # grouped_mm takes no float64
    with without_deepspeed():
        fp64 = Trainer(model64, training_args(f"{tmp}/fp64", odc=False, deepspeed=None, **stock_args),
                       train_dataset=ordered, data_collator=PackedCollator())
        fp64.train()
    out = summary({"odc": odc, "stock": stock, "fp64": fp64}, initial)
    out.update(microbatches=microbatch_counts(odc), own_loss="forward" not in vars(odc.model))
    return out


# -- OdcSFTTrainer -------------------------------------------------------------------------------------------------------
def scenario_sft(tmp: str) -> dict:
    """OdcSFTTrainer (padding-free rows) against SFTTrainer + stock ZeRO-3 fed the minibatches in the plan's order:
    one sample per microbatch (LB-Mini, uneven counts; ``local-sort``, equal counts; per-module fetches, MoE blocks
    as DeepSpeed's leaf modules) against stock with one sample per microbatch, and in float64; LB-Mini packing samples
    against stock with two per microbatch (``grouping``: measured)."""
    import torch
    from trl import SFTConfig, SFTTrainer

    from _rl_workload import char_tokenizer
    from hf_worker import pair_dataset
    from ds_odc.integrations import match_accelerate_backend
    from ds_odc.integrations.trl_sft import OdcSFTTrainer

    tok = char_tokenizer()
    data = pair_dataset(64)
    base = tiny_qwen3_moe(len(tok))
    initial = full_params(base, torch.float64)
    per_rank = 4  # samples per rank per optimizer step

    def config(name: str, odc: bool | dict, per_device: int, **extra):
        ds = ds_config(bool(odc))
        if isinstance(odc, dict):
            ds["zero_optimization"]["odc"] = odc
        return SFTConfig(**{**dict(
            output_dir=f"{tmp}/{name}", per_device_train_batch_size=per_device,
            gradient_accumulation_steps=per_rank // per_device, max_steps=4, learning_rate=0.1, optim="sgd",
            lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, logging_steps=1,
            save_strategy="no", report_to=[], use_cpu=ON_CPU, deepspeed=ds, seed=0, disable_tqdm=True,
            dataloader_num_workers=0, max_length=None, padding_free=True, bf16=False, gradient_checkpointing=False),
            **extra})

    def odc_run(name: str, odc=True, per_device: int = 1, **balancer):
        # per_device: the stock microbatch size compared with, for which the logged metrics are reconstructed
        trainer = OdcSFTTrainer(copy.deepcopy(base), config(name, odc, per_device), train_dataset=data,
                                processing_class=tok, balancer_cost="tokens", **balancer)
        with counting_idle_experts(trainer.model) as idle:
            trainer.train()
        return trainer, idle

    def stock_run(name: str, per_device: int, order, fp64: bool = False):
        model = copy.deepcopy(base)
        if fp64:
            model.double().set_experts_implementation("eager")  # grouped_mm takes no float64
        extra = dict(deepspeed=None) if fp64 else {}
        with without_deepspeed() if fp64 else contextlib.nullcontext():
            trainer = SFTTrainer(model, config(name, False, per_device, train_sampling_strategy="sequential", **extra),
                                 train_dataset=data.select(order), processing_class=tok)
            if not fp64:
                match_accelerate_backend(trainer.args)
            trainer.train()
        return trainer

    runs, idle = {}, {}
    runs["odc"], idle["odc"] = odc_run("odc")  # LB-Mini, one sample per microbatch (no budget)
    order = runs["odc"].odc_pack_sampler.sampler.epoch_order(0).tolist()
    runs["local_sort"], idle["local_sort"] = odc_run("local_sort", balancer_planner="local-sort")
    runs["per_module"], idle["per_module"] = odc_run("per_module", odc={"enabled": True, "fetch_unit": "module"})
    runs["stock"] = stock_run("stock", 1, order)
    runs["fp64"] = stock_run("fp64", 1, order, fp64=True)
    out = summary(runs, initial)
    # LB-Mini packing several samples per microbatch, against stock packing two (both padding-free rows)
    packed, _ = odc_run("packed", per_device=2, max_tokens_per_microbatch=80)
    packed_order = packed.odc_pack_sampler.sampler.epoch_order(0).tolist()
    grouped = {"packed": packed, "stock": stock_run("stock2", 2, packed_order)}
    if packed_order == order:  # the yardstick: stock itself with one sample per microbatch instead of two
        grouped["stock_one_per_microbatch"] = runs["stock"]
    out["grouping"] = {**summary(grouped, initial), "microbatches": microbatch_counts(packed)}
    orders_agree = packed_order == order
    out.update(idle=idle, microbatches={n: microbatch_counts(runs[n]) for n in ("odc", "local_sort")},
               same_order=orders_agree, optimizers={n: type(t.model_wrapped.optimizer).__name__ for n, t in runs.items()
                                                    if n != "fp64"})
    return out


# -- OdcGRPOTrainer ------------------------------------------------------------------------------------------------------
GRPO_CASE = dict(loss_type="dapo", beta=0.05, num_generations=4, max_steps=4, learning_rate=0.1)


def save_moe(folder: str) -> str:
    """The tiny MoE policy as a local checkpoint (GRPO builds the policy and its reference model from the path)."""
    import torch.distributed as dist

    from _rl_workload import char_tokenizer
    path = os.path.join(folder, "tiny-qwen3-moe")
    if dist.get_rank() == 0:
        tok = char_tokenizer()
        model = tiny_qwen3_moe(len(tok))
        model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
        model.save_pretrained(path)
        tok.save_pretrained(path)
    dist.barrier()
    return path


def train_grpo(path: str, out: str, variant: str, per_device: int, **balancer):
    """``variant``: "stock" (GRPOTrainer, stock ZeRO-3), "fp64" (GRPOTrainer in float64, DDP), "packed" / "padded"
    (OdcGRPOTrainer with ``balancer`` options); ``per_device`` rows per stock microbatch, 4 per rank per optimizer
    step, one generation batch per step."""
    import torch
    from trl import GRPOTrainer

    from _rl_workload import char_tokenizer, letter_reward, prompt_dataset, scripted_rollout
    from grpo_worker import MAX_NEW, grpo_config
    from ds_odc.integrations import match_accelerate_backend
    from ds_odc.integrations.trl_grpo import OdcGRPOTrainer

    overrides = dict(GRPO_CASE, per_device_train_batch_size=per_device, gradient_accumulation_steps=4 // per_device,
                     steps_per_generation=4 // per_device)
    if variant == "fp64":
        overrides.update(deepspeed=None, model_init_kwargs={"dtype": torch.float64, "experts_implementation": "eager"})
    with without_deepspeed() if variant == "fp64" else contextlib.nullcontext():
        config = grpo_config(out, odc=variant in ("packed", "padded"), **overrides)
        kwargs = dict(reward_funcs=letter_reward, args=config, train_dataset=prompt_dataset(64),
                      processing_class=char_tokenizer(), rollout_func=scripted_rollout(MAX_NEW))
        if variant in ("stock", "fp64"):
            trainer = GRPOTrainer(path, **kwargs)
            if variant == "stock":
                match_accelerate_backend(trainer.args)
        else:
            trainer = OdcGRPOTrainer(path, padding_free=variant == "packed", balancer_cost="tokens", **balancer,
                                     **kwargs)
        with counting_idle_experts(trainer.model) as idle:
            trainer.train()
    return trainer, idle


def grpo_logs(trainer) -> list[dict]:
    return [{k: v for k, v in e.items() if not k.startswith("odc/") and k != "step_time"}
            for e in trainer.state.log_history if "loss" in e]


def scenario_grpo(tmp: str) -> dict:
    """OdcGRPOTrainer with a reference model (beta > 0) against GRPOTrainer + stock ZeRO-3 (and in float64) fed the
    same completions, one sample per microbatch on both sides (stock with one row per microbatch): padded microbatches
    of one row (a 1-token budget; LB-Mini, uneven counts) and padding-free rows of one sample (``local-sort``, equal
    counts); LB-Mini packing samples into 80-token rows against stock with four rows per microbatch (``grouping``:
    measured)."""
    import torch

    from _workload import full_params as params_of

    path = save_moe(tmp)
    from transformers import AutoModelForCausalLM
    initial = params_of(AutoModelForCausalLM.from_pretrained(path), torch.float64)
    runs, idle = {}, {}
    one_sample = {"padded": dict(max_tokens_per_microbatch=1), "packed": dict(balancer_planner="local-sort")}
    for variant in ("stock", "fp64", "packed", "padded"):
        runs[variant], idle[variant] = train_grpo(path, f"{tmp}/{variant}", variant, per_device=1,
                                                  **one_sample.get(variant, {}))
    out = summary(runs, initial)
    out["logs"] = {name: grpo_logs(t) for name, t in runs.items()}
    grouped = {}
    for variant in ("stock", "packed"):
        budget = {"max_tokens_per_microbatch": 80} if variant == "packed" else {}
        grouped[variant], _ = train_grpo(path, f"{tmp}/{variant}4", variant, per_device=4, **budget)
    grouped["stock_one_per_microbatch"] = runs["stock"]
    out["grouping"] = {**summary(grouped, initial), "microbatches": list(grouped["packed"].odc_microbatch_history)}
    out["grouping"]["logs"] = {name: grpo_logs(t) for name, t in grouped.items()}
    out.update(idle=idle, microbatches={v: list(runs[v].odc_microbatch_history) for v in ("packed", "padded")},
               optimizers={v: type(t.model_wrapped.optimizer).__name__ for v, t in runs.items() if v != "fp64"})
    return out


def main():
    init_ranks(timeout_s=120)
    import torch.distributed as dist
    out = {"world": dist.get_world_size()}
    with shared_tmpdir("odc_moe_") as tmp:
        for name in sys.argv[1].split(","):
            out[name] = globals()[f"scenario_{name}"](os.path.join(tmp, name))
    if dist.get_rank() == 0:
        emit(out)
    shutdown_and_exit()


if __name__ == "__main__":
    main()
