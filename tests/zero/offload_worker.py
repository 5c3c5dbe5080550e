"""``engine.offload_states()`` / ``reload_states()`` with ``"odc": true``, the way DeepSpeed's own ZeRO-3 test of them
runs (``tests/unit/runtime/zero/test_offload_states.py``: train, snapshot every state, offload, check where each
state is, reload, compare bit for bit, train on), against stock ZeRO-3 in the same process. Launched by
test_offload.py on CPU ranks (and by tests/gpu on GPUs).

Usage: offload_worker.py states [--include NAME,...] [--bf16] [--offload-optimizer]; rank 0 prints one ODC_RESULT line
with, per case (an ``include`` list, pinned or not, blocking or not; one engine per mode goes through all of them, a
training step before each), whether every state came back bit for bit, where the states were while offloaded and
whether ODC's symmetric memory was given back; and how far ODC's parameters are from stock's at the end.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import ds_odc  # noqa: F401
from _support.launch import emit
from ds_odc.training.distributed import shutdown_and_exit

sys.path.insert(0, os.path.dirname(__file__))
from _workload import ds_config, flat, full_params, minibatch, rel_diff, tiny_llama  # noqa: E402
from worker import build, init_ranks  # noqa: E402


def allow_torch_adam_states():
    """Stock's ``offload_states`` moves Adam states and fp32 master weights only under DeepSpeed's FusedAdam (it
    asserts the class), which JIT-compiles for over a minute on CPU; the states it moves (``exp_avg``,
    ``exp_avg_sq``, the flat fp32 partitions) are the same under torch's AdamW (``torch_adam``), so the check is
    pointed at that class, for stock and ODC alike."""
    from deepspeed.ops.adam import fused_adam
    fused_adam.FusedAdam = torch.optim.AdamW


def train(engine, steps: range):
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        s = minibatch(step, world)[rank]
        engine.backward(engine(input_ids=s, labels=s).loss)
        engine.step()


def snapshot(engine) -> dict[str, torch.Tensor]:
    """Every state offload_states can move, as DeepSpeed's test reads them (its public accessors)."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state
    params = [p for p in engine.module.parameters()]
    return {
        "hp_params": flat(safe_get_local_fp32_param(p) for p in params),
        "lp_params": flat(p.ds_tensor for p in params),
        "lp_grads": engine.optimizer.grad_partitions_flat_buffer.detach().float().cpu().clone(),
        "exp_avg": flat(safe_get_local_optimizer_state(p, "exp_avg") for p in params),
        "exp_avg_sq": flat(safe_get_local_optimizer_state(p, "exp_avg_sq") for p in params),
    }


def devices(engine) -> dict[str, list[str]]:
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
    from deepspeed.runtime.zero.offload_states import get_state_devices
    return {s.value: sorted(str(d) for d in get_state_devices(engine, s)) for s in OffloadStateTypeEnum}


def symmetric_memory_given_back(engine) -> dict[str, bool]:
    """ODC only, while offloaded: whether this rank's shared-memory shards read as zeros (their pages given back) with
    every ``ds_tensor`` pointing at a host copy instead, and whether the gradient partitions point at a host copy
    instead of the accumulator."""
    odc = engine.optimizer.odc
    places = {ds_id: place.address for ds_id, place in odc.shards.items()}
    return {"lp_params": bool(all(not b.peers[odc.transport.rank].any() for b in odc.shard_buffers()) and
                              all(p.ds_tensor.data_ptr() != places[p.ds_id] for p in engine.module.parameters())),
            "lp_grads": engine.optimizer.grad_partitions_flat_buffer.data_ptr() != odc.accumulator.local.data_ptr()}


