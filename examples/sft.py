"""Supervised fine-tuning with DeepSpeed ZeRO-3, with or without ODC, on imbalanced sequence lengths.

    torchrun --standalone --nproc_per_node 2 examples/sft.py --deepspeed ds_configs/zero3_odc_fp32_cpu.json \\
        --balancer lb-mini --model tiny --preset baselines-longtail --length-scale 0.004 --steps 5

The logged loss is the global mean token loss of each minibatch, the same quantity in every mode, so stock and ODC
runs can be compared step by step. ``--metrics-json`` writes per-step throughput, bubble rate and per-rank busy/wait.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

import ds_odc  # noqa: F401  (before the model is built: installs the odc config key)
from ds_odc.balancer.sampler import BalancedBatchSampler
from ds_odc.balancer import FittedCost, QuadraticCost
from ds_odc.balancer.collate import PackedCollator
from ds_odc.balancer.presets import PRESETS, get_preset
from ds_odc.loss import global_mean_weight, token_loss_sum
from ds_odc.metrics import StepClock, gather_step, summarize
from ds_odc.profiling import describe, profile_step
from ds_odc.testing import finish, init_cpu_distributed

MODEL_PRESETS = {
    # Qwen2.5 shapes (random init: nothing is downloaded).
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", choices=sorted(MODEL_PRESETS))
    p.add_argument("--model-path", help="a local Hugging Face checkpoint (overrides --model)")
    data = p.add_mutually_exclusive_group()
    data.add_argument("--lengths-file", help="one sample length (tokens) per line; token ids are random")
    data.add_argument("--preset", choices=sorted(PRESETS), help="synthetic lengths (see ds_odc.balancer.presets)")
    data.add_argument("--data", help="a local .jsonl/.parquet file with a 'text' field (needs --tokenizer)")
    p.add_argument("--tokenizer", help="local tokenizer directory for --data")
    p.add_argument("--num-samples", type=int, default=None, help="dataset size for --preset (default: enough)")
    p.add_argument("--length-scale", type=float, default=1.0, help="multiply preset lengths (tiny CPU runs)")
    p.add_argument("--equal-lengths", type=int, default=None, help="every sample this long (no-regression runs)")
    p.add_argument("--balancer", default="lb-mini", choices=["local-sort", "lb-micro", "lb-mini"])
    p.add_argument("--cost", default="auto", choices=["auto", "tokens", "quadratic", "fitted"],
                   help="balancer cost model; auto (default): refitted every step from the measured busy times, "
                        "starting from the model's shape; quadratic: a*L + b*L^2 from the model's shape; fitted: "
                        "--cost-coeffs")
    p.add_argument("--cost-coeffs", default=None, metavar="A,B,C",
                   help="fitted cost a*L + b*L^2 per sample + c per microbatch (e.g. from python -m "
                        "ds_odc.balancer.fit RUN.json)")
    p.add_argument("--minibatch-size", type=int, default=4, help="samples per rank per optimizer step")
    p.add_argument("--max-tokens", type=int, default=None, help="token budget per microbatch (default: 1 sample)")
    p.add_argument("--oversize", default="error", choices=["error", "truncate", "skip"],
                   help="a sample longer than --max-tokens: stop with an error, truncate it, or skip it (counted)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup-steps", type=int, default=0, help="steps excluded from the summary")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-shuffle", action="store_true", help="take samples in file order (benchmarks)")
    p.add_argument("--deepspeed", required=True, help="ds_config JSON")
    p.add_argument("--attn-implementation", default=None, help="default: sdpa on GPU, eager on CPU")
    p.add_argument("--sdpa-backends", default=None,
                   help="comma list of the sdpa kernels torch may pick from (flash, efficient, cudnn, math); default: "
                        "all. cuDNN plans each new sequence length on the host, which variable lengths pay for")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--zero-init", action="store_true",
                   help="build the model partitioned with deepspeed.zero.Init (GPU; fails on CPU with torch 2.13)")
    p.add_argument("--metrics-json")
    p.add_argument("--profile-step", type=int, default=None,
                   help="profile this step (torch profiler): host vs device time, top ops, Chrome trace")
    p.add_argument("--profile-dir", default="profile", help="where --profile-step writes its files")
    p.add_argument("--timeline", help="draw per-rank busy/wait bars of the last steps to this PNG")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no summary lines")
    p.add_argument("--local_rank", type=int, default=None)  # the deepspeed launcher passes it
    return p.parse_args(argv)


def load_lengths(args) -> tuple[np.ndarray, list | None]:
    """Per-sample lengths, plus the token ids when the data is real text."""
    needed = args.num_samples or 10_000
    if args.data:
        if not args.tokenizer:
            sys.exit("--data needs --tokenizer DIR (a local tokenizer)")
        from datasets import load_dataset
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        kind = "parquet" if args.data.endswith(".parquet") else "json"
        ds = load_dataset(kind, data_files=args.data, split="train")
        ids = [tok(t)["input_ids"] for t in ds["text"]]
        return np.array([len(x) for x in ids]), ids
    if args.lengths_file:
        lengths = np.loadtxt(args.lengths_file, dtype=np.int64).reshape(-1)
    elif args.equal_lengths:
        lengths = np.full(needed, args.equal_lengths, dtype=np.int64)
    else:
        lengths = get_preset(args.preset or "baselines-longtail").sample(needed, args.seed)
    lengths = np.maximum(2, np.round(lengths * args.length_scale)).astype(np.int64)
    return lengths, None


def sample_tokens(index: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """Deterministic random tokens of sample ``index``: the same sample is identical in every mode and on every rank."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.randint(0, vocab, (length,), generator=g)


