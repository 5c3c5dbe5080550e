"""Generation tokens/s and peak memory on one device: ZeRO-3 + ODC lockstep-free vs stock ZeRO-3 vs the full-model
gather vs the plain unsharded model, for a batch of prompts whose completions have long-tail lengths.

    python benchmarks/generation.py --out runs/generation                    # one GPU: Qwen2-1.5B shape, bf16
    python benchmarks/generation.py --out runs/gen-cpu --model tiny          # CPU smoke run (seconds)

Each mode runs in its own single-rank process (clean memory, its own DeepSpeed engine) on the same random-init
model, prompts and per-completion lengths (a logits processor ends completion i at its drawn length L_i, so every
mode decodes exactly the same tokens, greedy):

| mode | what generates |
|---|---|
| ``plain`` | the unsharded model, no DeepSpeed |
| ``zero3-synced`` | stock ZeRO-3: every forward all-gathers each module; ``synced_gpus=True`` (what a multi-rank job needs) |
| ``zero3-gather`` | stock ZeRO-3 with the whole model gathered for the call and the hooks removed (TRL's ``ds3_gather_for_generation``, through TRL's own hook helpers: needs ``trl``) |
| ``odc-block`` | ODC, ``lockstep_free(residency="block")``: one-sided reads per transformer block at every forward |
| ``odc-full`` | ODC, ``lockstep_free(residency="full")``: every parameter read once, kept for the call |

New tokens/s counts the completions' own tokens (sum of L_i) over the wall time of one ``generate`` call after a
warm-up call. Peak memory is ``max_memory_allocated`` during that call; "static" is what was allocated before it
(shards, optimizer: a state-free SGD, so ZeRO modes hold shards + an fp32 master copy). The multi-rank effect of
lockstep (ranks that finished wait for the slowest) is not visible on one device.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

from _modes import ROOT, finish_worker, run_modes  # benchmarks/_modes.py
MODES = ("plain", "zero3-synced", "zero3-gather", "odc-block", "odc-full")
SHAPES = {
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
}
EOS, PAD = 2, 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", choices=sorted(SHAPES), default="1.5b")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256, help="longest prompt; others are 1/4 to all of it")
    p.add_argument("--max-new", type=int, default=192, help="longest completion; the rest follow a long tail")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode-timeout", type=float, default=240)
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def workload(args):
    """Prompt lengths and completion lengths: the same in every mode (numpy, seeded)."""
    import numpy as np
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(max(1, args.prompt_len // 4), args.prompt_len + 1, args.prompts)
    completion = np.clip(rng.lognormal(np.log(max(args.max_new / 8, 1)), 1.0, args.prompts), 4, args.max_new)
    completion = completion.astype(int)
    completion[rng.integers(args.prompts)] = args.max_new  # one completion reaches the limit: the long tail
    return prompt.tolist(), completion.tolist()


def prompt_tensors(lengths, vocab, seed, device):
    import torch
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids.to(device), mask.to(device)


class EndAtLength:
    """Logits processor: completion i emits EOS exactly at its L_i-th new token and never before."""

    def __init__(self, prompt_width: int, lengths):
        import torch
        self.prompt_width = prompt_width
        self.lengths = torch.tensor(lengths)

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_width  # new tokens so far
        end = (self.lengths.to(scores.device) - 1) <= step
        scores[:, EOS] = float("-inf")
        scores[:, PAD] = float("-inf")  # so that every token before EOS counts as produced
        scores[end] = float("-inf")
        scores[end, EOS] = 0.0
        return scores


def run_worker(args) -> dict:
    import deepspeed
    import torch
    from transformers import LogitsProcessorList, Qwen2Config, Qwen2ForCausalLM

    mode = args.worker
    on_gpu = torch.cuda.is_available()
    if mode.startswith("odc"):
        import ds_odc  # noqa: F401
    from ds_odc.training.distributed import init_distributed
    init_distributed()
    device, dtype = (torch.device("cuda", 0), torch.bfloat16) if on_gpu else (torch.device("cpu"), torch.float32)
    config = Qwen2Config(**SHAPES[args.model], max_position_embeddings=4096, pad_token_id=PAD, eos_token_id=EOS,
                         bos_token_id=None)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    prompt_lengths, completion_lengths = workload(args)
    ids, mask = prompt_tensors(prompt_lengths, config.vocab_size, args.seed, device)

    engine = None
    if mode != "plain":
        ds = json.loads((ROOT / "ds_configs" / ("zero3_bf16.json" if on_gpu else "zero3_fp32_cpu.json")).read_text())
        ds.pop("optimizer", None)
        ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, zero_allow_untested_optimizer=True)
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        if mode.startswith("odc"):
            ds["zero_optimization"]["odc"] = {"enabled": True}
        params = [p for p in model.parameters()]
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=ds,
                                          optimizer=torch.optim.SGD(params, lr=0.0))
        model = engine.module
    model.eval()

    def context():

        if mode.startswith("odc"):
            from ds_odc.integrations.generation import lockstep_free
            return lockstep_free(engine, residency=mode.split("-")[1])
        if mode == "zero3-gather":
            return full_model_gather(engine)  # the same mechanics as TRL's ds3_gather_for_generation
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def full_model_gather(engine):
        """Stock ZeRO-3's way to generate at full speed: all-gather the whole model (a collective), hooks off, with
        TRL's own hook helpers (what its ``ds3_gather_for_generation`` uses)."""
        from trl.models.utils import add_hooks, remove_hooks
        params = [p for p in engine.module.parameters() if hasattr(p, "ds_id")]
        with deepspeed.zero.GatheredParameters(params):
            remove_hooks(engine)
            try:
                yield engine.module
            finally:
                add_hooks(engine)

    def generate(input_ids, attention_mask, lengths):
        kwargs = dict(max_new_tokens=max(lengths), do_sample=False, pad_token_id=PAD, eos_token_id=EOS,
                      logits_processor=LogitsProcessorList([EndAtLength(input_ids.shape[1], lengths)]))
        if mode in ("zero3-synced", "zero3-gather"):
            kwargs["synced_gpus"] = True
        with torch.no_grad(), context():
            return model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    def sync():
        if on_gpu:
            torch.cuda.synchronize()

    generate(ids[:2, -16:], mask[:2, -16:], [8, 8])  # warm-up: kernels, DeepSpeed's module trace
    sync()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
        static = torch.cuda.memory_allocated()
    started = time.perf_counter()
    out = generate(ids, mask, completion_lengths)
    sync()
    seconds = time.perf_counter() - started
    new = out[:, ids.shape[1]:]
    produced = [int((row != PAD).sum()) for row in new]  # up to and including EOS; padding after it
    result = {"mode": mode, "seconds": seconds, "new_tokens": sum(completion_lengths),
              "tokens_per_second": sum(completion_lengths) / seconds, "decode_steps": int(new.shape[1]),
              "lengths_ok": produced == completion_lengths, "tokens": new.tolist(),
              "device": torch.cuda.get_device_name(0) if on_gpu else "cpu"}
    if on_gpu:
        result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["static_gib"] = static / 2**30
    return result


