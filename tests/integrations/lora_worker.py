"""PEFT LoRA adapters in every ODC trainer, against the stock trainer + stock ZeRO-3 in the same launch; launched by
test_lora.py through ``_support.launch.launch``.

Each scenario trains a tiny model's LoRA adapters (a frozen base model; gradient checkpointing on) three ways: the ODC
trainer (LB-Mini, uneven microbatch counts), the stock trainer with stock ZeRO-3 fed the same minibatches, and the
stock trainer in float64 without DeepSpeed (DDP on the same ranks), whose distance from stock is the reference of the
bounds (``tests/_support/tolerance.py``). It records which parameters ODC pushed gradients for, and the size of ODC's gradient
accumulator. fp32, SGD (Adam where a resume must restore optimizer state).

Usage: lora_worker.py SCENARIO[,SCENARIO...] (trainer, sft, grpo, dpo); rank 0 prints one ODC_RESULT line.
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
from _hf_workload import ON_CPU, ds_config, logged, shared_tmpdir, tiny_llama, token_dataset, training_args  # noqa: E402
from _hf_workload import without_deepspeed  # noqa: E402
from _support.tolerance import plant_wrong_weight  # noqa: E402
from _workload import flat, full_params, rel_diff  # noqa: E402
from worker import init_ranks  # noqa: E402

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)


def lora_config():
    from peft import LoraConfig
    return LoraConfig(**LORA)


def adapters(trainer) -> dict:
    """The trainer's adapter weights by name, in float64 (gathered from ZeRO-3 shards; collective)."""
    import torch
    return {k: v for k, v in full_params(trainer.model_wrapped, torch.float64).items() if "lora_" in k}


def adapter_distance(a: dict, b: dict) -> float:
    """The largest per-tensor relative distance of ``a`` from ``b`` (same names)."""
    assert a.keys() == b.keys() and a, (sorted(a), sorted(b))
    return max(rel_diff(a[k], b[k]) for k in a)


@contextlib.contextmanager
def recording_pushes():
    """Every ODC push in the block: ds_id -> elements pushed (all microbatches, all steps)."""
    from ds_odc.zero.state import OdcState
    seen: dict[int, int] = {}
    push = OdcState.push

    def recorded(self, params):
        for p in params:
            seen[p.ds_id] = seen.get(p.ds_id, 0) + p.ds_numel
        return push(self, params)

    OdcState.push = recorded
    try:
        yield seen
    finally:
        OdcState.push = push


def pushes(trainer, seen: dict[int, int]) -> dict:
    """What ODC pushed and holds, by parameter name: pushed names, trainable names, and the accumulator's size next
    to the trainable and frozen shard sizes of this rank."""
    engine = trainer.model_wrapped
    named = list(engine.module.named_parameters())
    by_id = {p.ds_id: n for n, p in named}
    return {"pushed": sorted(by_id[i] for i in seen),
            "trainable": sorted(n for n, p in named if p.requires_grad),
            "accumulator": int(engine.optimizer.odc.accumulator.numel),
            "trainable_shards": sum(p.partition_numel() for _, p in named if p.requires_grad),
            "frozen_shards": sum(p.ds_tensor.numel() for _, p in named if not p.requires_grad)}


def microbatch_counts(trainer) -> list[list]:
    import torch.distributed as dist
    return [[e.get(f"odc/microbatches_rank{r}") for r in range(dist.get_world_size())]
            for e in trainer.state.log_history if "odc/bubble" in e]


def step_logs(trainer, drop=("odc/", "step_time")) -> list[dict]:
    return [{k: v for k, v in e.items() if not k.startswith(drop)} for e in trainer.state.log_history if "loss" in e]


