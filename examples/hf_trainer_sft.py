"""Causal-LM fine-tuning with the Hugging Face Trainer and ds_odc (ODC + LB-Mini), on synthetic variable-length data.

CPU (tiny random model, nothing downloaded):
    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/hf_trainer_sft.py            # ODC + LB-Mini
    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/hf_trainer_sft.py --no-odc   # stock Trainer, ZeRO-3
GPU (bigger presets, bf16):
    .venv/bin/torchrun --standalone --nproc_per_node 8 examples/hf_trainer_sft.py --preset 1b --bf16

The model is random-init from a config, so the loss only shows that training runs; ODC's numbers in the log lines
(samples/s, the wait at the step and the bubble; with --log-dicts every odc/* metric, microbatches per rank too) are
the point. See docs/HF_TRAINER.md.
"""

from __future__ import annotations

import argparse

import torch

import ds_odc  # noqa: F401  (teaches DeepSpeed the `odc` key: import before TrainingArguments and the model)
from ds_odc.balancer.planners import DEFAULT_PLANNER, PLANNERS
from ds_odc.recipes.trainer_config import zero3_config
from ds_odc.training.distributed import init_distributed, output_folder, shutdown_and_exit

PRESETS = {  # name: (hidden, layers, heads, kv heads, intermediate, vocab, max_tokens_per_microbatch, max_len)
    "tiny": (64, 2, 4, 4, 128, 1000, 128, 128),
    "small": (768, 12, 12, 12, 3072, 32000, 8192, 4096),
    "1b": (2048, 16, 32, 8, 8192, 32000, 16384, 8192),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--odc", action=argparse.BooleanOptionalAction, default=True,
                   help="ODC + LB-Mini (default) or stock ZeRO-3 with the stock Trainer (--no-odc)")
    p.add_argument("--planner", default=DEFAULT_PLANNER, choices=list(PLANNERS),
                   help="; ".join(f"{spec.name}: {spec.description}" for spec in PLANNERS.values()))
    p.add_argument("--max-tokens", type=int, default=None, help="token budget per microbatch (preset default)")
    p.add_argument("--per-device-batch", type=int, default=4, help="per_device_train_batch_size")
    p.add_argument("--grad-accum", type=int, default=2, help="gradient_accumulation_steps")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--num-samples", type=int, default=512)
    p.add_argument("--max-len", type=int, default=None, help="longest synthetic sample (preset default)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, flash_attention_2, ...)")
    p.add_argument("--output-dir", help="where checkpoints go (default: a temporary folder, removed at the end; "
                                        "--save-steps and --resume need a folder of yours)")
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: no checkpoints)")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output-dir")
    p.add_argument("--logging-steps", type=int, default=1)
    p.add_argument("--shared-gpu", action="store_true",
                   help="every rank on one GPU (torch.distributed over gloo): several ranks on a one-GPU machine, for correctness, not speed")
    p.add_argument("--log-dicts", action="store_true",
                   help="print every log dict whole (the Trainer's own printing) instead of one short line per step")
    p.add_argument("--local_rank", type=int, default=None)  # the deepspeed launcher passes it
    return p.parse_args()


def synthetic_dataset(num_samples: int, max_len: int, vocab: int, seed: int = 0):
    """Long-tailed lengths (most samples short, a few long), like SFT data: where load balancing matters."""
    from datasets import Dataset
    g = torch.Generator().manual_seed(seed)
    lengths = torch.distributions.LogNormal(0.0, 1.0).sample((num_samples,))
    lengths = (lengths / lengths.max() * max_len).clamp(min=8).long().tolist()
    return Dataset.from_dict({"input_ids": [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]})


def ds_config(odc: bool, bf16: bool) -> dict:
    return zero3_config(odc, {"contiguous_gradients": True, "reduce_scatter": True},
                        **({"bf16": {"enabled": True}} if bf16 else {}))


def main():
    args = parse_args()
    if (args.save_steps or args.resume) and args.output_dir is None:
        raise SystemExit("--save-steps and --resume keep checkpoints between runs: name their folder with --output-dir")
    # Before TrainingArguments: then HF's zero.Init sees the real world size (on CPU nothing else would set it).
    init_distributed(shared_gpu=args.shared_gpu or None)
    from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

    from ds_odc.training.collate import PackedCollator
    from ds_odc.integrations import match_accelerate_backend
    from ds_odc.integrations.transformers import OdcTrainer

    hidden, layers, heads, kv, inter, vocab, budget, max_len = PRESETS[args.preset]
    max_tokens = args.max_tokens or budget
    max_len = min(args.max_len or max_len, max_tokens)
    on_gpu = torch.cuda.is_available()
    training_args = TrainingArguments(
        output_dir=output_folder(args.output_dir, "ds_odc_hf_trainer_sft_"),
        per_device_train_batch_size=args.per_device_batch, gradient_accumulation_steps=args.grad_accum,
        max_steps=args.max_steps, learning_rate=args.lr,
        lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=args.logging_steps,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        report_to=[], use_cpu=not on_gpu, optim="adamw_torch", bf16=args.bf16, deepspeed=ds_config(args.odc, args.bf16),
        seed=0, disable_tqdm=True, dataloader_pin_memory=on_gpu,
    )
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                         max_position_embeddings=max(max_len, 256), tie_word_embeddings=False,
                         attn_implementation=args.attn, use_cache=False)
    # After TrainingArguments(deepspeed=...) HF builds the model inside zero.Init: partitioned from the start.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if args.bf16 else torch.float32)
    data = synthetic_dataset(args.num_samples, max_len, vocab)

    if args.odc:
        trainer = OdcTrainer(model, training_args, train_dataset=data, balancer_planner=args.planner,
                             max_tokens_per_microbatch=max_tokens)
    else:  # the baseline: stock Trainer and ZeRO-3, one padding-free sample per microbatch
        trainer = Trainer(model, training_args, train_dataset=data, data_collator=PackedCollator())
        match_accelerate_backend(trainer.args)  # gathers over gloo when the ranks share a GPU (--shared-gpu)
    if not args.log_dicts:
        from ds_odc.integrations import show_log_lines
        show_log_lines(trainer)  # one short line per logging step
    result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    if trainer.is_world_process_zero():
        summary = {k: round(v, 4) for k, v in result.metrics.items()}
        print(f"done: {trainer.state.global_step} steps, {summary}", flush=True)

    shutdown_and_exit()


if __name__ == "__main__":
    main()
