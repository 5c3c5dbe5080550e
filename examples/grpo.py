"""GRPO with ds_odc: lockstep-free generation and LB-Mini over the rollouts (``OdcGRPOTrainer``), on a toy task
whose answers can be checked.

The task: prompts ``"a+b="``; a completion earns 1 if it starts with the right sum and up to 0.2 more the sooner it
stops. The policy is a random-init Qwen2 with a character tokenizer built in code, so nothing is downloaded (pass
``--model PATH`` for a local pretrained checkpoint and its tokenizer). Completion lengths vary a lot from the start
(a random policy stops at a random EOS), which is what ODC is for: each rank decodes until its own completions are
done, then LB-Mini spreads the step's completions over the ranks by cost.

CPU, 2 ranks (seconds):
    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/grpo.py
    .venv/bin/accelerate launch --config_file ds_configs/accelerate_zero3_odc_cpu.yaml examples/grpo.py
    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/grpo.py --no-odc     # stock GRPOTrainer + stock ZeRO-3
    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/grpo.py --lora 8     # LoRA adapters (needs peft)
GPU, one node (Qwen2-1.5B shape, bf16):
    .venv/bin/accelerate launch --config_file ds_configs/accelerate_zero3_odc.yaml examples/grpo.py --preset 1.5b

Every log carries, besides TRL's metrics (the console shows one short line per step; ``--log-dicts``: every value):
``odc/microbatches_rank{r}`` (microbatches each rank trained),
``odc/bubble`` (share of rank-time not spent in forward/backward), ``odc/generation_tokens_per_second`` (new tokens
of all ranks over the slowest rank's generation time) and ``odc/step_wait_seconds`` (time a rank waited for the
others at the optimizer step).
"""

from __future__ import annotations

import argparse
import random
import re

import torch

import ds_odc  # noqa: F401  (teaches DeepSpeed the `odc` key before GRPOConfig and the model)
from ds_odc.integrations import activation_checkpointing
from ds_odc.training.distributed import init_distributed, output_folder, shutdown_and_exit
from ds_odc.recipes.lora import lora_config
from ds_odc.recipes.toy_text import char_tokenizer
from ds_odc.recipes.trainer_config import accelerate_chose_deepspeed, zero3_config

PRESETS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_new_tokens=48, per_device_batch=4, num_generations=4, grad_accum=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, max_new_tokens=1024, per_device_batch=8, num_generations=8, grad_accum=2),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--odc", action=argparse.BooleanOptionalAction, default=True,
                   help="ODC on (default) or stock ZeRO-3 (torchrun only; with accelerate the config file decides)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--model", help="local pretrained model folder (with its tokenizer) instead of a random init")
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--loss-type", default="dapo")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--per-device-batch", type=int)
    p.add_argument("--num-generations", type=int)
    p.add_argument("--grad-accum", type=int)
    p.add_argument("--max-tokens", type=int, help="token budget of one microbatch, a padding-free row (default: "
                                                    "the largest microbatch the stock trainer would run)")
    p.add_argument("--residency", default="auto", choices=["auto", "full", "block"],
                   help="generation: keep the read parameters for the whole generate call (full) or read per block")
    p.add_argument("--output-dir", help="where the trainer writes (default: a temporary folder, removed at the end)")
    p.add_argument("--lora", type=int, default=None, metavar="RANK",
                   help="train LoRA adapters of this rank (peft_config; every linear layer but the LM head)")
    p.add_argument("--shared-gpu", action="store_true",
                   help="every rank on one GPU (torch.distributed over gloo): several ranks on a one-GPU machine, for correctness, not speed")
    p.add_argument("--log-dicts", action="store_true",
                   help="print every log dict whole (the Trainer's own printing) instead of one short line per step")
    p.add_argument("--local_rank", type=int, default=None)
    return p.parse_args()


def sums_dataset(n: int, seed: int = 0):
    from datasets import Dataset
    rng = random.Random(seed)
    pairs = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(n)]
    return Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in pairs], "answer": [a + b for a, b in pairs]})


def correct_sum(completions, answer, **kwargs):
    """1 when the completion starts with the right number."""
    out = []
    for text, expected in zip(completions, answer):
        match = re.match(r"\s*(-?\d+)", text)
        out.append(1.0 if match and int(match.group(1)) == expected else 0.0)
    return out


def make_short_reward(max_new_tokens: int):
    def stops_early(completions, **kwargs):
        """Up to 1 for a completion that ends well before the token limit."""
        return [max(0.0, 1.0 - len(text) / max_new_tokens) for text in completions]
    return stops_early


def build_model(args, preset, tokenizer, dtype):
    from transformers import AutoModelForCausalLM, Qwen2Config
    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    shape = {k: preset[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                    "num_key_value_heads")}
    config = Qwen2Config(**shape, vocab_size=len(tokenizer), max_position_embeddings=4096, tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    # Built after GRPOConfig: with ZeRO-3 transformers partitions it with zero.Init while it is built.
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def main():
    args = parse_args()
    preset = PRESETS[args.preset]
    for key in ("max_new_tokens", "per_device_batch", "num_generations", "grad_accum"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    init_distributed(shared_gpu=args.shared_gpu or None)
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    from ds_odc.integrations.trl_grpo import OdcGRPOTrainer

    on_gpu = torch.cuda.is_available()
    accelerate_config = accelerate_chose_deepspeed()  # then the config file's deepspeed_config_file decides
    deepspeed_config = None if accelerate_config else zero3_config(
        args.odc, {"stage3_param_persistence_threshold": 0}, bf16={"enabled": "auto"})
    config = GRPOConfig(
        output_dir=output_folder(args.output_dir, "ds_odc_grpo_"), per_device_train_batch_size=args.per_device_batch,
        num_generations=args.num_generations, gradient_accumulation_steps=args.grad_accum, max_steps=args.max_steps,
        max_completion_length=args.max_new_tokens, loss_type=args.loss_type, learning_rate=1e-4 if on_gpu else 1e-3,
        beta=0.0, logging_steps=1, save_strategy="no", report_to=[], use_cpu=not on_gpu, bf16=on_gpu,
        **activation_checkpointing(on_gpu), optim="adamw_torch", seed=0, disable_tqdm=True, log_completions=False,
        reward_weights=[1.0, 0.2], deepspeed=deepspeed_config, dataloader_num_workers=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model) if args.model else char_tokenizer()
    model = build_model(args, preset, tokenizer, torch.bfloat16 if on_gpu else torch.float32)
    rewards = [correct_sum, make_short_reward(args.max_new_tokens)]
    data = sums_dataset(4096)
    common = dict(reward_funcs=rewards, args=config, train_dataset=data, processing_class=tokenizer,
                  peft_config=lora_config(args.lora))
    trainer = OdcGRPOTrainer(model, max_tokens_per_microbatch=args.max_tokens, generation_residency=args.residency,
                             **common)
    if not trainer.odc and args.odc and not accelerate_config:
        raise SystemExit("ODC did not turn on: check the DeepSpeed config")
    if not args.log_dicts:
        from ds_odc.integrations import show_log_lines
        show_log_lines(trainer, extra=("reward",))  # one short line per logging step
    trainer.train()
    if trainer.is_world_process_zero():
        logs = [e for e in trainer.state.log_history if "reward" in e]
        mode = "odc + lb-mini" if trainer.odc else "stock zero-3"
        print(f"done: {trainer.state.global_step} steps ({mode}), reward {logs[0]['reward']:.3f} -> "
              f"{logs[-1]['reward']:.3f}", flush=True)
    shutdown_and_exit()


if __name__ == "__main__":
    main()
