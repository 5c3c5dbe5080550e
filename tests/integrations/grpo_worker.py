"""OdcGRPOTrainer vs stock GRPOTrainer + stock ZeRO-3, launched by test_trl_grpo.py through ``_support.launch.launch``.

Both trainers get the same scripted completions (TRL's ``rollout_func``), so any difference comes from how the
step is trained: ODC re-plans every step's rollouts across ranks with LB-Mini (uneven microbatch counts), in
padding-free rows or in padded microbatches, and must still give TRL's loss, parameters and logged metrics. fp32,
SGD, a tiny Qwen2 loaded from a local folder (nothing downloaded). Stock also trains each case in float64 (on the
same ranks through DDP, as DeepSpeed refuses float64): how far fp32 rounding moves stock itself is the reference
distance of the bound (tests/_support/tolerance.py). ``--planted``: one more ODC run of the first case with one
microbatch missing from its gradient (the planted-error check).

Usage: grpo_worker.py equivalence [--cases a,b] [--refusals] [--resume] [--planted] | gpu; rank 0 prints one
ODC_RESULT line. With ODC_TEST_CUDA=1 (tests/gpu/test_grpo_gpu.py) the ranks train on CUDA: one GPU each, or all on
GPU 0 over gloo (DS_ODC_SHARED_GPU=1).
"""

from __future__ import annotations

import argparse
import os
import sys

import ds_odc  # noqa: F401  (the `odc` key must parse before GRPOConfig / zero.Init)
from _support.launch import emit
from ds_odc.training.distributed import shutdown_and_exit

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "zero"))
from _hf_workload import ON_CPU, ds_config, logged, shared_tmpdir, without_deepspeed  # noqa: E402
from _support.tolerance import plant_wrong_weight  # noqa: E402
from _rl_workload import char_tokenizer, letter_reward, prompt_dataset, scripted_rollout, tiny_qwen2  # noqa: E402
from _workload import flat, full_params, max_rel_diff, rel_diff  # noqa: E402
from worker import init_ranks  # noqa: E402  (CPU ranks, or GPU ranks under tests/gpu: one GPU each, or all on one)

MAX_NEW = 48
# stock TRL; ODC with padded microbatches; ODC padding-free; stock TRL in float64 (DDP), the reference distance's end
VARIANTS = ("stock", "padded", "packed", "fp64")


def save_model(folder: str, hidden_size: int = 32) -> str:
    """The tiny policy as a local checkpoint: TRL builds the reference model (beta > 0) from the policy's path."""
    import torch.distributed as dist
    path = os.path.join(folder, "tiny-qwen2")
    if dist.get_rank() == 0:
        tok = char_tokenizer()
        model = tiny_qwen2(vocab=len(tok), hidden_size=hidden_size)
        model.config.eos_token_id = tok.eos_token_id
        model.generation_config.eos_token_id = tok.eos_token_id
        model.save_pretrained(path)
        tok.save_pretrained(path)
    dist.barrier()
    return path


def initial_params(path: str) -> dict:
    from transformers import AutoModelForCausalLM
    return full_params(AutoModelForCausalLM.from_pretrained(path))


def grpo_config(output_dir: str, odc: bool, **overrides):
    from trl import GRPOConfig
    kwargs = dict(output_dir=output_dir, per_device_train_batch_size=4, num_generations=4,
                  gradient_accumulation_steps=2, max_steps=2, learning_rate=0.05, optim="sgd",
                  lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
                  logging_steps=1, save_strategy="no", report_to=[], use_cpu=ON_CPU, seed=0, disable_tqdm=True,
                  bf16=False, gradient_checkpointing=False, max_completion_length=MAX_NEW, beta=0.0,
                  deepspeed=ds_config(odc), dataloader_num_workers=0, log_completions=False)
    kwargs.update(overrides)
    if kwargs["bf16"]:  # DeepSpeed's bf16 engine (fp32 master weights), not only autocast
        kwargs["deepspeed"] = {**kwargs["deepspeed"], "bf16": {"enabled": True}}
    return GRPOConfig(**kwargs)


