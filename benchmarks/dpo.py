"""DPO training step on GPUs: stock ``DPOTrainer`` + ZeRO-3 (padded, and with ``padding_free=True``) and unsharded
(plain) vs ``OdcDPOTrainer`` with padded microbatches and padding-free rows, on the same preference pairs, in one call.

    python benchmarks/dpo.py --out runs/dpo                  # one GPU: Qwen2-1.5B shape, random init, bf16
    python benchmarks/dpo.py --out runs/dpo-cpu --model tiny --ranks 2   # CPU smoke run (a minute)
    python benchmarks/dpo.py --out runs/dpo-lora --lora 16      # LoRA adapters, the base model frozen

Each mode runs in its own process group (``--ranks`` ranks; clean memory, its own engines) on the same
random-init model (saved once; TRL loads the policy and builds the reference model from it) and the same pairs, in
the same order: ``--pairs`` pairs per optimizer step (all ranks), prompts of a quarter to all of ``--prompt-len``
tokens, chosen and rejected completions drawn independently, long-tailed from ``--min-completion`` to
``--max-completion`` tokens (lognormal around ``--max-completion / 16``, one in eight at the limit). Nothing is
downloaded: the tokenizer is a character tokenizer built in code (``ds_odc.recipes.toy_text``) and the model's shape
comes from ``ds_odc.balancer.presets.MODEL_SHAPES``.

| mode | trainer |
|---|---|
| ``stock`` | ``trl.DPOTrainer``, stock ZeRO-3, padded microbatches of ``--per-device-batch`` pairs |
| ``stock-padding-free`` | the same with ``DPOConfig(padding_free=True)`` (TRL 1.16 trains it padded, with a warning) |
| ``plain`` | ``trl.DPOTrainer`` without DeepSpeed (``deepspeed=None``): unsharded on one rank, bf16 weights on a GPU |
| ``odc-padded`` | ``OdcDPOTrainer``: LB-Mini over pairs, padded microbatches within ``--max-tokens`` |
| ``odc-packed`` | ``OdcDPOTrainer``, ``padding_free=True``: padding-free rows (``ds_odc_varlen``), the same budget |

``plain`` is the unsharded baseline: ``stock`` less its DeepSpeed config, so the same pairs in the same padded
microbatches of ``--per-device-batch`` pairs, the policy and reference models in the dtype they were saved in (bf16
weights and AdamW state on a GPU, fp32 on CPU) and no gradient communication. It runs at ``--ranks 1`` only (the
default mode set leaves it out at more ranks; asking for it there is an error), where the table adds each mode's
speed against it.

Every mode computes the reference log-probabilities during the step (the reference model scores the step's rows), or,
with ``--precompute``, before training (``precompute_ref_log_probs``; not timed). Per optimizer step after
``--warmup`` steps: the step's wall time (device synchronised) and pairs per second; peak memory is
``max_memory_allocated`` over the timed steps. The table is printed last and written to ``DIR/dpo.md`` (numbers in
``DIR/dpo.json``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from _modes import (adapters_in_model_dtype, finish_worker, model_folder,  # benchmarks/_modes.py
                    run_modes_on_random_model)
MODES = ("stock", "stock-padding-free", "plain", "odc-padded", "odc-packed")
PLAIN = "plain"  # TRL's trainer without DeepSpeed: the unsharded baseline, one rank only
SHAPES = {"1.5b": "qwen2.5-1.5b", "0.5b": "qwen2.5-0.5b", "tiny": "tiny"}
SMALL = dict(pairs=16, prompt_len=24, min_completion=2, max_completion=96, per_device_batch=2, max_tokens=512)
BIG = dict(pairs=64, prompt_len=256, min_completion=16, max_completion=2048, per_device_batch=4, max_tokens=16384)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/dpo")
    p.add_argument("--model", choices=sorted(SHAPES), default="1.5b")
    p.add_argument("--modes", help=f"comma-separated, from {','.join(MODES)} (default: all; {PLAIN} only at "
                                   "--ranks 1)")
    p.add_argument("--ranks", type=int, default=1, help="ranks per mode (GPUs, or CPU processes)")
    p.add_argument("--pairs", type=int, help="pairs per optimizer step, all ranks (default 64; tiny: 16)")
    p.add_argument("--prompt-len", type=int, help="longest prompt in tokens (default 256; tiny: 24)")
    p.add_argument("--min-completion", type=int, help="shortest completion (default 16; tiny: 2)")
    p.add_argument("--max-completion", type=int, help="longest completion (default 2048; tiny: 96)")
    p.add_argument("--per-device-batch", type=int, help="pairs of a stock microbatch (default 4; tiny: 2)")
    p.add_argument("--max-tokens", type=int, help="ODC's microbatch budget: tokens of its pairs, both sequences "
                                                  "(default 16384; tiny: 512)")
    p.add_argument("--loss-type", default="sigmoid")
    p.add_argument("--precompute", action="store_true", help="reference log-probs before training (not timed)")
    p.add_argument("--lora", type=int, default=None, metavar="RANK",
                   help="train LoRA adapters of this rank on every linear layer but the LM head, in the model's dtype; "
                        "the reference model is then the base model, adapters disabled (as TRL does)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per mode, warm-up included")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode-timeout", type=float, default=600)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.modes = args.modes or ",".join(m for m in MODES if m != PLAIN or args.ranks == 1)
    for mode in args.modes.split(","):
        if mode not in MODES:
            p.error(f"mode {mode!r}: choose from {MODES}")
        if mode == PLAIN and args.ranks != 1:
            p.error(f"mode {mode!r} trains unsharded on one rank (no DeepSpeed, no gradient communication): run it "
                    "with --ranks 1, or leave it out of --modes")
    for key, value in (SMALL if args.model == "tiny" else BIG).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.pairs % (args.ranks * args.per_device_batch):
        p.error("--pairs must be a multiple of --ranks x --per-device-batch")
    if 2 * (args.prompt_len + args.max_completion + 1) > args.max_tokens:
        p.error("--max-tokens must hold the longest pair: 2 x (--prompt-len + --max-completion + 1)")
    return args


def pair_texts(args) -> list[dict]:
    """The benchmark's pairs, every step's, in training order: random letters (one token each with the character
    tokenizer); the same in every mode."""
    import numpy as np
    n = args.pairs * args.steps
    rng = np.random.default_rng(args.seed)

    def completions():
        lengths = np.clip(rng.lognormal(np.log(max(args.max_completion / 16, 1)), 1.0, n), args.min_completion,
                          args.max_completion).astype(int)
        lengths[rng.random(n) < 1 / 8] = args.max_completion  # the long tail: completions at the limit
        return lengths

    prompts = rng.integers(max(1, args.prompt_len // 4), args.prompt_len + 1, n)
    chosen, rejected = completions(), completions()
    text = lambda k: "".join(chr(c) for c in rng.integers(97, 123, int(k)))  # noqa: E731
    return [{"prompt": text(p), "chosen": text(c), "rejected": text(r)} for p, c, r in zip(prompts, chosen, rejected)]


def run_worker(args) -> dict:
    import torch
    import torch.distributed as dist

    import ds_odc  # noqa: F401  (the `odc` key must parse before DPOConfig)
    from ds_odc.training.distributed import init_distributed
    init_distributed()
    from datasets import Dataset, load_from_disk
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from ds_odc.balancer.sampler import BalancedBatchSampler
    from ds_odc.integrations import activation_checkpointing, match_accelerate_backend
    from ds_odc.integrations.trl_dpo import OdcDPOTrainer
    from ds_odc.recipes.lora import lora_config
    from ds_odc.recipes.toy_text import char_tokenizer

    mode, on_gpu = args.worker, torch.cuda.is_available()
    world = dist.get_world_size()
    odc = mode.startswith("odc")
    zero = {"stage": 3, "overlap_comm": False, "contiguous_gradients": True, "stage3_param_persistence_threshold": 0}
    if odc:
        zero["odc"] = {"enabled": True, "timeout_s": 600}
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
                 "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    rows = pair_texts(args)
    if not odc:  # stock trains the pairs in the order ODC's plan draws them: the same pairs in every step
        order = BalancedBatchSampler([1] * len(rows), world_size=1, rank=0, minibatch_size=len(rows),
                                     max_tokens=None, cost="tokens", seed=args.seed).epoch_order(0)
        rows = [rows[i] for i in order.tolist()]
    config = DPOConfig(
        output_dir=str(Path(args.out) / mode), per_device_train_batch_size=args.per_device_batch,
        gradient_accumulation_steps=args.pairs // (world * args.per_device_batch), max_steps=args.steps,
        loss_type=[args.loss_type], beta=0.1, learning_rate=1e-6, optim="adamw_torch", lr_scheduler_type="constant",
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=not on_gpu, bf16=on_gpu,
        **activation_checkpointing(on_gpu), seed=args.seed, data_seed=args.seed, disable_tqdm=True,
        deepspeed=None if mode == PLAIN else ds_config, dataloader_num_workers=0, max_length=None,
        padding_free=mode in ("stock-padding-free", "odc-packed"), precompute_ref_log_probs=args.precompute,
        train_sampling_strategy="random" if odc else "sequential",
        model_init_kwargs={"dtype": "bfloat16" if on_gpu else "float32"})

    def sync():
        if on_gpu:
            torch.cuda.synchronize()

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.steps = []

        def on_step_begin(self, *a, **k):
            sync()
            if len(self.steps) == args.warmup and on_gpu:
                torch.cuda.reset_peak_memory_stats()
            self.started = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync()
            self.steps.append(time.perf_counter() - self.started)

    # On disk, read by every rank: TRL caches what it derives (tokens, precomputed log-probs) next to its files.
    data_dir = Path(args.out) / f"data-{mode}"
    if dist.get_rank() == 0:
        Dataset.from_list(rows).save_to_disk(str(data_dir))
    dist.barrier()
    timer = StepTimer()
    kwargs = dict(args=config, train_dataset=load_from_disk(str(data_dir)), processing_class=char_tokenizer(),
                  callbacks=[timer], peft_config=lora_config(args.lora))
    # every mode loads the same weights; TRL builds the reference model from them
    model = str(model_folder(args.out, args.model))
    if odc:
        trainer = OdcDPOTrainer(model, max_tokens_per_microbatch=args.max_tokens, **kwargs)
    else:
        trainer = DPOTrainer(model, **kwargs)
        match_accelerate_backend(trainer.args)
    if args.lora and mode == PLAIN:
        adapters_in_model_dtype(trainer.model)
    trainer.train()
    timed = timer.steps[args.warmup:] or timer.steps
    step_s = sum(timed) / len(timed)
    logs = [e for e in trainer.state.log_history if "loss" in e]
    counts = [[e[f"odc/microbatches_rank{r}"] for r in range(world)] for e in logs if "odc/bubble" in e]
    result = {"mode": mode, "ranks": world, "step_s": step_s, "pairs_per_s": args.pairs / step_s, "steps": timer.steps,
              "loss": [e["loss"] for e in logs], "microbatches": counts,
              "device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
              "wrapped_model": type(trainer.model_wrapped).__name__}  # DeepSpeedEngine; plain: the model itself
    if on_gpu:
        peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        result["peak_gib"] = float(peak)
    return result


def orchestrate(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = run_modes_on_random_model(
        __file__, args.modes.split(","), _worker_args(args), shape=SHAPES[args.model],
        folder=model_folder(args.out, args.model), max_positions=args.prompt_len + args.max_completion + 64,
        seed=args.seed, ranks=args.ranks, out=out, timeout=args.mode_timeout)
    for mode in args.modes.split(","):
        shutil.rmtree(out / f"data-{mode}", ignore_errors=True)
    table = report(results, args)
    (out / "dpo.md").write_text(table)
    (out / "dpo.json").write_text(json.dumps(results, indent=1))
    print(table)
    return 0 if all("failed" not in r for r in results.values()) else 1


def _worker_args(args) -> list[str]:
    keys = ("out", "model", "ranks", "pairs", "prompt_len", "min_completion", "max_completion", "per_device_batch",
            "max_tokens", "loss_type", "steps", "warmup", "seed")
    out = [x for k in keys for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    return out + (["--precompute"] if args.precompute else []) + (["--lora", str(args.lora)] if args.lora else [])


def report(results: dict, args) -> str:
    import numpy as np
    rows = pair_texts(args)
    tokens = np.array([2 * len(r["prompt"]) + len(r["chosen"]) + len(r["rejected"]) + 2 for r in rows])
    stock, stock_pf = results.get("stock", {}), results.get("stock-padding-free", {})
    plain = results.get(PLAIN) if PLAIN in results and "failed" not in results[PLAIN] else None  # its column if it ran
    lines = [f"{args.model} shape, {args.ranks} rank(s), {args.pairs} pairs per step, pairs of {tokens.min()}-"
             f"{tokens.max()} tokens (median {int(np.median(tokens))}), loss {args.loss_type}, reference log-probs "
             f"{'precomputed' if args.precompute else 'in the step'}"
             + (f", LoRA adapters of rank {args.lora} (base model frozen)" if args.lora else "")
             + f"; means over {args.steps - args.warmup} timed steps", "",
             "| mode | step s | pairs/s | vs stock | vs stock padding-free | " + ("vs plain | " if plain else "")
             + "peak GiB | microbatches per rank |", "|---|---|---|---|---|---|---|" + ("---|" if plain else "")]
    for mode, r in results.items():
        if "failed" in r:
            lines.append(f"| {mode} | failed |" + " |" * (6 if plain else 5))
            continue
        versus = lambda base: (f"{r['pairs_per_s'] / base['pairs_per_s']:.2f}x"  # noqa: E731
                               if "pairs_per_s" in base else "-")
        peak = f"{r['peak_gib']:.1f}" if "peak_gib" in r else "-"
        counts = r["microbatches"][args.warmup:] or r["microbatches"]
        per_rank = ("/".join(f"{sum(c[k] for c in counts) / len(counts):.1f}" for k in range(r["ranks"])) if counts
                    else str(args.pairs // (args.ranks * args.per_device_batch)))  # stock: its accumulation steps
        vs_plain = f"{versus(plain)} | " if plain else ""
        lines.append(f"| {mode} | {r['step_s']:.2f} | {r['pairs_per_s']:.1f} | {versus(stock)} | {versus(stock_pf)} | "
                     f"{vs_plain}{peak} | {per_rank} |")
    lines.append("")
    lines.append("command: python benchmarks/dpo.py " + " ".join(_worker_args(args)[2:]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return finish_worker(Path(args.out, f"{args.worker}.json"), run_worker(args))
    return orchestrate(args)


if __name__ == "__main__":
    raise SystemExit(main())