def run_cases(odc, cases: list[tuple[str, list | None, bool, bool]], bf16: bool, offload_optimizer: bool):
    """One engine, as DeepSpeed's test: per case (name, include, pin_memory, non_blocking) a training step, then the
    offload and the reload with every check; two more steps at the end. Returns (per case, final parameters)."""
    engine = build(tiny_llama(), ds_config(odc, bf16=bf16, offload=offload_optimizer))
    results = {}
    for step, (name, include, pin_memory, non_blocking) in enumerate(cases):
        train(engine, range(step, step + 1))
        before = snapshot(engine)
        engine.offload_states(include=include, pin_memory=pin_memory, non_blocking=non_blocking)
        out = {"devices_offloaded": devices(engine)}
        if odc is not None and engine.optimizer.odc.transport.can_evict:  # shared memory (CPU)
            out["given_back"] = symmetric_memory_given_back(engine)
        engine.reload_states(non_blocking=non_blocking)
        after = snapshot(engine)
        out["devices_reloaded"] = devices(engine)
        out["changed"] = sorted(k for k in before if not torch.equal(before[k], after[k]))
        out["offloaded_states_left"] = sorted(s.value for s in engine.optimizer.offloaded_states)
        results[name] = out
        # Under ODC a peer may push its next minibatch's gradients into this rank's accumulator as soon as the step
        # is over: the snapshots compare this rank's round trip only when no peer starts the next case before both.
        dist.barrier()
    train(engine, range(len(cases), len(cases) + 2))
    params = flat(full_params(engine).values())
    engine.destroy()
    return results, params


def scenario_states(args):
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
    allow_torch_adam_states()
    ours = ("all", "lp_params", "lp_grads")  # ODC's own paths, pinned and blocking both ways; the others one way
    cases = [(f"{name}-pin{int(pin)}-nb{int(nb)}", None if name == "all" else [OffloadStateTypeEnum(name)], pin, nb)
             for name in args.include.split(",")
             for pin, nb in (((False, False), (True, True)) if name in ours else ((True, True),))]
    stock, stock_params = run_cases(None, cases, args.bf16, args.offload_optimizer)
    odc, odc_params = run_cases(True, cases, args.bf16, args.offload_optimizer)
    if dist.get_rank() == 0:
        emit({"cases": {name: {"stock": stock[name], "odc": odc[name]} for name, *_ in cases},
              "odc_vs_stock": rel_diff(odc_params, stock_params),
              "stock_moved": rel_diff(stock_params, flat(full_params(tiny_llama()).values()))})


def scenario_refused(args):
    """A transport that cannot give symmetric memory back (NVSHMEM) refuses to move lp_params / lp_grads, naming
    them, before any rank waits for another; the other states still move."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
    allow_torch_adam_states()
    engine = build(tiny_llama(), ds_config(True, bf16=args.bf16, offload=args.offload_optimizer))
    train(engine, range(1))
    if not engine.optimizer.odc.transport.can_evict:
        transport = None
    else:  # on CPU: a transport that says it cannot (as NVSHMEM's)
        transport = engine.optimizer.odc.transport
        type(transport).can_evict = False
    out = {}
    for name, include in (("all", None), ("lp_params", [OffloadStateTypeEnum.lp_params]),
                          ("lp_grads", [OffloadStateTypeEnum.lp_grads])):
        try:
            engine.offload_states(include=include)
            out[name] = "no error"
            engine.reload_states()
        except Exception as err:  # noqa: BLE001 - the point is to report it
            out[name] = f"{type(err).__name__}: {err}"
    before = flat(full_params(engine).values())
    engine.offload_states(include=[OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states])
    engine.reload_states()
    train(engine, range(1, 2))
    out["trains_after"] = rel_diff(flat(full_params(engine).values()), before)
    if transport is not None:
        type(transport).can_evict = True
    if dist.get_rank() == 0:
        emit(out)


def reference(model, minibatches, clip: float, dtype: torch.dtype):
    """One process, plain PyTorch: every global minibatch's token-mean loss, SGD (as the client optimizer), clipped."""
    import copy

    import _workload
    from _workload import client_optimizer
    from ds_odc.training.loss import token_loss_sum
    model = copy.deepcopy(model).to(_workload.DEVICE, dtype)
    params = list(model.parameters())
    opt = client_optimizer(params)
    for samples in minibatches:
        opt.zero_grad()
        n_tokens = sum(s.numel() - 1 for s in samples)
        for s in samples:
            (token_loss_sum(model(input_ids=s).logits.to(dtype), s) / n_tokens).backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
    return flat(full_params(model, dtype).values()).double() if dtype == torch.float64 else flat(
        full_params(model).values())


