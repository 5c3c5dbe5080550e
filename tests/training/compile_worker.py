"""Distributed scenarios for compiled blocks and the fused loss under ZeRO-3 (tests/training/test_compile.py, and
tests/gpu/test_compile_gpu.py with ODC_TEST_CUDA=1).

Every scenario trains the same global minibatches of packed rows (``ds_odc_varlen`` attention, activation
checkpointing, the loss as a global token mean) once per engine and compares the parameters; rank 0 prints one
ODC_RESULT line. On CPU "fused" is a stand-in with Liger's access pattern (_fused_standin.py); on a GPU it is Liger.
Usage: compile_worker.py SCENARIO [options].
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import ds_odc  # noqa: F401  (installs the odc config key before any engine is built)
from _support.launch import emit, init_test_ranks
from ds_odc.training import attention  # noqa: F401  (registers ds_odc_varlen)
from ds_odc.training.collate import PackedCollator
from ds_odc.training.compile import CompileOptions, compile_blocks, compile_counts
from ds_odc.training.distributed import shutdown_and_exit
from ds_odc.training.kernels import Kernels, apply_kernels
from ds_odc.training.loss import count_loss_tokens, global_mean_weight, share_head_with_loss, use_chunked_loss

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "zero"))
sys.path.insert(0, os.path.dirname(__file__))
from _fused_standin import use_fused_standin  # noqa: E402
import _workload  # noqa: E402
from _workload import VOCAB, client_optimizer, ds_config, full_params, max_rel_diff, minibatch  # noqa: E402

ROW = 2  # samples per packed row (microbatch)


def tiny_model(tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                         tie_word_embeddings=tied, attn_implementation="ds_odc_varlen", use_cache=False)
    return LlamaForCausalLM(config)


def rank_world():
    import torch.distributed as dist
    return dist.get_rank(), dist.get_world_size()


def train(odc, counts, *, kernels: str, steps: int, backend: str, tied: bool = False, blocks: bool = False,
          register_head: bool = True, bf16: bool = False, attention_kernel: str = "auto"):
    """Rank r trains counts[r] packed rows of every global minibatch; returns (parameters, losses, counts per step,
    what was compiled)."""
    import deepspeed
    from ds_odc.recipes.sft import on_device
    rank, world = rank_world()
    cuda = _workload.DEVICE.type == "cuda"
    model = tiny_model(tied)
    attention.use_kernel(model, attention_kernel)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = None
    if cuda and kernels != "eager":  # the real kernels: Liger where fused
        compiled = apply_kernels(model, Kernels.from_name(kernels, backend=backend))
        compiled = compiled or None
    elif kernels in ("compiled", "compiled+fused"):
        compiled = compile_blocks(model, CompileOptions(backend=backend))
    if kernels.endswith("fused"):
        if not cuda:
            use_fused_standin(model)
        if register_head:
            share_head_with_loss(model)
    else:
        # Chunks of 16 positions under ODC, one per row under stock: the comparison covers the chunking too.
        use_chunked_loss(model, chunk_tokens=16 if odc else 4096)
    extra = {}
    if blocks and not odc:  # stock ZeRO-3 with the leaf-module flag ODC sets by itself
        extra["leaf_module"] = {"classes": ["LlamaDecoderLayer"]}
    if odc:
        odc = {"enabled": True}
    config = ds_config(odc, managed=True, optimizer="sgd", extra_zero=extra, bf16=bf16)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, optimizer=client_optimizer(params),
                                      config=config)
    collate = PackedCollator()
    first, total = sum(counts[:rank]), sum(counts)
    losses, after_step = [], []
    for step in range(steps):
        samples = minibatch(step, ROW * total, min_len=4, max_len=20 + 4 * step)
        rows = [collate([{"input_ids": s[0].cpu()} for s in samples[i:i + ROW]])
                for i in range(0, len(samples), ROW)]
        weight = global_mean_weight(sum(count_loss_tokens(r) for r in rows), world)
        mine = rows[first:first + counts[rank]]
        local = 0.0
        for i, row in enumerate(mine):
            engine.set_gradient_accumulation_boundary(i == len(mine) - 1)
            loss = engine(**on_device(row, _workload.DEVICE), num_items_in_batch=1 / weight).loss
            engine.backward(loss, scale_wrt_gas=False)
            engine.step()
            local += loss.item() / world
        if not mine:
            engine.set_gradient_accumulation_boundary(True)
            engine.step()
        # the sum over ranks (gloo takes CPU tensors: CPU ranks and ranks sharing a GPU; NCCL takes CUDA ones)
        nccl = torch.distributed.get_backend() == "nccl"
        summed = torch.tensor([local], dtype=torch.float64, device=_workload.DEVICE if nccl else "cpu")
        torch.distributed.all_reduce(summed)  # the minibatch's global mean loss, the same on every rank
        losses.append(float(summed))
        after_step.append(compile_counts().as_dict())
    out = full_params(engine)
    engine.destroy()
    return out, losses, after_step, None if compiled is None else compiled.describe()


def scenario_compiled(args):
    """Eager stock ZeRO-3 (equal counts) against ODC with compiled blocks (uneven counts), and stock ZeRO-3 with
    the same leaf modules compiled: the same global minibatches, parameters compared after every engine."""
    rank, world = rank_world()
    stock, stock_losses, _, _ = train(None, [2] * world, kernels="eager", steps=args.steps, backend=args.backend)
    odc, odc_losses, counts, compiled = train(True, [3, 1], kernels="compiled", steps=args.steps,
                                              backend=args.backend)
    out = {"odc_vs_stock": max_rel_diff(odc, stock), "loss_stock": stock_losses, "loss_odc": odc_losses,
           "counts": counts, "compiled": compiled}
    if args.stock_compiled:
        blocks, _, blocks_counts, _ = train(None, [2] * world, kernels="compiled", steps=args.steps,
                                            backend=args.backend, blocks=True)
        out.update(stock_compiled_vs_stock=max_rel_diff(blocks, stock), stock_counts=blocks_counts)
    if rank == 0:
        emit(out)


def scenario_fused(args):
    """The fused-loss stand-in (reads lm_head.weight outside any module forward) under ODC, uneven counts, and under
    stock ZeRO-3, against eager stock ZeRO-3 with the chunked loss; tied embeddings with ``--tied``. With
    ``--no-register`` the head is not made present (the failure the registration fixes)."""
    rank, world = rank_world()
    stock, stock_losses, _, _ = train(None, [2] * world, kernels="eager", steps=args.steps, backend=args.backend,
                                      tied=args.tied)
    out = {"loss_stock": stock_losses}
    for name, odc, counts in (("odc", True, [3, 1]), ("stock_fused", None, [2] * world)):
        try:
            params, losses, per_step, _ = train(odc, counts, kernels=args.kernels, steps=args.steps,
                                                backend=args.backend, tied=args.tied,
                                                register_head=not args.no_register)
            out[name] = {"vs_stock": max_rel_diff(params, stock), "losses": losses, "counts": per_step}
        except Exception as err:  # noqa: BLE001 - reported, asserted by the test
            out[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    if rank == 0:
        emit(out)


def scenario_kernels(args):
    """Every ``--variants`` entry (``ENGINE:KERNELS[/ATTENTION_KERNEL]``; ENGINE odc trains 3,1 rows per rank, stock
    2,2) against eager stock ZeRO-3 and, where it ran first, eager ODC: parameters, losses, dynamo's counters."""
    rank, world = rank_world()
    common = dict(steps=args.steps, backend=args.backend, bf16=args.bf16, tied=args.tied)
    stock, stock_losses, _, _ = train(None, [2] * world, kernels="eager", **common)
    out, odc_eager = {"loss_stock": stock_losses}, None
    for variant in args.variants.split(","):
        engine, _, rest = variant.partition(":")
        kernels, _, attn = rest.partition("/")
        odc = engine == "odc"
        counts = [3, 1] if odc else [2] * world
        try:
            params, losses, per_step, compiled = train(True if odc else None, counts, kernels=kernels,
                                                       attention_kernel=attn or "auto", **common)
        except Exception as err:  # noqa: BLE001 - reported, asserted by the test
            import traceback
            traceback.print_exc()
            out[variant] = {"error": f"{type(err).__name__}: {str(err)[:400]}"}
            continue
        if variant == "odc:eager":
            odc_eager = params
        out[variant] = {"vs_stock": max_rel_diff(params, stock), "losses": losses, "counts": per_step,
                        "compiled": compiled}
        if odc_eager is not None and odc:
            out[variant]["vs_odc_eager"] = max_rel_diff(params, odc_eager)
    if rank == 0:
        emit(out)


def init_ranks() -> None:
    """CPU ranks, or with ODC_TEST_CUDA=1 (tests/gpu) CUDA ranks, as tests/zero/worker.py sets them up."""
    from ds_odc.training.distributed import training_device
    cuda = os.environ.get("ODC_TEST_CUDA") == "1"
    init_test_ranks(timeout_s=300 if cuda else 120)
    if cuda:
        _workload.DEVICE = training_device()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--kernels", default="fused")
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--no-register", action="store_true")
    parser.add_argument("--stock-compiled", action="store_true")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--variants", default="odc:eager,odc:compiled")
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args()
    init_ranks()
    globals()[f"scenario_{args.scenario}"](args)
    shutdown_and_exit()


if __name__ == "__main__":
    main()
