"""One rank of the NVSHMEM transport checks (launched by test_transport_gpu.py through torchrun).

Each check is compared with what torch.distributed computes on the same data (NCCL with one GPU per rank, gloo when
the ranks share a GPU), or with an exact or float64 sum, and its outcome is written to ``rank<N>.json`` as soon as it
is known, so a later hang still leaves the earlier verdicts behind. One launch runs every requested path, each on
its own transport (NVSHMEM comes up once), so the paths can also be compared with each other.
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
from ds_odc.training.distributed import shared_gpu_mode

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


def random_pushes(t, acc, rank, world, rounds, in_dtype, seed, delays=None):
    """``rounds`` pushes of normal data from this rank into every owner (the same data for the same seed); with
    ``delays``, this rank sleeps ``delays[k]`` seconds before push ``k`` (so arrival orders differ between runs)."""
    segments = acc.segments
    for k in range(rounds):
        if delays is not None:
            time.sleep(delays[k])
        gen = torch.Generator(device="cuda").manual_seed(seed * 7919 + rank * 131 + k)
        inputs = [torch.randn(world * s.length, generator=gen, device="cuda").to(in_dtype) for s in segments]
        t.scatter_accumulate(t.plan_scatter(acc, segments, [x.numel() for x in inputs]), inputs, scale=0.5)
    t.fence([acc])
    result = acc.local.clone()
    t.zero_([acc])
    t.barrier()
    return result


def check_contention_vs_fp64(t, rank, world, in_dtype, rounds=40):
    """Every rank pushes ``rounds`` times into one owner (rank 0) at once; the sum must match float64."""
    n = 3 * 4099 + 17
    acc = t.allocate(n + 8, torch.float32, accumulator=True)
    segment = [Segment(8, n)]
    for k in range(rounds):
        gen = torch.Generator(device="cuda").manual_seed(55_000 + 97 * rank + k)
        data = torch.randn(n, generator=gen, device="cuda").to(in_dtype)  # n elements: only owner 0 gets any
        t.scatter_accumulate(t.plan_scatter(acc, segment, [n]), [data])
    t.fence([acc])
    detail = "owner 0 receives nothing to check" if rank else ""
    if rank == 0:
        exact = torch.zeros(n, dtype=torch.float64, device="cuda")
        for src in range(world):
            for k in range(rounds):
                gen = torch.Generator(device="cuda").manual_seed(55_000 + 97 * src + k)
                exact += torch.randn(n, generator=gen, device="cuda").to(in_dtype).double()
        got = acc.local.narrow(0, 8, n).double()
        err = ((got - exact).norm() / exact.norm()).item()
        untouched = acc.local[:8].abs().max().item()
        if not (err <= 1e-6 and untouched == 0):
            raise AssertionError(f"{world} PEs x {rounds} rounds into one owner: rel err {err:.3g} vs float64 "
                                 f"(<= 1e-6), bytes before the segment {untouched}")
        detail = f"{world} PEs x {rounds} rounds, {in_dtype}: rel err {err:.3g} vs float64"
    t.zero_([acc])
    t.barrier()
    return detail


def check_deterministic_repeat(t, acc, rank, world):
    """The same pushes twice, arriving in different orders (random per-rank delays): bit-identical sums."""
    first = random_pushes(t, acc, rank, world, 6, torch.float32, seed=3,
                          delays=[0.02 * ((rank + k) % world) for k in range(6)])
    second = random_pushes(t, acc, rank, world, 6, torch.float32, seed=3,
                           delays=[0.02 * ((world - rank + 2 * k) % world) for k in range(6)])
    if not torch.equal(first.view(torch.int32), second.view(torch.int32)):
        bad = (first != second).sum().item()
        raise AssertionError(f"{bad} elements differ between two runs of the same pushes")
    return "two arrival orders, bit-identical"


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


def init(args):
    """torch.distributed and this rank's GPU: NCCL with one GPU per rank, gloo when the ranks share one."""
    if "LOCAL_RANK" not in os.environ:  # started by mpirun: take torch.distributed's ranks from MPI's variables
        for ours, theirs in (("RANK", ("OMPI_COMM_WORLD_RANK", "PMI_RANK")),
                             ("WORLD_SIZE", ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")),
                             ("LOCAL_RANK", ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_RANK"))):
            os.environ.setdefault(ours, next(os.environ[k] for k in theirs if k in os.environ))
    if shared_gpu_mode():
        torch.cuda.set_device(0)
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    else:
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=timedelta(seconds=60), device_id=torch.device("cuda", local_rank))


def fence_timeout(args, report, rank, world):
    remote, method = PATHS[args.paths[0]]
    timeout_s = 6.0
    t = NvshmemTransport(None, timeout_s, force_remote_path=remote, scatter_method=method)
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


def run_path(name, report, rank, world, sums):
    """Every check of one path, on a transport of its own; ``sums`` collects each path's result of the same pushes."""
    remote, method = PATHS[name]
    t = NvshmemTransport(None, 60.0, force_remote_path=remote, scatter_method=method)
    check = lambda label, fn: report.run(f"{name}/{label}", fn)  # noqa: E731
    report.record(f"{name}/path", True, f"remote={t.remote} method={t.scatter_method}")
    from ds_odc.ops import nvshmem_runtime
    check("gather_bf16_bitwise", lambda: check_gather(t, rank, world, torch.bfloat16))  # brings NVSHMEM up
    report.record("bootstrap", True, nvshmem_runtime._RUNTIME.bootstrap)
    if t.remote != remote:
        report.record(f"{name}/path", False, f"asked remote={remote}, got remote={t.remote}")
    check("gather_fp32_bitwise", lambda: check_gather(t, rank, world, torch.float32))
    many = [int(x) for x in torch.randint(1, 300, (300,), generator=torch.Generator().manual_seed(5))]
    check("gather_bucket_side_stream", on_side_stream(lambda: check_gather(t, rank, world, torch.bfloat16, many)))
    segments, total = layout(LENGTHS)
    acc = t.allocate(total, torch.float32, accumulator=True)
    acc.segments = segments
    check("scatter_fp32_vs_reduce_scatter", lambda: check_scatter_vs_reduce_scatter(t, acc, rank, world,
                                                                                   torch.float32))
    check("scatter_bf16_vs_reduce_scatter", lambda: check_scatter_vs_reduce_scatter(t, acc, rank, world,
                                                                                   torch.bfloat16))
    check("mutual_100_rounds_exact", lambda: check_exact_rounds(t, acc, rank, world, [100] * world))
    check("uneven_rounds_exact", lambda: check_exact_rounds(t, acc, rank, world, [3] + [0] * (world - 1)))
    check("contention_fp32_vs_fp64", lambda: check_contention_vs_fp64(t, rank, world, torch.float32))
    check("contention_bf16_vs_fp64", lambda: check_contention_vs_fp64(t, rank, world, torch.bfloat16))
    if t.scatter_method == "staging" or t.remote:
        check("deterministic_repeat", lambda: check_deterministic_repeat(t, acc, rank, world))
    sums[name] = random_pushes(t, acc, rank, world, 5, torch.bfloat16, seed=11)
    # More tasks than one kernel launch carries (300 parameters x W owners), on a side stream.
    bucket_segments, bucket_total = layout(many)
    bucket = t.allocate(bucket_total, torch.float32, accumulator=True)
    bucket.segments = bucket_segments
    check("bucket_300_params_exact", on_side_stream(lambda: check_exact_rounds(t, bucket, rank, world,
                                                                               [3, 2] + [1] * max(0, world - 2))))
    t.close()
    report.record(f"{name}/closed", True)


def compare_paths(report, sums):
    """The same pushes through every path: the source-ordered ones (staging, RMA) bit-identical, the atomic one
    within fp32 rounding of them."""
    if "p2p-staging" in sums and "rma" in sums:
        a, b = sums["p2p-staging"], sums["rma"]
        report.record("rma_equals_p2p_staging_bitwise", torch.equal(a.view(torch.int32), b.view(torch.int32)),
                      f"{(a != b).sum().item()} elements differ")
    if "p2p" in sums and "rma" in sums:
        a, b = sums["p2p"], sums["rma"]
        err = ((a - b).norm() / b.norm()).item()
        report.record("rma_matches_p2p_atomic", err <= 1e-6, f"rel diff {err:.3g} (<= 1e-6)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", choices=["main", "fence-timeout"], required=True)
    parser.add_argument("--paths", default="p2p,p2p-staging,rma", type=lambda s: s.split(","))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    init(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    report = Report(args.out, rank)
    report.record("placement", True, f"{'shared GPU' if shared_gpu_mode() else 'one GPU per rank'}, "
                                     f"backend {dist.get_backend()}")
    if args.scenario == "fence-timeout":
        fence_timeout(args, report, rank, world)
    sums = {}
    for name in args.paths:
        run_path(name, report, rank, world, sums)
    compare_paths(report, sums)
    report.record("closed", True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
