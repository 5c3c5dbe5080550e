"""DeepSpeed's gradient and parameter APIs under ODC, the way DeepSpeed's own ZeRO-3 tests use them, against stock
ZeRO-3 in the same process (launched by test_dropin.py on 2 and 3 CPU ranks).

``apis``: one engine per mode runs the same sequence (every rank, drop-in: the configured accumulation steps):
gradients read between backward and step (``safe_get_full_grad``, ``safe_get_local_grad``,
``optimizer.averaged_gradients``), written there (``safe_set_full_grad``, ``safe_update_full_grad_vectorized``),
dropped there (``optimizer.zero_grad()``); then parameters written outside the step and read at once:
``GatheredParameters(modifier_rank=0)`` with one rank slow to write its slice, ``safe_set_full_fp32_param`` (published
by the next step), and a shard replaced with ``param.ds_tensor.data = ...``. Rank 0 reports how far ODC is from stock at
each point, and (on CPU ranks) stock's own rounding of each kind of quantity (``worker.stock_rounding``).

``refusals``: the early gradient reads ODC cannot answer (mid-minibatch with explicit boundaries; unmanaged
accumulation) raise an error that says why, instead of hanging or returning partial sums.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

import ds_odc  # noqa: F401
from _support.launch import emit, expect_error
from ds_odc.training.distributed import shutdown_and_exit

sys.path.insert(0, os.path.dirname(__file__))
import _workload  # noqa: E402
from _workload import ds_config, flat, full_params, minibatch, odc_vs_stock, tiny_llama  # noqa: E402
from worker import build, init_ranks, stock_rounding  # noqa: E402


def named(engine):
    return [p for _, p in engine.module.named_parameters()]


def microbatch(engine, step: int, k: int, gas: int = 2):
    """Forward and backward of this rank's k-th microbatch of minibatch ``step`` (the caller calls engine.step())."""
    rank, world = dist.get_rank(), dist.get_world_size()
    s = minibatch(step, gas * world)[k * world + rank]
    loss = engine(input_ids=s, labels=s).loss
    engine.backward(loss)
    return loss


def padded(value: torch.Tensor, param) -> torch.Tensor:
    """A full gradient as stage 3's set/update APIs slice it: flat, padded to a multiple of the ranks it is
    partitioned over (given the unpadded tensor they read past its end on the last rank when the size does not
    divide)."""
    ranks = dist.get_world_size(param.ds_process_group)
    out = torch.zeros(param.partition_numel() * ranks, dtype=value.dtype, device=value.device)
    out[:param.ds_numel] = value.reshape(-1)
    return out


def eval_loss(engine, step: int = 99) -> float:
    s = minibatch(step, dist.get_world_size())[dist.get_rank()]
    engine.eval()
    with torch.no_grad():
        loss = engine(input_ids=s, labels=s).loss.item()
    engine.train()
    return loss


def slow_shard_writes_on(rank: int, delay_s: float):
    """Make ``rank`` write its slice of every GatheredParameters(modifier_rank=...) late: a peer that reads at once
    (one-sidedly) would see the old shard unless the write is published first."""
    from deepspeed.runtime.zero.partition_parameters import Init
    if dist.get_rank() != rank or hasattr(Init._partition, "slowed"):
        return
    stock = Init._partition

    def late(self, param_list, has_been_updated=False, free_data=True):
        if has_been_updated:
            time.sleep(delay_s)
        return stock(self, param_list, has_been_updated=has_been_updated, free_data=free_data)

    late.slowed = True
    Init._partition = late


def build_sgd(odc):
    engine = build(tiny_llama(), ds_config(odc, gas=2, optimizer="sgd"))
    return engine, named(engine), engine.optimizer


