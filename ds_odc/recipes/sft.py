"""The command line of an SFT run, shared by the SFT loop (:mod:`ds_odc.recipes.train`, ``examples/sft.py``) and the
torch baselines in ``benchmarks/``.

One parser, so every engine takes the same flags and ``benchmarks/e2e.py`` can hand them the same command; plus the
two things a run derives from its flags: the samples (lengths, and token ids for real text) and the balancer's cost.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import torch

from ds_odc.balancer import FittedCost, choose_cost
from ds_odc.balancer.plan import OVERSIZE_POLICIES, check_max_tokens
from ds_odc.balancer.planners import DEFAULT_PLANNER, PLANNERS, get_planner
from ds_odc.balancer.presets import MODEL_SHAPES, PRESETS
from ds_odc.balancer.sp import DEFAULT_EFFICIENCY, SplitPolicy
from ds_odc.recipes.lora import with_adapters
from ds_odc.recipes.workloads import load_lengths, tokenize_text_file
from ds_odc.training import attention
from ds_odc.training.collate import on_device
from ds_odc.training.kernels import KERNEL_CHOICES, Kernels, apply_kernels
from ds_odc.training.loss import use_chunked_loss

__all__ = ["sft_argument_parser", "samples_from_args", "cost_from_args", "prepare_model", "on_device", "plan_attention"]


def sft_argument_parser(description: str | None = None, deepspeed_config: bool = True) -> argparse.ArgumentParser:
    """The flags of an SFT run; ``deepspeed_config``: whether ``--deepspeed CONFIG.json`` is required."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", choices=sorted(MODEL_SHAPES))
    p.add_argument("--model-path", help="a local Hugging Face checkpoint (overrides --model)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="--model's shape with this many decoder layers (the same width; a smaller host or GPU)")
    data = p.add_mutually_exclusive_group()
    data.add_argument("--lengths-file", help="one sample length (tokens) per line; token ids are random")
    data.add_argument("--preset", choices=sorted(PRESETS), help="synthetic lengths (see ds_odc.balancer.presets)")
    data.add_argument("--data", help="a local .jsonl/.parquet file with a 'text' field (needs --tokenizer)")
    p.add_argument("--tokenizer", help="local tokenizer directory for --data")
    p.add_argument("--num-samples", type=int, default=None, help="dataset size for --preset (default: enough)")
    p.add_argument("--length-scale", type=float, default=1.0, help="multiply preset lengths (tiny CPU runs)")
    p.add_argument("--equal-lengths", type=int, default=None, help="every sample this long (no-regression runs)")
    p.add_argument("--balancer", default=DEFAULT_PLANNER, choices=list(PLANNERS),
                   help="; ".join(f"{spec.name}: {spec.description}" for spec in PLANNERS.values()))
    p.add_argument("--cost", default="auto", choices=["auto", "tokens", "quadratic", "fitted"],
                   help="balancer cost model; auto (default): refitted every step from the measured busy times, "
                        "starting from the model's shape; quadratic: a*L + b*L^2 from the model's shape; fitted: "
                        "--cost-coeffs")
    p.add_argument("--cost-coeffs", default=None, metavar="A,B,C",
                   help="fitted cost a*L + b*L^2 per sample + c per microbatch (python -m ds_odc.balancer.fit RUN.json "
                        "prints them for a run)")
    splitting = ", ".join(name for name, spec in PLANNERS.items() if spec.splits)
    p.add_argument("--sp-efficiency", type=float, default=DEFAULT_EFFICIENCY,
                   help=f"{splitting}: a sample split over g ranks takes 1/(g*E) of its time on each (default "
                        f"{DEFAULT_EFFICIENCY}, assumed; benchmarks/split_efficiency.py measures it)")
    p.add_argument("--sp-max-group-size", type=int, default=None,
                   help=f"{splitting}: the most ranks a sample is split over (default: the world size)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help=f"{splitting}: ranks that share a node's fast links (default: the launcher's LOCAL_WORLD_SIZE)")
    p.add_argument("--minibatch-size", type=int, default=4, help="samples per rank per optimizer step")
    p.add_argument("--max-tokens", type=_max_tokens, default=None,
                   help="token budget per microbatch (default: 1 sample)")
    p.add_argument("--oversize", default="error", choices=OVERSIZE_POLICIES,
                   help="a sample longer than --max-tokens: stop with an error, truncate it, or skip it (counted)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup-steps", type=int, default=0, help="steps excluded from the summary")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-shuffle", action="store_true", help="take samples in file order (benchmarks)")
    if deepspeed_config:
        p.add_argument("--deepspeed", required=True, help="ds_config JSON")
        p.add_argument("--loop", default="recipe", choices=["recipe", "stock"],
                       help="recipe (default): the recipe's loop over its sampler's plan, marking step boundaries "
                            "and weighting losses itself; stock: DeepSpeed's three lines (engine(batch), "
                            "engine.backward(loss), engine.step()) over the loader that deepspeed.initialize("
                            "training_data=...) returns under zero_optimization.odc.balancer, which these flags fill "
                            "in")
    p.add_argument("--attn-implementation", default="ds_odc_varlen",
                   help="transformers attention; default ds_odc_varlen: each packed document attends to itself only, "
                        "with no per-length planning (ds_odc.training.attention)")
    p.add_argument("--attention-kernel", default="auto", choices=["auto", "varlen", "sdpa", "bucketed"],
                   help="kernel of ds_odc_varlen: torch's varlen flash attention (GPU), sdpa per document, or "
                        "bucketed (long documents through sdpa padded to a few lengths, short ones through varlen); "
                        "auto: bucketed on a GPU, sdpa elsewhere")
    p.add_argument("--loss-chunk-tokens", type=int, default=4096,
                   help="compute the loss this many positions at a time, never the full logits (0: full logits)")
    p.add_argument("--sdpa-backends", default=None,
                   help="comma list of the sdpa kernels torch may pick from inside the model (flash, efficient, cudnn, "
                        "math); default: all. cuDNN plans each new sequence length on the host, which variable lengths "
                        "pay for")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--lora", type=int, default=None, metavar="RANK",
                   help="train LoRA adapters of this rank on every linear layer but the LM head (PEFT; the base "
                        "model frozen)")
    p.add_argument("--kernels", default="eager", choices=KERNEL_CHOICES,
                   help="eager: the model as written; compiled: every transformer block through torch.compile "
                        "(dynamic lengths, hooks outside); fused: Liger's kernels (needs liger-kernel and a GPU); "
                        "compiled+fused: compiled blocks plus Liger's fused linear cross-entropy "
                        "(ds_odc.training.kernels)")
    p.add_argument("--compile", action="store_true", help="compile the blocks (with --liger: --kernels compiled+fused)")
    p.add_argument("--liger", action="store_true", help="Liger's fused kernels (with --compile: compiled+fused)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of --kernels compiled (aot_eager: no code generation, for tests)")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode (e.g. max-autotune-no-cudagraphs)")
    p.add_argument("--zero-init", action="store_true",
                   help="build the model partitioned with deepspeed.zero.Init (GPU; fails on CPU with torch 2.13)")
    p.add_argument("--metrics-json")
    p.add_argument("--profile-step", type=int, default=None,
                   help="profile this step (torch profiler): host vs device time, top ops, Chrome trace")
    p.add_argument("--profile-dir", default=os.path.join(tempfile.gettempdir(), "ds_odc_profile"),
                   help="where --profile-step writes its files (default: ds_odc_profile in the temporary folder)")
    p.add_argument("--profile-python", action="store_true",
                   help="--profile-step records Python calls too, to say which ones ran while the GPU idled")
    p.add_argument("--timeline", help="draw per-rank busy/wait bars of the last steps to this PNG")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no summary lines")
    p.add_argument("--shared-gpu", action="store_true",
                   help="every rank on one GPU (torch.distributed over gloo): several ranks on a one-GPU machine, for correctness, not speed")
    p.add_argument("--local_rank", type=int, default=None)  # the deepspeed launcher passes it
    return p


