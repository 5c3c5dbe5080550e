"""The optimizer on the host: stock ZeRO-3 and ZeRO-3 + ODC, both with ``"offload_optimizer": {"device": "cpu"}``, on
the same packed long-tail rows, one table.

    python benchmarks/offload.py --out results/offload/

A Qwen2.5-7B-shaped model (random weights, nothing downloaded) trains at one rank (``--nproc``) with its fp32 master
weights, gradients and Adam state on the host, stepped by DeepSpeed's CPU Adam (``--optimizer cpu-adam``; ``torch``:
torch's AdamW on the host). Each mode runs in its own torchrun launch of the SFT loop (``ds_odc.recipes.train``) with
activation checkpointing, 4 samples per rank per minibatch from the long-tail distribution of benchmarks/e2e.py,
packed into rows of up to ``--max-tokens`` by the same planner for both (lb-micro: the same rows in both modes, so
the comparison isolates the offloaded step); 1 warm-up minibatch and ``--steps - 1`` timed.

Per mode: samples/s; peak device memory as torch's allocator counts it plus ODC's symmetric heap (shards and the
gradient accumulator live there under NVSHMEM, outside torch's statistics), and the device memory in use after the
last step as the driver sees it (CUDA context, NVSHMEM's runtime and the allocator's cache included); the process's
peak host memory (pinned buffers included); and the optimizer step's host time per step, broken down: copy out (the
gradient's way to the host: ODC once per step after the fence; stock in every backward, where it accumulates
microbatches on the host and waits for the copies at the end of backward), CPU optimizer (clip + Adam) and copy back
(new parameters into the device shards).

Host memory: a 7B model's offloaded state is about 122 GB (4 + 4 + 8 bytes per parameter: master, gradient, Adam);
stock adds its pinned gradient partition (2 bytes per parameter in bf16). Run it where the host has room for that,
e.g. a 2-GPU H200 node (256 GiB) at ``--nproc 1``; on a host with 128 GiB, ``--num-layers 14`` keeps the 7B
width with half its layers (about 4.4B parameters, 70 GB on the host). CPU smoke run (tiny model, torch's AdamW, scaled lengths):

    python benchmarks/offload.py --model tiny --scale 0.004 --optimizer torch --steps 3 --out /tmp/offload_smoke

At ``--nproc 2`` or more on a machine with fewer GPUs, the ranks share GPU 0 (``DS_ODC_SHARED_GPU=1``): per-rank
memory, not speed between ranks. The peaks are the largest rank's, and the table adds ODC's fp32 gradient
accumulator, 4/W bytes per trainable parameter at W ranks, as its own line beside stock's peak.

Where one call may not run that long, run the modes in separate calls into one folder and print the table after
(``--modes stock``, ``--modes odc``, then ``--table-only``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ds_odc.balancer.presets import longtail_from_normals  # noqa: E402
from ds_odc.training.launch import run_launch  # noqa: E402

MODES = {"stock": "zero3_bf16.json", "odc": "zero3_odc_bf16.json"}
PHASES = ("copy_out", "optimizer", "copy_back")
GIB = 2 ** 30


def write_lengths(minibatches: int, nproc: int, path: Path, scale: float) -> None:
    """4 samples per rank per minibatch, drawn as benchmarks/e2e.py draws its long-tail workload."""
    g = torch.Generator().manual_seed(0)
    lengths = [int(x) for _ in range(minibatches)
               for x in longtail_from_normals(torch.randn(4 * nproc, generator=g).numpy())]
    path.write_text("\n".join(str(max(2, round(n * scale))) for n in lengths) + "\n")


def write_config(mode: str, optimizer: str, path: Path) -> None:
    """The repository's bf16 ds_config of ``mode`` with the optimizer on the host (pinned)."""
    config = json.loads((ROOT / "ds_configs" / MODES[mode]).read_text())
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    params = config["optimizer"]["params"]
    params.pop("fused", None)  # a CUDA-kernel option of torch's AdamW: not for parameters on the host
    if optimizer == "cpu-adam":
        params.pop("torch_adam", None)  # DeepSpeed picks its CPU Adam for an offloaded optimizer
    else:
        config["zero_force_ds_cpu_optimizer"] = False
    path.write_text(json.dumps(config, indent=1))