# -- OdcTrainer with a PeftModel ---------------------------------------------------------------------------------------
def scenario_trainer(tmp: str) -> dict:
    """A PeftModel in OdcTrainer against the stock Trainer (ZeRO-3, and float64 DDP) fed LB-Mini's order one sample
    per microbatch; one more ODC run with one microbatch weighted 1.5 (the planted error); the final adapters saved
    and read back; then a resume from a checkpoint (Adam: its state must come back too)."""
    import torch
    import torch.distributed as dist
    from peft import get_peft_model
    from transformers import Trainer

    from ds_odc.integrations import match_accelerate_backend
    from ds_odc.integrations.transformers import OdcTrainer
    from ds_odc.training.collate import PackedCollator

    world = dist.get_world_size()
    per_device, gas, steps = 2, 2, 4
    data = token_dataset(per_device * gas * world * steps)
    peft = get_peft_model(tiny_llama(), lora_config())
    models = {name: copy.deepcopy(peft) for name in ("odc", "stock", "planted")}  # before any TrainingArguments
    models["fp64"] = copy.deepcopy(peft).double()
    common = dict(gradient_checkpointing=True, optim="sgd", learning_rate=0.5)

    def odc_trainer(name: str) -> OdcTrainer:
        return OdcTrainer(models[name], training_args(f"{tmp}/{name}", odc=True, per_device_train_batch_size=per_device,
                                                      gradient_accumulation_steps=gas, **common),
                          train_dataset=data, max_tokens_per_microbatch=48, balancer_cost="tokens")

    odc = odc_trainer("odc")
    with recording_pushes() as seen:
        odc.train()
    ordered = data.select(odc.odc_pack_sampler.sampler.epoch_order(0).tolist())
    stock_args = dict(per_device_train_batch_size=1, gradient_accumulation_steps=per_device * gas,
                      train_sampling_strategy="sequential", **common)
    stock = Trainer(models["stock"], training_args(f"{tmp}/stock", odc=False, **stock_args), train_dataset=ordered,
                    data_collator=PackedCollator())
    match_accelerate_backend(stock.args)
    stock.train()
    with without_deepspeed():
        fp64 = Trainer(models["fp64"], training_args(f"{tmp}/fp64", odc=False, deepspeed=None, **stock_args),
                       train_dataset=ordered, data_collator=PackedCollator())
        fp64.train()
    planted = odc_trainer("planted")
    plant_wrong_weight(planted.accelerator, 1.5)
    planted.train()

    final = adapters(odc)
    odc.save_model(f"{tmp}/odc-final")  # collective under ZeRO-3
    saved = None
    if dist.get_rank() == 0:
        from safetensors.torch import load_file
        stored = load_file(os.path.join(tmp, "odc-final", "adapter_model.safetensors"))
        # PEFT stores the adapter without its name ("default") in the keys
        live = {k.replace(".default", ""): v for k, v in final.items()}
        saved = {"keys_match": sorted(stored) == sorted(live),
                 "max_abs_diff": max(float((stored[k].double() - live[k].cpu()).abs().max()) for k in live if k in stored)}
    runs = {"odc": odc, "stock": stock, "fp64": fp64, "planted": planted}
    weights = {name: adapters(t) for name, t in runs.items()}
    initial = {k: v for k, v in full_params(peft, torch.float64).items() if "lora_" in k}
    return {"adapters": {name: adapter_distance(w, weights["stock"]) for name, w in weights.items()},
            "stock_moved": rel_diff(flat(weights["stock"].values()), flat(initial.values())),
            "fp64_dtype": str(next(fp64.model.parameters()).dtype),
            "logs": {name: step_logs(t) for name, t in runs.items()},
            "microbatches": microbatch_counts(odc),
            "optimizer": type(odc.model_wrapped.optimizer).__name__,
            "chunked_loss_on_base_model": "forward" in vars(odc.model.get_base_model()),
            "pushes": pushes(odc, seen), "saved": saved, "resume": resume_trainer(tmp, peft)}


