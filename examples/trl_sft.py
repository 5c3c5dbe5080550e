"""TRL's SFTTrainer with ds_odc (ODC + LB-Mini): ``ds_odc.integrations.trl_sft.OdcSFTTrainer``.

CPU (tiny random model, a character tokenizer built in code, synthetic prompt/completion text; nothing downloaded):
    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/trl_sft.py
    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/trl_sft.py --no-odc    # stock SFTTrainer + ZeRO-3
    .venv/bin/accelerate launch --config_file ds_configs/accelerate_zero3_odc_cpu.yaml examples/trl_sft.py
    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/trl_sft.py --lora 8    # LoRA adapters (needs peft)

``OdcSFTTrainer`` is ``OdcTrainer`` + ``SFTTrainer``: each microbatch is collated by SFT's own collator (prompts
masked, padding-free rows), and the metrics SFTTrainer logs (entropy, mean_token_accuracy, num_tokens) are the values
stock SFTTrainer would log for the same minibatches, although ranks train different numbers of microbatches.
Needs ``pip install trl`` (tested with trl 1.16).
"""

from __future__ import annotations

import argparse
import random

import torch

import ds_odc  # noqa: F401  (teaches DeepSpeed the `odc` key before SFTConfig and the model)
from ds_odc.integrations import activation_checkpointing, match_accelerate_backend
from ds_odc.recipes.lora import lora_config
from ds_odc.recipes.toy_text import char_tokenizer
from ds_odc.recipes.trainer_config import accelerate_chose_deepspeed, zero3_config
from ds_odc.training.distributed import init_distributed, output_folder, shutdown_and_exit


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--odc", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--per-device-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=512, help="token budget per microbatch")
    p.add_argument("--lora", type=int, default=None, metavar="RANK",
                   help="train LoRA adapters of this rank (peft_config; every linear layer but the LM head)")
    p.add_argument("--num-samples", type=int, default=256)
    p.add_argument("--output-dir", help="where the trainer writes (default: a temporary folder, removed at the end)")
    p.add_argument("--shared-gpu", action="store_true",
                   help="every rank on one GPU (torch.distributed over gloo): several ranks on a one-GPU machine, for correctness, not speed")
    p.add_argument("--log-dicts", action="store_true",
                   help="print every log dict whole (the Trainer's own printing) instead of one short line per step")
    p.add_argument("--local_rank", type=int, default=None)
    return p.parse_args()


def synthetic_pairs(n: int, seed: int = 0):
    """Prompt/completion pairs with long-tailed completion lengths; the loss covers completions only."""
    from datasets import Dataset
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "odc", "zero", "rank", "step", "token", "pack"]
    prompts, completions = [], []
    for _ in range(n):
        prompts.append("Q: " + " ".join(rng.choices(words, k=rng.randint(2, 6))) + "\nA:")
        completions.append(" " + " ".join(rng.choices(words, k=min(60, max(1, int(rng.lognormvariate(1.5, 0.9)))))))
    return Dataset.from_dict({"prompt": prompts, "completion": completions})


def main():
    args = parse_args()
    init_distributed(shared_gpu=args.shared_gpu or None)
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, vocab_size=len(tokenizer),
                                         max_position_embeddings=512, tie_word_embeddings=False, use_cache=False,
                                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    # accelerate launch: the config file's deepspeed_config_file decides (ODC or not); torchrun: --odc / --no-odc.
    accelerate_config = accelerate_chose_deepspeed()
    deepspeed_config = None if accelerate_config else zero3_config(args.odc)
    config = SFTConfig(
        output_dir=output_folder(args.output_dir, "ds_odc_trl_sft_"), per_device_train_batch_size=args.per_device_batch,
        gradient_accumulation_steps=args.grad_accum, max_steps=args.max_steps, learning_rate=3e-4,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available(),  # TRL's default is bf16, which on CPU means slow bf16 autocast
        optim="adamw_torch", seed=0, disable_tqdm=True, max_length=None, padding_free=True,
        **activation_checkpointing(True), deepspeed=deepspeed_config,  # what SFTConfig defaults to
    )
    data = synthetic_pairs(args.num_samples)
    common = dict(train_dataset=data, processing_class=tokenizer, peft_config=lora_config(args.lora))
    if args.odc or accelerate_config:  # OdcSFTTrainer defers to SFTTrainer when the config has no odc
        from ds_odc.integrations.trl_sft import OdcSFTTrainer
        trainer = OdcSFTTrainer(model, config, max_tokens_per_microbatch=args.max_tokens, **common)
    else:
        trainer = SFTTrainer(model, config, **common)
        match_accelerate_backend(trainer.args)  # gathers over gloo when the ranks share a GPU (--shared-gpu)
    if not args.log_dicts:
        from ds_odc.integrations import show_log_lines
        show_log_lines(trainer)  # one short line per logging step
    result = trainer.train()
    if trainer.is_world_process_zero():
        print(f"done: {trainer.state.global_step} steps, train_loss={result.metrics['train_loss']:.4f}", flush=True)

    shutdown_and_exit()


if __name__ == "__main__":
    main()
