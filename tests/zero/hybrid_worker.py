"""Hybrid sharding (``odc.shard_size``): several checks in one launch (tests/zero/test_hybrid.py on CPU ranks,
tests/gpu/test_hybrid_gpu.py on CUDA ranks).

Usage: hybrid_worker.py --shard-size S --checks a,b,... [--counts ...] [--dir DIR]; rank 0 prints one ODC_RESULT line
with one entry per check:

* ``uneven``: every rank its own number of microbatches (0 included) against one process computing the same
  minibatches; also: the layout (shard groups, transport over S ranks), replicas bit-identical after the steps
  (shards and optimizer state), one gradient all-reduce per step, and no torch.distributed call in forward/backward;
* ``equal``: the drop-in loop (same GAS on every rank) against flat stock ZeRO-3 over all ranks, and both against
  an fp64 single-process computation;
* ``checkpoint``: save, continue, and a fresh engine loading the save continues identically; only the first shard
  group writes files, and DeepSpeed's zero_to_fp32 consolidates them into the saved parameters;
* ``zero_init``: a model built under ``deepspeed.zero.Init(config_dict_or_path=ds_config)`` is partitioned over its
  shard group (the config decides), starts from the same values everywhere although every rank drew its own (the
  first rank's win, as under stock), and trains as the reference; one built under a bare ``zero.Init`` (the world) is
  refused at ``deepspeed.initialize``, naming the fix.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import ds_odc  # noqa: F401  (installs the odc config key before any engine is built)
from _support.launch import emit, expect_error
from ds_odc.training.distributed import shutdown_and_exit

sys.path.insert(0, os.path.dirname(__file__))
from _workload import (ds_config, full_params, max_rel_diff, minibatch, reference_and_rounding,  # noqa: E402
                       reference_run, rel_diff, tiny_llama)
from worker import CALLS, build, count_collectives, init_ranks, rank_world, train_uneven  # noqa: E402

STEPS = 3


def odc_block(args) -> dict:
    block = {"enabled": True, "shard_size": args.shard_size}
    if args.remote:
        block["force_remote_path"] = True  # GPU: NVSHMEM get/put only, as between nodes
    return block


def gathered(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of a small tensor (collective; through pickles, so on any backend and device)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, tensor.detach().cpu())
    return out


def replicas_identical(engine, shard_size: int) -> bool:
    """Ranks j, S+j, 2S+j, ... hold bit-identical shards and optimizer state (SGD momentum)."""
    optimizer = engine.optimizer
    state = [s["momentum_buffer"].reshape(-1) for s in optimizer.optimizer.state.values() if "momentum_buffer" in s]
    mine = torch.cat([optimizer.odc.trainable.local.reshape(-1).float(), *[s.float() for s in state]])
    copies = gathered(mine)
    return all(torch.equal(copies[r], copies[r % shard_size]) for r in range(len(copies)))


def check_uneven(args) -> dict:
    rank, world = rank_world()
    counts = [int(c) for c in args.counts.split(",")]
    assert len(counts) == world, f"--counts needs {world} entries"
    model = tiny_llama()
    initial = full_params(model)
    ref_model, _, ref_rounding = reference_and_rounding(model, STEPS, sum(counts), clip=args.clip)
    engine = build(model, ds_config(odc_block(args), clip=args.clip, managed=False, optimizer="sgd"))
    odc = engine.optimizer.odc
    sums = []
    sum_ = odc.replicas.sum_
    odc.replicas.sum_ = lambda acc: sums.append(acc.numel()) or sum_(acc)
    CALLS["by_name"] = {}
    forward, backward = engine.forward, engine.backward

    def counted(fn):
        def run(*a, **k):
            CALLS["on"] = True
            try:
                return fn(*a, **k)
            finally:
                CALLS["on"] = False
        return run

    engine.forward, engine.backward = counted(forward), counted(backward)
    train_uneven(engine, counts, STEPS)
    engine.forward, engine.backward = forward, backward
    layout = odc.groups.layout
    partition_groups = {tuple(dist.get_process_group_ranks(p.ds_process_group)) for p in engine.module.parameters()}
    trained = full_params(engine)
    return {"max_rel_diff": max_rel_diff(trained, full_params(ref_model)), "ref_rounding": ref_rounding,
            "moved": max_rel_diff(trained, initial),
            "transport_ranks": odc.transport.world_size, "partition_groups": sorted(partition_groups),
            "shard_groups": layout.replicas, "replicas_identical": replicas_identical(engine, args.shard_size),
            "replica_sums": len(sums), "forward_backward_collectives": sum(CALLS["by_name"].values())}


def check_equal(args) -> dict:
    """Drop-in, GAS 2, SGD: hybrid ODC vs flat stock ZeRO-3 (every rank, one shard group) and vs fp64."""
    rank, world = rank_world()
    gas = 2
    results = {}
    for name, odc in (("stock", None), ("hybrid", odc_block(args))):
        engine = build(tiny_llama(), ds_config(odc, gas=gas, clip=args.clip, optimizer="sgd"))
        for step in range(STEPS):
            samples = minibatch(step, gas * world)
            for k in range(gas):
                s = samples[k * world + rank]
                engine.backward(engine(input_ids=s, labels=s).loss)
                engine.step()
        results[name] = full_params(engine)
    ref, _ = reference_run(tiny_llama(), STEPS, gas * world, clip=args.clip, per_sample_mean=True,
                           dtype=torch.float64)
    ref = full_params(ref, torch.float64)
    return {"max_rel_diff": max_rel_diff(results["hybrid"], results["stock"]),
            "hybrid_vs_ref": max_rel_diff(results["hybrid"], ref), "stock_vs_ref": max_rel_diff(results["stock"], ref)}


def check_checkpoint(args) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    rank, world = rank_world()
    counts = [int(c) for c in args.counts.split(",")]
    config = ds_config(odc_block(args), clip=args.clip, managed=False, optimizer="sgd")
    engine = build(tiny_llama(), config)
    train_uneven(engine, counts, 2)
    engine.save_checkpoint(args.dir, tag="step2")
    saved = full_params(engine)
    train_uneven(engine, counts, 2, step_offset=2)
    uninterrupted = full_params(engine)
    resumed_engine = build(tiny_llama(seed=123), config)
    resumed_engine.load_checkpoint(args.dir, tag="step2")
    loaded = full_params(resumed_engine)
    train_uneven(resumed_engine, counts, 2, step_offset=2)
    out = {"max_rel_diff": max_rel_diff(full_params(resumed_engine), uninterrupted),
           "loaded_vs_saved": max_rel_diff(loaded, saved)}
    dist.barrier()
    if rank == 0:
        out["files"] = sorted(os.listdir(os.path.join(args.dir, "step2")))
        consolidated = get_fp32_state_dict_from_zero_checkpoint(args.dir, tag="step2")
        out["consolidated_vs_saved"] = max(rel_diff(consolidated[n].float(), saved[n]) for n in saved)
    return out


def check_zero_init(args) -> dict:
    import deepspeed
    rank, world = rank_world()
    counts = [int(c) for c in args.counts.split(",")]
    config = ds_config(odc_block(args), clip=args.clip, managed=False, optimizer="sgd")
    from transformers import LlamaForCausalLM  # noqa: F401  (imported under zero.Init's patched torch it fails)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = tiny_llama(seed=rank)  # each rank draws its own: the first rank's must win, as under stock
    partition_sizes = sorted({dist.get_world_size(p.ds_process_group) for p in model.parameters()})
    engine = build(model, config)
    initial = full_params(engine)
    copies = gathered(torch.cat([t.reshape(-1) for t in initial.values()]))
    plain = tiny_llama()
    plain.load_state_dict(initial)
    ref_model, _, ref_rounding = reference_and_rounding(plain, 2, sum(counts), clip=args.clip)
    train_uneven(engine, counts, 2)
    with deepspeed.zero.Init():  # no config: stock's world group
        world_model = tiny_llama()
    refused = expect_error(lambda: build(world_model, config))
    return {"partition_sizes": partition_sizes, "initial_same_everywhere": all(torch.equal(c, copies[0])
                                                                               for c in copies),
            "replicas_identical": replicas_identical(engine, args.shard_size),
            "max_rel_diff": max_rel_diff(full_params(engine), full_params(ref_model)), "ref_rounding": ref_rounding,
            "refused": refused}


CHECKS = {"uneven": check_uneven, "equal": check_equal, "checkpoint": check_checkpoint, "zero_init": check_zero_init}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shard-size", type=int, required=True)
    parser.add_argument("--checks", default="uneven")
    parser.add_argument("--counts", default="1,1,1,1")
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--dir", help="checkpoint folder (the checkpoint check)")
    parser.add_argument("--remote", action="store_true", help="GPU: odc.force_remote_path (NVSHMEM get/put only)")
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args()
    count_collectives()
    init_ranks(timeout_s=60)
    out = {name: CHECKS[name](args) for name in args.checks.split(",")}
    if dist.get_rank() == 0:
        emit(out)
    shutdown_and_exit()


if __name__ == "__main__":
    main()