def train(model_path: str, out: str, variant: str, resume: str | None = None, odc_kwargs: dict | None = None,
          plant: float | None = None, **overrides) -> dict:
    """``variant``: see VARIANTS; ``plant``: the first microbatch of rank 0 weighted by it (a planted error)."""
    import torch
    from trl import GRPOTrainer

    from ds_odc.integrations import match_accelerate_backend
    from ds_odc.integrations.trl_grpo import OdcGRPOTrainer
    if variant == "fp64":  # stock in float64 through DDP (DeepSpeed refuses float64)
        with without_deepspeed():
            return train(model_path, out, "stock", resume, odc_kwargs, plant, deepspeed=None,
                         model_init_kwargs={"dtype": torch.float64}, **overrides)
    config = grpo_config(out, odc=variant in ("padded", "packed"), **overrides)
    kwargs = dict(reward_funcs=letter_reward, args=config, train_dataset=prompt_dataset(64),
                  processing_class=char_tokenizer(), rollout_func=scripted_rollout(MAX_NEW))
    if variant == "stock":
        trainer = GRPOTrainer(model_path, **kwargs)
        match_accelerate_backend(trainer.args)  # stock, on one GPU shared over gloo
    else:  # budgets: padded rows x width, or tokens of a packed row. A cost dominated by squared lengths (attention)
        # gives ranks different microbatch counts more often than tokens do (the automatic cost: see resume()).
        from ds_odc.balancer.cost import QuadraticCost
        odc_kwargs = {"balancer_cost": QuadraticCost(a=1.0, b=0.1, c=0.0), **(odc_kwargs or {})}
        trainer = OdcGRPOTrainer(model_path, padding_free=variant == "packed",
                                 max_tokens_per_microbatch=64 if variant == "padded" else 80, **odc_kwargs, **kwargs)
    if plant is not None:
        plant_wrong_weight(trainer.accelerator, plant)
    trainer.train(resume_from_checkpoint=resume)
    return {"loss": logged(trainer, "loss"), "params": full_params(trainer.model_wrapped, torch.float64),
            "optimizer": type(getattr(trainer.model_wrapped, "optimizer", trainer.optimizer)).__name__,
            "dtype": str(next(trainer.model.parameters()).dtype),
            "microbatches": list(getattr(trainer, "odc_microbatch_history", [])),
            "plans": [[step, mbs] for step, mbs in getattr(trainer, "odc_plan_history", [])],
            "logs": [e for e in trainer.state.log_history if "loss" in e]}


def rel_loss_diff(a: list[float], b: list[float]) -> float:
    """Largest loss difference relative to max(|loss|, 1): GRPO losses sit near 0 (advantages have zero mean)."""
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / max(abs(y), 1.0) for x, y in zip(a, b))


def trl_logs(run: dict) -> list[dict]:
    """What TRL logged at every step, less timings and ds_odc's own keys."""
    return [{k: v for k, v in entry.items() if not k.startswith("odc/") and k != "step_time"}
            for entry in run["logs"]]


# Every case: KL to a reference model (beta > 0), two passes over each generation batch (num_iterations = 2), and a
# generation batch of two optimizer steps (steps_per_generation = 2 x gradient_accumulation_steps): 4 optimizer steps.
HARD = {"beta": 0.05, "num_iterations": 2, "steps_per_generation": 4, "max_steps": 4}
# Learning rates that move the parameters by 1-6% over the 4 steps whatever the loss's scale (luspo sums its terms
# over each sequence, dr_grpo divides by the 48-token limit): the KL to the reference then grows well above the
# rounding of the log-probs it is computed from.
RATES = {"luspo": 0.015, "dr_grpo": 1.5, "cispo": 1.5, "sapo": 0.15}
CASES = {name: {"loss_type": name, **HARD, "learning_rate": RATES.get(name, 0.3)}
         for name in ("grpo", "dapo", "bnpo", "dr_grpo", "luspo", "sapo", "cispo", "vespo")}
# Gradient checkpointing: the backward recomputes every layer's forward, packed rows included.
CASES["checkpointing"] = {**CASES["dapo"], "gradient_checkpointing": True}


def scenario_equivalence(args):
    import torch.distributed as dist
    with shared_tmpdir("odc_grpo_") as tmp:
        model_path = save_model(tmp)
        initial = initial_params(model_path)
        out = {"world": dist.get_world_size(), "cases": {}}
        for name in args.cases.split(","):
            runs = {v: train(model_path, f"{tmp}/{name}-{v}", v, **CASES[name]) for v in args.variants.split(",")}
            if args.planted and name == args.cases.split(",")[0]:  # the first microbatch of rank 0 left out
                runs["planted"] = train(model_path, f"{tmp}/{name}-planted", "packed", plant=0.0, **CASES[name])
            stock = runs["stock"]
            out["cases"][name] = {
                "optimizers": {v: r["optimizer"] for v, r in runs.items()},
                "dtypes": {v: r["dtype"] for v, r in runs.items()},
                "logs": {v: trl_logs(r) for v, r in runs.items()},
                "loss_diff": {v: rel_loss_diff(r["loss"], stock["loss"]) for v, r in runs.items()},
                # every run's distance from stock; the fp64 run's is stock's own rounding, the reference distance
                "param_diff": {v: max_rel_diff(r["params"], stock["params"]) for v, r in runs.items()},
                "stock_moved": rel_diff(flat(initial.values()), flat(stock["params"].values())),  # training did move
                "microbatches": {v: r["microbatches"] for v, r in runs.items() if v != "stock"},
            }
            if name == args.cases.split(",")[0]:
                logs = runs[[v for v in args.variants.split(",") if v in ("padded", "packed")][-1]]["logs"]
                out["log_keys"] = sorted(set().union(*logs))  # the steps without generation log no rewards
                out["last_log"] = {k: v for k, v in logs[-1].items() if k.startswith("odc/")}
        if args.refusals:
            out["refusals"] = refusals(model_path, tmp)
        if args.resume:
            out["resume"] = resume(model_path, tmp)
    if dist.get_rank() == 0:
        emit(out)