def cost_model(args, model_config):
    """The balancer's cost of a sample, from ``--cost`` (and ``--cost-coeffs``)."""
    if args.cost == "quadratic":
        return QuadraticCost.from_hf_config(model_config)
    if args.cost == "fitted":
        if not args.cost_coeffs:
            sys.exit("--cost fitted needs --cost-coeffs A,B,C (cost = A*L + B*L^2 + C)")
        a, b, c = (float(x) for x in args.cost_coeffs.split(","))
        return FittedCost(a=a, b=b, c=c)
    return args.cost  # "auto" or "tokens"


def build_model(args, ds_config: dict, device: torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config
    attn = args.attn_implementation or ("sdpa" if device.type == "cuda" else "eager")
    dtype = torch.bfloat16 if ds_config.get("bf16", {}).get("enabled") else torch.float32
    if args.model_path:
        config = AutoConfig.from_pretrained(args.model_path)
    else:
        config = Qwen2Config(**MODEL_PRESETS[args.model], max_position_embeddings=131072)
    config.use_cache = False  # packed rows: transformers only detects sample boundaries without a cache
    torch.manual_seed(args.seed)
    if args.zero_init:  # partitioned from the start, for models that do not fit one device
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig
        build_model.keep_alive = HfDeepSpeedConfig(ds_config)  # HF reads it during from_config
        with deepspeed.zero.Init(config_dict_or_path=ds_config, dtype=dtype):
            model = (AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype, attn_implementation=attn)
                     if args.model_path else
                     AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn))
    else:  # built whole on the device (fast random init), partitioned by deepspeed.initialize
        with torch.device(device):
            model = (AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype, attn_implementation=attn)
                     if args.model_path else
                     AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn))
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def configure_sdpa(backends: str | None) -> None:
    """Restrict torch's scaled_dot_product_attention to the listed kernels (process-wide)."""
    if not backends:
        return
    allowed = {b.strip() for b in backends.split(",") if b.strip()}
    switches = {"flash": "enable_flash_sdp", "efficient": "enable_mem_efficient_sdp", "cudnn": "enable_cudnn_sdp",
                "math": "enable_math_sdp"}
    unknown = allowed - switches.keys()
    if unknown:
        sys.exit(f"--sdpa-backends: unknown {sorted(unknown)}; choose from {sorted(switches)}")
    for name, switch in switches.items():
        getattr(torch.backends.cuda, switch)(name in allowed)


def main(argv=None):
    args = parse_args(argv)
    configure_sdpa(args.sdpa_backends)
    init_distributed()
    train(args)
    finish()


def init_distributed() -> None:
    import deepspeed
    if os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available():
        init_cpu_distributed(timeout_s=300)
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        deepspeed.init_distributed()


