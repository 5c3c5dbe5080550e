"""ODC primitives against NCCL on the GPUs of one host.

    torchrun --nproc_per_node 2 benchmarks/primitives.py [--sizes-mib 1,4,16,64,128,256,1024] [--out FILE.md]

For each per-rank shard size (bf16 parameters, fp32 accumulation):

* gather of one parameter's full tensor: ODC peer-pointer path, ODC RMA path, NCCL ``all_gather_into_tensor``;
* scatter-accumulate of a full bf16 gradient into the owners' fp32 accumulators: ODC atomic (vector and scalar
  fp32 reductions), ODC staging (single-writer slots), ODC RMA path, and NCCL ``reduce_scatter_tensor`` + the local
  add it implies, in bf16 and in fp32 (DeepSpeed's ``communication_data_type``).

Every rank runs the operation at the same time. Warm-up runs are excluded; each timed run starts aligned (device sync
+ barrier) and is timed with CUDA events; a rank's time is the median over repeats, and the reported time is the
slower rank's. GB/s = bf16 bytes each rank exchanges = (W-1) x shard bytes / time, which is NCCL's bus bandwidth
for the bf16 collectives, so ratios compare like with like. Also reported: host vs GPU time of one call covering a
bucket of many small parameters (what a ZeRO-3 prefetch bucket looks like).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist

from ds_odc.ops.nvshmem import NvshmemTransport
from ds_odc.ops.transport import Segment

MiB = 1 << 20


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", default="1,4,16,64,128,256,1024", help="per-rank bf16 shard sizes")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None, help="write the tables (markdown) and raw numbers (.json) here")
    p.add_argument("--memory-only", action="store_true", help="only report what the symmetric heap costs")
    return p.parse_args()


class Timer:
    def __init__(self, gloo):
        self.gloo = gloo

    def __call__(self, fn, reps, warmup) -> float:
        """Median milliseconds of ``fn`` on this rank, max over ranks."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            dist.barrier(group=self.gloo)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        mine = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.gloo)
        return mine.item()