def resume_trainer(tmp: str, peft) -> dict:
    """6 steps with Adam over a 4-step epoch, a checkpoint at step 3; a new trainer whose adapters start elsewhere,
    resumed from the checkpoint, must log the same losses and end with the same adapters."""
    import torch
    from peft import get_peft_model

    from ds_odc.integrations.transformers import OdcTrainer

    data = token_dataset(16)
    common = dict(per_device_train_batch_size=2, gradient_accumulation_steps=1, max_steps=6, save_strategy="steps",
                  save_steps=3, gradient_checkpointing=True, optim="adamw_torch", learning_rate=1e-2)
    full = OdcTrainer(copy.deepcopy(peft), training_args(f"{tmp}/run", odc=True, **common), train_dataset=data,
                      max_tokens_per_microbatch=40)
    full.train()
    torch.manual_seed(7)
    elsewhere = get_peft_model(copy.deepcopy(peft.get_base_model()), lora_config())  # other adapter init
    elsewhere_start = {k: v for k, v in full_params(elsewhere, torch.float64).items() if "lora_" in k}
    resumed = OdcTrainer(elsewhere, training_args(f"{tmp}/run", odc=True, **common), train_dataset=data,
                         max_tokens_per_microbatch=40)
    resumed.train(resume_from_checkpoint=os.path.join(tmp, "run", "checkpoint-3"))
    ends = adapters(full), adapters(resumed)
    losses = [{e["step"]: e["loss"] for e in t.state.log_history if "loss" in e} for t in (full, resumed)]
    return {"losses": [[d[s] for s in (4, 5, 6)] for d in losses], "adapters": adapter_distance(ends[1], ends[0]),
            "started_elsewhere": adapter_distance(elsewhere_start, ends[0])}


SFT_BUDGET = {2: 80, 3: 72}  # tokens per microbatch: uneven microbatch counts at either world size


# -- OdcSFTTrainer with peft_config ------------------------------------------------------------------------------------
def scenario_sft(tmp: str) -> dict:
    """``peft_config`` in OdcSFTTrainer (padding-free rows, uneven packs) against SFTTrainer with stock ZeRO-3 and in
    float64, fed the minibatches in the plan's order: adapters and every value SFTTrainer logs."""
    import torch
    import torch.distributed as dist
    from trl import SFTConfig, SFTTrainer

    from _rl_workload import char_tokenizer
    from hf_worker import pair_dataset
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
            learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], use_cpu=ON_CPU,
            deepspeed=ds_config(odc), seed=0, disable_tqdm=True, dataloader_num_workers=0, max_length=None,
            padding_free=True, bf16=False, gradient_checkpointing=True), **extra})

    torch.manual_seed(0)  # the adapters' initialisation, the same in every run
    odc = OdcSFTTrainer(models["odc"], config("odc", True), train_dataset=data, processing_class=tok,
                        max_tokens_per_microbatch=SFT_BUDGET[dist.get_world_size()], balancer_cost="tokens",
                        peft_config=lora_config())
    with recording_pushes() as seen:
        odc.train()
    ordered = data.select(odc.odc_pack_sampler.sampler.epoch_order(0).tolist())
    torch.manual_seed(0)
    stock = SFTTrainer(models["stock"], config("stock", False, train_sampling_strategy="sequential"),
                       train_dataset=ordered, processing_class=tok, peft_config=lora_config())
    match_accelerate_backend(stock.args)
    stock.train()
    with without_deepspeed():
        torch.manual_seed(0)
        fp64 = SFTTrainer(models["fp64"], config("fp64", False, train_sampling_strategy="sequential", deepspeed=None),
                          train_dataset=ordered, processing_class=tok, peft_config=lora_config())
        fp64.train()
    runs = {"odc": odc, "stock": stock, "fp64": fp64}
    weights = {name: adapters(t) for name, t in runs.items()}
    return {"adapters": {name: adapter_distance(w, weights["stock"]) for name, w in weights.items()},
            "lora_b_norm": max(float(v.norm()) for k, v in weights["stock"].items() if "lora_B" in k),  # from 0
            "fp64_dtype": str(next(p for p in fp64.model.parameters() if p.requires_grad).dtype),
            "logs": {name: step_logs(t) for name, t in runs.items()},
            "microbatches": microbatch_counts(odc), "pushes": pushes(odc, seen),
            "optimizer": type(odc.model_wrapped.optimizer).__name__}


# -- OdcGRPOTrainer with peft_config -----------------------------------------------------------------------------------
GRPO_CASE = dict(loss_type="dapo", beta=0.05, num_iterations=2, steps_per_generation=4, max_steps=4,
                 learning_rate=0.5, gradient_checkpointing=True)


