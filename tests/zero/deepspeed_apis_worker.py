"""DeepSpeed ZeRO-3 APIs that DeepSpeed's own unit tests use, with ``"odc": true`` against stock ZeRO-3 in the same
process (launched by test_deepspeed_apis.py on 2 and 3 CPU ranks, and by tests/gpu on GPUs).

Each section builds one engine per mode and runs the same drop-in sequence on every rank; rank 0 reports how far
ODC is from stock at each point (and, on CPU ranks, stock's own rounding of each kind of quantity:
``worker.stock_rounding``):

* ``zero_grad_then_step``: ``optimizer.zero_grad()`` between backward and a step with no backward in between. Stock
  keeps the reduced gradients until the next backward overwrites them, so that step still applies them (DeepSpeed's
  partitioning test asserts a non-zero gradient norm there).
* ``backward_read_zero_grad_repeated``: several backward passes without a step, each read with
  ``optimizer.get_fp32_grad_partitions()``, with and without ``zero_grad()`` in between (accumulate or overwrite),
  then the step.
* ``full_grads_read_repeated``: the same with every full gradient read through ``deepspeed.utils.safe_get_full_grad``
  (the same numbers whatever the partitioning, so it also compares hybrid sharding with flat stock ZeRO-3).
* ``save_16bit_model``: the consolidated 16-bit state dict written after training (into ``--dir``, a folder the test
  owns).
* ``unwrap_for_generation``: logits and greedy tokens inside ``unwrap_model_for_generation`` (hooks removed,
  parameters gathered), then a training step after the hooks are back.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import torch.distributed as dist

import ds_odc  # noqa: F401
from _support.launch import emit
from ds_odc.training.distributed import shutdown_and_exit

sys.path.insert(0, os.path.dirname(__file__))
import _workload  # noqa: E402
from _workload import ds_config, flat, full_params, minibatch, odc_vs_stock, tiny_llama  # noqa: E402
from worker import build, init_ranks, stock_rounding  # noqa: E402


def backward_on(engine, step: int, k: int = 0, gas: int = 1):
    """Forward and backward of this rank's k-th microbatch of minibatch ``step``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    s = minibatch(step, gas * world)[k * world + rank]
    engine.backward(engine(input_ids=s, labels=s).loss)


def build_sgd(odc, gas: int = 1):
    return build(tiny_llama(), ds_config(odc, gas=gas, optimizer="sgd"))


def zero_grad_then_step(odc) -> dict:
    engine = build_sgd(odc)
    backward_on(engine, 0)
    engine.optimizer.zero_grad()
    engine.step()
    norm = torch.tensor([float(engine.get_global_grad_norm())])
    backward_on(engine, 1)
    engine.step()
    return {"grad_norm_after_zero_grad_step": norm, "params_after_zero_grad_step": flat(full_params(engine).values())}


def backward_read_zero_grad_repeated(odc) -> dict:
    out = {}
    for zero_grad in (True, False):
        engine = build_sgd(odc)
        reads = []
        for k in range(3):
            backward_on(engine, k)
            parts = engine.optimizer.get_fp32_grad_partitions()
            reads.append(flat(g for i in sorted(parts) for _, g in sorted(parts[i].items())))
            if zero_grad:
                engine.optimizer.zero_grad()
        engine.step()
        tag = "zero_grad" if zero_grad else "accumulate"
        # every rank's own partition differs: gather them so rank 0 compares all of them
        local = torch.cat(reads).to(engine.device)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        out[f"grad_partitions_read_{tag}"] = torch.cat([g.cpu() for g in gathered])
        out[f"params_after_{tag}"] = flat(full_params(engine).values())
    return out


def full_grads_read_repeated(odc) -> dict:
    from deepspeed.utils import safe_get_full_grad
    out = {}
    for zero_grad in (True, False):
        engine = build_sgd(odc)
        reads = []
        for k in range(3):
            backward_on(engine, k)
            reads.append(flat(safe_get_full_grad(p) for p in engine.module.parameters()))
            if zero_grad:
                engine.optimizer.zero_grad()
        engine.step()
        tag = "zero_grad" if zero_grad else "accumulate"
        out[f"full_grads_read_{tag}"] = torch.cat(reads)
        out[f"params_after_full_grads_{tag}"] = flat(full_params(engine).values())
    return out


def save_16bit_model(odc, folder: str) -> dict:
    engine = build(tiny_llama(), ds_config(odc, optimizer="sgd",
                                           extra_zero={"stage3_gather_16bit_weights_on_model_save": True}))
    for step in range(2):
        backward_on(engine, step)
        engine.step()
    folder = os.path.join(folder, "odc" if odc else "stock")
    engine.save_16bit_model(folder, "model.bin")
    dist.barrier()
    saved = torch.load(os.path.join(folder, "model.bin"), map_location="cpu", weights_only=True)
    return {"saved_16bit_state_dict": flat(saved[k] for k in sorted(saved)),
            "params_after_16bit_save": flat(full_params(engine).values())}


def unwrap_for_generation(odc) -> dict:
    from deepspeed.runtime.zero import unwrap_model_for_generation
    engine = build_sgd(odc)
    backward_on(engine, 0)
    engine.step()
    prompt = minibatch(7, dist.get_world_size())[dist.get_rank()][:, :6]
    with unwrap_model_for_generation(engine) as unwrapped:
        with torch.no_grad():
            logits = unwrapped(input_ids=prompt).logits
            tokens = unwrapped.module.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    backward_on(engine, 1)
    engine.step()
    return {"logits_in_unwrap": flat([logits]), "tokens_in_unwrap": flat([tokens]),
            "params_after_unwrap_and_step": flat(full_params(engine).values())}


SECTIONS = [zero_grad_then_step, backward_read_zero_grad_repeated, save_16bit_model, unwrap_for_generation]
OPTIONAL = [full_grads_read_repeated]  # run when named by --only


def with_shard_size(section, shard_size: int):
    """``section`` with ODC on as hybrid sharding (stock stays flat ZeRO-3 over every rank)."""
    def run(odc, **kwargs):
        return section(None if odc is None else {"enabled": True, "shard_size": shard_size}, **kwargs)
    run.__name__ = section.__name__
    return run


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="comma-separated section names (default: all)")
    parser.add_argument("--shard-size", type=int, default=0, help="ODC with zero_optimization.odc.shard_size")
    parser.add_argument("--dir", required=True, help="a folder the test owns and removes (save_16bit_model)")
    parser.add_argument("--local_rank", type=int, default=None)
    parser.add_argument("--offload", choices=["odc", "both"], default="",
                        help="offload_optimizer to the CPU for ODC's engines (stock without offload stays the "
                             "reference), or for stock's too")
    args = parser.parse_args()
    _workload.OFFLOAD = args.offload
    init_ranks(timeout_s=60)
    named = [s for s in SECTIONS + OPTIONAL if s.__name__ in args.only.split(",")] if args.only else SECTIONS
    sections = []
    for section in named:
        run = with_shard_size(section, args.shard_size) if args.shard_size else section
        sections.append(functools.partial(run, folder=args.dir) if section is save_16bit_model else run)
    out = odc_vs_stock(sections, flat(full_params(tiny_llama()).values()))
    if os.environ.get("ODC_TEST_CUDA") != "1":  # the CPU tests' reference distances
        out["stock_rounding"] = stock_rounding()
    if dist.get_rank() == 0:
        emit(out)
    shutdown_and_exit()


if __name__ == "__main__":
    main()
