"""Fit the balancer's cost model to a measured run, so that plans count what really takes time on your machine.

    python -m ds_odc.balancer.fit RUN.json [RUN.json ...] [--warmup-steps 1]

Every rank-step of a ``--metrics-json`` file (``examples/sft.py``, ``benchmarks/fsdp2_sft.py``) records the rank's
busy seconds, tokens, sum of squared sample lengths and microbatch count. A non-negative least-squares fit of

    busy = a * tokens + b * sum(L^2) + c * microbatches + d

(``d``: the per-step part every rank pays alike, such as the optimizer step) gives the cost ``a*L + b*L^2`` per
sample plus ``c`` per microbatch that ``--cost fitted --cost-coeffs a,b,c`` plans with, ``c`` being the fixed host
and launch cost of a microbatch. The fit needs rank-steps that differ in their mix of lengths and counts: several
steps of an imbalanced workload, or runs of more than one planner. This is the fit that ``cost="auto"`` (the
default) makes online from the latest steps; run it by hand to check a run's automatic cost (the metrics file
records the automatic cost of every step) or to fix a cost for a bit-reproducible run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from .autocost import rank_rows
from .lsq import solve, stats_of

__all__: list[str] = []

COLUMNS = ("a (per token)", "b (per token^2)", "c (per microbatch)", "d (per step)")


def rank_steps(metrics: dict, warmup_steps: int = 1) -> np.ndarray:
    """[n, 5] rows (tokens, sum L^2, microbatches, 1, busy seconds) of the timed steps of one metrics file (a
    profiled step is not timed); busy as the automatic cost counts it (``autocost.rank_rows``: lock-step waits out)."""
    rows = []
    profiled = (metrics.get("config") or {}).get("profile_step")
    for i, step in enumerate(metrics["steps"]):
        if i < warmup_steps or i == profiled:
            continue
        if any("sq_tokens" not in r for r in step["per_rank"]):
            raise ValueError("this metrics file has no sq_tokens per rank; re-run with a current examples/sft.py")
        tokens, sq_tokens, microbatches, busy = rank_rows(step["per_rank"])
        rows += [(t, q, m, 1.0, b) for t, q, m, b in zip(tokens, sq_tokens, microbatches, busy)]
    return np.asarray(rows, dtype=np.float64).reshape(-1, 5)


def fit(rows: np.ndarray) -> tuple[np.ndarray, float]:
    """Non-negative coefficients (a, b, c, d) and the rms residual in seconds (the same exactly rounded solver as
    the automatic cost, without its prior)."""
    if len(rows) < 4:
        raise ValueError(f"{len(rows)} rank-steps: need at least 4 to fit 4 coefficients")
    coef = np.asarray(solve(stats_of(rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 4])), dtype=np.float64)
    rms = float(np.sqrt(np.mean((rows[:, :4] @ coef - rows[:, 4]) ** 2)))
    return coef, rms


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", nargs="+", help="--metrics-json files of runs on the same model and machine")
    p.add_argument("--warmup-steps", type=int, default=1, help="leading steps of each file to leave out")
    args = p.parse_args(argv)
    try:
        runs = [json.loads(Path(f).read_text()) for f in args.metrics]
        rows = np.concatenate([rank_steps(run, args.warmup_steps) for run in runs])
        coef, rms = fit(rows)
    except (ValueError, KeyError) as err:
        print(f"ds_odc.balancer.fit: {err}", file=sys.stderr)
        return 2
    busy = rows[:, 4]
    if np.unique(rows[:, 2]).size < 2:
        print("warning: every rank-step ran the same number of microbatches, so c (per microbatch) and d (per step) "
              "cannot be told apart; add a run whose ranks run different counts (e.g. --balancer lb-mini)",
              file=sys.stderr)
    automatic = [automatic_cost(run) for run in runs]
    print(f"{'':<20} {'this fit':>11}" + "".join(f" {'automatic' + (f' ({i})' if len(runs) > 1 else ''):>13}"
                                                for i, a in enumerate(automatic) if a))
    for k, (name, value) in enumerate(zip(COLUMNS, coef)):
        print(f"{name:<20} {value:>11.4g}" + "".join(f" {a['abcd'[k]]:>13.4g}" for a in automatic if a))
    print(f"rank-steps {len(rows)}, busy {busy.mean():.3f} s on average, rms residual {rms:.3f} s "
          f"({rms / busy.mean():.1%})")
    if any(automatic):
        print("(automatic: the cost the run itself had fitted after its last step, from its latest steps, with the "
              "model-shape prior and outlier steps left out)")
    print(f"--cost fitted --cost-coeffs {coef[0]:.4g},{coef[1]:.4g},{coef[2]:.4g}")
    return 0


def automatic_cost(metrics: dict) -> dict | None:
    """The automatic cost a run recorded after its last step (``cost="auto"``), if it fitted one."""
    for step in reversed(metrics.get("steps", [])):
        cost = step.get("cost")
        if cost and cost.get("fitted"):
            return cost
    return None


if __name__ == "__main__":
    sys.exit(main())