def train_grpo(model_path: str, out: str, variant: str, resume: str | None = None, plant: float | None = None,
               **overrides):
    """One GRPO run with ``peft_config`` (adapters initialised from seed 0): ``variant`` "stock" (GRPOTrainer, stock
    ZeRO-3), "fp64" (GRPOTrainer in float64, DDP), "packed" / "padded" (OdcGRPOTrainer)."""
    import torch
    from trl import GRPOTrainer

    from _rl_workload import char_tokenizer, letter_reward, prompt_dataset, scripted_rollout
    from grpo_worker import MAX_NEW, grpo_config
    from ds_odc.balancer.cost import QuadraticCost
    from ds_odc.integrations import match_accelerate_backend
    from ds_odc.integrations.trl_grpo import OdcGRPOTrainer

    if variant == "fp64":
        with without_deepspeed():
            return train_grpo(model_path, out, "stock", resume, plant, deepspeed=None,
                              model_init_kwargs={"dtype": torch.float64}, **overrides)
    config = grpo_config(out, odc=variant in ("packed", "padded"), **overrides)
    kwargs = dict(reward_funcs=letter_reward, args=config, train_dataset=prompt_dataset(64),
                  processing_class=char_tokenizer(), rollout_func=scripted_rollout(MAX_NEW), peft_config=lora_config())
    torch.manual_seed(0)
    if variant == "stock":
        trainer = GRPOTrainer(model_path, **kwargs)
        match_accelerate_backend(trainer.args)
    else:
        trainer = OdcGRPOTrainer(model_path, padding_free=variant == "packed",
                                 max_tokens_per_microbatch=64 if variant == "padded" else 80,
                                 balancer_cost=QuadraticCost(a=1.0, b=0.1, c=0.0), **kwargs)
    if plant is not None:
        plant_wrong_weight(trainer.accelerator, plant)
    with recording_pushes() as seen:
        trainer.train(resume_from_checkpoint=resume)
    return trainer, seen


def scenario_grpo(tmp: str) -> dict:
    """``peft_config`` in OdcGRPOTrainer, padding-free and padded, with a reference model (beta > 0: TRL takes it from
    the base model, adapters disabled), two passes over each generation batch, a generation batch of two optimizer
    steps, against GRPOTrainer with stock ZeRO-3 and in float64; then a resume from a checkpoint."""
    from grpo_worker import save_model, trl_logs

    model_path = save_model(tmp)
    runs, seen = {}, {}
    for variant in ("stock", "fp64", "packed", "padded"):
        runs[variant], seen[variant] = train_grpo(model_path, f"{tmp}/{variant}", variant, **GRPO_CASE)
    weights = {name: adapters(t) for name, t in runs.items()}
    logs = {name: trl_logs({"logs": [e for e in t.state.log_history if "loss" in e]}) for name, t in runs.items()}
    return {"adapters": {name: adapter_distance(w, weights["stock"]) for name, w in weights.items()},
            "lora_b_norm": max(float(v.norm()) for k, v in weights["stock"].items() if "lora_B" in k),
            "fp64_dtype": str(next(p for p in runs["fp64"].model.parameters() if p.requires_grad).dtype),
            "ref_model": [t.ref_model is None for t in runs.values()],
            "logs": logs, "microbatches": {v: list(runs[v].odc_microbatch_history) for v in ("packed", "padded")},
            "pushes": {v: pushes(runs[v], seen[v]) for v in ("packed", "padded")},
            "resume": resume_grpo(model_path, tmp)}


def resume_grpo(model_path: str, tmp: str) -> dict:
    """Padding-free, 6 steps with a checkpoint at step 4; a new trainer resumed from it must reproduce steps 5, 6 and
    the adapters."""
    common = dict(GRPO_CASE, max_steps=6, save_strategy="steps", save_steps=4)
    full, _ = train_grpo(model_path, f"{tmp}/full", "packed", **common)
    resumed, _ = train_grpo(model_path, f"{tmp}/resumed", "packed", resume=f"{tmp}/full/checkpoint-4", **common)
    losses = [logged(t, "loss") for t in (full, resumed)]
    return {"losses": [losses[0][-2:], losses[1][-2:]], "steps_run": [len(l) for l in losses],
            "adapters": adapter_distance(adapters(resumed), adapters(full))}


# -- OdcDPOTrainer with peft_config -----------------------------------------------------------------------------------
DPO_BUDGET = 300  # tokens of a microbatch's pairs (both sequences of each): uneven microbatch counts at 2 ranks


