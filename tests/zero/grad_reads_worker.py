"""DeepSpeed's gradient-clipping test sequence (``unit/runtime/zero/test_zero_grad_clip.py``), ODC against stock
ZeRO-3 in the same process: right after ``engine.backward`` the norm groups are read (``optimizer._get_norm_groups``),
every local gradient is clamped (``safe_get_local_grad`` / ``safe_set_local_grad``), the norm groups are read again,
then the step. Launched by test_gradient_reads.py on 1, 2 and 3 CPU ranks; each launch runs fp32 and bf16, with and
without ``offload_optimizer``.

Rank 0 reports, per case, ODC's distance from stock of each read (the norms, every rank's clamped partition, the
parameters after the step), and stock's own rounding of each kind of quantity at that precision: in fp32
``worker.stock_rounding``; in bf16 the same measure for a bf16 stock engine (:func:`bf16_rounding`), against float64
from the same bf16-rounded weights.
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
import _workload  # noqa: E402
from _workload import client_optimizer, ds_config, flat, full_params, minibatch, rel_diff, tiny_llama  # noqa: E402
from worker import build, init_ranks, stock_rounding  # noqa: E402

GAS = 2  # two microbatches per rank, the drop-in loop (the boundary is implicit)


def backward_all(engine) -> None:
    """The drop-in loop up to the last backward of the minibatch (``engine.step()`` after every other one)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    samples = minibatch(0, GAS * world)
    for k in range(GAS):
        s = samples[k * world + rank]
        engine.backward(engine(input_ids=s, labels=s).loss)
        if k < GAS - 1:
            engine.step()


def global_norm(groups) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack([g.float().reshape(()) for g in groups]).cpu()).reshape(1)


def clip_sequence(odc, bf16: bool, offload: bool) -> dict:
    """DeepSpeed's grad-clip test, on every rank; every rank's clamped partition gathered (rank 0 compares them)."""
    from deepspeed.utils import safe_get_local_grad, safe_set_local_grad
    engine = build(tiny_llama(), ds_config(odc, gas=GAS, bf16=bf16, offload=offload, optimizer="sgd"))
    backward_all(engine)
    pre = global_norm(engine.optimizer._get_norm_groups())  # the first read after backward
    params = [p for p in engine.module.parameters() if hasattr(p, "ds_id")]
    # the clamp bites: a value of the order of the gradients' RMS (the same on every rank)
    limit = float(pre) / sum(p.ds_numel for p in params) ** 0.5
    clamped = []
    for param in params:
        grad = safe_get_local_grad(param)
        if grad is not None:
            safe_set_local_grad(param, grad.clamp(-limit, limit))
            clamped.append(safe_get_local_grad(param))
    post = global_norm(engine.optimizer._get_norm_groups())
    local = flat(clamped).to(engine.device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    engine.step()
    return {"grad_norm_before_clamp": pre, "grad_norm_after_clamp": post,
            "local_grads_clamped": torch.cat([g.cpu() for g in gathered]),
            "params_after_clamped_step": flat(full_params(engine).values())}


def bf16_rounding() -> dict[str, float] | None:
    """How far bf16 moves stock ZeRO-3 from float64 on this sequence's minibatch (one drop-in step of GAS 2, SGD):
    gradients and parameters, relative distances of whole flat vectors, from one float64 process that starts from the
    same bf16-rounded weights. On the first rank (None on the others)."""
    from deepspeed.utils import safe_get_full_grad
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = build(tiny_llama(), ds_config(None, gas=GAS, bf16=True, optimizer="sgd"))
    backward_all(engine)
    grads = torch.cat([safe_get_full_grad(p).float().reshape(-1).cpu() for p in engine.module.parameters()])
    engine.step()
    trained = full_params(engine, torch.float64)  # collective
    if rank != 0:
        return None
    exact = tiny_llama().to(torch.bfloat16).to(_workload.DEVICE, torch.float64)
    samples = minibatch(0, GAS * world)
    for s in samples:  # stock's weight: the mean over microbatches (GAS) of the ranks' mean of token means
        loss = torch.nn.functional.cross_entropy(exact(input_ids=s).logits[0, :-1], s[0, 1:])
        (loss / len(samples)).backward()
    exact_grads = torch.cat([p.grad.reshape(-1).cpu() for p in exact.parameters()])
    client_optimizer(list(exact.parameters())).step()
    params = [torch.cat([t.reshape(-1) for t in p.values()]) for p in (trained, full_params(exact, torch.float64))]
    return {"grads": rel_diff(grads, exact_grads), "params": rel_diff(*params)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=None)
    parser.parse_args()
    init_ranks(timeout_s=60)
    cases = {}
    for bf16 in (False, True):
        for offload in (False, True):
            stock = clip_sequence(None, bf16, offload)
            odc = clip_sequence(True, bf16, offload)
            name = f"{'bf16' if bf16 else 'fp32'}-{'offload' if offload else 'device'}"
            cases[name] = {"odc_vs_stock": {k: rel_diff(odc[k], stock[k]) for k in stock},
                           "stock_norms": [float(stock["grad_norm_before_clamp"]),
                                           float(stock["grad_norm_after_clamp"])],
                           "odc_norms": [float(odc["grad_norm_before_clamp"]), float(odc["grad_norm_after_clamp"])]}
    rounding = {"fp32": stock_rounding(), "bf16": bf16_rounding()}
    if dist.get_rank() == 0:
        emit({"cases": cases, "rounding": rounding})
    shutdown_and_exit()


if __name__ == "__main__":
    main()
