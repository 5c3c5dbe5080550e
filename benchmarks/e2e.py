"""End-to-end SFT benchmark: stock ZeRO-3, ZeRO-3 + ODC and FSDP2 on the same samples, back to back, one table.

    python benchmarks/e2e.py --model qwen2.5-1.5b --workload longtail --nproc 2 --out results/

Workloads (4 samples per rank per minibatch; ``--warmup`` minibatches, default 1, then the timed ones):
  longtail         clamp(exp(ln 8000 + 0.8 N(0,1)), 1024, 32768) from torch.Generator().manual_seed(0), one
                   sample per microbatch
  longtail-packed  the same lengths; the planners pack samples into padding-free rows of up to 64k tokens (--max-tokens)
  equal            every sample 8192 tokens (the no-regression check)
  long-sft         the balancer's long-context preset (8k floor, median ~16k, up to 64k), one sample per microbatch
At other rank counts (--nproc) every workload keeps 4 samples per rank per minibatch.
Modes: stock+local-sort, stock+lb-micro, stock-blocks+lb-micro (stock ZeRO-3 with the block fetch and plain linear
that ODC defaults to), odc+lb-micro, odc+lb-mini (ZeRO-3 via examples/sft.py), fsdp2 (benchmarks/fsdp2_sft.py,
local-sort) and plain (benchmarks/fsdp2_sft.py --engine plain: unsharded training on one GPU, --nproc 1 only).
A mode takes options after slashes: ``/packed`` or ``/unpacked`` (override the workload's packing; packed rows of
a local-sort mode are planned by lb-micro), an attention implementation (``/sdpa``, ``/flex_attention``; default
ds_odc_varlen) and a kernel of ds_odc_varlen (``/varlen``, ``/bucketed``; default auto), e.g.
``odc+lb-mini/unpacked/sdpa``; ``/stock-loop`` trains a DeepSpeed mode through DeepSpeed's own three-line loop over
the loader that ``deepspeed.initialize(training_data=...)`` returns under ``zero_optimization.odc.balancer``
(examples/sft.py ``--loop stock``) instead of the recipe's loop, on the same rows: ``--modes
odc+lb-mini,odc+lb-mini/stock-loop --compare-to odc+lb-mini`` times one against the other. Each runs in its own
torchrun launch; the table compares samples/s measured in this one call (ratios, not absolute times, are what carry
over between machines). Every mode is compared like for like: with FSDP2 and with plain training on the same rows
(packed with packed, unpacked with unpacked, the same attention), when those ran in the call. A second table puts
the simulator beside every run: its step time predicted from the run's own minibatches, planner and sync, with the
cost fitted to the run's timed steps (``ds_odc.balancer.simulate.replay_run``), and the balance bound of those
minibatches at that cost: a baseline's measured/bound is the most any whole-sample plan could gain over it at its own
speed. On a machine without CUDA (smoke runs with ``--model tiny``) every mode computes in fp32, as FSDP2 and plain
training do there: the DeepSpeed modes get their config with ``bf16`` off.

Kernels: a mode option ``/compiled`` (every transformer block through ``torch.compile``, dynamic lengths),
``/fused`` (Liger's kernels) or ``/compiled+fused`` (compiled blocks plus Liger's fused linear cross-entropy on the
head), the same for every engine (``--kernels`` of examples/sft.py and benchmarks/fsdp2_sft.py; FSDP2's blocks are
compiled before ``fully_shard``, as torchtitan does). ``--modes kernels`` runs ODC, FSDP2 and plain training each
eager and compiled+fused on packed rows:

    python benchmarks/e2e.py --nproc 1 --model qwen2.5-1.5b --workload longtail-packed --steps 4 --modes kernels \
        --out results/

Every mode prints its tokens/s and its model FLOP utilisation (MFU):

    MFU = sum over timed samples of (6 N L + 6 n_layers d_attn L^2) / (time x ranks x peak)

with L the document length, N the parameters that multiply activations (all of them, less an untied input
embedding), d_attn = heads x head_dim, causal attention counted as half of the full L^2 (forward 2 L^2 d_attn per
layer, backward twice that); peak is the dense bf16 matmul rate this benchmark measures at start on the same GPU
(median of 20 products of 8192 x 8192 matrices). The compile column gives the graphs compiled and the frames
compiled after the second minibatch (0: new lengths never recompiled), marked ``*`` where frames were compiled
during the timed minibatches (a code path first met there, e.g. unpacked rows' attention without a long document):
that time includes compiling; ``--warmup 2`` leaves it out for every mode alike.

The packed table on one GPU (ODC packed vs unpacked vs FSDP2 vs plain; cuDNN's sdpa as the "before" of the
per-layer host time):

    python benchmarks/e2e.py --nproc 1 --workload longtail-packed --profile --out results/

``--lora RANK`` trains LoRA adapters instead of the whole model in every mode (PEFT; the base model frozen and, under
ZeRO-3, still sharded), the LoRA row of the SFT table:

    python benchmarks/e2e.py --nproc 1 --workload longtail --modes stock+lb-micro,odc+lb-mini --lora 16 \
        --out results/

On a shared or noisy machine, ``--repeat N`` runs the mode list N times in rounds (A B C A B C ...): the table shows
each mode's median run, and each ratio is the median of the ratios within a round. A mode ending in ``@DIR`` runs
from another checkout of this repository (e.g. ``odc+lb-mini@../before``): a code change measured against the code
before it, alternating in one call:

    python benchmarks/e2e.py --nproc 1 --workload longtail-packed --repeat 3 \
        --modes odc+lb-mini,odc+lb-mini@../before,fsdp2 --out results/
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ds_odc.balancer.presets import get_preset, longtail_from_normals  # noqa: E402
from ds_odc.balancer.simulate import replay_run  # noqa: E402
from ds_odc.training.launch import run_launch  # noqa: E402

MODES = {
    "stock+local-sort": ("sft", "zero3_bf16.json", "local-sort"),
    "stock+lb-micro": ("sft", "zero3_bf16.json", "lb-micro"),
    # stock ZeRO-3 given the two settings ODC defaults to (block fetch, plain linear): what a tuned stock run gets
    "stock-blocks+lb-micro": ("sft", "zero3_bf16_blocks.json", "lb-micro"),
    "odc+lb-micro": ("sft", "zero3_odc_bf16.json", "lb-micro"),
    "odc+lb-mini": ("sft", "zero3_odc_bf16.json", "lb-mini"),
    # ODC's transport with collective ZeRO-3's per-layer meetings put back (odc.lockstep): the collective baseline
    # that runs where NCCL cannot (several ranks on partitions of one GPU); it needs equal counts per rank
    "lockstep+lb-micro": ("sft", "zero3_odc_lockstep_bf16.json", "lb-micro"),
    "lockstep+local-sort": ("sft", "zero3_odc_lockstep_bf16.json", "local-sort"),
    "fsdp2": ("fsdp2", None, "local-sort"),
    "plain": ("plain", None, "local-sort"),
}
PARTITION_TABLE = ["odc+lb-mini", "odc+lb-micro", "lockstep+lb-micro", "lockstep+local-sort"]
PACKED_TABLE = ["odc+lb-mini", "fsdp2", "plain", "odc+lb-mini/unpacked", "fsdp2/unpacked", "plain/unpacked"]
KERNELS_TABLE = ["odc+lb-mini", "fsdp2", "plain", "odc+lb-mini/compiled+fused", "fsdp2/compiled+fused",
                 "plain/compiled+fused"]
KERNEL_CHOICES = {"eager", "compiled", "fused", "compiled+fused"}  # examples/sft.py --kernels
LIKE_FOR_LIKE = ["fsdp2", "plain"]  # every mode's ratio against these on the same rows
ATTENTION_OPTIONS = {"ds_odc_varlen", "sdpa", "eager", "flex_attention", "flash_attention_2"}
KERNEL_OPTIONS = {"varlen", "bucketed"}  # of ds_odc_varlen (--attention-kernel)
STOCK_LOOP = "stock-loop"  # a DeepSpeed mode through DeepSpeed's own loop (examples/sft.py --loop stock)


def checkout_of(mode: str) -> Path:
    """The checkout a mode runs from: this one, or ``DIR`` of ``MODE@DIR``."""
    _, at, tree = mode.partition("@")
    if not at:
        return ROOT
    root = Path(tree).expanduser().resolve()
    if not (root / "examples" / "sft.py").exists():
        raise SystemExit(f"mode {mode!r}: {root} is not a checkout of this repository (no examples/sft.py)")
    return root


class Mode(NamedTuple):
    """A mode as ``--modes`` names it: the engine, the rows it trains, and the loop that trains them."""

    name: str  # a key of MODES
    packed: bool
    attn: str  # the attention implementation
    kernel: str  # its kernel (of ds_odc_varlen)
    kernels: str  # the model's kernels
    stock_loop: bool  # /stock-loop: examples/sft.py --loop stock

    @property
    def rows(self) -> tuple:
        """What the rows and their computation are: modes alike in these train like for like."""
        return self.packed, self.attn, self.kernel, self.kernels


def parse_mode(mode: str, workload: str) -> Mode:
    """``NAME[/packed|/unpacked][/ATTENTION][/KERNEL][/KERNELS][/stock-loop][@DIR]`` -> :class:`Mode`."""
    name, *options = mode.partition("@")[0].split("/")
    if name not in MODES:
        raise SystemExit(f"unknown mode {name!r}; choose from {sorted(MODES)}")
    packed, attn, kernel, kernels, stock_loop = workload == "longtail-packed", "ds_odc_varlen", "auto", "eager", False
    for option in options:
        if option in ("packed", "unpacked"):
            packed = option == "packed"
        elif option in ATTENTION_OPTIONS:
            attn = option
        elif option in KERNEL_OPTIONS:
            kernel = option
        elif option in KERNEL_CHOICES:
            kernels = option
        elif option == STOCK_LOOP:
            if MODES[name][0] != "sft":
                raise SystemExit(f"mode {mode!r}: /{STOCK_LOOP} is DeepSpeed's own loop (examples/sft.py --loop "
                                 f"stock); {name} does not run DeepSpeed")
            stock_loop = True
        else:
            raise SystemExit(f"mode {mode!r}: unknown option {option!r} (packed, unpacked, "
                             f"{sorted(ATTENTION_OPTIONS)}, kernels of ds_odc_varlen {sorted(KERNEL_OPTIONS)}, "
                             f"model kernels {sorted(KERNEL_CHOICES)}, {STOCK_LOOP})")
    return Mode(name, packed, attn, kernel, kernels, stock_loop)


PEAK_PROBE = """
import torch
n, times = 8192, []
a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
for _ in range(5):
    a @ b