def _max_tokens(text: str) -> int:
    """``--max-tokens``, checked by the budget's one rule as the flags are parsed (argparse names the flag)."""
    try:
        value: int | str = int(text)
    except ValueError:
        value = text  # not a number: the rule's error says what the flag takes
    try:
        return check_max_tokens(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def samples_from_args(args: argparse.Namespace) -> tuple[np.ndarray, list[list[int]] | None]:
    """Per-sample lengths, plus the token ids when the data is real text (``--data``)."""
    if args.data:
        if not args.tokenizer:
            raise SystemExit("--data needs --tokenizer DIR (a local tokenizer)")
        ids = tokenize_text_file(args.data, args.tokenizer)
        return np.array([len(x) for x in ids], dtype=np.int64), ids
    return load_lengths(lengths_file=args.lengths_file, preset=args.preset, equal_lengths=args.equal_lengths,
                        num_samples=args.num_samples, length_scale=args.length_scale, seed=args.seed), None


def cost_from_args(args: argparse.Namespace, model_config):
    """The balancer's cost of a sample, from ``--cost`` (and ``--cost-coeffs``), chosen as every trainer chooses it
    (:func:`ds_odc.balancer.choose_cost`): ``auto`` is an ``AutoCost`` starting from the model's shape."""
    choice = args.cost
    if choice == "fitted":
        if not args.cost_coeffs:
            raise SystemExit("--cost fitted needs --cost-coeffs A,B,C (cost = A*L + B*L^2 + C)")
        a, b, c = (float(x) for x in args.cost_coeffs.split(","))
        choice = FittedCost(a=a, b=b, c=c)
    return choose_cost(choice, model_config)


def split_policy_from_args(args: argparse.Namespace, model_config) -> SplitPolicy | None:
    """How ``--balancer`` may split samples over groups of ranks (``None`` for a planner that does not)."""
    if not get_planner(args.balancer).splits:
        return None
    ranks_per_node = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", 8))
    return SplitPolicy.from_hf_config(model_config, efficiency=args.sp_efficiency, ranks_per_node=ranks_per_node,
                                      max_group_size=args.sp_max_group_size)


def attention_from_args(args: argparse.Namespace) -> str:
    """The model's attention: ``--attn-implementation``, or for a planner that splits samples ``ds_odc_sp`` (which
    is ``ds_odc_varlen`` for every other microbatch); a split sample through any other attention is refused."""
    if not get_planner(args.balancer).splits:
        return args.attn_implementation
    from ds_odc.training import sequence_parallel
    if args.attn_implementation not in (attention.ATTENTION_NAME, sequence_parallel.ATTENTION_NAME):
        raise SystemExit(f"--balancer {args.balancer} trains split samples with attn_implementation="
                         f"{sequence_parallel.ATTENTION_NAME!r} (each member attends over the whole sample), not "
                         f"{args.attn_implementation!r}: drop --attn-implementation")
    return sequence_parallel.ATTENTION_NAME


def kernels_from_args(args: argparse.Namespace) -> Kernels:
    """The model's kernels: ``--kernels``, or ``--compile`` / ``--liger`` added to it."""
    name = getattr(args, "kernels", "eager")
    compiled = name.startswith("compiled") or getattr(args, "compile", False)
    fused = name.endswith("fused") or getattr(args, "liger", False)
    name = "+".join(n for n, on in (("compiled", compiled), ("fused", fused)) if on) or "eager"
    return Kernels.from_name(name, backend=getattr(args, "compile_backend", "inductor"),
                             mode=getattr(args, "compile_mode", None))


def prepare_model(model: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    """The model options of the flags: attention kernel and sdpa backends, the loss (chunked, or Liger's fused
    cross-entropy), activation checkpointing, compiled blocks, LoRA adapters (then the model returned is a
    ``PeftModel`` around ``model``, whose layers hold the adapters). Before ``deepspeed.initialize`` /
    ``fully_shard``."""
    attention.use_kernel(model, args.attention_kernel)
    attention.limit_sdpa_backends(model, args.sdpa_backends)
    kernels = kernels_from_args(args)
    if args.loss_chunk_tokens and not kernels.liger:  # Liger's loss never holds the logits either
        use_chunked_loss(model, chunk_tokens=args.loss_chunk_tokens)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_kernels(model, kernels)
    if getattr(args, "lora", None):
        model = with_adapters(model, args.lora)  # in the model's dtype: benchmarks/e2e.py's engines alike
    return model


def plan_attention(model: torch.nn.Module, args: argparse.Namespace, lengths, device: torch.device,
                   dtype: torch.dtype) -> None:
    """Before the first step: plan the ``bucketed`` attention shapes the run can meet (up to its longest row), so
    the first minibatches do not pay cuDNN's planning. Prints one line on rank 0."""
    if args.attn_implementation != attention.ATTENTION_NAME or device.type != "cuda":
        return
    longest = max(int(max(lengths)), args.max_tokens or 0)
    shapes, seconds = attention.plan_buckets(model, longest, device, dtype)
    if shapes and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        print(f"ds_odc_varlen: planned {shapes} bucketed attention shapes up to {longest} tokens in {seconds:.1f} s",
              flush=True)
