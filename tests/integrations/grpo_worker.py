"""OdcGRPOTrainer vs stock GRPOTrainer + stock ZeRO-3, launched by test_trl_grpo.py through ``_support.launch.launch``.

Both trainers get the same scripted completions (TRL's ``rollout_func``), so any difference comes from how the
step is trained: ODC re-plans every step's rollouts across ranks with LB-Mini (uneven microbatch counts) and must
still give TRL's loss and parameters. fp32, SGD, a tiny Qwen2 loaded from a local folder (nothing downloaded).

Usage: grpo_worker.py equivalence [--cases a,b] [--refusals] [--resume]; rank 0 prints one ODC_RESULT line.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import ds_odc  # noqa: F401  (the `odc` key must parse before GRPOConfig / zero.Init)
from _support.launch import emit, init_test_ranks
from ds_odc.training.distributed import shutdown_and_exit

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "zero"))
from _hf_workload import ds_config, logged  # noqa: E402
from _rl_workload import char_tokenizer, letter_reward, prompt_dataset, scripted_rollout, tiny_qwen2  # noqa: E402
from _workload import full_params, max_rel_diff  # noqa: E402

MAX_NEW = 48


def shared_tmpdir() -> str:
    import torch.distributed as dist
    box = [tempfile.mkdtemp(prefix="odc_grpo_")] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_model(folder: str) -> str:
    """The tiny policy as a local checkpoint: TRL builds the reference model (beta > 0) from the policy's path."""
    import torch.distributed as dist
    path = os.path.join(folder, "tiny-qwen2")
    if dist.get_rank() == 0:
        tok = char_tokenizer()
        model = tiny_qwen2(vocab=len(tok))
        model.config.eos_token_id = tok.eos_token_id
        model.generation_config.eos_token_id = tok.eos_token_id
        model.save_pretrained(path)
        tok.save_pretrained(path)
    dist.barrier()
    return path


def grpo_config(output_dir: str, odc: bool, **overrides):
    from trl import GRPOConfig
    kwargs = dict(output_dir=output_dir, per_device_train_batch_size=4, num_generations=4,
                  gradient_accumulation_steps=2, max_steps=2, learning_rate=0.5, optim="sgd",
                  lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
                  logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                  bf16=False, gradient_checkpointing=False, max_completion_length=MAX_NEW, beta=0.0,
                  deepspeed=ds_config(odc), dataloader_num_workers=0, log_completions=False)
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


def train(model_path: str, out: str, odc: bool, resume: str | None = None, **overrides) -> dict:
    from trl import GRPOTrainer

    from ds_odc.integrations.trl_grpo import OdcGRPOTrainer
    config = grpo_config(out, odc, **overrides)
    tok = char_tokenizer()
    kwargs = dict(reward_funcs=letter_reward, args=config, train_dataset=prompt_dataset(64),
                  processing_class=tok, rollout_func=scripted_rollout(MAX_NEW))
    if odc:
        trainer = OdcGRPOTrainer(model_path, max_tokens_per_microbatch=64, **kwargs)
    else:
        trainer = GRPOTrainer(model_path, **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    return {"loss": logged(trainer, "loss"), "params": full_params(trainer.model_wrapped),
            "optimizer": type(trainer.model_wrapped.optimizer).__name__,
            "microbatches": list(getattr(trainer, "odc_microbatch_history", [])),
            "logs": [e for e in trainer.state.log_history if "loss" in e]}


def rel_loss_diff(a: list[float], b: list[float]) -> float:
    """Largest loss difference relative to max(|loss|, 1): GRPO losses sit near 0 (advantages have zero mean)."""
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / max(abs(y), 1.0) for x, y in zip(a, b))


def compare(stock: dict, odc: dict) -> dict:
    return {"loss_stock": stock["loss"], "loss_odc": odc["loss"],
            "loss_diff": rel_loss_diff(odc["loss"], stock["loss"]),
            "param_diff": max_rel_diff(odc["params"], stock["params"]),
            "optimizers": [stock["optimizer"], odc["optimizer"]],
            "microbatches": odc["microbatches"]}


CASES = {
    "grpo": {"loss_type": "grpo"},
    "dapo": {"loss_type": "dapo"},
    "bnpo": {"loss_type": "bnpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "luspo": {"loss_type": "luspo"},
    "sapo": {"loss_type": "sapo"},
    "cispo": {"loss_type": "cispo"},
    "vespo": {"loss_type": "vespo"},
    # KL to a reference model, two passes over each generation batch, and a generation batch of two optimizer steps
    "grpo_kl_iter2_spg4": {"loss_type": "grpo", "beta": 0.04, "num_iterations": 2, "steps_per_generation": 4,
                           "max_steps": 4},
}


def scenario_equivalence(args):
    import torch.distributed as dist
    tmp = shared_tmpdir()
    model_path = save_model(tmp)
    out = {"world": dist.get_world_size(), "cases": {}}
    for name in args.cases.split(","):
        stock = train(model_path, f"{tmp}/{name}-stock", odc=False, **CASES[name])
        odc = train(model_path, f"{tmp}/{name}-odc", odc=True, **CASES[name])
        out["cases"][name] = compare(stock, odc)
        if name == args.cases.split(",")[0]:
            out["log_keys"] = sorted(odc["logs"][-1])
            out["last_log"] = {k: v for k, v in odc["logs"][-1].items() if k.startswith("odc/")}
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
    """4 steps with a checkpoint at step 2; a new trainer resumed from it must reproduce steps 3 and 4."""
    common = dict(loss_type="dapo", max_steps=4, save_strategy="steps", save_steps=2)
    full = train(model_path, f"{tmp}/full", odc=True, **common)
    resumed = train(model_path, f"{tmp}/resumed", odc=True, resume=f"{tmp}/full/checkpoint-2", **common)
    return {"full_loss": full["loss"], "resumed_loss": resumed["loss"],
            "loss_diff": rel_loss_diff(resumed["loss"][-2:], full["loss"][-2:]),
            "param_diff": max_rel_diff(resumed["params"], full["params"]),
            "steps_run": [len(full["microbatches"]), len(resumed["microbatches"])]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--refusals", action="store_true")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args()
    init_test_ranks(timeout_s=120)
    globals()[f"scenario_{args.scenario}"](args)


if __name__ == "__main__":
    main()
    shutdown_and_exit()
