"""Can one GPU stand in for several? A probe of SM partitions, one process (one NVSHMEM PE) per partition.

    python benchmarks/partitions.py --out results/partitions

Ranks of a job that share one GPU with all its SMs lend each other the GPU whenever one waits, so imbalance between
them costs nothing and nothing about speed between ranks can be measured. Confined to a share of the SMs, a rank
that finishes early leaves its SMs idle, as a separate GPU would. Two ways to confine a process are tried:

* CUDA MPS: a user-space daemon (``nvidia-cuda-mps-control -d``, its pipe and log folders in a temporary folder,
  stopped at the end) and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` = 100/N in each of N processes; no GPU setting
  changes (compute mode, clocks, MIG stay as they are).
* CUDA green contexts (``torch.cuda.green_contexts``): each process makes its work current on a green context of
  1/N of the SMs. Processes without MPS share the GPU by time slices, so this shows whether they still run at once.

Each configuration runs N processes (torchrun, gloo between them, every process on GPU 0) through phases separated by
barriers: rank 0 alone while the others idle, then every rank busy at once, for a bf16 matrix product (8192^3,
repeated for ~1.5 s) and for training steps of a Qwen2.5-1.5B-shaped model (random weights, bf16, one 8192-token
row, forward and backward, activation checkpointing). A partition that works runs rank 0 at about 1/N of the whole
GPU's rate alone *and* with the others busy (an idle rank lends it nothing). With MPS the ranks also bring up ODC's
NVSHMEM transport (peer-pointer path) and check a gather, a scatter-accumulate and the fence against exact sums.

What partitions do not model: memory bandwidth, L2 and the copy engines stay shared, and one-sided traffic between
partitions stays on the device instead of crossing NVLink.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ds_odc.training.launch import run_launch  # noqa: E402

NO_MULTICAST = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


# -- one process of a configuration -----------------------------------------------------------------------------------
def _timed(fn, seconds: float) -> tuple[float, int]:
    """Run ``fn`` repeatedly for about ``seconds`` (after one warm-up); returns (seconds per call, calls)."""
    import torch
    fn()
    torch.cuda.synchronize()
    calls, started = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        if calls % 2 == 0:
            torch.cuda.synchronize()
            if time.perf_counter() - started >= seconds:
                break
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / calls, calls


class _Clocks:
    """Samples the GPU's SM clock and power draw (nvidia-smi, every 0.25 s) while a phase runs: a partition alone may
    run at a higher clock than with its neighbours busy (the power budget is the whole GPU's)."""

    def __init__(self):
        import threading
        self.samples, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                line = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
                                      capture_output=True, text=True, timeout=5).stdout.strip().splitlines()[0]
                clock, power = (float(x) for x in line.split(","))
                self.samples.append((clock, power))
            except Exception:  # noqa: BLE001 - no nvidia-smi, or a value it could not read
                pass
            self._stop.wait(0.25)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {}
        clocks, powers = sorted(c for c, _ in self.samples), sorted(p for _, p in self.samples)
        return {"sm_mhz": clocks[len(clocks) // 2], "power_w": powers[len(powers) // 2]}


def _worker(args) -> None:
    import torch
    import torch.distributed as dist

    from ds_odc.training.distributed import init_distributed
    init_distributed(timeout_s=600, shared_gpu=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(0)
    out = {"rank": rank, "world": world, "mps_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
           "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    green = None
    if args.green_sms:
        try:
            from torch.cuda import green_contexts
            out["green_api"] = sorted(n for n in dir(green_contexts.GreenContext) if not n.startswith("__"))
            try:
                green = green_contexts.GreenContext.create(num_sms=args.green_sms, device_id=0)
            except TypeError:
                green = green_contexts.GreenContext.create(args.green_sms, 0)
            if hasattr(green, "set_context"):
                green.set_context()
                out["green"] = f"set_context, {args.green_sms} SMs (this thread)"
            else:
                stream = green.Stream()
                torch.cuda.set_stream(stream)
                out["green"] = f"Stream(), {args.green_sms} SMs"
        except Exception as err:  # noqa: BLE001 - the probe reports what failed
            out["green_error"] = f"{type(err).__name__}: {err}"

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    flops = 2 * 8192 ** 3

    def matmul():
        torch.mm(a, b)

    def phase(name, fn, seconds, alone):
        dist.barrier()
        if not alone or rank == 0:
            with (_Clocks() if rank == 0 else contextlib.nullcontext()) as clocks:
                per_call, calls = _timed(fn, seconds)
            out[name] = per_call
            if clocks is not None:
                out[name.replace("_s", "_clock")] = clocks.summary()
        dist.barrier()

    phase("matmul_alone_s", matmul, 1.5, alone=True)
    phase("matmul_busy_s", matmul, 1.5, alone=False)
    out["matmul_alone_tflops"] = flops / out["matmul_alone_s"] / 1e12 if rank == 0 else None
    out["matmul_busy_tflops"] = flops / out["matmul_busy_s"] / 1e12
    del a, b

    if args.train:
        from transformers import Qwen2Config, Qwen2ForCausalLM
        config = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                             num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                             max_position_embeddings=32768, attn_implementation="sdpa")
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = Qwen2ForCausalLM(config).to(torch.bfloat16)
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
        ids = torch.randint(0, 151936, (1, args.tokens), device="cuda")

        def train_step():
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        phase("train_alone_s", train_step, 4.0, alone=True)
        phase("train_busy_s", train_step, 4.0, alone=False)
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        del model

    if args.nvshmem:
        try:
            out["nvshmem"] = _nvshmem_check()
        except Exception as err:  # noqa: BLE001
            out["nvshmem"] = f"FAILED {type(err).__name__}: {err}"[:800]
    dist.barrier()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(out, indent=1))
    if green is not None and hasattr(green, "pop_context"):
        with contextlib.suppress(Exception):
            green.pop_context()
    from ds_odc.training.distributed import shutdown_and_exit
    shutdown_and_exit()


def _nvshmem_check() -> str:
    """ODC's transport between the partitions: a gather of every rank's shard and a scatter-accumulate of every
    rank's contribution, against exact integer-valued sums."""
    import torch
    import torch.distributed as dist

    from ds_odc.ops.nvshmem import NvshmemTransport
    from ds_odc.ops.transport import Segment
    rank, world = dist.get_rank(), dist.get_world_size()
    started = time.perf_counter()
    transport = NvshmemTransport(timeout_s=120)
    n = 1 << 20
    shards = transport.allocate(n, torch.float32)
    acc = transport.allocate(n, torch.float32, accumulator=True)
    shards.local.copy_(torch.arange(n, device="cuda", dtype=torch.float32) + rank * n)
    transport.barrier("after writing shards")
    plan = transport.plan_gather(shards, [Segment(0, n)])
    full = torch.empty(plan.out_numel, device="cuda", dtype=torch.float32)
    transport.gather(plan, full)
    torch.cuda.synchronize()
    gather_ok = bool(torch.equal(full, torch.arange(world * n, device="cuda", dtype=torch.float32)))
    push = transport.plan_scatter(acc, [Segment(0, n)], [world * n])
    grad = torch.full((world * n,), float(rank + 1), device="cuda")
    transport.scatter_accumulate(push, [grad])
    transport.fence([acc])
    scatter_ok = bool(torch.all(acc.local == world * (world + 1) / 2).item())
    transport.close()
    return (f"{transport.path if hasattr(transport, 'path') else 'up'}: gather {'ok' if gather_ok else 'WRONG'}, "
            f"scatter-accumulate {'ok' if scatter_ok else 'WRONG'}, {time.perf_counter() - started:.1f} s")


# -- the configurations -----------------------------------------------------------------------------------------------
def mps_control() -> str | None:
    """The MPS control program, if this machine has one."""
    found = shutil.which("nvidia-cuda-mps-control")
    for folder in ("/usr/local/nvidia/bin", "/usr/bin", "/usr/local/cuda/bin"):
        candidate = Path(folder) / "nvidia-cuda-mps-control"
        if found is None and candidate.exists():
            found = str(candidate)
    return found


@contextlib.contextmanager
def mps_daemon(control: str):
    """An MPS control daemon of this user, its pipe and log folders in a temporary folder; yields the environment
    its clients need, and stops it (``quit``) on the way out, also after an error."""
    folder = Path(tempfile.mkdtemp(prefix="ds_odc_mps_"))
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(folder / "log")}
    for path in env.values():
        Path(path).mkdir()
    started = subprocess.run([control, "-d"], env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    try:
        if started.returncode != 0:
            raise RuntimeError(f"{control} -d failed ({started.returncode}): {started.stderr or started.stdout}")
        yield env
    finally:
        subprocess.run([control], input="quit\n", env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=60)
        time.sleep(1)
        logs = "".join(p.read_text(errors="replace")[-2000:] for p in (folder / "log").glob("*.log"))
        (Path(os.environ.get("PARTITIONS_OUT", folder)) / "mps-logs.txt").write_text(logs)
        shutil.rmtree(folder, ignore_errors=True)


def run_config(name: str, nproc: int, out: Path, env: dict, extra: list[str], timeout: float) -> dict:
    folder = out / name
    shutil.rmtree(folder, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__,
           "--worker", "--out", str(folder), *extra]
    started = time.perf_counter()
    finished = run_launch(cmd, env={**os.environ, **NO_MULTICAST, **env}, timeout=timeout)
    log = finished.output[-9000:] + ("" if finished.returncode == 0 else f"\nthe launch {finished.describe(timeout)}")
    rc = -9 if finished.timed_out else finished.returncode
    (out / f"{name}.log").write_text(log)
    ranks = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
    return {"name": name, "nproc": nproc, "rc": rc, "seconds": time.perf_counter() - started, "ranks": ranks,
            "log_tail": log[-1500:] if rc else ""}


def table(results: list[dict]) -> str:
    full = next((r for r in results if r["name"] == "whole-gpu" and r["ranks"]), None)
    base_mm = full["ranks"][0]["matmul_alone_tflops"] if full else None
    base_tr = full["ranks"][0].get("train_alone_s") if full else None
    lines = ["| configuration | ranks | matmul alone TFLOP/s (x whole) | matmul all busy, per rank (x whole) | "
             "train step alone s (x whole rate) | train all busy s, per rank (x whole rate) | NVSHMEM |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if not r["ranks"]:
            lines.append(f"| {r['name']} | {r['nproc']} | failed rc={r['rc']} | | | | |")
            continue
        r0 = r["ranks"][0]
        busy = [x["matmul_busy_tflops"] for x in r["ranks"]]
        def rate(x, base):
            return f"{x:.1f} ({x / base:.2f})" if base else f"{x:.1f}"
        tr_alone = r0.get("train_alone_s")
        tr_busy = [x.get("train_busy_s") for x in r["ranks"] if x.get("train_busy_s")]
        tr_a = f"{tr_alone:.3f} ({base_tr / tr_alone:.2f})" if tr_alone and base_tr else "-"
        tr_b = ("/".join(f"{t:.3f}" for t in tr_busy) + (f" ({base_tr / max(tr_busy):.2f}-{base_tr / min(tr_busy):.2f})"
                                                         if base_tr else "")) if tr_busy else "-"
        nv = "; ".join(sorted({str(x.get("nvshmem", "-")) for x in r["ranks"]}))
        lines.append(f"| {r['name']} | {r['nproc']} | {rate(r0['matmul_alone_tflops'], base_mm)} | "
                     f"{'/'.join(f'{x:.0f}' for x in busy)} ({min(busy) / base_mm:.2f}-{max(busy) / base_mm:.2f}) | "
                     f"{tr_a} | {tr_b} | {nv} |" if base_mm else f"| {r['name']} | {busy} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/partitions")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--green-sms", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nvshmem", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-train", action="store_true", help="matrix products only (no training steps)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens of the training row")
    p.add_argument("--counts", default="2,4", help="partition counts to try")
    p.add_argument("--skip", default="", help="comma-separated configurations to leave out (green, mps)")
    p.add_argument("--timeout", type=float, default=400)
    args = p.parse_args()
    if args.worker:
        return _worker(args)

    import torch
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["PARTITIONS_OUT"] = str(out.resolve())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    control = mps_control()
    env_report = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "sms": sms,
                  "mps_control": control, "green_contexts": hasattr(torch.cuda, "green_contexts")}
    print("environment:", json.dumps(env_report), flush=True)
    train = [] if args.no_train else ["--train", "--tokens", str(args.tokens)]
    results = [run_config("whole-gpu", 1, out, {}, train, args.timeout)]
    counts = [int(c) for c in args.counts.split(",")]
    skip = set(args.skip.split(","))
    if "green" not in skip:
        results.append(run_config("green-2", 2, out, {}, ["--green-sms", str(sms // 2)], args.timeout))
    if "mps" not in skip:
        if control is None:
            results.append({"name": "mps", "nproc": 0, "rc": "no nvidia-cuda-mps-control on this machine",
                            "ranks": [], "seconds": 0})
        else:
            try:
                with mps_daemon(control) as env:
                    for n in counts:
                        pct = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(100 // n)}
                        results.append(run_config(f"mps-{n}", n, out, {**env, **pct}, train + ["--nvshmem"],
                                                  args.timeout))
            except Exception as err:  # noqa: BLE001
                results.append({"name": "mps", "nproc": 0, "rc": f"{type(err).__name__}: {err}", "ranks": [],
                                "seconds": 0})
    (out / "partitions.json").write_text(json.dumps({"environment": env_report, "results": results}, indent=1))
    for r in results:
        print(f"{r['name']}: rc={r['rc']} {r['seconds']:.0f} s" + (f"\n{r.get('log_tail', '')}" if r["rc"] else ""))
    print(table(results))
    for r in results:  # rank 0's SM clock and the GPU's power in each phase
        if r["ranks"]:
            clocks = {k: v for k, v in r["ranks"][0].items() if k.endswith("_clock") and v}
            print(f"{r['name']} clocks (rank 0's phases): " + "; ".join(
                f"{k[:-6]} {v['sm_mhz']:.0f} MHz {v['power_w']:.0f} W" for k, v in clocks.items()))


if __name__ == "__main__":
    main()
