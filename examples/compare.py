"""The main job: the same SFT run under stock ZeRO-3 and under ZeRO-3 + ODC, side by side.

Runs ``examples/sft.py`` once per mode on N ranks (CPU by default: a tiny Qwen2-shaped model, long-tail lengths
scaled down, nothing downloaded) and prints per-step losses, which must agree across modes, plus samples/s and the
bubble rate of each mode.

    python examples/compare.py                      # CPU, 2 ranks, 5 steps
    python examples/compare.py --json out.json      # also write every run's metrics
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = [  # (label, ds_config, balancer)
    ("stock + local-sort", "zero3_fp32_cpu.json", "local-sort"),
    ("stock + lb-micro", "zero3_fp32_cpu.json", "lb-micro"),
    ("odc + lb-micro", "zero3_odc_fp32_cpu.json", "lb-micro"),
    ("odc + lb-mini", "zero3_odc_fp32_cpu.json", "lb-mini"),
]


def run_mode(config: str, balancer: str, args, metrics: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(ROOT / "examples" / "sft.py"), "--deepspeed", str(ROOT / "ds_configs" / config),
           "--balancer", balancer, "--model", "tiny", "--preset", args.preset, "--length-scale",
           str(args.length_scale), "--minibatch-size", str(args.minibatch_size),
           "--steps", str(args.steps), "--seed", str(args.seed), "--metrics-json", str(metrics)]
    if args.max_tokens:
        cmd += ["--max-tokens", str(args.max_tokens)]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
               DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-6000:])
        raise SystemExit(f"{balancer} with {config} failed (rc={proc.returncode})")
    return json.loads(metrics.read_text())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--minibatch-size", type=int, default=4)
    p.add_argument("--preset", default="baselines-longtail")
    p.add_argument("--length-scale", type=float, default=0.004, help="scale preset lengths down for a CPU run")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="token budget per microbatch (default: one sample per microbatch, where lb-mini gives ranks "
                        "different microbatch counts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", help="write all runs' metrics here")
    args = p.parse_args(argv)

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, config, balancer in MODES:
            print(f"running {label} ...", flush=True)
            runs[label] = run_mode(config, balancer, args, Path(tmp) / f"{balancer}-{config}")

    labels = list(runs)
    print("\nloss per step (global token mean; identical data in every mode)")
    print("step  " + "  ".join(f"{label:>18}" for label in labels))
    for step in range(args.steps):
        print(f"{step:>4}  " + "  ".join(f"{runs[label]['steps'][step]['loss']:>18.6f}" for label in labels))
    print("\n" + f"{'mode':<20}{'samples/s':>10}{'bubble':>9}   microbatches per rank, step by step")
    for label in labels:
        s = runs[label]["summary"]
        counts = " ".join("/".join(str(r["microbatches"]) for r in step["per_rank"]) for step in runs[label]["steps"])
        bubble = f"{s['bubble_rate']:.1%}" if label.startswith("odc") else f">={s['bubble_rate']:.1%}"
        print(f"{label:<20}{s['samples_per_s']:>10.1f}{bubble:>9}   {counts}")
    reference = [s["loss"] for s in runs[labels[0]]["steps"]]
    worst = max(abs(s["loss"] - r) / abs(r) for label in labels for s, r in zip(runs[label]["steps"], reference))
    print(f"\nlargest relative loss difference between modes: {worst:.2e}")
    print("(stock's bubble is a lower bound: its waits hide inside every layer's collectives. CPU timings of a tiny\n"
          " model show the mechanics, not GPU speed: see docs/BENCHMARKS.md)")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "max_rel_loss_diff": worst}, indent=1))


if __name__ == "__main__":
    main()