def scenario_sampler(args):
    """ODC with the optimizer on the host, the microbatches of each rank planned by LB-Mini
    (``BalancedBatchSampler``: a different number per rank, none on some), gradient clipping active, against one
    process computing the same global minibatches in fp32 and in float64; and ODC without offload on the same
    microbatches, which does the same arithmetic on the device (so it must agree bit for bit)."""
    import _workload
    from _workload import VOCAB
    from ds_odc.balancer import BalancedBatchSampler
    from ds_odc.training.loss import global_mean_weight, token_loss_sum
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(5)
    lengths = [int(n) for n in torch.randint(4, 41, (48,), generator=g)]
    data = [torch.randint(0, VOCAB, (1, n), generator=g).to(_workload.DEVICE) for n in lengths]
    sampler = BalancedBatchSampler(lengths, world_size=world, rank=rank, minibatch_size=4, max_tokens=48,
                                   cost="tokens", seed=1)
    batches = [batch for _, batch in zip(range(args.steps), sampler)]
    counts, minibatches = [], []
    for batch in batches:  # every rank's share of each minibatch: the counts, and the whole minibatch for the reference
        shares = [None] * world
        dist.all_gather_object(shares, batch.microbatches)
        counts.append([len(share) for share in shares])
        minibatches.append([data[i] for share in shares for mb in share for i in mb])

    def train(offload: bool, planted: bool = False):
        """``planted``: the first rank's first microbatch of every minibatch counts 0 (a real error, to be caught)."""
        engine = build(tiny_llama(), ds_config(True, clip=args.clip, managed=False, optimizer="sgd", offload=offload))
        for batch in batches:
            weight = global_mean_weight(batch.num_tokens - batch.num_samples, world)  # labels = inputs
            for k, microbatch in enumerate(batch.microbatches):
                for i in microbatch:
                    scale = 0.0 if planted and rank == 0 and k == 0 else 1.0
                    loss = token_loss_sum(engine(input_ids=data[i]).logits, data[i]) * weight * scale
                    engine.backward(loss, scale_wrt_gas=False)
            engine.step()
        return engine, flat(full_params(engine).values())

    offloaded_engine, offloaded = train(True)
    host_step = offloaded_engine.optimizer.odc_host_step_times
    _, on_device = train(False)
    _, planted = train(True, planted=True)
    ref32 = reference(tiny_llama(), minibatches, args.clip, torch.float32)
    ref64 = reference(tiny_llama(), minibatches, args.clip, torch.float64)
    initial = flat(full_params(tiny_llama()).values())
    if rank == 0:
        emit({"offload_vs_ref32": rel_diff(offloaded, ref32), "offload_vs_ref64": rel_diff(offloaded, ref64),
              "ref32_vs_ref64": rel_diff(ref32, ref64), "offload_vs_device": rel_diff(offloaded, on_device),
              "bits_differ": int((offloaded.view(torch.int32) != on_device.view(torch.int32)).sum()),
              "planted_vs_ref64": rel_diff(planted, ref64),
              "moved": rel_diff(ref32, initial), "counts": counts,
              "offloaded": offloaded_engine.optimizer.offload_optimizer,
              "host_step_ran": host_step is not None and host_step.optimizer > 0,
              "grad_norm": float(offloaded_engine.get_global_grad_norm())})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["states", "refused", "sampler"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--clip", type=float, default=0.05)
    parser.add_argument("--include", default="hp_params,lp_params,optim_states,lp_grads,contiguous_grad_buffer,all",
                        help="the include lists to run, one state each, 'all' for include=None")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--offload-optimizer", action="store_true", help="offload_optimizer to the CPU as well")
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args()
    init_ranks(timeout_s=60)
    globals()[f"scenario_{args.scenario}"](args)
    shutdown_and_exit()


if __name__ == "__main__":
    main()