def reads_between_backward_and_step(odc) -> dict:
    """After each backward (a partial sum after the first, as stock), then the step."""
    from deepspeed.utils import safe_get_full_grad, safe_get_local_grad
    engine, params, opt = build_sgd(odc)
    seen = {}
    for k in range(2):
        microbatch(engine, 0, k)
        seen[f"full_grads_{k}"] = flat(safe_get_full_grad(p) for p in params)
        seen[f"local_grads_{k}"] = flat(safe_get_local_grad(p) for p in params)
        seen[f"averaged_{k}"] = flat(g for i in range(len(opt.fp16_groups)) for g in opt.averaged_gradients[i])
        engine.step()  # a no-op after the first microbatch (gradient_accumulation_steps 2), the update after the last
    seen["params_after_reads"] = flat(full_params(engine).values())
    return seen


def slow_reader_between_microbatches(odc) -> dict:
    """The first rank copies what safe_get_local_grad / averaged_gradients returned only after a pause, while the
    others go on to their next microbatch at once. Stock's next reduce-scatter waits for it; under ODC on a GPU the
    others' pushes add straight into its accumulator, so they must wait too, or the copy sees their next
    microbatch."""
    from deepspeed.utils import safe_get_local_grad
    engine, params, opt = build_sgd(odc)
    seen = {}
    for k in range(2):
        microbatch(engine, 0, k)
        local = [safe_get_local_grad(p) for p in params]
        averaged = [g for i in range(len(opt.fp16_groups)) for g in opt.averaged_gradients[i]]
        if dist.get_rank() == 0:
            time.sleep(0.5)
        seen[f"slow_local_grads_{k}"] = flat(local)
        seen[f"slow_averaged_{k}"] = flat(averaged)
        engine.step()
    seen["params_after_slow_reads"] = flat(full_params(engine).values())
    return seen


def writes_between_backward_and_step(odc) -> dict:
    from deepspeed.utils import safe_set_full_grad, safe_update_full_grad_vectorized
    engine, params, opt = build_sgd(odc)
    microbatch(engine, 0, 0)
    engine.step()
    microbatch(engine, 0, 1)
    safe_set_full_grad(params[0], padded(torch.full(params[0].ds_shape, -5.0), params[0]))
    safe_update_full_grad_vectorized(params[1:4], lambda grad, param: padded(grad * 0.5 - 1.0, param))
    engine.step()
    return {"params_after_grad_writes": flat(full_params(engine).values())}


def write_then_backward(odc) -> dict:
    """A gradient written after the first microbatch, then the second microbatch adds to it (as stock's next
    backward adds into the partition)."""
    from deepspeed.utils import safe_set_full_grad
    engine, params, opt = build_sgd(odc)
    microbatch(engine, 0, 0)
    engine.step()  # a no-op: the first of gradient_accumulation_steps 2
    safe_set_full_grad(params[0], padded(torch.full(params[0].ds_shape, -5.0), params[0]))
    microbatch(engine, 0, 1)
    engine.step()
    return {"params_after_write_then_backward": flat(full_params(engine).values())}


def zero_grad_between_backward_and_step(odc) -> dict:
    """Skipping a bad batch: the first microbatch's gradients are dropped, the second's are trained."""
    engine, params, opt = build_sgd(odc)
    microbatch(engine, 0, 0)
    opt.zero_grad()
    engine.step()
    microbatch(engine, 0, 1)
    engine.step()
    return {"params_after_zero_grad": flat(full_params(engine).values())}


def shard_writes_read_at_once(odc) -> dict:
    """GatheredParameters(modifier_rank=0) with the last rank slow to write its slice, then every rank reads."""
    import deepspeed
    engine, params, opt = build_sgd(odc)
    slow_shard_writes_on(rank=dist.get_world_size() - 1, delay_s=0.2)
    losses = []
    for trial in range(5):
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            if dist.get_rank() == 0:
                for i, p in enumerate(params):
                    p.data.mul_(0.9).add_(0.001 * (trial + i))
        losses.append(eval_loss(engine, trial))
    return {"loss_after_modifier_writes": torch.tensor(losses)}