def train_dpo(tmp: str, name: str, base, data, odc: bool, fp64: bool = False, peft_model: bool = False,
              resume: str | None = None, adapter_seed: int = 0, **overrides):
    """One DPO run of ``base``'s LoRA adapters (initialised from ``adapter_seed``) without a ``ref_model``:
    OdcDPOTrainer (LB-Mini; padding-free rows unless ``padding_free=False``), DPOTrainer with stock ZeRO-3 (``odc``
    False), or in float64 under DDP (``fp64``). ``peft_model``: a ``PeftModel`` instead of ``peft_config``. Returns
    the trainer and the pushes ODC made."""
    import torch
    from peft import get_peft_model
    from trl import DPOTrainer

    from _rl_workload import char_tokenizer
    from dpo_worker import dpo_config
    from ds_odc.balancer.cost import QuadraticCost
    from ds_odc.integrations import match_accelerate_backend
    from ds_odc.integrations.trl_dpo import OdcDPOTrainer

    if fp64:
        with without_deepspeed():
            return train_dpo(tmp, name, base.double(), data, odc=False, deepspeed=None, adapter_seed=adapter_seed,
                             **overrides)
    settings = dict(padding_free=odc, activation_checkpointing=True, loss_type=["sigmoid"], learning_rate=2.0,
                    **({} if odc else {"train_sampling_strategy": "sequential"}))
    config = dpo_config(f"{tmp}/{name}", overrides.pop("deepspeed", ds_config(odc)), **{**settings, **overrides})
    torch.manual_seed(adapter_seed)  # the adapters' initialisation
    model, peft = (get_peft_model(base, lora_config()), None) if peft_model else (base, lora_config())
    kwargs = dict(args=config, train_dataset=data, processing_class=char_tokenizer(), peft_config=peft)
    if odc:
        # A cost dominated by squared lengths: a rank with a long pair gets fewer pairs (uneven microbatch counts).
        trainer = OdcDPOTrainer(model, max_tokens_per_microbatch=DPO_BUDGET,
                                balancer_cost=QuadraticCost(a=1.0, b=0.1, c=0.0), **kwargs)
    else:
        trainer = DPOTrainer(model, **kwargs)
        match_accelerate_backend(trainer.args)
    with recording_pushes() as seen:
        trainer.train(resume_from_checkpoint=resume)
    return trainer, seen


@contextlib.contextmanager
def reference_with_adapters():
    """The planted error of the reference: OdcDPOTrainer's reference forwards leave the adapters on (the reference
    is then the policy itself)."""
    from ds_odc.integrations import trl_dpo
    use_adapter = trl_dpo.use_adapter
    trl_dpo.use_adapter = lambda model, adapter_name: contextlib.nullcontext()
    try:
        yield
    finally:
        trl_dpo.use_adapter = use_adapter


def policy_adapters(trainer) -> dict:
    """The trained adapter ("default"), without the frozen copy named "ref" that TRL adds to a PeftModel."""
    return {k: v for k, v in adapters(trainer).items() if ".ref." not in k}