# -- one mode, inside its torchrun launch ----------------------------------------------------------------------------
def child(report: Path, sft_argv: list[str]) -> None:
    """Train with ``ds_odc.recipes.train`` and write what the table needs: its summary, every optimizer step's host
    phases and wall time, and memory."""
    import deepspeed

    from ds_odc.recipes.sft import sft_argument_parser
    from ds_odc.recipes.train import train
    from ds_odc.training.metrics import peak_memory_bytes
    from ds_odc.training.distributed import init_distributed, shutdown_and_exit
    from ds_odc.zero.engine import host_step_timer, symmetric_device_bytes

    seen = {"steps": [], "device_used": 0, "symmetric": 0, "trainable": 0}
    initialize = deepspeed.initialize

    def initialize_and_time(*args, **kwargs):  # the loop builds its engine inside train(): time it as it is built
        built = initialize(*args, **kwargs)
        engine = built[0]
        read = host_step_timer(engine)
        seen["symmetric"] = symmetric_device_bytes(engine)
        seen["trainable"] = sum(getattr(q, "ds_numel", q.numel()) for q in engine.module.parameters() if q.requires_grad)
        step = engine.optimizer.step

        def timed_step(*a, **k):
            started = time.perf_counter()
            out = step(*a, **k)
            phases = read() if read is not None else None
            seen["steps"].append({"step_s": time.perf_counter() - started,
                                  **({} if phases is None else dataclasses.asdict(phases))})
            if torch.cuda.is_available():
                free, total = torch.cuda.mem_get_info()
                seen["device_used"] = max(seen["device_used"], total - free)
            return out

        engine.optimizer.step = timed_step
        return built

    deepspeed.initialize = initialize_and_time
    args = sft_argument_parser().parse_args(sft_argv)
    init_distributed()
    out = train(args)
    mine = {"peak_device": peak_memory_bytes() + seen["symmetric"],
            "host_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    rank_report(report, int(os.environ.get("RANK", "0"))).write_text(json.dumps(mine))  # every rank's own peaks
    if out is not None:
        out["offload"] = {**seen, **mine}
        report.write_text(json.dumps(out))
    shutdown_and_exit()


def rank_report(report: Path, rank: int) -> Path:
    return report.with_name(f"{report.stem}-rank{rank}.json")


# -- the comparison --------------------------------------------------------------------------------------------------
def run(mode: str, args, lengths: Path, out: Path) -> dict | None:
    config, report = out / f"ds_config-{mode}.json", out / f"{args.model}-{mode}.json"
    write_config(mode, args.optimizer, config)
    report.unlink(missing_ok=True)
    for stale in out.glob(f"{report.stem}-rank*.json"):
        stale.unlink()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(Path(__file__).resolve()), "--child", str(report), "--",
           "--model", args.model, "--lengths-file", str(lengths), "--no-shuffle", "--balancer", "lb-micro",
           "--minibatch-size", "4", "--max-tokens", str(max(2, round(args.max_tokens * args.scale))),
           "--steps", str(args.steps), "--warmup-steps", "1", "--gradient-checkpointing", "--cost", "tokens",
           "--deepspeed", str(config), "--quiet"] + (["--num-layers", str(args.num_layers)] if args.num_layers else [])
    log = out / f"{args.model}-{mode}.log"
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ds_odc_offload_") as scratch:
        finished = run_launch(cmd, timeout=args.run_timeout, log=log,
                              env=dict(os.environ, TMPDIR=scratch, **shared_gpu_env(args.nproc),
                                       PYTHONPATH=os.pathsep.join(
                                           p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)))
    if finished.returncode != 0 or not report.exists():
        print(f"  {mode} FAILED: the launch {finished.describe(args.run_timeout, '--run-timeout')}; log tail:\n"
              f"{log.read_text()[-2500:]}", flush=True)
        return None
    result = read_report(report)
    print(f"  {mode}: {result['samples_per_s']:.3f} samples/s, peak device {result['peak_device'] / GIB:.1f} GiB, "
          f"host {result['host_peak'] / GIB:.1f} GiB ({time.monotonic() - started:.0f}s wall)", flush=True)
    return result


def shared_gpu_env(nproc: int) -> dict[str, str]:
    """More ranks than GPUs: every rank on GPU 0 (``DS_ODC_SHARED_GPU=1``), which measures memory per rank, not speed
    between ranks."""
    if nproc > 1 and torch.cuda.is_available() and torch.cuda.device_count() < nproc:
        return {"DS_ODC_SHARED_GPU": "1"}
    return {}


def read_report(report: Path) -> dict:
    """One mode's row of the table, from the report its launch wrote (rank 0) and every rank's own peaks."""
    written = json.loads(report.read_text())
    timed = written["offload"]["steps"][1:] or written["offload"]["steps"]  # the first minibatch warms up
    ranks = [json.loads(f.read_text()) for f in sorted(report.parent.glob(f"{report.stem}-rank*.json"))]
    ranks = ranks or [written["offload"]]
    return {"samples_per_s": written["summary"]["samples_per_s"],
            "peak_device": max(r["peak_device"] for r in ranks),  # the largest rank's
            "symmetric": written["offload"]["symmetric"], "device_used": written["offload"]["device_used"],
            "host_peak": max(r["host_peak_bytes"] for r in ranks), "ranks": len(ranks),
            "trainable": written["offload"].get("trainable", 0),
            "step_s": sum(s["step_s"] for s in timed) / len(timed),
            **{phase: sum(s.get(phase, 0.0) for s in timed) / len(timed) for phase in PHASES}}