def fp32_param_write_then_step(odc) -> dict:
    """safe_set_full_fp32_param writes the fp32 master partition; the next step's update publishes it."""
    from deepspeed.utils import safe_set_full_fp32_param
    engine, params, opt = build_sgd(odc)
    # stage 3 slices the unpadded value, which reads past its end on the last rank unless the size divides
    divisible = [p for p in params if p.ds_numel % dist.get_world_size(p.ds_process_group) == 0]
    if not divisible:
        return {}
    if dist.get_rank() == dist.get_world_size() - 1:
        time.sleep(0.2)  # the last rank writes late
    safe_set_full_fp32_param(divisible[0], torch.full(divisible[0].ds_shape, 0.25))
    for k in range(2):
        microbatch(engine, 0, k)
        engine.step()
    return {"loss_after_set_fp32_and_step": torch.tensor([eval_loss(engine)])}


def replaced_shards_read_at_once(odc) -> dict:
    engine, params, opt = build_sgd(odc)
    for i, p in enumerate(params):
        p.ds_tensor.data = torch.full_like(p.ds_tensor.data, 0.01 * (i + 1) * (1 + dist.get_rank()))
    return {"loss_after_replaced_shards": torch.tensor([eval_loss(engine)])}


SECTIONS = [reads_between_backward_and_step, slow_reader_between_microbatches, writes_between_backward_and_step, zero_grad_between_backward_and_step,
            shard_writes_read_at_once, fp32_param_write_then_step, replaced_shards_read_at_once]
# With hybrid sharding (--shard-size) against flat stock: the sections whose results do not depend on which rank
# holds which slice (not the local gradients, not the rank-dependent replaced shards).
HYBRID_SECTIONS = [writes_between_backward_and_step, write_then_backward, zero_grad_between_backward_and_step,
                   shard_writes_read_at_once, fp32_param_write_then_step]


def scenario_apis(args):
    sections = SECTIONS
    if args.shard_size:
        from deepspeed_apis_worker import with_shard_size
        sections = [with_shard_size(s, args.shard_size) for s in HYBRID_SECTIONS]
    out = odc_vs_stock(sections, flat(full_params(tiny_llama()).values()))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    rounding = stock_rounding() if os.environ.get("ODC_TEST_CUDA") != "1" else None  # the CPU tests' references
    if dist.get_rank() == 0:
        emit({"ranks": gathered, "stock_rounding": rounding})


def scenario_refusals(args):
    from deepspeed.utils import safe_get_local_grad
    out = {}
    engine = build(tiny_llama(), ds_config(True, gas=1, optimizer="sgd"))
    engine.set_gradient_accumulation_boundary(False)
    microbatch(engine, 0, 0, gas=1)
    out["explicit_mid_minibatch"] = expect_error(lambda: safe_get_local_grad(named(engine)[0]))
    engine.set_gradient_accumulation_boundary(True)
    microbatch(engine, 0, 0, gas=1)
    out["explicit_at_boundary"] = expect_error(lambda: safe_get_local_grad(named(engine)[0]))
    engine.step()
    engine = build(tiny_llama(), ds_config(True, gas=1, optimizer="sgd", managed=False))
    microbatch(engine, 0, 0, gas=1)
    out["unmanaged"] = expect_error(lambda: safe_get_local_grad(named(engine)[0]))
    if dist.get_rank() == 0:
        emit(out)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["apis", "refusals"])
    parser.add_argument("--shard-size", type=int, default=0, help="apis with zero_optimization.odc.shard_size")
    parser.add_argument("--offload", choices=["odc", "both"], default="",
                        help="offload_optimizer to the CPU for ODC's engines (stock without offload stays the "
                             "reference), or for stock's too")
    args = parser.parse_args()
    _workload.OFFLOAD = args.offload
    init_ranks(timeout_s=60)
    globals()[f"scenario_{args.scenario}"](args)
    shutdown_and_exit()


if __name__ == "__main__":
    main()
