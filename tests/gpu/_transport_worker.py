"""One rank of the NVSHMEM transport checks (launched by test_transport_gpu.py through torchrun).

Each check is compared with what NCCL computes on the same data, and its outcome is written to ``rank<N>.json``
as soon as it is known, so a later hang still leaves the earlier verdicts behind.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ds_odc.ops.nvshmem import NvshmemTransport
from ds_odc.ops.transport import FenceTimeout, Segment

PATHS = {  # name -> (force_remote_path, scatter_method)
    "p2p": (False, "atomic"),
    "p2p-staging": (False, "staging"),
    "rma": (True, "atomic"),  # the RMA path always stages
}
# Odd lengths and offsets on purpose: unaligned heads and tails, one-element parameters, several blocks.
LENGTHS = [1, 7, 4099, (1 << 20) + 3]


def layout(lengths, gap=5):
    segments, offset = [], 3
    for n in lengths:
        segments.append(Segment(offset, n))
        offset += n + gap
    return segments, offset


class Report:
    def __init__(self, out: str, rank: int):
        self.path = Path(out) / f"rank{rank}.json"
        self.results = {}

    def record(self, name, ok, detail=""):
        self.results[name] = {"ok": bool(ok), "detail": str(detail)[-3000:]}
        self.path.write_text(json.dumps(self.results, indent=1))

    def run(self, name, fn):
        try:
            detail = fn()
            self.record(name, True, detail or "")
        except Exception:
            self.record(name, False, traceback.format_exc())


def integer_data(n, source, round_, dtype, device):
    """Small integers, identical on every rank for a given (source, round): sums of them are exact in fp32."""
    gen = torch.Generator(device=device)
    gen.manual_seed(1000 * source + round_ + 1)
    return torch.randint(-8, 9, (n,), generator=gen, device=device).to(dtype)


def check_gather(t, rank, world, dtype, lengths=LENGTHS):
    segments, total = layout(lengths)
    buf = t.allocate(total, dtype)
    gen = torch.Generator(device="cuda").manual_seed(rank + 7)
    buf.local.copy_(torch.randn(total, generator=gen, device="cuda").to(dtype))
    t.barrier()
    plan = t.plan_gather(buf, segments)
    flat = torch.full((plan.out_numel,), float("nan"), dtype=dtype, device="cuda")
    t.gather(plan, flat)
    for seg, offset in zip(segments, plan.out_offsets):
        out = flat.narrow(0, offset, world * seg.length)
        ref = torch.empty_like(out)
        dist.all_gather_into_tensor(ref, buf.local.narrow(0, seg.offset, seg.length).contiguous())
        bits = torch.int16 if dtype.itemsize == 2 else torch.int32
        if not torch.equal(out.view(bits), ref.view(bits)):
            bad = (out.view(bits) != ref.view(bits)).nonzero()[:5].flatten().tolist()
            raise AssertionError(f"gather of {seg} differs from all_gather at {bad}")
    return f"{len(segments)} segments, {dtype}"


def check_scatter_vs_reduce_scatter(t, acc, rank, world, in_dtype):
    segments = acc.segments
    scale = 1.0 / world
    ref = torch.zeros_like(acc.local)
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    for _microbatch in range(2):
        inputs = []
        for i, seg in enumerate(segments):
            n = world * seg.length - (5 if i == len(segments) - 1 and seg.length > 5 else 0)  # padding of last rank
            inputs.append(torch.randn(n, generator=gen, device="cuda").to(in_dtype))
        t.scatter_accumulate(t.plan_scatter(acc, segments, [x.numel() for x in inputs]), inputs, scale=scale)
        for seg, inp in zip(segments, inputs):
            padded = torch.zeros(world * seg.length, dtype=torch.float32, device="cuda")
            padded[:inp.numel()] = inp.float()
            mine = torch.empty(seg.length, dtype=torch.float32, device="cuda")
            dist.reduce_scatter_tensor(mine, padded)
            ref.narrow(0, seg.offset, seg.length).add_(mine, alpha=scale)
    torch.cuda.synchronize()
    t.fence([acc])
    err = ((acc.local - ref).norm() / ref.norm()).item()
    worst = ((acc.local - ref).abs().max() / ref.abs().max()).item()
    t.zero_([acc])
    t.barrier()
    if not (err <= 1e-6 and worst <= 1e-6):
        raise AssertionError(f"relative error {err:.3g} (norm), {worst:.3g} (max) > 1e-6")
    return f"rel err {err:.3g}, max {worst:.3g}"


def check_exact_rounds(t, acc, rank, world, rounds_by_rank, in_dtype=torch.bfloat16):
    """Every rank pushes integer data into every other at once, ``rounds_by_rank[r]`` times; the sum must be exact."""
    segments = acc.segments
    for k in range(rounds_by_rank[rank]):
        inputs = [integer_data(world * s.length, rank, k * 31 + i, in_dtype, "cuda") for i, s in enumerate(segments)]
        t.scatter_accumulate(t.plan_scatter(acc, segments, [x.numel() for x in inputs]), inputs, scale=1.0)
    t.fence([acc])
    expected = torch.zeros_like(acc.local)
    for src in range(world):
        for k in range(rounds_by_rank[src]):
            for i, s in enumerate(segments):
                data = integer_data(world * s.length, src, k * 31 + i, in_dtype, "cuda").float()
                expected.narrow(0, s.offset, s.length).add_(data.narrow(0, rank * s.length, s.length))
    ok = torch.equal(acc.local, expected)
    bad = (acc.local != expected).sum().item()
    t.zero_([acc])
    t.barrier()
    if not ok:
        raise AssertionError(f"{bad} elements differ from the exact sum")
    return f"rounds {rounds_by_rank}, exact"


def on_side_stream(fn):
    """Run ``fn`` on a non-default stream, as DeepSpeed's prefetch and reduce streams do."""
    def run():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            detail = fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        return detail
    return run


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", choices=["main", "fence-timeout"], required=True)
    parser.add_argument("--path", choices=sorted(PATHS), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:  # started by mpirun: take torch.distributed's ranks from MPI's variables
        for ours, theirs in (("RANK", ("OMPI_COMM_WORLD_RANK", "PMI_RANK")),
                             ("WORLD_SIZE", ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")),
                             ("LOCAL_RANK", ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_RANK"))):
            os.environ.setdefault(ours, next(os.environ[k] for k in theirs if k in os.environ))
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=timedelta(seconds=60), device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    report = Report(args.out, rank)
    remote, method = PATHS[args.path]
    timeout_s = 6.0 if args.scenario == "fence-timeout" else 60.0
    t = NvshmemTransport(None, timeout_s, force_remote_path=remote, scatter_method=method)

    if args.scenario == "fence-timeout":
        acc = t.allocate(1024, torch.float32, accumulator=True)
        t.scatter_accumulate(t.plan_scatter(acc, [Segment(0, 512)], [1024]), [torch.ones(1024, device="cuda")])
        if rank == world - 1:
            report.record("skipped_fence", True)
            time.sleep(timeout_s + 10)  # stay alive, so the others see a missing rank rather than a dead socket
        else:
            start = time.monotonic()
            try:
                t.fence([acc])
                report.record("fence_timeout", False, "fence returned although a rank never arrived")
            except FenceTimeout as err:
                elapsed = time.monotonic() - start
                ok = err.missing_ranks == [world - 1] and elapsed < timeout_s + 10
                report.record("fence_timeout", ok, f"missing={err.missing_ranks} after {elapsed:.1f} s: {err}")
        os._exit(0)  # the job is deliberately broken: skip collective teardown

    report.record("path", True, f"remote={t.remote} method={t.scatter_method}")
    from ds_odc.ops import nvshmem_runtime
    report.run("gather_bf16_bitwise", lambda: check_gather(t, rank, world, torch.bfloat16))  # brings NVSHMEM up
    report.record("bootstrap", True, nvshmem_runtime._RUNTIME.bootstrap)
    if t.remote != remote:
        report.record("path", False, f"asked remote={remote}, got remote={t.remote}")
    report.run("gather_fp32_bitwise", lambda: check_gather(t, rank, world, torch.float32))
    many = [int(x) for x in torch.randint(1, 300, (300,), generator=torch.Generator().manual_seed(5))]
    report.run("gather_bucket_side_stream", on_side_stream(lambda: check_gather(t, rank, world, torch.bfloat16, many)))
    segments, total = layout(LENGTHS)
    acc = t.allocate(total, torch.float32, accumulator=True)
    acc.segments = segments
    report.run("scatter_fp32_vs_reduce_scatter", lambda: check_scatter_vs_reduce_scatter(t, acc, rank, world,
                                                                                        torch.float32))
    report.run("scatter_bf16_vs_reduce_scatter", lambda: check_scatter_vs_reduce_scatter(t, acc, rank, world,
                                                                                        torch.bfloat16))
    report.run("mutual_100_rounds_exact", lambda: check_exact_rounds(t, acc, rank, world, [100] * world))
    report.run("uneven_rounds_exact", lambda: check_exact_rounds(t, acc, rank, world, [3] + [0] * (world - 1)))
    # More tasks than one kernel launch carries (300 parameters x W owners), on a side stream.
    bucket_segments, bucket_total = layout(many)
    bucket = t.allocate(bucket_total, torch.float32, accumulator=True)
    bucket.segments = bucket_segments
    report.run("bucket_300_params_exact", on_side_stream(lambda: check_exact_rounds(t, bucket, rank, world,
                                                                                    [3, 2] + [1] * (world - 2))))
    t.close()
    report.record("closed", True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