for _ in range(20):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(); a @ b; end.record(); torch.cuda.synchronize()
    times.append(start.elapsed_time(end) / 1e3)
print(2 * n ** 3 / sorted(times)[len(times) // 2] / 1e12)
"""


def measure_peak_tflops() -> float | None:
    """The GPU's dense bf16 matmul rate (TFLOP/s, median of 20 products of 8192 x 8192 matrices), in a process of
    its own so that this one holds no GPU memory while the modes run; ``None`` without a GPU."""
    if not torch.cuda.is_available():
        return None
    proc = subprocess.run([sys.executable, "-c", PEAK_PROBE], capture_output=True, text=True, timeout=300)
    return float(proc.stdout.split()[-1]) if proc.returncode == 0 and proc.stdout.split() else None


def model_flop_terms(shape: str) -> tuple[int, int, int]:
    """(N, layers, d_attn) of a model shape for the MFU formula: N counts the parameters that multiply activations
    (all of them, less an untied input embedding, which is a lookup); d_attn = heads x head_dim."""
    from transformers import AutoModelForCausalLM

    from ds_odc.recipes.workloads import model_config
    config = model_config(shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = {id(p): p.numel() for p in model.parameters()}
    embed = model.get_input_embeddings().weight
    tied = embed is model.get_output_embeddings().weight
    n = sum(params.values()) - (0 if tied else embed.numel())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return n, config.num_hidden_layers, config.num_attention_heads * head_dim


def model_tflops(metrics: dict, terms: tuple[int, int, int], first: int, last: int) -> float:
    """Model TFLOP/s of a run over its steps ``first..last-1``: sum of 6 N L + 6 layers d_attn L^2 over every
    document of every rank (tokens and squared lengths as the plan counted them), over the steps' time."""
    n, layers, d_attn = terms
    steps = metrics["steps"][first:last]
    flops = sum(6 * n * r["tokens"] + 6 * layers * d_attn * r["sq_tokens"] for s in steps for r in s["per_rank"])
    seconds = sum(s["step_time_s"] for s in steps)
    return flops / seconds / 1e12 if seconds else 0.0


def write_lengths(workload: str, minibatches: int, path: Path, scale: float = 1.0, nproc: int = 2) -> None:
    """4 samples per rank per minibatch. longtail draws them in order from one generator, so at 2 ranks these are
    the lengths every 2-rank result in docs/BENCHMARKS.md was measured on."""
    per_minibatch = 4 * nproc
    if workload == "equal":
        lengths = [8192] * (per_minibatch * minibatches)
    elif workload == "long-sft":
        lengths = [int(x) for x in get_preset("long-sft").sample(per_minibatch * minibatches, 0)]
    else:
        g = torch.Generator().manual_seed(0)
        lengths = [int(x) for _ in range(minibatches)
                   for x in longtail_from_normals(torch.randn(per_minibatch, generator=g).numpy())]
    lengths = [max(2, round(n * scale)) for n in lengths]
    path.write_text("\n".join(map(str, lengths)) + "\n")


def like_for_like(mode: str, base: str, ran: dict, workload: str) -> str | None:
    """The mode of ``ran`` that trains ``base`` on the same rows as ``mode`` (packing and attention), if any."""
    rows = parse_mode(mode, workload).rows
    for other in ran:
        parsed = parse_mode(other, workload)
        if parsed.name == base and parsed.rows == rows:
            return other
    return None


def engine_config(path: Path, out: Path) -> Path:
    """A DeepSpeed mode's config: ``path`` on a GPU; without CUDA the same config with ``bf16`` off, written into
    ``out``. FSDP2 and plain training compute in fp32 on the CPU (bf16 matmuls there are several times slower than
    fp32), so every mode of a CPU call then computes in the same precision."""
    if torch.cuda.is_available():
        return path
    config = json.loads(path.read_text())
    config["bf16"] = {"enabled": False}
    target = out / f"fp32-{path.parent.parent.name}-{path.name}"
    target.write_text(json.dumps(config, indent=1))
    return target


def run(mode: str, args, lengths: Path, out: Path, round_: int = 0) -> dict:
    name, packed, attn, kernel, kernels, stock_loop = parse_mode(mode, args.workload)
    root = checkout_of(mode)
    profile = args.profile and round_ == 0  # one profiled minibatch per mode is enough
    script, config, balancer = MODES[name]
    if packed and balancer == "local-sort":
        balancer = "lb-micro"
    if script == "plain" and args.nproc != 1:
        print(f"  {mode}: skipped (plain training runs at --nproc 1 only)", flush=True)
        return {"mode": mode, "failed": True}
    slug = mode.partition("@")[0].replace("/", "-") + (f"-at-{root.name}" if "@" in mode else "")
    slug += f"-round{round_ + 1}" if args.repeat > 1 else ""
    metrics = out / f"{args.model}-{args.workload}-{slug}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(root / ("examples/sft.py" if script == "sft" else "benchmarks/fsdp2_sft.py")),
           "--model", args.model, "--lengths-file", str(lengths), "--no-shuffle", "--balancer", balancer,
           "--minibatch-size", "4", "--steps", str(args.steps + profile), "--warmup-steps", str(args.warmup),
           "--gradient-checkpointing", "--attn-implementation", attn, "--attention-kernel", kernel,
           "--metrics-json", str(metrics), "--cost", args.cost]
    if script == "plain":
        cmd += ["--engine", "plain"]
    if stock_loop:
        cmd += ["--loop", "stock"]
    if kernels != "eager":
        cmd += ["--kernels", kernels, "--compile-backend", args.compile_backend]
    if args.cost_coeffs:
        cmd += ["--cost-coeffs", args.cost_coeffs]
    if config:
        cmd += ["--deepspeed", str(engine_config(root / "ds_configs" / config, out))]
    if args.sdpa_backends:
        cmd += ["--sdpa-backends", args.sdpa_backends]
    if profile:
        cmd += ["--profile-step", str(args.steps), "--profile-dir", str(out / f"profile-{args.model}-{slug}")]
        cmd += ["--profile-python"] if args.profile_python else []
    if packed:
        cmd += ["--max-tokens", str(max(2, round((args.max_tokens or 65536) * args.scale)))]
    if args.lora:
        cmd += ["--lora", str(args.lora)]
    log = out / f"{args.model}-{args.workload}-{slug}.log"
    started = time.monotonic()
    partition_env = getattr(args, "partition_env", None) or {}
    # TMPDIR: torchrun's log folder goes into a temporary folder of this launch, removed afterwards
    with tempfile.TemporaryDirectory(prefix="ds_odc_e2e_") as scratch:
        finished = run_launch(cmd, timeout=args.run_timeout, log=log,
                              env=dict(os.environ, **partition_env, TMPDIR=scratch, PYTHONPATH=os.pathsep.join(
                                  p for p in [str(root), os.environ.get("PYTHONPATH", "")] if p)))
    if finished.returncode != 0 or not metrics.exists():
        text = log.read_text()
        errors = "\n".join(line for line in text.splitlines() if "Error" in line and "elastic" not in line)[-2500:]
        print(f"  {mode} FAILED: the launch {finished.describe(args.run_timeout, '--run-timeout')}; errors in {log}:\n"
              f"{errors or text[-2500:]}", flush=True)
        return {"mode": mode, "failed": True}
    written = json.loads(metrics.read_text())
    result = written["summary"]
    result.update(mode=mode, wall_s=time.monotonic() - started, metrics_file=str(metrics))
    result["model_tflops"] = model_tflops(written, args.flop_terms, args.warmup, args.steps)
    if args.peak_tflops:
        result["mfu"] = result["model_tflops"] / (args.nproc * args.peak_tflops)
    if written.get("profile_rank0"):
        result["profile"] = written["profile_rank0"]
    waited = f", lock-step waits {result['device_wait_rate']:.1%} on the device" if "device_wait_rate" in result else ""
    print(f"  {mode}{f' (round {round_ + 1})' if args.repeat > 1 else ''}: {result['samples_per_s']:.3f} samples/s, "
          f"{result['tokens_per_s']:.0f} tokens/s, {result['model_tflops']:.0f} model TFLOP/s, "
          f"bubble {result['bubble_rate']:.1%}{waited} ({result['wall_s']:.0f}s wall)", flush=True)
    return result


def median_run(runs: list[dict]) -> dict:
    """The run with the median samples/s (the lower one of two middles), with every run's samples/s beside it."""
    ok = sorted((r for r in runs if not r.get("failed")), key=lambda r: r["samples_per_s"])
    if not ok:
        return runs[0]
    return {**ok[(len(ok) - 1) // 2], "runs_samples_per_s": [r["samples_per_s"] for r in runs if not r.get("failed")]}


def ratio(runs: dict[str, list[dict]], mode: str, base: str) -> float:
    """Median over the rounds where both ran of mode's samples/s over base's, measured in the same round."""
    pairs = [(a, b) for a, b in zip(runs[mode], runs[base]) if not a.get("failed") and not b.get("failed")]
    return statistics.median(a["samples_per_s"] / b["samples_per_s"] for a, b in pairs) if pairs else float("nan")


def print_replays(results: dict[str, dict], calibrate_on: str | None = None) -> None:
    """The simulator's step time for each mode's (median) run beside the measured one
    (:func:`ds_odc.balancer.simulate.replay_run`: its minibatches in order, its planner and sync, its own cost fit),
    and, in the column before the costs, its prediction with the cost fitted to ``calibrate_on``'s run instead
    (default: the first mode that replays): one mode's measured costs predicting the others' step times."""
    print("\nsimulator replaying each run (its minibatches, planner and sync; cost fitted to its own timed steps, "
          "and in the column before the costs to one mode's run for all)")
    replays, errors = {}, {}
    for mode, r in results.items():
        try:
            metrics = json.loads(Path(r["metrics_file"]).read_text())
            replays[mode] = (metrics, replay_run(metrics))
        except (OSError, KeyError, ValueError) as err:
            errors[mode] = err
    base = calibrate_on if calibrate_on in replays else next(iter(replays), None)
    if calibrate_on and base != calibrate_on:
        print(f"(--calibrate-on {calibrate_on}: no replayed run of that mode in this call; priced with {base}'s)")
    cross = f"with {base}'s cost" if base else ""
    print(f"{'mode':<34}{'measured s/step':>16}{'predicted':>11}{'predicted/measured':>20}{'bound':>8}"
          f"{'measured/bound':>16}{cross:>{len(cross) + 3}}   own cost")
    for mode in results:
        if mode in errors:
            print(f"{mode:<34}{'-':>16}{'-':>11}{'-':>20}{'-':>8}{'-':>16}   not replayed: {errors[mode]}")
            continue
        metrics, replay = replays[mode]
        n, cost = replay["steps"], replay["cost"]
        try:
            other = replay_run(metrics, cost={**replays[base][1]["cost"], "source": f"{base}'s fit"})["ratio"]
            other = f"{other:.2f}x"
        except (KeyError, ValueError):
            other = "-"
        headroom = f"{replay['measured_s'] / replay['bound_s']:.2f}x" if replay["bound_s"] > 0 else "-"
        print(f"{mode:<34}{replay['measured_s'] / n:>16.3f}{replay['predicted_s'] / n:>11.3f}"
              f"{replay['ratio']:>19.2f}x{replay['bound_s'] / n:>8.3f}{headroom:>16}"
              f"{other:>{len(cross) + 3}}   {cost['source']}: a={cost['a']:.3g} b={cost['b']:.3g} c={cost['c']:.3g} "
              f"d={cost['d']:.3g}")
    print("bound: the balance bound of the run's own minibatches at its own cost (its fitted speed): no plan that "
          "trains every sample whole on one rank finishes them sooner; measured/bound is the most any such plan, "
          "ODC's included, could gain over this run without computing faster")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--workload", default="longtail", choices=["longtail", "longtail-packed", "equal", "long-sft"])
    p.add_argument("--modes", default=None,
                   help=f"comma list (default: every mode; for longtail-packed: {','.join(PACKED_TABLE)})")
    p.add_argument("--compare-to", default=None,
                   help="more modes the table gives ratios against (default: stock+lb-micro; none for "
                        "longtail-packed), besides FSDP2 and plain on the same rows")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed minibatches at the start of every mode (more: a compiled mode's compiling of new "
                        "code paths, e.g. unpacked rows' attention, stays out of the timed ones)")
    p.add_argument("--out", default="e2e_results")
    p.add_argument("--run-timeout", type=float, default=300)
    p.add_argument("--budget-s", type=float, default=1e9, help="skip the remaining modes after this many seconds")
    p.add_argument("--cost", default="auto", choices=["auto", "tokens", "quadratic", "fitted"],
                   help="the balancer cost of every mode (default auto: refitted from each run's measured busy times)")
    p.add_argument("--cost-coeffs", help="A,B,C for --cost fitted (e.g. the per-microbatch overhead measured here)")
    p.add_argument("--calibrate-on", metavar="MODE",
                   help="the run whose fitted cost the simulator table prices every mode with, in the column "
                        "before the costs (default: the first mode that ran)")
    p.add_argument("--sdpa-backends", help="passed to every mode (examples/sft.py --sdpa-backends)")
    p.add_argument("--profile", action="store_true",
                   help="run one more minibatch under the torch profiler (not timed): host vs device time per layer")
    p.add_argument("--profile-python", action="store_true",
                   help="with --profile: record Python calls too, and list those that ran while the GPU idled")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compiled modes (aot_eager: CPU smoke runs)")
    p.add_argument("--scale", type=float, default=1.0, help="scale all lengths (CPU smoke runs with --model tiny)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="packed modes: the token budget of a row before --scale (default 65536)")
    p.add_argument("--lora", type=int, default=None, metavar="RANK",
                   help="every mode trains LoRA adapters of this rank (all linear layers but the LM head; the base "
                        "model frozen); the TFLOP/s and MFU columns still count a full fine-tune's FLOPs")
    p.add_argument("--partition-gpu", action="store_true",
                   help="run the --nproc ranks of every mode on SM partitions of GPU 0 (CUDA MPS, 100/nproc percent "
                        "of the SMs each; ds_odc.training.partition): speed between ranks on a one-GPU machine")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the modes this many times, in rounds; medians and in-round ratios in the table")
    args = p.parse_args()
    if args.repeat < 1:
        raise SystemExit("--repeat must be at least 1")
    if not 0 <= args.warmup < args.steps:
        raise SystemExit(f"--warmup {args.warmup}: give 0 to {args.steps - 1} (--steps {args.steps} minibatches, at "
                         "least one of them timed)")
    packed_table = args.workload == "longtail-packed"
    args.modes = args.modes or ",".join(PARTITION_TABLE if args.partition_gpu else PACKED_TABLE if packed_table else
                                        [m for m in MODES if m != "plain" and not m.startswith("lockstep")
                                         or args.nproc == 1 and m == "plain"])
    if args.modes == "kernels":
        args.modes = ",".join(KERNELS_TABLE)
    args.compare_to = args.compare_to if args.compare_to is not None else (
        "lockstep+lb-micro,lockstep+local-sort" if args.partition_gpu else "" if packed_table else "stock+lb-micro")
    modes = args.modes.split(",")
    for mode in modes:
        checkout_of(mode)  # a wrong @DIR fails now, before anything is written or run
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = out / f"lengths-{args.workload}.txt"
    write_lengths(args.workload, args.steps + args.profile, lengths, args.scale, args.nproc)
    print(f"# {args.model} / {args.workload} on {args.nproc} ranks"
          + (f", LoRA adapters of rank {args.lora}" if args.lora else "") + f": {' '.join(sys.argv)}", flush=True)
    args.flop_terms = model_flop_terms(args.model)
    args.peak_tflops = measure_peak_tflops()
    n, layers, d_attn = args.flop_terms
    print(f"# model FLOPs per document of L tokens: 6 N L + 6 n_layers d_attn L^2 = 6 x {n:,} x L + 6 x {layers} x "
          f"{d_attn} x L^2 (causal attention); peak: "
          + (f"{args.peak_tflops:.0f} TFLOP/s dense bf16 measured here (8192^3 matmul, median of 20)"
             if args.peak_tflops else "not measured (no GPU): no MFU"), flush=True)
    with contextlib.ExitStack() as stack:
        if args.partition_gpu:
            from ds_odc.training.partition import gpu_partitions
            args.partition_env = stack.enter_context(gpu_partitions(args.nproc))
            print(f"# ranks on SM partitions of GPU 0: CUDA MPS, {args.partition_env['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE']}% "
                  "of the SMs each (memory bandwidth, L2 and power stay shared; see ds_odc.training.partition)",
                  flush=True)
        runs = run_modes(modes, args, lengths, out)
    report(runs, args, out)
    failed = [mode for mode, done in runs.items() if any(r.get("failed") for r in done)]
    if failed:
        raise SystemExit(f"e2e: {len(failed)} of {len(runs)} modes failed or did not run in some round: "
                         f"{', '.join(failed)} (their messages are above; the tables show the rest)")


def run_modes(modes: list[str], args, lengths: Path, out: Path) -> dict[str, list[dict]]:
    started, runs = time.monotonic(), {mode: [] for mode in modes}
    try:
        for round_ in range(args.repeat):
            for mode in modes:
                if time.monotonic() - started > args.budget_s:
                    print(f"  {mode}: skipped (time budget)", flush=True)
                    runs[mode].append({"mode": mode, "failed": True})
                    continue
                runs[mode].append(run(mode, args, lengths, out, round_))
    except KeyboardInterrupt:  # Ctrl-C, or a time limit around the call: the tables still show what finished
        print("  interrupted: the launch in progress was stopped with its ranks; what did not finish is left out",
              flush=True)
        for mode, done in runs.items():
            if not done:
                done.append({"mode": mode, "failed": True})
    return runs


def report(runs: dict[str, list[dict]], args, out: Path) -> None:
    results = {mode: median_run(rs) for mode, rs in runs.items()}
    ok = {m: r for m, r in results.items() if not r.get("failed")}
    references = [m for m in args.compare_to.split(",") if m in ok]
    print(f"\n{args.model} / {args.workload} ({args.nproc} ranks; timed minibatches {args.warmup + 1}-{args.steps}; "
          "'same rows': packed with packed, unpacked with unpacked"
          + (f"; median of {args.repeat} rounds, ratios within a round" if args.repeat > 1 else "") + ")")
    eager_twins = {m: m.replace("/compiled+fused", "").replace("/compiled", "").replace("/fused", "")
                   for m in ok}  # a mode with other kernels -> the same mode eager
    print(f"{'mode':<34}{'samples/s/dev':>14}{'tokens/s':>11}{'TFLOP/s':>8}{'MFU':>7}{'bubble':>8}{'dev wait':>9}"
          f"{'peak GiB':>9}"
          f"{'compile':>10}{'vs eager':>9}"
          + "".join(f"{'vs ' + m + ' same rows':>22}" for m in LIKE_FOR_LIKE)
          + "".join(f"{'vs ' + m:>{max(12, len(m) + 5)}}" for m in references))
    for mode, r in ok.items():
        like = ""
        for base in LIKE_FOR_LIKE:
            twin = like_for_like(mode, base, ok, args.workload)
            like += f"{ratio(runs, mode, twin):>21.2f}x" if twin else f"{'-':>22}"
        ratios = "".join(f"{ratio(runs, mode, m):>{max(12, len(m) + 5) - 1}.2f}x" for m in references)
        compiled = r.get("compile")
        compiled = (f"{compiled['graphs']}g/{compiled['compiled_after_step_2']}r"
                    + ("*" if compiled.get("compiled_while_timed") else "")) if compiled else "-"
        eager = eager_twins[mode]
        vs_eager = f"{ratio(runs, mode, eager):>8.2f}x" if eager != mode and eager in ok else f"{'-':>9}"
        mfu = f"{r['mfu']:>7.1%}" if "mfu" in r else f"{'-':>7}"
        dev_wait = f"{r['device_wait_rate']:>9.1%}" if "device_wait_rate" in r else f"{'-':>9}"
        print(f"{mode:<34}{r['samples_per_s_per_device']:>14.3f}{r['tokens_per_s']:>11.0f}{r['model_tflops']:>8.0f}"
              f"{mfu}{r['bubble_rate']:>8.1%}{dev_wait}{r['peak_mem_bytes'] / 2**30:>9.1f}{compiled:>10}{vs_eager}"
              f"{like}{ratios}")
    print("dev wait: lock-step modes on CUDA: the share of the ranks' time their per-layer meetings waited on the "
          "device (counted as busy in the bubble, as a collective's wait is; summed over the streams they ran on)")
    print("compile: graphs compiled / frames compiled after the second minibatch (recompiles); *: frames compiled "
          "during the timed minibatches, whose time then includes compiling (more --warmup leaves it out); MFU: "
          "model FLOPs (6 N L + 6 n_layers d_attn L^2 per document) over time x ranks x the measured peak")
    if args.repeat > 1:
        print("samples/s of every round: " + "; ".join(
            f"{m} {' '.join(f'{x:.3f}' for x in r['runs_samples_per_s'])}" for m, r in ok.items()))
    print_replays(ok, args.calibrate_on)
    profiled = {m: rs[0]["profile"] for m, rs in runs.items() if rs and rs[0].get("profile")}
    if profiled:
        print(f"\nprofile of one more minibatch (rank 0, not timed above; files in {out}/profile-*)")
        print(f"{'mode':<28}{'wall s':>8}{'dev busy':>9}{'busy %':>7}   per layer forward: {'calls':>6}"
              f"{'host ms':>9}{'dev busy ms':>12}{'dev span ms':>12}")
        for mode, prof in profiled.items():
            busy = prof['device_busy_s'] / prof['wall_s'] if prof['wall_s'] else 0.0
            print(f"{mode:<28}{prof['wall_s']:>8.2f}{prof['device_busy_s']:>9.2f}{busy:>7.0%}{'':>22}"
                  f"{prof.get('layer_forward_calls', 0):>6}{prof.get('layer_forward_host_ms', 0):>9.2f}"
                  f"{prof.get('layer_forward_device_ms', 0):>12.2f}{prof.get('layer_forward_device_span_ms', 0):>12.2f}")
        for mode, prof in profiled.items():
            print(f"\n{mode}: device idle {prof['device_idle_s'] * 1e3:.0f} ms; host events running meanwhile "
                  "(innermost, per thread):")
            for name, seconds in prof.get("idle_host", [])[:10]:
                print(f"  {seconds * 1e3:8.1f} ms  {name[:110]}")
            if prof.get("idle_python"):
                print("  ... and by the training code's innermost Python frame:")
                for name, seconds in prof["idle_python"][:10]:
                    print(f"  {seconds * 1e3:8.1f} ms  {name[:110]}")
    (out / f"{args.model}-{args.workload}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