REFUSED = {
    "use_vllm": {"use_vllm": True},
    "top_entropy_quantile": {"top_entropy_quantile": 0.5},
    "entropy_coef": {"entropy_coef": 0.01},
    "steps_per_generation": {"steps_per_generation": 3},
    "loss_type": {"loss_type": "no-such-loss"},
}


def refusals(model_path: str, tmp: str) -> dict:
    """Options ODC cannot run: each must fail at construction with a message naming it (no hang, no training)."""
    from ds_odc.integrations.trl_grpo import OdcGRPOTrainer
    out = {}
    for name, overrides in REFUSED.items():
        try:
            config = grpo_config(f"{tmp}/refused", odc=True, **{k: v for k, v in overrides.items() if k != "loss_type"})
            if "loss_type" in overrides:
                config.loss_type = overrides["loss_type"]
            OdcGRPOTrainer(model_path, reward_funcs=letter_reward, args=config, train_dataset=prompt_dataset(8),
                           processing_class=char_tokenizer())
            out[name] = "accepted"
        except ValueError as err:
            out[name] = str(err)
    return out


def resume(model_path: str, tmp: str) -> dict:
    """Padding-free, automatic cost (fitted from the first step on): 6 steps with a checkpoint at step 4; a new trainer
    resumed from it must plan step 5 as the uninterrupted run did (the fit is part of the checkpoint) and reproduce
    steps 5 and 6."""
    import json

    from transformers import AutoConfig

    from ds_odc.balancer.autocost import AutoCost
    from ds_odc.balancer.sampler import auto_cost_prior

    def cost():
        return {"balancer_cost": AutoCost(auto_cost_prior(AutoConfig.from_pretrained(model_path)), warmup_steps=0)}

    common = dict(loss_type="dapo", max_steps=6, save_strategy="steps", save_steps=4)
    full = train(model_path, f"{tmp}/full", "packed", odc_kwargs=cost(), **common)
    resumed = train(model_path, f"{tmp}/resumed", "packed", resume=f"{tmp}/full/checkpoint-4", odc_kwargs=cost(),
                    **common)
    saved = os.path.join(tmp, "full", "checkpoint-4", "ds_odc_balancer.json")
    state = json.load(open(saved)) if os.path.isfile(saved) else {}
    return {"full_loss": full["loss"], "resumed_loss": resumed["loss"],
            "loss_diff": rel_loss_diff(resumed["loss"][-2:], full["loss"][-2:]),
            "param_diff": max_rel_diff(resumed["params"], full["params"]),
            "steps_run": [len(full["microbatches"]), len(resumed["microbatches"])],
            "plans": [[p for _, p in full["plans"]], [p for _, p in resumed["plans"]]],
            "balancer_state_saved": bool(state),
            "cost_fitted_at_resume": state.get("auto_cost", {}).get("coef") is not None,
            "cost_logged": any("odc/cost_a" in e for e in full["logs"])}


def scenario_gpu(args):
    """bf16 on CUDA, 2 steps, a reference model: stock GRPOTrainer + ZeRO-3, and OdcGRPOTrainer padded and
    padding-free (ds_odc_varlen on the GPU's kernels), each against stock in bf16 and against stock in fp32."""
    import torch.distributed as dist
    common = dict(loss_type="dapo", beta=0.04, max_steps=2, use_cpu=ON_CPU, learning_rate=1.0)
    with shared_tmpdir("odc_grpo_gpu_") as tmp:
        model_path = save_model(tmp, hidden_size=128)
        initial = initial_params(model_path)
        runs = {"fp32": train(model_path, f"{tmp}/fp32", "stock", bf16=False, **common)}
        for variant in ("stock", "padded", "packed"):
            runs[variant] = train(model_path, f"{tmp}/{variant}", variant, bf16=True, **common)
    reference, stock = runs["fp32"]["params"], runs["stock"]["params"]
    out = {"world": dist.get_world_size(), "optimizers": {v: r["optimizer"] for v, r in runs.items()},
           "moved": rel_diff(flat(initial.values()), flat(reference.values())),
           "stock_vs_fp32": max_rel_diff(stock, reference),
           "loss": {v: r["loss"] for v, r in runs.items()},
           "microbatches": {v: r["microbatches"] for v, r in runs.items()}}
    for variant in ("padded", "packed"):
        out[f"{variant}_vs_stock"] = max_rel_diff(runs[variant]["params"], stock)
        out[f"{variant}_vs_fp32"] = max_rel_diff(runs[variant]["params"], reference)
    if dist.get_rank() == 0:
        emit(out)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--refusals", action="store_true")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--planted", action="store_true", help="an ODC run of the first case, a microbatch left out")
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args()
    init_ranks(timeout_s=120)
    globals()[f"scenario_{args.scenario}"](args)


if __name__ == "__main__":
    main()
    shutdown_and_exit()
