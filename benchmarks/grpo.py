"""GRPO training step on GPUs: stock ``GRPOTrainer`` + ZeRO-3 and unsharded (plain) vs ``OdcGRPOTrainer`` with padded
microbatches vs ``OdcGRPOTrainer`` padding-free, on the same rollouts, in one call.

    python benchmarks/grpo.py --out runs/grpo                 # one GPU: Qwen2-1.5B shape, random init, bf16
    python benchmarks/grpo.py --out runs/grpo-cpu --model tiny   # CPU smoke run (a minute)
    python benchmarks/grpo.py --out runs/grpo-lora --lora 16     # LoRA adapters (peft_config), the base frozen

Each mode runs in its own process group (``--ranks`` ranks; clean memory, its own engine) on the same
random-init model and the same rollouts: ``--prompts`` prompts x ``--generations`` completions per optimizer step,
prompts of a quarter to all of ``--prompt-len`` tokens, completion lengths long-tailed from ``--min-completion`` to
``--max-completion`` tokens (lognormal around ``--max-completion / 16``, one completion in eight cut at the limit).
With ``--rollout scripted`` (default) the completions are drawn tokens (TRL's ``rollout_func``), so the step is the
training phase plus TRL's scoring; ``--rollout generate`` decodes them with the policy (sampling, each completion
forced to end at its drawn length), through lockstep-free generation under ODC, TRL's full-model gather under stock
ZeRO-3 and the whole model under plain. Nothing is downloaded: the tokenizer is a character tokenizer built in code
(``ds_odc.recipes.toy_text``) and the model's shape comes from ``ds_odc.balancer.presets.MODEL_SHAPES``.

| mode | trainer |
|---|---|
| ``stock`` | ``trl.GRPOTrainer``, stock ZeRO-3 |
| ``plain`` | ``trl.GRPOTrainer`` without DeepSpeed (``deepspeed=None``): unsharded, one rank, bf16 weights on a GPU |
| ``odc-padded`` | ``OdcGRPOTrainer(padding_free=False)``: padded microbatches up to the stock microbatch's size |
| ``odc-packed`` | ``OdcGRPOTrainer(padding_free=True)``: packed rows (``ds_odc_varlen``) of the same token budget |
| ``odc-equal-packed`` | ``odc-packed`` with ``balancer_planner="lb-micro"``: the same count of microbatches on every rank, without meetings; beside the two other packed modes it splits ODC's gain over the lock-step baseline into the meetings removed and lb-mini's uneven counts |
| ``lockstep-packed`` | ``odc-packed`` with ``odc.lockstep`` and ``balancer_planner="lb-micro"``: the same count of microbatches on every rank (what TRL and verl force) and every rank meeting every other at each block, as collective ZeRO-3 makes them; the collective baseline where NCCL cannot run (ranks on SM partitions of one GPU) |

``plain`` is the unsharded baseline: TRL's trainer with the stock mode's config less its DeepSpeed config, so the
same microbatches and accumulation steps, the model in the dtype it was saved in (bf16 weights and AdamW state on a
GPU, fp32 on CPU) and no gradient communication. It runs at ``--ranks 1`` only (the default mode set leaves it out at
more ranks; asking for it there is an error), where the table adds each mode's training phase against it. With
``--lora`` every mode trains its adapters in the model's dtype (TRL makes plain's float32: they are cast before
training).

A mode takes the model's kernels after a slash (``ds_odc.training.kernels``): ``odc-packed/compiled`` compiles every
transformer block (dynamic lengths; the training forward, the scoring forwards and activation checkpointing's
recomputation all run the compiled blocks), ``/fused`` adds Liger's layer kernels (RMSNorm, SwiGLU, RoPE), and
``/compiled+fused`` is compiled blocks with TRL's own fused LM head (TRL 1.16 computes the log-probabilities chunk by
chunk without the logits and refuses Liger's fused cross-entropy; inside compiled blocks inductor fuses what Liger's
layer kernels would). The table then gives each such mode's training phase against the same mode eager:

    python benchmarks/grpo.py --out runs/grpo --modes odc-packed,odc-packed/compiled+fused

Between ranks on one GPU, ``--partition-gpu`` puts each of the ``--ranks`` ranks on its share of GPU 0's SMs (CUDA MPS)
and compares ODC + LB-Mini with its lock-step baseline on equal counts, the modes NCCL does not need; adding
``odc-equal-packed`` (the baseline's equal counts without its meetings) splits the gain in two:

    python benchmarks/grpo.py --out runs/grpo-partitions --ranks 4 --partition-gpu
    python benchmarks/grpo.py --out runs/grpo-partitions --ranks 4 --partition-gpu --modes odc-packed,odc-equal-packed,lockstep-packed

Per optimizer step after ``--warmup`` steps: the step's wall time (first microbatch to the end of the optimizer step,
device synchronised), the rollout's time inside it, and the training phase (step less rollout: scoring, old /
reference log-probs, re-planning, forward, backward, optimizer step). Waits: at more than one rank, the ranks' mean
share of the timed steps spent waiting for each other (ODC's fence before the optimizer step; with the lock-step
baseline also its per-block meetings). Peak memory is ``max_memory_allocated`` over the timed steps. The table is
printed last and written to ``DIR/grpo.md`` (numbers in ``DIR/grpo.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

from _modes import (adapters_in_model_dtype, finish_worker, model_folder,  # benchmarks/_modes.py
                    run_modes_on_random_model)
MODES = ("stock", "plain", "odc-padded", "odc-packed", "odc-equal-packed", "lockstep-packed")
DEFAULT_MODES = ("stock", "plain", "odc-padded", "odc-packed")
PARTITION_MODES = ("odc-packed", "lockstep-packed")  # --partition-gpu's default
PARTITION_ALLOWED = PARTITION_MODES + ("odc-equal-packed",)  # no collectives: NCCL refuses two ranks on one GPU
PLAIN = "plain"  # TRL's trainer without DeepSpeed: the unsharded baseline, one rank only
KERNELS = ("eager", "compiled", "fused", "compiled+fused")


def split_mode(mode: str) -> tuple[str, str]:
    """``NAME[/KERNELS]`` -> (name, kernels)."""
    name, _, kernels = mode.partition("/")
    if name not in MODES or (kernels or "eager") not in KERNELS:
        raise SystemExit(f"mode {mode!r}: choose NAME[/KERNELS], NAME from {MODES}, KERNELS from {KERNELS}")
    return name, kernels or "eager"


def mode_file(mode: str) -> str:
    return mode.replace("/", "-") + ".json"
SHAPES = {"1.5b": "qwen2.5-1.5b", "0.5b": "qwen2.5-0.5b", "tiny": "tiny"}
SMALL = dict(prompts=4, generations=4, prompt_len=24, min_completion=2, max_completion=48, per_device_batch=4)


def odc_settings(mode: str) -> dict | None:
    """What an ODC mode sets (None: stock or plain): its rows (``padding_free``), its planner and whether its ranks
    meet at every block (``lockstep``)."""
    if not mode.startswith(("odc", "lockstep")):
        return None
    equal_counts = mode.startswith("lockstep") or mode == "odc-equal-packed"
    return {"padding_free": mode.endswith("-packed"), "planner": "lb-micro" if equal_counts else "lb-mini",
            "lockstep": mode.startswith("lockstep")}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/grpo")
    p.add_argument("--model", choices=sorted(SHAPES), default="1.5b")
    p.add_argument("--modes", help=f"comma-separated NAME[/KERNELS] (default: {','.join(MODES)}; {PLAIN} only at "
                                   "--ranks 1)")
    p.add_argument("--ranks", type=int, default=1, help="ranks per mode (GPUs, or CPU processes)")
    p.add_argument("--rollout", choices=["scripted", "generate"], default="scripted")
    p.add_argument("--prompts", type=int, help="prompts per optimizer step, all ranks (default 16; tiny: 4)")
    p.add_argument("--generations", type=int, help="completions per prompt (default 8; tiny: 4)")
    p.add_argument("--prompt-len", type=int, help="longest prompt in tokens (default 256; tiny: 24)")
    p.add_argument("--min-completion", type=int, help="shortest completion (default 16; tiny: 2)")
    p.add_argument("--max-completion", type=int, help="longest completion, the generation limit (default 2048)")
    p.add_argument("--per-device-batch", type=int, help="rows of a stock microbatch (default 8; tiny: 4)")
    p.add_argument("--loss-type", default="dapo")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0 adds the reference model)")
    p.add_argument("--num-iterations", type=int, default=1)
    p.add_argument("--lora", type=int, default=None, metavar="RANK",
                   help="train LoRA adapters of this rank on every linear layer but the LM head (peft_config); the "
                        "reference model (--beta > 0) is then the base model, adapters disabled")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per mode, warm-up included")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode-timeout", type=float, default=420)
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compiled modes (aot_eager: CPU smoke runs)")
    p.add_argument("--partition-gpu", action="store_true",
                   help="run the --ranks ranks of every mode on SM partitions of GPU 0 (CUDA MPS, 100/ranks percent of "
                        f"the SMs each; ds_odc.training.partition); modes {', '.join(PARTITION_ALLOWED)} (default: "
                        f"{', '.join(PARTITION_MODES)})")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.modes = args.modes or ",".join(PARTITION_MODES if args.partition_gpu else
                                        (m for m in DEFAULT_MODES if m != PLAIN or args.ranks == 1))
    for mode in args.modes.split(","):
        if args.partition_gpu and split_mode(mode)[0] not in PARTITION_ALLOWED:
            p.error(f"mode {mode!r} needs collectives between the ranks, which NCCL refuses on one GPU: with "
                    f"--partition-gpu run {', '.join(PARTITION_ALLOWED)}")
        if split_mode(mode)[0] == PLAIN and args.ranks != 1:
            p.error(f"mode {mode!r} trains unsharded on one rank (no DeepSpeed, no gradient communication): run it "
                    f"with --ranks 1, or leave it out of --modes")
    big = dict(prompts=16, generations=8, prompt_len=256, min_completion=16, max_completion=2048, per_device_batch=8)
    for key, value in (SMALL if args.model == "tiny" else big).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if (args.prompts * args.generations) % (args.ranks * args.per_device_batch):
        p.error("--prompts x --generations must be a multiple of --ranks x --per-device-batch")
    return args


def completion_lengths(args, step: int):
    """The drawn completion lengths of one optimizer step (all ranks' rows, in prompt order): the same in every
    mode."""
    import numpy as np
    rng = np.random.default_rng([args.seed, step])
    n = args.prompts * args.generations
    lengths = np.clip(rng.lognormal(np.log(max(args.max_completion / 16, 1)), 1.0, n), args.min_completion,
                      args.max_completion).astype(int)
    lengths[rng.random(n) < 1 / 8] = args.max_completion  # the long tail: completions that hit the limit
    return lengths.tolist()


def prompt_texts(args, count: int) -> list[str]:
    import numpy as np
    rng = np.random.default_rng([args.seed, 1 << 20])
    lengths = rng.integers(max(1, args.prompt_len // 4), args.prompt_len + 1, count)
    return ["".join(chr(c) for c in rng.integers(97, 123, int(n))) for n in lengths]


def run_worker(args) -> dict:
    import torch
    import torch.distributed as dist

    import ds_odc  # noqa: F401  (the `odc` key must parse before GRPOConfig)
    from ds_odc.training.distributed import init_distributed
    init_distributed()
    from datasets import Dataset
    from transformers import LogitsProcessorList, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ds_odc.integrations.trl_grpo import OdcGRPOTrainer
    from ds_odc.recipes.lora import lora_config
    from ds_odc.recipes.toy_text import char_tokenizer

    (mode, kernels), on_gpu = split_mode(args.worker), torch.cuda.is_available()
    world, rank = dist.get_world_size(), dist.get_rank()
    rows_per_rank = args.prompts * args.generations // world
    zero = {"stage": 3, "overlap_comm": False, "contiguous_gradients": True, "stage3_param_persistence_threshold": 0}
    settings = odc_settings(mode)
    odc = settings is not None
    if odc:
        zero["odc"] = {"enabled": True, "timeout_s": 600, "lockstep": settings["lockstep"]}
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
                 "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    config = GRPOConfig(
        output_dir=str(Path(args.out) / mode), per_device_train_batch_size=args.per_device_batch,
        gradient_accumulation_steps=rows_per_rank // args.per_device_batch, num_generations=args.generations,
        max_completion_length=args.max_completion, max_steps=args.steps, loss_type=args.loss_type, beta=args.beta,
        num_iterations=args.num_iterations, learning_rate=1e-6, optim="adamw_torch", lr_scheduler_type="constant",
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=not on_gpu, bf16=on_gpu,
        gradient_checkpointing=on_gpu, seed=args.seed, disable_tqdm=True, log_completions=False,
        deepspeed=None if mode == PLAIN else ds_config, dataloader_num_workers=0, temperature=1.0,
        model_init_kwargs={"dtype": "bfloat16" if on_gpu else "float32"})
    tokenizer = char_tokenizer()
    # every mode loads the same weights (TRL builds the reference model from the path too)
    model = str(model_folder(args.out, args.model))
    prompts = prompt_texts(args, args.prompts)
    dataset = Dataset.from_dict({"prompt": [prompts[i % len(prompts)] for i in range(args.prompts * 64)]})
    clock = {"rollout": 0.0}

    def sync():
        if on_gpu:
            torch.cuda.synchronize()

    def lengths_now(trainer, count: int) -> list[int]:
        """This rank's rows of the step's drawn lengths (TRL hands each rank its own slice of the prompts)."""
        drawn = completion_lengths(args, trainer.state.global_step)
        return drawn[rank * count:(rank + 1) * count]

    def scripted(prompt_list, trainer):
        started = time.perf_counter()
        lengths = lengths_now(trainer, len(prompt_list))
        g = torch.Generator().manual_seed(args.seed * 1000003 + trainer.state.global_step * 101 + rank)
        completions = [torch.randint(3 + 65, 3 + 90, (n - 1,), generator=g).tolist() + [tokenizer.eos_token_id]
                       for n in lengths]
        out = {"prompt_ids": tokenizer(text=prompt_list)["input_ids"], "completion_ids": completions,
               "logprobs": None}
        clock["rollout"] += time.perf_counter() - started
        return out

    class EndAtLength:
        """Row i emits EOS exactly at its drawn length; before it, only the tokenizer's letters."""

        def __init__(self, prompt_width: int, lengths):
            self.prompt_width, self.lengths = prompt_width, torch.tensor(lengths)

        def __call__(self, input_ids, scores):
            step = input_ids.shape[1] - self.prompt_width
            keep = torch.full_like(scores, float("-inf"))
            keep[:, 3 + 65:3 + 91] = 0.0
            scores = scores + keep
            end = (self.lengths.to(scores.device) - 1) <= step
            scores[end] = float("-inf")
            scores[end, tokenizer.eos_token_id] = 0.0
            return scores

    class Timed:
        """Times the rollout inside each step (generation, when TRL generates)."""

        def _generate_single_turn(self, prompt_ids, *rest, **kwargs):
            sync()
            started = time.perf_counter()
            module = self.model
            width = max(len(p) for p in prompt_ids)
            drawn = lengths_now(self, len(prompt_ids))
            processor = LogitsProcessorList([EndAtLength(width, drawn)])
            stock_generate = type(module).generate
            module.generate = lambda *a, **k: stock_generate(module, *a, logits_processor=processor, **k)
            try:
                out = super()._generate_single_turn(prompt_ids, *rest, **kwargs)
            finally:
                del module.generate
            clock["lengths_ok"] = clock.get("lengths_ok", True) and [len(c) for c in out[0]] == drawn
            sync()
            clock["rollout"] += time.perf_counter() - started
            return out

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.steps = []

        def on_step_begin(self, *a, **k):
            sync()
            if len(self.steps) == args.warmup and on_gpu:
                torch.cuda.reset_peak_memory_stats()
            clock["rollout"] = 0.0
            self.started = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync()
            self.steps.append({"step_s": time.perf_counter() - self.started, "rollout_s": clock["rollout"]})
            if odc:  # this rank's waits for the others in the step: ODC's fence, and lock-step's meetings on the device
                from ds_odc.zero.engine import lockstep_waits, wait_seconds
                engine = self.trainer.model_wrapped
                self.steps[-1]["wait_s"] = wait_seconds(engine) + (lockstep_waits(engine) or 0.0)
            if kernels != "eager":  # dynamo's frames compiled so far: those of a timed step count in its time
                from ds_odc.training.compile import compile_counts
                self.steps[-1]["frames_compiled"] = compile_counts().frames

    base = OdcGRPOTrainer if odc else GRPOTrainer
    cls = type(f"Timed{base.__name__}", (Timed, base), {})
    kwargs = dict(reward_funcs=lambda completions, **k: [sum(c in "aeiou" for c in t) / max(len(t), 1)
                                                         for t in completions],
                  args=config, train_dataset=dataset, processing_class=tokenizer)
    if args.rollout == "scripted":
        kwargs["rollout_func"] = scripted
    if odc:
        kwargs.update(padding_free=settings["padding_free"], balancer_planner=settings["planner"])
    timer = StepTimer()
    trainer = timer.trainer = cls(model, callbacks=[timer], peft_config=lora_config(args.lora), **kwargs)
    if args.lora and mode == PLAIN:
        adapters_in_model_dtype(trainer.model)
    apply_grpo_kernels(trainer.model, kernels, args.compile_backend)
    trainer.train()
    timed = timer.steps[args.warmup:] or timer.steps
    mean = lambda key: sum(s[key] for s in timed) / len(timed)  # noqa: E731
    logs = [e for e in trainer.state.log_history if "loss" in e]
    result = {"mode": args.worker, "ranks": world, "step_s": mean("step_s"), "rollout_s": mean("rollout_s"),
              "generated_drawn_lengths": clock.get("lengths_ok"),
              "training_s": mean("step_s") - mean("rollout_s"), "steps": timer.steps,
              "loss": [e["loss"] for e in logs],
              "microbatches": [list(m) for m in getattr(trainer, "odc_microbatch_history", [])],
              "device": torch.cuda.get_device_name(0) if on_gpu else "cpu", "kernels": kernels,
              "wrapped_model": type(trainer.model_wrapped).__name__}  # DeepSpeedEngine; plain: the model itself
    if kernels != "eager":
        from ds_odc.training.compile import compile_counts
        result["compile"] = compile_counts().as_dict()
        before = timer.steps[args.warmup - 1]["frames_compiled"] if 0 < args.warmup < len(timer.steps) else 0
        result["compile"]["compiled_while_timed"] = timer.steps[-1]["frames_compiled"] - before
    if odc and world > 1:  # the ranks' mean share of the timed steps spent waiting for each other
        share = sum(t.get("wait_s", 0.0) for t in timed) / sum(t["step_s"] for t in timed)
        share = torch.tensor([share], device="cuda" if on_gpu else "cpu", dtype=torch.float64)
        dist.all_reduce(share)
        result["wait_share"] = float(share) / world
    result["completion_tokens"] = sum(sum(completion_lengths(args, s)) for s in range(args.steps)) / args.steps
    if on_gpu:
        peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        result["peak_gib"] = float(peak)
    return result


def apply_grpo_kernels(model, kernels: str, backend: str = "inductor") -> None:
    """The mode's kernels on the policy before training starts; TRL's fused LM head stays the loss's head."""
    if kernels == "eager":
        return
    from ds_odc.training.compile import compile_blocks
    from ds_odc.training.kernels import Kernels, apply_liger
    chosen = Kernels.from_name(kernels, backend=backend)
    if chosen.liger and chosen.compile is None:
        apply_liger(model, rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=False)
    if chosen.compile is not None:
        compile_blocks(model, chosen.compile)


def orchestrate(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if args.partition_gpu:
            from ds_odc.training.partition import gpu_partitions
            os.environ.update(stack.enter_context(gpu_partitions(args.ranks)))
            print(f"# ranks on SM partitions of GPU 0: CUDA MPS, {os.environ['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE']}% of "
                  "the SMs each (memory bandwidth, L2 and power stay shared; see ds_odc.training.partition)",
                  flush=True)
        results = _run(args, out)
    table = report(results, args)
    (out / "grpo.md").write_text(table)
    (out / "grpo.json").write_text(json.dumps(results, indent=1))
    print(table)
    return 0 if all("failed" not in r for r in results.values()) else 1


def _run(args, out: Path) -> dict:
    return run_modes_on_random_model(
        __file__, args.modes.split(","), _worker_args(args), shape=SHAPES[args.model],
        folder=model_folder(args.out, args.model), max_positions=args.prompt_len + args.max_completion + 64,
        seed=args.seed, ranks=args.ranks, out=out, timeout=args.mode_timeout, result_file=mode_file)


def _worker_args(args) -> list[str]:
    keys = ("out", "model", "ranks", "rollout", "prompts", "generations", "prompt_len", "min_completion",
            "max_completion", "per_device_batch", "loss_type", "beta", "num_iterations", "steps", "warmup", "seed",
            "compile_backend", "lora")
    given = [(k, getattr(args, k)) for k in keys if getattr(args, k) is not None]
    return [x for k, value in given for x in (f"--{k.replace('_', '-')}", str(value))]


def report(results: dict, args) -> str:
    lengths = [n for s in range(args.steps) for n in completion_lengths(args, s)]
    base_name = "stock" if "stock" in results else "lockstep-packed" if "lockstep-packed" in results else "stock"
    stock = results.get(base_name, {})  # the collective baseline: stock ZeRO-3, or on partitions ODC's lock-step
    plain = results.get(PLAIN) if PLAIN in results and "failed" not in results[PLAIN] else None  # its column if it ran
    lines = [f"{args.model} shape, {args.ranks} rank(s), {args.prompts} prompts x {args.generations} completions per "
             f"step, completions {min(lengths)}-{max(lengths)} tokens (median {sorted(lengths)[len(lengths) // 2]}), "
             f"{args.rollout} rollout, loss {args.loss_type}, beta {args.beta}"
             + (f", LoRA adapters of rank {args.lora} (base model frozen)" if args.lora else "")
             + f"; means over {args.steps - args.warmup} timed steps", "",
             f"| mode | training s/step | training vs {base_name} | " + ("training vs plain | " if plain else "")
             + f"training vs eager | step s | step vs {base_name} | rollout s | waits | peak GiB | "
             "microbatches per rank |",
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if plain else "")]
    for mode, r in results.items():
        if "failed" in r:
            lines.append(f"| {mode} | failed |" + " |" * (9 if plain else 8))
            continue
        speed = lambda key, base=stock: (f"{base[key] / r[key]:.2f}x" if key in base and r[key] > 0  # noqa: E731
                                         else "-")
        peak = f"{r['peak_gib']:.1f}" if "peak_gib" in r else "-"
        waits = f"{r['wait_share']:.1%}" if "wait_share" in r else "-"
        counts = r["microbatches"][args.warmup:] or r["microbatches"]  # stock: its accumulation steps
        per_rank = ("/".join(f"{sum(c[k] for c in counts) / len(counts):.1f}" for k in range(r["ranks"])) if counts
                    else str(args.prompts * args.generations // (args.ranks * args.per_device_batch)))
        eager = results.get(split_mode(mode)[0]) if "/" in mode else None
        vs_eager = (f"{eager['training_s'] / r['training_s']:.2f}x" if eager and "failed" not in eager
                    and r["training_s"] > 0 else "-")
        vs_plain = f"{speed('training_s', plain)} | " if plain else ""
        lines.append(f"| {mode} | {r['training_s']:.2f} | {speed('training_s')} | {vs_plain}{vs_eager} | "
                     f"{r['step_s']:.2f} | {speed('step_s')} | {r['rollout_s']:.2f} | {waits} | {peak} | {per_rank} |")
    lines.append("")
    for mode, r in results.items():
        if r.get("compile"):
            c = r["compile"]
            lines.append(f"{mode}: {c['graphs']} graphs, {c['frames']} frames compiled, "
                         f"{c.get('compiled_while_timed', '?')} of them during the timed steps"
                         + (" (their time includes compiling: more --warmup leaves it out)"
                            if c.get("compiled_while_timed") else ""))
    lines.append("command: python benchmarks/grpo.py " + " ".join(_worker_args(args)[2:])
                 + (" --partition-gpu" if args.partition_gpu else ""))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return finish_worker(Path(args.out, mode_file(args.worker)), run_worker(args))
    return orchestrate(args)


if __name__ == "__main__":
    raise SystemExit(main())
