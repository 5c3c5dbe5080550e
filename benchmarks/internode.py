"""Bytes between nodes per optimizer step and model-state memory per GPU: flat ODC, hybrid ODC, stock ZeRO-3 and
MiCS-style sharding, on paper (pure Python: no GPU, nothing launched).

    python benchmarks/internode.py [--nodes 2,4,8,16,32] [--gpus-per-node 8] [--node-gbs 400] [--steps 10]
    python benchmarks/internode.py --simulate [--ranks 64,128,256,512,1024] [--node-gbs 400] [--tflops 300]

For each model shape (Qwen2.5-1.5B and -7B) and node count N (W = N x 8 ranks), the microbatches every rank runs
come from the planners on the ``long-sft`` preset (4 samples per rank, max_tokens 65,536, the shape's quadratic
cost): ``lb-micro`` under collectives (stock ZeRO-3, MiCS: every rank runs the plan's slot count) and ``lb-mini``
under ODC (its mean per rank). The bytes are :mod:`ds_odc.balancer.traffic`'s: bf16 reads and pushes, fp32
accumulation, one direction, per node; "s at B" is that volume at the NIC bandwidth B (GB/s per node), not
overlapped with compute. Memory: parameters (bf16) + fp32 master + fp32 accumulator + Adam, per GPU.

``--simulate``: the simulator's step times with that traffic charged (``python -m ds_odc.balancer.simulate ...
--cost quadratic --model-config SHAPE --tflops F --microbatch-overhead 0.27 --inter-node-gbs B --sharding
flat|node --plan-cost given``): per shape and rank count, lb-micro and lb-mini with the model sharded flat and one
shard group per node.
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from ds_odc.balancer.cost import QuadraticCost
from ds_odc.balancer.planners import plan_minibatch
from ds_odc.balancer.presets import get_preset
from ds_odc.balancer.simulate import simulate
from ds_odc.balancer.traffic import (SCHEMES, Precision, allreduce_bytes_per_node, internode_bytes_per_node,
                                     InterNode, parameter_count, state_bytes_per_gpu)
from ds_odc.balancer.presets import MODEL_SHAPES

SHAPES = ("qwen2.5-1.5b", "qwen2.5-7b")
PLANNER_OF = {"zero3": "lb-micro", "mics": "lb-micro", "odc": "lb-mini", "hybrid": "lb-mini"}
LABEL = {"zero3": "stock ZeRO-3", "odc": "flat ODC", "mics": "MiCS-style", "hybrid": "hybrid ODC"}
GB = 1e9


def microbatches_per_rank(shape: dict, ranks: int, args) -> dict[str, float]:
    """Mean microbatches per rank per step, by planner, over ``args.steps`` minibatches of the preset."""
    cost = QuadraticCost.from_hf_config(shape)
    rng = np.random.default_rng(args.seed)
    totals = {"lb-micro": 0.0, "lb-mini": 0.0}
    for _ in range(args.steps):
        lengths = get_preset(args.preset).sample(ranks * args.minibatch_size, rng)
        for planner in totals:
            plan = plan_minibatch(lengths, ranks, planner=planner, max_tokens=args.max_tokens, cost=cost,
                                  oversize="truncate")
            counts = [len(r) for r in plan.microbatches]
            # collectives: every rank joins every slot, so it runs the largest count
            totals[planner] += max(counts) if planner == "lb-micro" else float(np.mean(counts))
    return {p: t / args.steps for p, t in totals.items()}


def simulated_tables(args) -> None:
    """Step times at cluster scale with the inter-node term (see the module docstring)."""
    ranks = [int(r) for r in args.ranks.split(",")]
    G, rate = args.gpus_per_node, args.tflops * 1e12
    for name in SHAPES:
        shape = dict(MODEL_SHAPES[name], model_type="qwen2")
        a, b, c = QuadraticCost.from_hf_config(shape).coefficients()
        cost = QuadraticCost(a=a / rate, b=b / rate, c=c / rate)  # seconds at the sustained rate
        print(f"\n## {name}, {args.node_gbs:g} GB/s per node, {args.tflops:g} TFLOP/s per GPU, "
              f"{args.microbatch_overhead:g} s per microbatch: step time, s (of which between nodes, per rank)\n")
        print("| ranks | stock ZeRO-3 lb-micro | flat ODC lb-mini | MiCS-style lb-micro | hybrid ODC lb-mini | "
              "hybrid vs flat ODC | hybrid vs stock ZeRO-3 |")
        print("|---|---|---|---|---|---|---|")
        for R in ranks:
            runs = {}
            for sharding in ("flat", "node"):
                internode = InterNode(params=parameter_count(shape), ranks=R, gpus_per_node=G,
                                      bandwidth=args.node_gbs * GB, sharding=sharding)
                runs[sharding] = simulate(args.preset, ranks=R, minibatch_size=args.minibatch_size,
                                          max_tokens=args.max_tokens, cost=cost, steps=args.steps, seed=args.seed,
                                          oversize="truncate", planners=("lb-micro", "lb-mini"),
                                          microbatch_overhead=args.microbatch_overhead, plan_cost="given",
                                          internode=internode)
            cells = [runs[sh][p] for sh, p in (("flat", "lb-micro"), ("flat", "lb-mini"), ("node", "lb-micro"),
                                               ("node", "lb-mini"))]
            text = [f"{s['step_time']:.2f} ({s['internode_time_per_rank']:.2f})" for s in cells]
            print(f"| {R} | " + " | ".join(text) + f" | {cells[1]['step_time'] / cells[3]['step_time']:.2f}x | "
                  f"{cells[0]['step_time'] / cells[3]['step_time']:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="2,4,8,16,32")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--node-gbs", type=float, default=400.0, help="NIC bandwidth per node, GB/s each way")
    ap.add_argument("--preset", default="long-sft")
    ap.add_argument("--minibatch-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--simulate", action="store_true", help="simulated step times at --ranks instead")
    ap.add_argument("--ranks", default="64,128,256,512,1024", help="with --simulate")
    ap.add_argument("--tflops", type=float, default=300.0, help="with --simulate: sustained TFLOP/s per GPU")
    ap.add_argument("--microbatch-overhead", type=float, default=0.27,
                    help="with --simulate: seconds per microbatch beyond its FLOPs (measured on H200 at 1.5B)")
    args = ap.parse_args()
    started = time.perf_counter()
    print(f"# {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, python "
          f"{platform.python_version()}")
    unused = {"nodes"} if args.simulate else {"simulate", "ranks", "tflops", "microbatch_overhead"}
    print("# python benchmarks/internode.py " + " ".join(
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(args).items() if k not in unused))
    if args.simulate:
        simulated_tables(args)
        print(f"\n({time.perf_counter() - started:.1f} s)")
        return
    nodes = [int(n) for n in args.nodes.split(",")]
    G, bw, precision = args.gpus_per_node, args.node_gbs * GB, Precision()
    for name in SHAPES:
        shape = dict(MODEL_SHAPES[name], model_type="qwen2")
        P = parameter_count(shape)
        print(f"\n## {name}: {P / 1e9:.3f} B parameters; GB leaving each node per step (seconds at "
              f"{args.node_gbs:g} GB/s)\n")
        print("| nodes | ranks | mb/rank lb-micro | mb/rank lb-mini | " + " | ".join(LABEL[s] for s in SCHEMES)
              + " | hybrid / one fp32 all-reduce |")
        print("|" + "---|" * (5 + len(SCHEMES)))
        for n in nodes:
            mbs = microbatches_per_rank(shape, n * G, args)
            cells = []
            for scheme in SCHEMES:
                volume = internode_bytes_per_node(scheme, P, n, G, mbs[PLANNER_OF[scheme]], precision)
                cells.append(f"{volume / GB:,.1f} ({volume / bw:.2f} s)")
            hybrid = internode_bytes_per_node("hybrid", P, n, G, mbs["lb-mini"], precision)
            ratio = hybrid / allreduce_bytes_per_node(P, n, precision)
            print(f"| {n} | {n * G} | {mbs['lb-micro']:.2f} | {mbs['lb-mini']:.2f} | " + " | ".join(cells)
                  + f" | {ratio:.2f} |")
        print(f"\nModel state per GPU, GiB ({precision.state} bytes per parameter):\n")
        print("| nodes | " + " | ".join(LABEL[s] for s in SCHEMES) + " | hybrid / flat ODC |")
        print("|" + "---|" * (2 + len(SCHEMES)))
        for n in nodes:
            per_gpu = {s: state_bytes_per_gpu(s, P, n, G, precision) for s in SCHEMES}
            print(f"| {n} | " + " | ".join(f"{per_gpu[s] / 2**30:.2f}" for s in SCHEMES)
                  + f" | {per_gpu['hybrid'] / per_gpu['odc']:.0f}x |")
    print(f"\n({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
