"""Measure the split efficiency that lb-mini-sp assumes (0.8): one sample trained by g ranks together against alone.

    torchrun --standalone --nproc_per_node=G benchmarks/split_efficiency.py --model qwen2.5-1.5b \\
        --lengths 8192,16384,32768 --out results/split

(G >= 2 GPUs of one node; on CPU: ``--model tiny --lengths 64,128 --deepspeed ds_configs/zero3_odc_fp32_cpu.json``.)

For each length L, under ZeRO-3 + ODC with the ``ds_odc_sp`` attention, activation checkpointing and the chunked
loss, the same engine times forward + backward (the optimizer step, the same either way, is left out):

* ``alone``: every rank trains its own sample of L tokens, whole (the ranks' groups never meet);
* ``split``: all G ranks train one sample of L tokens, each its L/G slice (Ulysses all-to-alls over the G ranks).

``efficiency = t_alone / (G * t_split)``: 1.0 when G ranks finish a sample G times faster than one. That number
includes the all-to-alls; ``SplitPolicy`` prices the exchange apart (``exchange_per_token``), so the efficiency it
should be given is ``t_alone / (G * (t_split - t_exchange))``, with ``t_exchange`` from the policy's own model
(printed as ``compute_efficiency``). Prints a table and writes ``split_efficiency.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--lengths", default="8192,16384,32768")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per length and mode (after one warm-up)")
    ap.add_argument("--deepspeed", default=str(ROOT / "ds_configs" / "zero3_odc_bf16.json"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import deepspeed
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import ds_odc  # noqa: F401
    from ds_odc.balancer.cost import QuadraticCost
    from ds_odc.balancer.sp import SplitPolicy
    from ds_odc.config import odc_config_from_ds_config
    from ds_odc.training.distributed import init_distributed, runs_on_cpu, shutdown_and_exit
    from ds_odc.training.loss import use_chunked_loss
    from ds_odc.training.sequence_parallel import SequenceParallel
    from ds_odc.recipes.workloads import model_config

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    ds_config = json.loads(Path(args.deepspeed).read_text())
    device = torch.device("cpu") if runs_on_cpu() else torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16 if ds_config.get("bf16", {}).get("enabled") else torch.float32
    config = model_config(args.model)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="ds_odc_sp")
    use_chunked_loss(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = SplitPolicy.from_hf_config(config, ranks_per_node=world)
    if world not in policy.group_sizes(world):
        raise SystemExit(f"{args.model} cannot be split {world} ways ({policy.head_limit(world) or 'not a power of 2'})")
    sp = SequenceParallel(policy, timeout_s=odc_config_from_ds_config(ds_config).timeout_s)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()],
                                      config=ds_config)
    ranks = tuple(range(world))

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def fwd_bwd(length: int, split: bool) -> float:
        g = torch.Generator().manual_seed(length + (0 if split else rank))
        ids = torch.randint(0, config.vocab_size, (length,), generator=g)
        sync()
        started = time.perf_counter()
        if split:
            piece = sp.slice(ids, ranks, device=device)
            with sp.run(piece):
                loss = engine(input_ids=piece.input_ids, position_ids=piece.position_ids,
                              shift_labels=piece.shift_labels, num_items_in_batch=length).loss
                engine.backward(loss, scale_wrt_gas=False)
        else:
            row = ids[None].to(device)
            loss = engine(input_ids=row, position_ids=torch.arange(length, device=device)[None], labels=row,
                          num_items_in_batch=length).loss
            engine.backward(loss, scale_wrt_gas=False)
        sync()
        slowest = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a mode is as fast as its slowest rank
        return float(slowest.item())

    shape_cost = QuadraticCost.from_hf_config(config)  # relative FLOPs, to put the policy's exchange in seconds
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        result = {"length": length}
        for mode in ("alone", "split"):
            fwd_bwd(length, mode == "split")  # warm-up (kernels, the fetch plans, the groups' connections)
            result[f"{mode}_s"] = statistics.median(fwd_bwd(length, mode == "split") for _ in range(args.repeats))
        engine.step()  # drop the accumulated gradients with an ordinary step (every rank, once)
        g = world
        exchange = (length / g) * ((g - 1) / g) * (policy.exchange_per_token + policy.exchange_per_kv_head
                                                   * max(policy.num_key_value_heads, g))
        t_exchange = result["alone_s"] * shape_cost.a * exchange / shape_cost(length)
        result["efficiency"] = result["alone_s"] / (g * result["split_s"])
        result["compute_efficiency"] = result["alone_s"] / (g * max(result["split_s"] - t_exchange, 1e-12))
        rows.append(result)
    if rank == 0:
        print(f"{args.model}, {world} ranks on {device.type} ({platform.node()}), torch {torch.__version__}, "
              f"{args.repeats} timed passes per cell (median; fwd+bwd of the slowest rank)")
        print(f"{'tokens':>8} {'alone s':>9} {'split s':>9} {'efficiency':>11} {'compute eff.':>13}")
        for r in rows:
            print(f"{r['length']:>8} {r['alone_s']:>9.3f} {r['split_s']:>9.3f} {r['efficiency']:>11.3f} "
                  f"{r['compute_efficiency']:>13.3f}")
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "split_efficiency.json").write_text(json.dumps(
                {"model": args.model, "ranks": world, "device": device.type, "rows": rows,
                 "command": " ".join(["torchrun", f"--nproc_per_node={world}", *sys.argv])}, indent=1))
    shutdown_and_exit()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
