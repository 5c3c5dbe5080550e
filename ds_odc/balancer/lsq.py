"""Least squares for the cost fits, bit-identical on every machine.

The model is ``busy = a*T + b*S + c*M + d`` over rank-steps (tokens ``T``, sum of squared document lengths ``S``,
microbatches ``M``). Rows are reduced to sufficient statistics (``X^T X``, ``X^T y``, ``y^T y``, the row count)
with :func:`math.fsum`, which rounds exactly once and so does not depend on the order of the rows or on the CPU's
vector width; the 4x4 system is then solved in plain Python floats. Two ranks given the same rows in any order
therefore get the same bits, which is what lets every rank plan from its own copy of the fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__: list[str] = []

NUM_TERMS = 4  # a (per token), b (per squared document length), c (per microbatch), d (per step)


@dataclass(frozen=True)
class Stats:
    """Sufficient statistics of some rank-steps: ``G = X^T X`` (4x4, row-major), ``h = X^T y``, ``yy``, ``n``."""

    G: tuple[float, ...]
    h: tuple[float, ...]
    yy: float
    n: int

    def __add__(self, other: "Stats") -> "Stats":
        return Stats.total([self, other])

    @staticmethod
    def total(parts: Sequence["Stats"]) -> "Stats":
        """Exactly rounded sums of several statistics (order-independent)."""
        if not parts:
            return Stats((0.0,) * 16, (0.0,) * 4, 0.0, 0)
        G = tuple(math.fsum(p.G[k] for p in parts) for k in range(16))
        h = tuple(math.fsum(p.h[k] for p in parts) for k in range(4))
        return Stats(G, h, math.fsum(p.yy for p in parts), sum(p.n for p in parts))

    def as_list(self) -> list[float]:
        return [*self.G, *self.h, self.yy, float(self.n)]

    @staticmethod
    def from_list(values: Sequence[float]) -> "Stats":
        v = [float(x) for x in values]
        if len(v) != 22:
            raise ValueError(f"cost-fit statistics have 22 numbers, got {len(v)}")
        return Stats(tuple(v[:16]), tuple(v[16:20]), v[20], int(v[21]))


def stats_of(tokens, sq_tokens, microbatches, busy) -> Stats:
    """Statistics of rank-steps given as four equal-length sequences."""
    T = np.asarray(tokens, dtype=np.float64).reshape(-1)
    X = np.stack([T, np.asarray(sq_tokens, dtype=np.float64).reshape(-1),
                  np.asarray(microbatches, dtype=np.float64).reshape(-1), np.ones_like(T)])
    y = np.asarray(busy, dtype=np.float64).reshape(-1)
    if not (X.shape[1] == y.size):
        raise ValueError("tokens, sq_tokens, microbatches and busy need one entry per rank")
    # Element-wise products are exactly rounded everywhere; fsum then makes the sums order-independent.
    upper = {(i, j): math.fsum((X[i] * X[j]).tolist()) for i in range(4) for j in range(i, 4)}
    G = tuple(upper[min(i, j), max(i, j)] for i in range(4) for j in range(4))
    h = tuple(math.fsum((X[i] * y).tolist()) for i in range(4))
    return Stats(G, h, math.fsum((y * y).tolist()), int(y.size))


def residual_ss(stats: Stats, coef: Sequence[float]) -> float:
    """Sum of squared residuals of ``coef`` over the rows behind ``stats`` (``y'y - 2 c'h + c'Gc``, >= 0)."""
    G, h = stats.G, stats.h
    # Plain float arithmetic in a fixed order: deterministic (only sums over rows need fsum's order-independence).
    quad = 0.0
    lin = 0.0
    for i in range(4):
        lin += coef[i] * h[i]
        for j in range(4):
            quad += coef[i] * G[4 * i + j] * coef[j]
    return max(0.0, stats.yy - 2.0 * lin + quad)


def solve(stats: Stats, *, nonnegative: Sequence[bool] = (True,) * 4, penalty: Sequence[float] = (0.0,) * 16,
          pulled: Sequence[float] = (0.0,) * 4) -> tuple[float, ...]:
    """Minimise ``|X c - y|^2 + c' P c - 2 c' q`` with ``c_k >= 0`` where ``nonnegative[k]``.

    ``penalty``: ``P``, 4x4 row-major (symmetric, positive semi-definite); ``pulled``: ``q = P t`` for a pull toward
    ``t`` (sums of such pulls add up). Active set: solve, then fix the most negative constrained coefficient at 0
    and solve again. Columns are scaled to unit norm first (``S`` is ~1e10 where ``M`` is ~1), and a 1e-12
    relative ridge keeps exactly collinear columns solvable.
    """
    G, h = stats.G, stats.h
    P = penalty
    scale = [math.sqrt(G[5 * k] + P[5 * k]) or 1.0 for k in range(4)]
    free = list(range(4))
    while True:
        A = [[(G[4 * i + j] + P[4 * i + j]) / (scale[i] * scale[j]) for j in free] for i in free]
        rhs = [(h[i] + pulled[i]) / scale[i] for i in free]
        for r in range(len(free)):
            A[r][r] += 1e-12
        x = _gauss(A, rhs)
        coef = [0.0] * 4
        for r, i in enumerate(free):
            coef[i] = x[r] / scale[i]
        negative = [i for i in free if nonnegative[i] and coef[i] < 0.0]
        if not negative:
            return tuple(coef)
        free.remove(min(negative, key=lambda i: (coef[i] * scale[i], i)))


def _gauss(A: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting on a small dense system (modified in place)."""
    n = len(b)
    for col in range(n):
        piv = max(range(col, n), key=lambda r: (abs(A[r][col]), -r))
        A[col], A[piv] = A[piv], A[col]
        b[col], b[piv] = b[piv], b[col]
        p = A[col][col]
        if p == 0.0:
            continue
        for r in range(col + 1, n):
            f = A[r][col] / p
            if f:
                for k in range(col, n):
                    A[r][k] -= f * A[col][k]
                b[r] -= f * b[col]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        s = b[r]
        for k in range(r + 1, n):
            s -= A[r][k] * x[k]
        x[r] = s / A[r][r] if A[r][r] != 0.0 else 0.0
    return x
