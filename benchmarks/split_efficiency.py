"""Measure the split efficiency that lb-mini-sp assumes (0.8): one sample trained by g ranks together against alone.

    torchrun --standalone --nproc_per_node=G benchmarks/split_efficiency.py --model qwen2.5-1.5b \\
        --lengths 8192,16384,32768 --shapes auto --out results/split

(G >= 2 GPUs; on CPU: ``--model tiny --lengths 64,128 --deepspeed ds_configs/zero3_odc_fp32_cpu.json``.)

For each length L and each group shape ``U x R`` of the G ranks (``--shapes``: ``auto`` = every shape the model's
heads allow, from Ulysses alone to ring alone; or a list such as ``4x2,1x8``), under ZeRO-3 + ODC with the
``ds_odc_sp`` attention, activation checkpointing and the chunked loss, the same engine times forward + backward
(the optimizer step, the same either way, is left out):

* ``alone``: every rank trains its own sample of L tokens, whole (the ranks' groups never meet);
* ``split``: all G ranks train one sample of L tokens, each its L/G slice (U Ulysses ranks x R ring ranks).

``efficiency = t_alone / (G * t_split)``: 1.0 when G ranks finish a sample G times faster than one. That number
includes the exchange; ``SplitPolicy`` prices the exchange apart (``exchange_per_member_token``), so the efficiency
it should be given is ``t_alone / (G * (t_split - t_exchange))``, with ``t_exchange`` from the policy's own model
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


def shapes_of(spec: str, policy, world: int) -> list[int]:
    """The Ulysses sizes to measure: every allowed one (``auto``), or those of ``UxR`` items."""
    if spec == "auto":
        sizes, u = [], 1
        while u <= world:
            if world % u == 0 and (u == 1 or policy.ulysses_limit(u) is None):
                sizes.append(u)
            u *= 2
        return sizes[::-1]
    out = []
    for item in spec.split(","):
        u, r = (int(x) for x in item.lower().split("x"))
        if u * r != world:
            raise SystemExit(f"--shapes {item}: {u} x {r} is not the {world} ranks of this run")
        if u > 1 and policy.ulysses_limit(u):
            raise SystemExit(f"--shapes {item}: {policy.ulysses_limit(u)}")
        out.append(u)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--lengths", default="8192,16384,32768")
    ap.add_argument("--shapes", default="auto", help="auto, or Ulysses x ring shapes of the G ranks, e.g. 4x2,1x8")
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
    from ds_odc.recipes.workloads import model_config
    from ds_odc.training.distributed import init_distributed, runs_on_cpu, shutdown_and_exit
    from ds_odc.training.loss import use_chunked_loss
    from ds_odc.training.sequence_parallel import SequenceParallel

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2 or world & (world - 1):
        raise SystemExit(f"split groups have 2, 4, 8, ... ranks; this run has {world}")
    ds_config = json.loads(Path(args.deepspeed).read_text())
    device = torch.device("cpu") if runs_on_cpu() else torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16 if ds_config.get("bf16", {}).get("enabled") else torch.float32
    config = model_config(args.model)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="ds_odc_sp")
    use_chunked_loss(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    priced = SplitPolicy.from_hf_config(config, ranks_per_node=world)  # the exchange the planner assumes
    timeout_s = odc_config_from_ds_config(ds_config).timeout_s
    groups = {}  # Ulysses size -> SequenceParallel whose group of all ranks has that shape (no exchange pricing)
    for u in shapes_of(args.shapes, priced, world):
        policy = SplitPolicy.from_hf_config(config, ranks_per_node=world, max_ulysses_size=u, flops_per_byte=0.0)
        groups[u] = SequenceParallel(policy, timeout_s=timeout_s)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()],
                                      config=ds_config)
    ranks = tuple(range(world))

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def fwd_bwd(length: int, sp=None) -> float:
        g = torch.Generator().manual_seed(length + (0 if sp else rank))
        ids = torch.randint(0, config.vocab_size, (length,), generator=g)
        sync()
        started = time.perf_counter()
        if sp is not None:
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

    def timed(length: int, sp=None) -> float:
        fwd_bwd(length, sp)  # warm-up (kernels, the fetch plans, the groups' connections)
        return statistics.median(fwd_bwd(length, sp) for _ in range(args.repeats))

    shape_cost = QuadraticCost.from_hf_config(config)  # relative FLOPs, to put the policy's exchange in seconds
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        alone = timed(length)
        for u, sp in groups.items():
            split = timed(length, sp)
            exchange = length * priced.exchange_per_member_token(world, u)  # in units of a token's linear compute
            t_exchange = alone * shape_cost.a * exchange / shape_cost(length)
            rows.append({"length": length, "shape": f"{u}x{world // u}", "alone_s": alone, "split_s": split,
                         "efficiency": alone / (world * split),
                         "compute_efficiency": alone / (world * max(split - t_exchange, 1e-12))})
        engine.step()  # drop the accumulated gradients with an ordinary step (every rank, once)
    if rank == 0:
        print(f"{args.model}, {world} ranks on {device.type} ({platform.node()}), torch {torch.__version__}, "
              f"{args.repeats} timed passes per cell (median; fwd+bwd of the slowest rank)")
        print(f"{'tokens':>8} {'shape':>6} {'alone s':>9} {'split s':>9} {'efficiency':>11} {'compute eff.':>13}")
        for r in rows:
            print(f"{r['length']:>8} {r['shape']:>6} {r['alone_s']:>9.3f} {r['split_s']:>9.3f} "
                  f"{r['efficiency']:>11.3f} {r['compute_efficiency']:>13.3f}")
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
