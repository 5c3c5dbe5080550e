"""The automatic cost (``cost="auto"``): a cost model refitted every step from the busy times the ranks measured.

Every step, each rank reports its busy seconds, tokens ``T``, sum of squared document lengths ``S`` and
microbatch count ``M`` (``ds_odc.training.metrics.gather_step`` brings every rank's numbers to every rank). Over the
recent steps :class:`AutoCost` fits

    busy = a*T + b*S + c*M + d

and the planners use ``a*L + b*S`` per sample plus ``c`` per microbatch (``d``, what every rank pays alike per
step, such as the optimizer step, does not change a plan and is left out).

* **The same on every rank.** The fit is a pure function of the gathered numbers, in exactly rounded arithmetic
  (:mod:`ds_odc.balancer.lsq`), so every rank computes the same bits and the plans stay identical without any
  communication of their own.
* **A prior until the data speaks.** It starts from a prior (the model-shape FLOPs of
  :meth:`~ds_odc.balancer.cost.QuadraticCost.from_hf_config` plus a per-microbatch constant) and, once fitted,
  stays pulled toward the prior's shape (scaled to seconds) with the weight of ``prior_rows`` rank-steps, which also
  settles what the data cannot tell apart (``c`` from ``d`` while every rank runs the same count).
* **Robust.** The first ``warmup_steps`` are ignored (allocator, kernel selection, compilation), and a step
  whose rms residual is more than ``outlier_factor`` times the median step's (and above 5% of its busy time) is
  left out: a profiled step, a checkpoint save inside the timed region, a paused machine.
* **Cheap.** A step's rows are reduced once to 4x4 statistics; a refit reads the ``window`` latest steps'
  statistics only (well under 1 ms at 512 ranks).
* **Resumable.** :meth:`state_dict` holds the statistics and the fits the next plans need, as JSON.

``lag``: the plan of global minibatch ``g`` uses the fit after observing ``g - lag`` steps. With ``lag=0`` the
sampler must observe step ``g - 1`` before minibatch ``g`` is drawn; a loader that prefetches ``P`` minibatches needs
``lag >= P`` for an interrupted and resumed run to plan exactly like an uninterrupted one.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from .cost import CostModel, FittedCost
from .lsq import Stats, residual_ss, solve, stats_of

__all__ = ["AutoCost"]

# A step is never an outlier for a residual under 5% of its rms busy time, or for a total busy time within 25% of
# what the fit predicts for it.
_MIN_OUTLIER_RMS = 0.05
_MIN_OUTLIER_LOG_RATIO = math.log(1.25)


@dataclass(frozen=True)
class CostUpdate:
    """What one observation did.

    ``predicted_step_s``: the slowest rank's busy time that the fit *before* this step predicted for it (``None``
    while the prior, in FLOPs, was all there was); ``measured_step_s``: the slowest rank's measured busy time.
    ``a, b, c, d``: the fitted coefficients now, in seconds per token, per squared document length, per microbatch
    and per step; ``None`` until a fit exists (``fitted`` False), while the plans still use ``prior``.
    ``prior``: the prior's ``(a, b, c)`` in its own units (FLOPs for the model-shape prior), never seconds.
    ``c_measured``: whether the fitted steps ran different microbatch counts (otherwise ``c`` is held from an earlier
    fit, or 0, and only ``c * count + d`` is measured).
    """

    step: int
    a: float | None
    b: float | None
    c: float | None
    d: float | None
    fitted: bool
    predicted_step_s: float | None
    measured_step_s: float
    rms_s: float | None
    steps_used: int
    outlier_steps: int
    c_measured: bool = False
    prior: tuple[float, float, float] | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def rank_rows(per_rank: Any) -> tuple[list[float], list[float], list[float], list[float]]:
    """(tokens, sq_tokens, microbatches, work seconds) per rank from a ``StepRecord``, its ``per_rank`` list, or
    dicts. Work is ``busy_s`` less ``device_wait_s``: the waits of ``odc.lockstep``'s meetings on the device, which
    ``busy_s`` includes (as a collective's are) and which are no cost of the rank's samples; fitted with them, every
    rank of a lock-step step looks equally busy whatever its load."""
    cols = ([], [], [], [])
    for r in getattr(per_rank, "per_rank", per_rank):
        r = r if isinstance(r, Mapping) else vars(r)
        for col, key in zip(cols[:3], ("tokens", "sq_tokens", "microbatches")):
            col.append(float(r[key]))
        cols[3].append(float(r["busy_s"]) - float(r.get("device_wait_s", 0.0)))
    return cols


class AutoCost:
    """Online fit of the cost model; see the module docstring.

    Args:
        prior: the cost to plan with before the fit (any units) and whose shape the fit is pulled toward.
        window: steps the fit reads (the latest ones).
        warmup_steps: leading observations left out.
        min_steps: observed steps (after warm-up) before the fit replaces the prior (and at least 8 rank-steps).
        prior_rows: weight of the prior's shape, in rank-steps.
        outlier_factor: a step whose relative rms residual exceeds this multiple of the median step's is left out.
        lag: see the module docstring.
    """

    def __init__(self, prior: CostModel, *, window: int = 32, warmup_steps: int = 1, min_steps: int = 2,
                 prior_rows: float = 1.0, outlier_factor: float = 4.0, lag: int = 0) -> None:
        if window < 1 or min_steps < 1 or warmup_steps < 0 or lag < 0:
            raise ValueError("AutoCost needs window >= 1, min_steps >= 1, warmup_steps >= 0 and lag >= 0")
        self.prior = prior
        self.window = int(window)
        self.warmup_steps = int(warmup_steps)
        self.min_steps = int(min_steps)
        self.prior_rows = float(prior_rows)
        self.outlier_factor = float(outlier_factor)
        self.lag = int(lag)
        self.observed = 0  # steps observed, warm-up included
        self._steps: deque[Stats] = deque(maxlen=self.window)
        self._coef: tuple[float, float, float, float] | None = None  # (a, b, c, d) in seconds once fitted
        self._history: dict[int, tuple[float, float, float] | None] = {0: None}  # observed -> plan coefficients
        self.last_update: CostUpdate | None = None

    # -- planning --------------------------------------------------------------------------------------------------
    @property
    def model(self) -> CostModel:
        """The cost to plan with now."""
        return self._as_model(self._history[self.observed])

    def model_for(self, minibatch: int) -> CostModel:
        """The cost that plans global minibatch ``minibatch``: the fit after ``minibatch - lag`` observations (or
        the latest one when fewer were made)."""
        n = min(self.observed, max(0, int(minibatch) - self.lag))
        return self._as_model(self._history.get(n, self._history[min(self._history)]))

    def _as_model(self, coef: tuple[float, float, float] | None) -> CostModel:
        return self.prior if coef is None else FittedCost(*coef)

    # -- measuring -------------------------------------------------------------------------------------------------
    def observe(self, tokens: Sequence[float], sq_tokens: Sequence[float], microbatches: Sequence[float],
                busy_s: Sequence[float]) -> CostUpdate:
        """Add one step's per-rank numbers (every rank passes the same gathered lists) and refit."""
        step = self.observed
        stats = stats_of(tokens, sq_tokens, microbatches, busy_s)
        measured = max(busy_s) if len(busy_s) else 0.0
        predicted = None
        if self._coef is not None and len(busy_s):
            a, b, c, d = self._coef
            rows = np.asarray([tokens, sq_tokens, microbatches], dtype=np.float64)
            predicted = float((a * rows[0] + b * rows[1] + c * rows[2] + d).max())
        self.observed += 1
        if step >= self.warmup_steps:
            self._steps.append(stats)
        rms = None
        outliers = 0
        varied = False
        if len(self._steps) >= self.min_steps and sum(s.n for s in self._steps) >= 8:  # 2 rows per coefficient
            coef, inliers = self._fit()
            if coef[0] + coef[1] + coef[2] > 0.0:  # an all-zero fit would make every plan arbitrary
                self._coef = coef
                outliers = len(self._steps) - len(inliers)
                total = Stats.total(inliers)
                rms = math.sqrt(residual_ss(total, coef) / max(total.n, 1))
                # n * sum(M^2) - sum(M)^2 > 0: the counts differ somewhere (exact: integers in floats)
                varied = total.n * total.G[10] - total.G[11] * total.G[11] > 0.5
        self._history[self.observed] = None if self._coef is None else self._coef[:3]
        for n in [n for n in self._history if n < self.observed - self.lag]:
            del self._history[n]
        a, b, c, d = self._coef if self._coef is not None else (None, None, None, None)
        self.last_update = CostUpdate(step=step, a=a, b=b, c=c, d=d, fitted=self._coef is not None,
                                      predicted_step_s=predicted, measured_step_s=float(measured), rms_s=rms,
                                      steps_used=len(self._steps) - outliers, outlier_steps=outliers,
                                      c_measured=varied, prior=tuple(float(x) for x in self.prior.coefficients()))
        return self.last_update

    def _fit(self) -> tuple[tuple[float, float, float, float], list[Stats]]:
        steps = list(self._steps)
        inliers = steps
        coef = self._solve(Stats.total(inliers))
        for _ in range(3):  # refit without the outliers until the set is stable
            keep = [s for s, ok in zip(steps, self._typical(steps, coef)) if ok]
            if len(keep) == len(inliers):
                break
            inliers = keep
            coef = self._solve(Stats.total(inliers))
        return coef, inliers

    def _typical(self, steps: list[Stats], coef: Sequence[float]) -> list[bool]:
        """Which steps look like the others under ``coef``: by the ratio of their measured to predicted total busy
        time (a profiled step is slower on every rank) and by their rms residual (one rank stalled)."""
        log_ratio = [math.log(max(s.h[3], 1e-300) / max(_predicted_total(s, coef), 1e-300)) for s in steps]
        rel = [_relative_rms(s, coef) for s in steps]
        mid = statistics.median(log_ratio)
        spread = 1.4826 * statistics.median(abs(x - mid) for x in log_ratio)  # MAD, as a standard deviation
        ratio_limit = max(self.outlier_factor * spread, _MIN_OUTLIER_LOG_RATIO)
        rms_limit = max(self.outlier_factor * statistics.median(rel), _MIN_OUTLIER_RMS)
        return [abs(x - mid) <= ratio_limit and e <= rms_limit for x, e in zip(log_ratio, rel)]

    def _solve(self, total: Stats) -> tuple[float, float, float, float]:
        G, h, n = total.G, total.h, max(total.n, 1)
        prior = self.prior.coefficients()
        # Scale the prior's shape to seconds: busy ~ s * prior_cost + d (two unknowns, from the same statistics).
        p = (*prior, 0.0)
        Gp = [math.fsum(G[4 * i + j] * p[j] for j in range(4)) for i in range(4)]
        qq = math.fsum(p[i] * Gp[i] for i in range(4))
        q1, qy = Gp[3], math.fsum(p[i] * h[i] for i in range(4))
        det = qq * n - q1 * q1
        s = max((qy * n - q1 * h[3]) / det, 0.0) if det > 0.0 else 0.0
        target = (s * prior[0], s * prior[1], s * prior[2], (h[3] - s * q1) / n)
        # The prior counts like `prior_rows` rank-steps in every direction the data measures (a Zellner g-prior:
        # the fit is the least-squares one shrunk toward the prior by prior_rows / (rows + prior_rows)).
        g = self.prior_rows / n
        penalty = [g * G[k] for k in range(16)]
        pulled = [math.fsum(penalty[4 * i + j] * target[j] for j in range(4)) for i in range(4)]
        # What the data cannot tell apart at all is settled by a hundredth of a row per coefficient, toward the last
        # fit (at first: the prior's shape, and no per-microbatch cost). So while every rank runs the same number
        # of microbatches c stays what it was; before it was ever measured it is 0, which lets lb-mini try uneven
        # counts, and those steps measure it.
        hold = self._coef[:3] if self._coef is not None else (target[0], target[1], 0.0)
        for k in range(3):
            weight = 0.01 * G[5 * k] / n
            penalty[5 * k] += weight
            pulled[k] += weight * hold[k]
        a, b, c, d = solve(total, penalty=penalty, pulled=pulled)  # all four non-negative, as the hand fit
        return a, b, c, d

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "observed": self.observed,
            "steps": [s.as_list() for s in self._steps],
            "coef": None if self._coef is None else list(self._coef),
            "history": {str(n): (None if c is None else list(c)) for n, c in self._history.items()},
            "settings": self._settings(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("settings") != self._settings():
            raise ValueError(f"cannot resume the automatic cost: the checkpoint's settings {state.get('settings')} "
                             f"differ from this run's {self._settings()}")
        self.observed = int(state["observed"])
        self._steps = deque((Stats.from_list(s) for s in state["steps"]), maxlen=self.window)
        self._coef = None if state["coef"] is None else tuple(float(x) for x in state["coef"])
        self._history = {int(n): (None if c is None else tuple(float(x) for x in c))
                         for n, c in state["history"].items()}

    def _settings(self) -> dict[str, Any]:
        return {"prior": [float(x) for x in self.prior.coefficients()], "window": self.window,
                "warmup_steps": self.warmup_steps, "min_steps": self.min_steps, "prior_rows": self.prior_rows,
                "outlier_factor": self.outlier_factor, "lag": self.lag}


def _predicted_total(stats: Stats, coef: Sequence[float]) -> float:
    """Sum over the step's ranks of the predicted busy time (the constant column's row of G holds the sums)."""
    G = stats.G
    return coef[0] * G[3] + coef[1] * G[7] + coef[2] * G[11] + coef[3] * G[15]


def _relative_rms(stats: Stats, coef: Sequence[float]) -> float:
    """A step's rms residual relative to its rms busy time."""
    return math.sqrt(residual_ss(stats, coef) / max(stats.yy, 1e-300))