def reference_of(trainer) -> dict:
    """Where the trainer's reference log-probs come from: no ``ref_model`` (the policy's base model, through its
    adapters: disabled, or the one named "ref"), the adapters it holds; and whether checkpointing is on."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {"ref_model": trainer.ref_model is None, "adapters": sorted(model.peft_config),
            "checkpointing": bool(model.is_gradient_checkpointing),
            "reentrant": (trainer.args.gradient_checkpointing_kwargs or {}).get("use_reentrant")}


def scenario_dpo(tmp: str) -> dict:
    """``peft_config`` in OdcDPOTrainer (padding-free rows, uneven microbatch counts) against DPOTrainer with stock
    ZeRO-3 and in float64, fed the minibatches in the plan's order: adapters and every value DPOTrainer logs (its
    ``rewards/*`` are the policy's log-probs less the reference's, the base model with the adapters disabled, as TRL
    does without a ``ref_model``). Besides: a PeftModel in padded microbatches (TRL's reference is then a frozen copy
    of the initial adapter, named "ref": zero, so the same reference); an ODC run whose reference forwards leave the
    adapters on (the planted error); the adapters saved; a resume from a checkpoint."""
    import torch.distributed as dist

    from _rl_workload import char_tokenizer
    from dpo_worker import preference_dataset

    tok = char_tokenizer()
    base = tiny_llama(vocab=len(tok))
    base.config.pad_token_id, base.config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    data = preference_dataset(16 * dist.get_world_size())
    runs, seen = {}, {}
    runs["odc"], seen["odc"] = train_dpo(tmp, "odc", copy.deepcopy(base), data, odc=True)
    ordered = data.select(runs["odc"].odc_pack_sampler.sampler.epoch_order(0).tolist())
    runs["stock"], _ = train_dpo(tmp, "stock", copy.deepcopy(base), ordered, odc=False)
    runs["fp64"], _ = train_dpo(tmp, "fp64", copy.deepcopy(base), ordered, odc=False, fp64=True)
    runs["peft_model"], seen["peft_model"] = train_dpo(tmp, "peft_model", copy.deepcopy(base), data, odc=True,
                                                       peft_model=True, padding_free=False)
    with reference_with_adapters():
        runs["planted"], _ = train_dpo(tmp, "planted", copy.deepcopy(base), data, odc=True)
    odc = runs["odc"]
    final = adapters(odc)
    odc.save_model(f"{tmp}/odc-final")  # collective under ZeRO-3
    saved = None
    if dist.get_rank() == 0:
        from safetensors.torch import load_file
        stored = load_file(os.path.join(tmp, "odc-final", "adapter_model.safetensors"))
        live = {k.replace(".default", ""): v for k, v in final.items()}  # PEFT stores the adapter without its name
        saved = {"keys_match": sorted(stored) == sorted(live),
                 "max_abs_diff": max(float((stored[k].double() - live[k].cpu()).abs().max()) for k in live if k in stored)}
    weights = {name: policy_adapters(t) for name, t in runs.items()}
    return {"adapters": {name: adapter_distance(w, weights["stock"]) for name, w in weights.items()},
            "lora_b_norm": max(float(v.norm()) for k, v in weights["stock"].items() if "lora_B" in k),  # from 0
            "fp64_dtype": str(next(p for p in runs["fp64"].model.parameters() if p.requires_grad).dtype),
            "reference": {name: reference_of(t) for name, t in runs.items()},
            "logs": {name: step_logs(t) for name, t in runs.items()},
            "microbatches": {v: microbatch_counts(runs[v]) for v in ("odc", "peft_model")},
            "pushes": {v: pushes(runs[v], seen[v]) for v in seen},
            "optimizer": type(odc.model_wrapped.optimizer).__name__, "saved": saved,
            "resume": resume_dpo(tmp, base, data)}


def resume_dpo(tmp: str, base, data) -> dict:
    """4 steps with Adam and a checkpoint at step 2; a new trainer whose adapters start elsewhere, resumed from the
    checkpoint, must log the same losses at steps 3 and 4 and end with the same adapters."""
    import torch
    from peft import get_peft_model

    common = dict(max_steps=4, save_strategy="steps", save_steps=2, optim="adamw_torch", learning_rate=1e-2)
    full, _ = train_dpo(tmp, "full", copy.deepcopy(base), data, odc=True, **common)
    resumed, _ = train_dpo(tmp, "resumed", copy.deepcopy(base), data, odc=True, resume=f"{tmp}/full/checkpoint-2",
                           adapter_seed=7, **common)
    torch.manual_seed(7)
    elsewhere = {k: v for k, v in full_params(get_peft_model(copy.deepcopy(base), lora_config()), torch.float64).items()
                 if "lora_" in k}
    losses = [{e["step"]: e["loss"] for e in t.state.log_history if "loss" in e} for t in (full, resumed)]
    return {"losses": [[d.get(s) for s in (3, 4)] for d in losses],
            "adapters": adapter_distance(policy_adapters(resumed), policy_adapters(full)),
            "started_elsewhere": adapter_distance(elsewhere, policy_adapters(full))}


def main():
    init_ranks(timeout_s=120)
    import torch.distributed as dist
    out = {"world": dist.get_world_size()}
    with shared_tmpdir("odc_lora_") as tmp:
        for name in sys.argv[1].split(","):
            out[name] = globals()[f"scenario_{name}"](os.path.join(tmp, name))
    if dist.get_rank() == 0:
        emit(out)
    shutdown_and_exit()


if __name__ == "__main__":
    main()