def orchestrate(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    passthrough = ["--model", args.model, "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len),
                   "--max-new", str(args.max_new), "--seed", str(args.seed), "--out", str(out)]
    results = run_modes(__file__, args.modes.split(","), passthrough, ranks=1, out=out, timeout=args.mode_timeout,
                        tail_chars=3000)
    table = report(results, args)
    (out / "generation.md").write_text(table)
    (out / "generation.json").write_text(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "tokens"}
                                                     for k, v in results.items()}, indent=1))
    print(table)
    return 0 if all("failed" not in r for r in results.values()) else 1


def report(results, args) -> str:
    prompt_lengths, completion_lengths = workload(args)
    plain = results.get("plain", {})
    lines = [f"{args.model}: {args.prompts} prompts of {min(prompt_lengths)}-{max(prompt_lengths)} tokens, "
             f"completions of {min(completion_lengths)}-{max(completion_lengths)} tokens "
             f"(median {sorted(completion_lengths)[len(completion_lengths) // 2]}), greedy, one generate call",
             "", "| mode | new tokens/s | vs plain | peak GiB | static GiB | seconds | same tokens as plain |",
             "|---|---|---|---|---|---|---|"]
    for mode, r in results.items():
        if "failed" in r:
            lines.append(f"| {mode} | failed | | | | | |")
            continue
        ratio = r["tokens_per_second"] / plain["tokens_per_second"] if "tokens_per_second" in plain else float("nan")
        same = "-" if mode == "plain" else ("yes" if "tokens" in plain and r["tokens"] == plain["tokens"] else "no")
        peak, static = r.get("peak_gib", float("nan")), r.get("static_gib", float("nan"))
        lines.append(f"| {mode} | {r['tokens_per_second']:.0f} | {ratio:.2f}x | {peak:.1f} | {static:.1f} | "
                     f"{r['seconds']:.1f} | {same} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return finish_worker(Path(args.out, f"{args.worker}.json"), run_worker(args))
    return orchestrate(args)


if __name__ == "__main__":
    raise SystemExit(main())