def print_table(results: dict[str, dict | None], args) -> None:
    layers = f" with {args.num_layers} decoder layers" if args.num_layers else ""
    print(f"\n{args.model}{layers}, {args.nproc} rank(s), optimizer on the host ({args.optimizer}), packed long-tail rows "
          f"(max {max(2, round(args.max_tokens * args.scale))} tokens), {args.steps - 1} timed minibatches")
    head = (f"{'mode':<8}{'samples/s':>11}{'vs stock':>10}{'peak device GiB':>17}{'vs stock':>10}"
            f"{'device used GiB':>17}{'host peak GiB':>15}{'step s':>9}{'copy out s':>12}{'CPU optim s':>13}"
            f"{'copy back s':>13}")
    print(head)
    stock = results.get("stock")
    for mode, r in results.items():
        if r is None:
            print(f"{mode:<8}{'failed':>11}")
            continue
        speed = f"{r['samples_per_s'] / stock['samples_per_s']:.2f}x" if stock else "-"
        memory = f"{r['peak_device'] / stock['peak_device']:.2f}x" if stock and stock["peak_device"] else "-"
        print(f"{mode:<8}{r['samples_per_s']:>11.3f}{speed:>10}{r['peak_device'] / GIB:>17.2f}{memory:>10}"
              f"{r['device_used'] / GIB:>17.2f}{r['host_peak'] / GIB:>15.2f}{r['step_s']:>9.3f}"
              f"{r['copy_out']:>12.3f}{r['optimizer']:>13.3f}{r['copy_back']:>13.3f}")
    odc = results.get("odc")
    if odc and odc["symmetric"]:
        print(f"(odc's peak device memory includes {odc['symmetric'] / GIB:.2f} GiB of symmetric heap: shards and the "
              "fp32 gradient accumulator)")
    if odc and stock and odc["trainable"] and stock["peak_device"]:
        accumulator = 4 * odc["trainable"] / args.nproc
        bound = (stock["peak_device"] + accumulator) * 1.05
        print(f"peak device memory is the largest rank's. ODC's fp32 gradient accumulator: 4/{args.nproc} bytes per "
              f"trainable parameter = {accumulator / GIB:.2f} GiB per rank ({odc['trainable']:,} parameters); "
              f"stock + accumulator = {(stock['peak_device'] + accumulator) / GIB:.2f} GiB; ODC "
              f"{odc['peak_device'] / GIB:.2f} GiB is {odc['peak_device'] / (stock['peak_device'] + accumulator):.3f}x "
              f"of it ({'within' if odc['peak_device'] <= bound else 'ABOVE'} +5%)")
    print("step s: host wall time of the optimizer step per minibatch (ODC's fence and publish included); copy out: "
          "for stock its host time in backward's gradient copies and accumulation (partition_grads and the epilogue "
          "waiting for them), for ODC the step's wait for its copies; all per timed minibatch.")


def main():
    if "--child" in sys.argv:
        i = sys.argv.index("--child")
        child(Path(sys.argv[i + 1]), sys.argv[sys.argv.index("--") + 1:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--num-layers", type=int, default=None,
                   help="the model's width with this many decoder layers (a host with less memory)")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--steps", type=int, default=4, help="minibatches per mode, the first one a warm-up")
    p.add_argument("--max-tokens", type=int, default=65536, help="tokens per packed row (before --scale)")
    p.add_argument("--optimizer", default="cpu-adam", choices=["cpu-adam", "torch"],
                   help="DeepSpeed's CPU Adam (JIT-built on first use) or torch's AdamW, on the host")
    p.add_argument("--modes", default="stock,odc")
    p.add_argument("--scale", type=float, default=1.0, help="scale all lengths (CPU smoke runs with --model tiny)")
    p.add_argument("--out", default="results/offload")
    p.add_argument("--run-timeout", type=float, default=1800)
    p.add_argument("--table-only", action="store_true",
                   help="print the table from the reports already in --out (modes run in separate calls)")
    args = p.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2 (one warm-up, one timed)")
    out = Path(args.out)
    if args.table_only:
        reports = {mode: out / f"{args.model}-{mode}.json" for mode in args.modes.split(",")}
        print_table({m: read_report(r) if r.exists() else None for m, r in reports.items()}, args)
        return
    out.mkdir(parents=True, exist_ok=True)
    lengths = out / "lengths-longtail.txt"
    write_lengths(args.steps, args.nproc, lengths, args.scale)
    print(f"# {' '.join(sys.argv)}", flush=True)
    results = {mode: None for mode in args.modes.split(",")}
    try:
        for mode in results:
            results[mode] = run(mode, args, lengths, out)
    except KeyboardInterrupt:  # Ctrl-C, or a time limit around the call: the table still shows what finished
        print("  interrupted: the launch in progress was stopped with its ranks; what did not finish shows as failed",
              flush=True)
    print_table(results, args)
    failed = [mode for mode, result in results.items() if result is None]
    if failed:
        raise SystemExit(f"offload: {', '.join(failed)} failed or did not run (the messages are above)")


if __name__ == "__main__":
    main()
