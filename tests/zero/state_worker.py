"""OdcState on N CPU ranks without DeepSpeed's engine (launched by test_state.py): fetch, push, fence, publish, and
gradients read or dropped before the step, each against what the ranks' data says the answer is."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from ds_odc.config import OdcConfig
from ds_odc.ops.transport import OdcError
from _support.launch import emit, init_test_ranks
from ds_odc.training.distributed import shutdown_and_exit
from ds_odc.zero.state import OdcState

sys.path.insert(0, os.path.dirname(__file__))
from _state_case import full_values, push_grads, release, zero3_params  # noqa: E402


def grads_of(rank: int, values, scale: float = 1.0):
    """Rank r's full gradient of each parameter (small integers)."""
    return [((torch.arange(v.numel()) % 5) + rank + 1).float().reshape(v.shape) * scale for v in values]


def main():
    init_test_ranks(timeout_s=30)
    rank, world = dist.get_rank(), dist.get_world_size()
    state = OdcState(OdcConfig(timeout_s=20))
    state.connect(torch.device("cpu"), None)
    params, flat = zero3_params(rank, world)
    values = full_values()
    state.place_trainable(params, flat)
    state.place_accumulator(params, sum(p.partition_numel() for p in params))
    out = {}

    # hop one: full parameters from every owner's shard, one plan per fetch group, reused
    state.fetch(params[:2]).wait()
    state.fetch(params[2:]).wait()
    out["fetched_exact"] = all(torch.equal(p.data, v) for p, v in zip(params, values))
    release(params)
    state.fetch(params[:2]).wait()
    release(params)

    # hop two + three: pushes from every rank, in buckets, over two microbatches, then the fence
    def push_all(microbatch):
        push_grads(state, [params[:3], params[3:]], grads_of(rank, values, microbatch + 1))

    push_all(0)
    push_all(1)
    state.start_step()
    state.fence()
    expected = []
    for p, v in zip(params, values):
        n = p.partition_numel()
        total = sum(grads_of(r, values, 1)[p.ds_id] * 3 for r in range(world)).reshape(-1) / world
        padded = torch.zeros(n * world)
        padded[:v.numel()] = total
        expected.append(padded[rank * n:(rank + 1) * n])
    out["accumulated"] = torch.allclose(state.accumulator.local, torch.cat(expected), rtol=1e-6, atol=0)
    state.publish()
    out["zeroed_after_publish"] = bool(state.accumulator.local.eq(0).all())

    # gradients read early (drop-in: every rank, same point), then more pushes, then the step: the total stays right
    push_all(0)
    state.settle("a test read")
    early = state.accumulator.local.clone()
    push_all(0)
    state.start_step()
    state.fence()
    out["early_read_then_rest"] = torch.allclose(state.accumulator.local, 2 * early, rtol=1e-6, atol=0)
    state.publish()

    # zero_grad before the step drops everything pushed so far, on every rank
    push_all(0)
    state.discard("a test zero_grad")
    push_all(1)
    state.start_step()
    state.fence()
    out["discard_keeps_only_later"] = torch.allclose(state.accumulator.local, 2 * early, rtol=1e-6, atol=0)
    state.publish()

    # an early read in the middle of an explicit-boundary minibatch is refused, not a hang
    state.accumulation = lambda: ("explicit", False)
    push_all(0)
    try:
        state.settle("a test read")
        out["mid_minibatch_refused"] = False
    except OdcError as err:
        out["mid_minibatch_refused"] = "middle of a minibatch" in str(err)
    state.accumulation = lambda: ("explicit", True)
    state.start_step()
    state.fence()
    state.publish()

    # a shard replaced behind ODC's back (param.ds_tensor.data = new) is adopted before anyone reads it
    for p in params:
        p.ds_tensor.data = torch.full_like(p.ds_tensor, float(rank + 1))
    state.fetch(params[:2]).wait()
    owner_of = [torch.arange(p.ds_numel) // p.partition_numel() for p in params[:2]]
    out["replaced_adopted"] = all(torch.equal(p.data.reshape(-1), (o + 1).float()) for p, o in zip(params, owner_of))
    release(params)

    out["fetch_plans"] = len(state._fetch_plans)
    everyone = [None] * world
    dist.all_gather_object(everyone, out)
    if rank == 0:
        emit({"ranks": everyone})
    state.close()
    shutdown_and_exit()


if __name__ == "__main__":
    main()
