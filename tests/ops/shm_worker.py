"""Transport scenarios for the shm transport, run on N CPU ranks by tests/ops/test_shm.py."""

import argparse
import time

import torch
import torch.distributed as dist

from ds_odc.ops.shm import ShmTransport
from ds_odc.ops.transport import Segment
from _support.launch import emit, init_test_ranks
from ds_odc.training.distributed import shutdown_and_exit


def scenario_stress(args, t: ShmTransport):
    """Every rank pushes into every owner at once, many rounds, integer-valued data: the sums must be exact."""
    rank, world = t.rank, t.world_size
    numel = 1000
    acc = t.allocate(numel, torch.float32, accumulator=True)
    # Segments of different sizes; the last one's input is short, so the last ranks own padding only.
    segments = [Segment(0, 7), Segment(7, 100), Segment(107, 1), Segment(108, 64)]
    expected = torch.zeros(numel, dtype=torch.float64)
    for rnd in range(args.rounds):
        inputs = []
        for i, seg in enumerate(segments):
            n = world * seg.length - (3 if i == 3 else 0)
            values = torch.arange(n, dtype=torch.float32) % 17 + rank + rnd
            inputs.append(values.to(torch.bfloat16) if i == 1 else values)
        t.scatter_accumulate(t.plan_scatter(acc, segments, [x.numel() for x in inputs]), inputs)
        for src in range(world):  # what every source pushed into *this* rank's slice
            for i, seg in enumerate(segments):
                n = world * seg.length - (3 if i == 3 else 0)
                full = torch.arange(n, dtype=torch.float64) % 17 + src + rnd
                part = full[rank * seg.length:(rank + 1) * seg.length]
                expected[seg.offset:seg.offset + part.numel()] += part
    t.fence([acc])
    exact = bool(torch.equal(acc.local.double(), expected))
    t.zero_([acc])
    t.barrier()
    gathered = [None] * world
    dist.all_gather_object(gathered, exact)
    if rank == 0:
        emit({"exact": gathered, "tag": t.tag, "sum": float(acc.local.sum())})


def scenario_gather(args, t: ShmTransport):
    """Gather equals all_gather of the same shards, bit for bit, in every dtype."""
    rank, world = t.rank, t.world_size
    ok = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        buf = t.allocate(300, dtype)
        torch.manual_seed(rank)
        buf.local.copy_(torch.randn(300).to(dtype))
        t.barrier()
        segments = [Segment(0, 100), Segment(100, 13), Segment(113, 187)]
        plan = t.plan_gather(buf, segments)
        flat = torch.full((plan.out_numel,), float("nan"), dtype=dtype)
        t.gather(plan, flat)
        for seg, offset in zip(segments, plan.out_offsets):
            out = flat.narrow(0, offset, world * seg.length)
            parts = [torch.empty(seg.length, dtype=dtype) for _ in range(world)]
            dist.all_gather(parts, buf.local[seg.offset:seg.offset + seg.length].clone())
            ok.append(bool(torch.equal(out, torch.cat(parts))))
    result = [None] * world
    dist.all_gather_object(result, all(ok))
    if rank == 0:
        emit({"bitwise_equal": result})


def scenario_one_sided(args, t: ShmTransport):
    """The owner (rank 0) sleeps through the others' reads and pushes: they complete without it."""
    rank, world = t.rank, t.world_size
    params = t.allocate(64, torch.float32)
    acc = t.allocate(64, torch.float32, accumulator=True)
    params.local.fill_(rank + 1)
    t.barrier()
    if rank == 0:
        time.sleep(args.sleep)
        done_before_wake = None
    else:
        start = time.monotonic()
        out = torch.empty(world * 64)
        t.gather(t.plan_gather(params, [Segment(0, 64)]), out)
        t.scatter_accumulate(t.plan_scatter(acc, [Segment(0, 64)], [world * 64]), [torch.ones(world * 64)])
        done_before_wake = (time.monotonic() - start) < args.sleep / 2 and bool(out[:64].eq(1).all())
    t.fence([acc])
    flags = [None] * world
    dist.all_gather_object(flags, done_before_wake)
    if rank == 0:
        emit({"peers_done_while_owner_slept": flags[1:], "owner_received": float(acc.local[0]),
              "expected": float(world - 1)})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--sleep", type=float, default=3.0)
    args = parser.parse_args()
    init_test_ranks(timeout_s=60)
    transport = ShmTransport(timeout_s=60)
    globals()[f"scenario_{args.scenario}"](args, transport)
    transport.close()
    shutdown_and_exit()


if __name__ == "__main__":
    main()
