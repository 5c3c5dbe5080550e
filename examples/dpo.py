"""TRL's DPOTrainer with ds_odc: LB-Mini over preference pairs (``ds_odc.integrations.OdcDPOTrainer``).

CPU (tiny random model, a character tokenizer built in code, synthetic preference pairs; nothing downloaded):
    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/dpo.py
    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/dpo.py --no-padding-free   # padded microbatches
    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/dpo.py --lora 8    # LoRA adapters (needs peft)
    .venv/bin/torchrun --standalone --nproc_per_node 2 examples/dpo.py --no-odc    # stock DPOTrainer + ZeRO-3 (its
                                                           # own sampler: the same pairs in another order)
    .venv/bin/accelerate launch --config_file ds_configs/accelerate_zero3_odc_cpu.yaml examples/dpo.py

A pair (a prompt, a chosen and a rejected completion) is one sample for LB-Mini: it is never split across ranks or
microbatches and costs both of its sequences. Each rank trains its share of a step's pairs in as many microbatches as
it needs (padding-free rows by default), and the reference model scores the same rows (with ``--lora``: the base
model with the adapters disabled, as TRL does; no reference copy is kept). The loss and the metrics TRL
logs (``rewards/*``, ``logps/*``, ``logits/*``, ...) are the values stock DPOTrainer would log for the same
minibatches. Every log also carries ``odc/microbatches_rank{r}`` and ``odc/bubble``; the console shows one short line
per step (loss, reward accuracy, samples/s, ODC's wait and bubble), ``--log-dicts`` every value. Needs ``pip install trl``
(tested with trl 1.16).
"""

from __future__ import annotations

import argparse
import random

import torch

import ds_odc  # noqa: F401  (teaches DeepSpeed the `odc` key before DPOConfig and the model)
from ds_odc.integrations import match_accelerate_backend
from ds_odc.recipes.lora import lora_config
from ds_odc.recipes.toy_text import char_tokenizer
from ds_odc.recipes.trainer_config import accelerate_chose_deepspeed, zero3_config
from ds_odc.training.distributed import init_distributed, output_folder, shutdown_and_exit

WORDS = ["alpha", "beta", "gamma", "delta", "odc", "zero", "rank", "step", "token", "pack"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--odc", action=argparse.BooleanOptionalAction, default=True,
                   help="ODC on (default) or stock ZeRO-3 (torchrun only; with accelerate the config file decides)")
    p.add_argument("--padding-free", action=argparse.BooleanOptionalAction, default=True,
                   help="ODC trains padding-free rows (DPOConfig.padding_free); TRL 1.16 itself pads either way")
    p.add_argument("--lora", type=int, default=None, metavar="RANK",
                   help="train LoRA adapters of this rank (peft_config; every linear layer but the LM head)")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--per-device-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=512, help="token budget of a microbatch (both sequences of "
                                                               "each pair)")
    p.add_argument("--num-pairs", type=int, default=512)
    p.add_argument("--output-dir", help="where the trainer writes (default: a temporary folder, removed at the end)")
    p.add_argument("--shared-gpu", action="store_true",
                   help="every rank on one GPU (torch.distributed over gloo): several ranks on a one-GPU machine, "
                        "for correctness, not speed")
    p.add_argument("--log-dicts", action="store_true",
                   help="print every log dict whole (the Trainer's own printing) instead of one short line per step")
    p.add_argument("--local_rank", type=int, default=None)
    return p.parse_args()


def preference_pairs(n: int, seed: int = 0):
    """Prompts listing a few words; the chosen completion repeats the prompt's first word, the rejected one does not.
    Completion lengths are long-tailed (a few characters to a few hundred)."""
    from datasets import Dataset
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = rng.choices(WORDS, k=rng.randint(2, 6))

        def completion(first: str) -> str:
            return " " + " ".join([first] + rng.choices(WORDS, k=min(60, int(rng.lognormvariate(1.2, 1.0)))))
        rows.append({"prompt": "Q: " + " ".join(words) + "\nA:", "chosen": completion(words[0]),
                     "rejected": completion(rng.choice([w for w in WORDS if w != words[0]]))})
    return Dataset.from_list(rows)


def tiny_llama(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)  # the policy and its reference start from the same weights
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, vocab_size=len(tokenizer),
                                        max_position_embeddings=1024, tie_word_embeddings=False, use_cache=False,
                                        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))


def main():
    args = parse_args()
    init_distributed(shared_gpu=args.shared_gpu or None)
    from trl import DPOConfig, DPOTrainer

    from ds_odc.integrations import OdcDPOTrainer

    tokenizer = char_tokenizer()
    # accelerate launch: the config file's deepspeed_config_file decides (ODC or not); torchrun: --odc / --no-odc.
    accelerate_config = accelerate_chose_deepspeed()
    deepspeed_config = None if accelerate_config else zero3_config(args.odc)
    config = DPOConfig(
        output_dir=output_folder(args.output_dir, "ds_odc_dpo_"), per_device_train_batch_size=args.per_device_batch,
        gradient_accumulation_steps=args.grad_accum, max_steps=args.max_steps, learning_rate=5e-3, beta=0.1,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available(), optim="adamw_torch", seed=0, disable_tqdm=True, max_length=None,
        padding_free=args.padding_free, deepspeed=deepspeed_config,
    )
    # Built after DPOConfig: under ZeRO-3 transformers partitions them while they are built. A random-init policy has
    # no checkpoint TRL could load a reference from, so the reference is passed: the same weights. With LoRA adapters
    # the reference is the policy's base model with the adapters disabled (TRL's choice without a ref_model).
    model = tiny_llama(tokenizer)
    ref_model = None if args.lora else tiny_llama(tokenizer)
    common = dict(ref_model=ref_model, args=config, train_dataset=preference_pairs(args.num_pairs),
                  processing_class=tokenizer, peft_config=lora_config(args.lora))
    if args.odc or accelerate_config:  # OdcDPOTrainer defers to DPOTrainer when the config has no odc
        trainer = OdcDPOTrainer(model, max_tokens_per_microbatch=args.max_tokens, **common)
    else:
        trainer = DPOTrainer(model, **common)
        match_accelerate_backend(trainer.args)  # gathers over gloo when the ranks share a GPU (--shared-gpu)
    if not args.log_dicts:
        from ds_odc.integrations import show_log_lines
        show_log_lines(trainer, extra=("rewards/accuracies",))  # one short line per logging step
    trainer.train()
    if trainer.is_world_process_zero():
        logs = [e for e in trainer.state.log_history if "rewards/accuracies" in e]
        mode = "odc + lb-mini" if getattr(trainer, "odc", False) else "stock zero-3"
        print(f"done: {trainer.state.global_step} steps ({mode}), loss {logs[0]['loss']:.4f} -> {logs[-1]['loss']:.4f}"
              f", rewards/accuracies {logs[0]['rewards/accuracies']:.2f} -> {logs[-1]['rewards/accuracies']:.2f}",
              flush=True)
    shutdown_and_exit()


if __name__ == "__main__":
    main()