def train(args) -> dict | None:
    """One training run in an initialised process group; returns the metrics (rank 0) that --metrics-json writes."""
    import deepspeed
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    ds_config = json.loads(Path(args.deepspeed).read_text())
    odc = ds_config.get("zero_optimization", {}).get("odc", False)
    odc_on = odc if isinstance(odc, bool) else odc.get("enabled", True)
    if args.balancer == "lb-mini" and not odc_on:
        sys.exit("--balancer lb-mini gives ranks different numbers of microbatches, which only ODC can run: add "
                 '"odc": true to zero_optimization in the ds_config, or use --balancer lb-micro')
    ds_config["train_micro_batch_size_per_gpu"] = 1
    ds_config["gradient_accumulation_steps"] = 1  # boundaries are set explicitly: any count per rank
    ds_config.pop("train_batch_size", None)

    lengths, token_ids = load_lengths(args)
    model = build_model(args, ds_config, device)
    vocab = model.config.vocab_size
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # peak memory of training, not of building the unpartitioned model

    cost = cost_model(args, model.config)
    sampler = BalancedBatchSampler(lengths.tolist(), world_size=world, rank=rank, minibatch_size=args.minibatch_size,
                                   max_tokens=args.max_tokens, planner=args.balancer, seed=args.seed,
                                   shuffle=not args.no_shuffle, cost=cost, oversize=args.oversize,
                                   model_config=model.config)
    if rank == 0 and sampler.data_report.message():
        print(sampler.data_report.message(), flush=True)
    collate = PackedCollator()

    def sample_ids(j: int) -> torch.Tensor:
        return torch.as_tensor(token_ids[j]) if token_ids else sample_tokens(j, int(lengths[j]), vocab, args.seed)

    steps = min(args.steps, len(sampler))
    records = []
    progress = None
    if rank == 0:
        from tqdm import tqdm
        progress = tqdm(total=steps, desc=f"{'odc' if odc_on else 'stock'}+{args.balancer}", dynamic_ncols=True,
                        disable=getattr(args, "quiet", False))
    clock = StepClock()
    profile = None
    for step, batch in zip(range(steps), sampler):
        weight = global_mean_weight(batch.num_label_tokens, world)
        profiling = (profile_step(args.profile_dir, rank, decoder_layers(model))
                     if step == args.profile_step else contextlib.nullcontext())
        clock.start()
        loss_share = 0.0
        k = len(batch.microbatches)
        with profiling as profiled:
            for i, mb in enumerate(batch.microbatches):
                samples = [{"input_ids": sample_ids(j)[:args.max_tokens] if j in batch.truncated else sample_ids(j)}
                           for j in mb]
                row = {key: t.to(device) for key, t in collate(samples).items()}
                engine.set_gradient_accumulation_boundary(i == k - 1)
                logits = engine(input_ids=row["input_ids"], position_ids=row["position_ids"]).logits
                loss = token_loss_sum(logits, row["labels"]) * weight
                del logits
                engine.backward(loss, scale_wrt_gas=False)
                engine.step()
                loss_share += loss.item() / world
            if k == 0:  # a rank with no microbatch still joins the step
                engine.set_gradient_accumulation_boundary(True)
                engine.step()
        if profiled is not None:
            profile = profiled
        busy, step_time = clock.finish(getattr(engine.optimizer, "odc_wait_s", 0.0))
        tokens, sq_tokens = sampler.load(batch.microbatches)
        record = gather_step(loss_share, busy, step_time, k, tokens, batch.num_samples, sq_tokens=sq_tokens)
        if step != args.profile_step:  # the profiler's own overhead is no cost of the plan
            update = sampler.observe(record)
            record.cost = update.as_dict() if update else None
        records.append(record)
        if progress is not None:
            progress.set_postfix(loss=f"{record.loss:.4f}", samples_s=f"{record.samples_per_s:.2f}",
                                 bubble=f"{record.bubble_rate:.1%}")
            progress.update()
    if progress is not None:
        progress.close()

    out = None
    if rank == 0:
        summary = summarize(records, args.warmup_steps, world, untimed=[args.profile_step])
        total_time = summary["time_s"]
        config = {k: v for k, v in vars(args).items() if k != "local_rank"}
        config.update(world_size=world, odc=odc_on, device=str(device), deepspeed_version=deepspeed.__version__)
        out = {"config": config, "data": sampler.data_report.as_dict(), "steps": [r.as_dict() for r in records],
               "summary": summary}
        if profile:
            out["profile_rank0"] = profile
            print(f"profile of step {args.profile_step} (rank 0): {describe(profile)}; files in "
                  f"{args.profile_dir}/", flush=True)
        if args.metrics_json:
            Path(args.metrics_json).write_text(json.dumps(out, indent=1))
        if not getattr(args, "quiet", False):
            print(f"summary: loss {summary['final_loss']:.5f}  samples/s {summary['samples_per_s']:.3f}  "
                  f"bubble {summary['bubble_rate']:.1%}  time {total_time:.2f}s", flush=True)
            fitted = next((r.cost for r in reversed(records) if r.cost and r.cost["fitted"]), None)
            if fitted:
                print(f"automatic cost: {fitted['a']:.3g} s/token + {fitted['b']:.3g} s/token^2 + {fitted['c']:.3g} s "
                      f"per microbatch (+ {fitted['d']:.3g} s per step); last step predicted "
                      f"{fitted['predicted_step_s'] or float('nan'):.3f} s busy, measured "
                      f"{fitted['measured_step_s']:.3f} s", flush=True)
        if args.timeline:
            draw_timeline(records[-min(len(records), 4):], args.timeline)
    engine.destroy()
    return out


def decoder_layers(model) -> list:
    """The transformer blocks of an HF causal LM (``model.model.layers``), or none for other shapes."""
    return list(getattr(getattr(model, "model", None), "layers", ()))


def draw_timeline(records, path: str) -> None:
    """Per-rank busy (solid) and waiting (hatched) time, step after step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    world = len(records[0].per_rank)
    fig, ax = plt.subplots(figsize=(9, 0.6 * world + 1.5))
    start = 0.0
    for record in records:
        for r, p in enumerate(record.per_rank):
            ax.barh(r, p.busy_s, left=start, color="tab:blue")
            ax.barh(r, p.wait_s, left=start + p.busy_s, color="tab:orange", hatch="//", alpha=0.6)
        start += record.step_time_s
        ax.axvline(start, color="k", lw=0.8)
    ax.set_yticks(range(world), [f"rank {r}" for r in range(world)])
    ax.set_xlabel("seconds (blue: busy, orange: waiting; lines: optimizer steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