def main():
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    timer = Timer(gloo)
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    n_max = max(sizes) * MiB // 2  # bf16 elements per rank
    dev = torch.device("cuda", local_rank)
    scale = 1.0 / world

    def used():
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free

    # Memory: what NVSHMEM's bring-up costs, then what each allocation costs beyond its own bytes.
    base = used()
    fast = NvshmemTransport(None, 120.0, scatter_method="atomic")
    tiny = fast.allocate(1, torch.bfloat16)  # brings NVSHMEM up
    after_init = used()
    staged = NvshmemTransport(None, 120.0, scatter_method="staging")
    remote = NvshmemTransport(None, 120.0, force_remote_path=True)
    params = {"fast": fast.allocate(n_max, torch.bfloat16), "remote": remote.allocate(n_max, torch.bfloat16)}
    accs = {"fast": fast.allocate(n_max, torch.float32, accumulator=True),
            "staged": staged.allocate(n_max, torch.float32, accumulator=True),
            "remote": remote.allocate(n_max, torch.float32, accumulator=True)}
    after_all = used()
    sym = fast.symmetric_bytes + staged.symmetric_bytes + remote.symmetric_bytes
    env = {k: os.environ[k] for k in ("NVSHMEM_SYMMETRIC_SIZE", "NVSHMEM_CUMEM_GRANULARITY") if k in os.environ}
    heap_note = (f"NVSHMEM bring-up took {(after_init - base) / MiB:.0f} MiB of GPU memory; then {sym / MiB:.0f} MiB "
                 f"of symmetric buffers took {(after_all - base) / MiB:.0f} MiB in all (overhead "
                 f"{(after_all - base - sym) / MiB:+.0f} MiB; env {env})")
    if args.memory_only:
        if rank == 0:
            print(heap_note, flush=True)
        for t in (remote, staged, fast):
            t.close()
        dist.destroy_process_group()
        return

    gen = torch.Generator(device=dev).manual_seed(rank)
    for p in params.values():
        p.local.copy_(torch.randn(n_max, generator=gen, device=dev).to(torch.bfloat16))
    grads = torch.randn(world * n_max, generator=gen, device=dev).to(torch.bfloat16)
    grads32 = grads.float()
    out = torch.empty(world * n_max, dtype=torch.bfloat16, device=dev)
    rs16 = torch.empty(n_max, dtype=torch.bfloat16, device=dev)
    rs32 = torch.empty(n_max, dtype=torch.float32, device=dev)
    acc_ref = torch.zeros(n_max, dtype=torch.float32, device=dev)
    fast.barrier(), staged.barrier(), remote.barrier()

    rows = []
    for size in sizes:
        n = size * MiB // 2
        seg = [Segment(0, n)]
        o, g, g32 = out[:world * n], grads[:world * n], grads32[:world * n]
        reps = args.reps if size <= 256 else max(5, args.reps // 3)

        def nccl_rs(src, dst):
            dist.reduce_scatter_tensor(dst[:n], src)
            acc_ref[:n].add_(dst[:n], alpha=scale)

        def scatter_with(transport, acc, method=None):
            plan = transport.plan_scatter(acc, seg, [g.numel()])

            def push():
                if method:  # the two atomic variants share one transport and accumulator
                    transport.scatter_method = method
                transport.scatter_accumulate(plan, [g], scale=scale)
            return push

        fast_read, remote_read = fast.plan_gather(params["fast"], seg), remote.plan_gather(params["remote"], seg)

        ops = {
            ("gather", "nccl all_gather"): lambda: dist.all_gather_into_tensor(o, params["fast"].local[:n]),
            ("gather", "odc p2p (copy engine)"): lambda: fast.gather(fast_read, o),
            ("gather", "odc rma (getmem_on_stream)"): lambda: remote.gather(remote_read, o),
            ("scatter", "nccl reduce_scatter bf16 + add"): lambda: nccl_rs(g, rs16),
            ("scatter", "nccl reduce_scatter fp32 + add"): lambda: nccl_rs(g32, rs32),
            ("scatter", "odc p2p atomic v4 (red.v4.f32)"): scatter_with(fast, accs["fast"], "atomic"),
            ("scatter", "odc p2p atomic scalar"): scatter_with(fast, accs["fast"], "atomic-scalar"),
            ("scatter", "odc p2p staging (RMW slots)"): scatter_with(staged, accs["staged"]),
            ("scatter", "odc rma staging (get+add+put)"): scatter_with(remote, accs["remote"]),
        }
        for (kind, name), fn in ops.items():
            ms = timer(fn, reps, args.warmup)
            gbps = (world - 1) * n * 2 / (ms * 1e-3) / 1e9
            rows.append({"kind": kind, "name": name, "size_mib": size, "ms": ms, "gbps": gbps})
        fast.scatter_method = "atomic"
        for t, a in ((fast, accs["fast"]), (staged, accs["staged"]), (remote, accs["remote"])):
            t.fence([a])  # includes the owner-side drain of staging slots
            t.zero_([a])  # keep the accumulators' values bounded between sizes
            t.barrier()
        acc_ref.zero_()

    # Host cost of one call over a bucket of many small parameters (ZeRO-3 prefetch bucket shape).
    host_rows = []
    nseg, seg_len = 64, 64 * 1024  # 64 parameters x 128 KiB bf16 shards = 8 MiB per rank
    segs = [Segment(i * seg_len, seg_len) for i in range(nseg)]
    bucket_reads = {"fast": fast.plan_gather(params["fast"], segs), "remote": remote.plan_gather(params["remote"], segs)}
    outs = torch.empty(bucket_reads["fast"].out_numel, dtype=torch.bfloat16, device=dev)
    gins = [grads[:world * seg_len] for _ in range(nseg)]
    bucket_pushes = {"fast": fast.plan_scatter(accs["fast"], segs, [g.numel() for g in gins]),
                     "remote": remote.plan_scatter(accs["remote"], segs, [g.numel() for g in gins])}
    bucket_out = torch.empty(world * nseg * seg_len, dtype=torch.bfloat16, device=dev)
    host_ops = {
        "nccl all_gather (one coalesced 8 MiB bucket)":
            lambda: dist.all_gather_into_tensor(bucket_out, params["fast"].local[:nseg * seg_len]),
        "odc gather p2p, 64 params": lambda: fast.gather(bucket_reads["fast"], outs),
        "odc gather rma, 64 params": lambda: remote.gather(bucket_reads["remote"], outs),
        "odc scatter p2p atomic, 64 params": lambda: fast.scatter_accumulate(bucket_pushes["fast"], gins, scale=scale),
        "odc scatter rma, 64 params": lambda: remote.scatter_accumulate(bucket_pushes["remote"], gins, scale=scale),
    }
    for name, fn in host_ops.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        host, gpu = [], []
        for _ in range(20):
            torch.cuda.synchronize()
            dist.barrier(group=gloo)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e3)
            end.record()
            end.synchronize()
            gpu.append(start.elapsed_time(end))
        host_rows.append({"name": name, "host_ms": statistics.median(host), "gpu_ms": statistics.median(gpu)})

    if rank == 0:
        report(rows, host_rows, heap_note, world, args)
    for t in (remote, staged, fast):
        t.close()
    dist.destroy_process_group()


def report(rows, host_rows, heap_note, world, args):
    gpu = torch.cuda.get_device_name()
    command = "torchrun --nproc_per_node %d benchmarks/primitives.py %s" % (world, shlex.join(sys.argv[1:]))
    lines = [f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {world}x {gpu}, torch {torch.__version__}, "
             f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}.", "", f"Command: `{command}`", "",
             f"Memory: {heap_note}.", ""]
    sizes = sorted({r["size_mib"] for r in rows})
    for kind, base in (("gather", "nccl all_gather"), ("scatter", "nccl reduce_scatter bf16 + add")):
        names = list(dict.fromkeys(r["name"] for r in rows if r["kind"] == kind))
        lines += [f"**{kind}** (GB/s per rank; ratio to `{base}`)", "",
                  "| method | " + " | ".join(f"{s} MiB" for s in sizes) + " |",
                  "|---|" + "---|" * len(sizes)]
        for name in names:
            cells = []
            for s in sizes:
                r = next(x for x in rows if x["kind"] == kind and x["name"] == name and x["size_mib"] == s)
                b = next(x for x in rows if x["kind"] == kind and x["name"] == base and x["size_mib"] == s)
                cells.append(f"{r['gbps']:.0f} ({b['ms'] / r['ms']:.2f}x)")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["**host vs GPU time of one call** (median ms)", "", "| call | host | GPU |", "|---|---|---|"]
    lines += [f"| {r['name']} | {r['host_ms']:.3f} | {r['gpu_ms']:.3f} |" for r in host_rows]
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({"rows": rows, "host": host_rows, "command": command, "memory": heap_note}, f, indent=1)


if __name__ == "__main__":
    main()
