"""The bound of the LoRA and MoE equality tests: how far two fp32 computations of the same training may differ.

A local stand-in with the interface and rule of the suite's shared bound (``tests/_support/tolerance.py``, where the
reasoning is written out); switching to it is an import change. Each test measures, in the same launch, two
distances of the same kind:

* ``measured``: the run under test (ODC) from the run it must equal (stock ZeRO-3, the stock Trainer or stock TRL);
* ``reference``: that stock run from the same training in float64 (stock without DeepSpeed, which refuses float64:
  DDP on the same ranks, the same data, weights and optimizer), i.e. how far fp32 rounding moved the legitimate
  implementation itself on this machine's kernels;

and passes when ``measured <= FACTOR * reference + ulps * eps``, with a reference that is rounding (at most
``LIMIT_IN_EPS * eps``). ``FACTOR`` = 4: two fp32 approximations of one float64 answer differ by up to about twice
the distance of either, and 4 leaves room for the run under test rounding less luckily. The floor: one unit of
roundoff for whole parameter sets, ``SCALAR_ULPS`` for single logged values (a loss, a gradient norm: one draw of
their rounding each, and fp32 at logging). A planted error (a microbatch missing or weighted wrong) must fail its
bound by at least ``margin`` times (:func:`assert_caught`).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

FACTOR = 4.0
SCALAR_ULPS = 16.0
FP32_EPS = 2.0 ** -23
LIMIT_IN_EPS = 1000.0

__all__ = ["FACTOR", "FP32_EPS", "SCALAR_ULPS", "Comparison", "assert_caught", "assert_within", "compare",
           "compare_logs", "logged_distance", "plant_wrong_weight", "without_deepspeed"]


@dataclass(frozen=True)
class Comparison:
    what: str
    measured: float
    reference: float
    eps: float = FP32_EPS
    ulps: float = 1.0

    @property
    def bound(self) -> float:
        return FACTOR * self.reference + self.ulps * self.eps

    @property
    def reference_limit(self) -> float:
        return LIMIT_IN_EPS * self.eps

    @property
    def holds(self) -> bool:
        return self.measured <= self.bound and self.reference <= self.reference_limit

    def __str__(self) -> str:
        text = (f"{self.what}: measured {self.measured:.4g}, reference {self.reference:.4g}, bound {self.bound:.4g} "
                f"(= {FACTOR:g} x reference + {self.ulps:g} x {self.eps:.3g})")
        if self.reference > self.reference_limit:
            text += f"; the reference is above {self.reference_limit:.3g}: not rounding, another computation"
        return text


def compare(what: str, measured: float, reference: float, *, eps: float = FP32_EPS, ulps: float = 1.0) -> Comparison:
    """A :class:`Comparison`; NaN counts as infinitely far."""
    measured, reference = (math.inf if math.isnan(x) else float(x) for x in (measured, reference))
    return Comparison(what, measured, reference, eps, ulps)


def logged_distance(logs: list[dict], reference: list[dict], key: str, scale: float = 0.0) -> float:
    """The largest ``|a - b| / max(|b|, scale)`` of the value ``key`` over the steps that log it; logged on one side
    only (or NaN on one side only) counts as infinitely far."""
    if len(logs) != len(reference) or not logs:
        return math.inf
    far = 0.0
    for mine, theirs in zip(logs, reference):
        if key not in mine and key not in theirs:
            continue
        if key not in mine or key not in theirs:
            return math.inf
        a, b = float(mine[key]), float(theirs[key])
        if math.isnan(b) or math.isnan(a):
            far = far if math.isnan(a) and math.isnan(b) else math.inf
            continue
        far = max(far, abs(a - b) / max(abs(b), scale, 1e-300))
    return far


def compare_logs(what: str, logs: list[dict], stock: list[dict], fp64: list[dict], keys, *,
                 scales: dict[str, float] | None = None) -> list[Comparison]:
    """``keys`` that ``logs`` and ``stock`` log, every step, against one reference: the largest distance of any of
    them from ``fp64``'s over all steps (a single logged value's rounding is one draw; the run's values share it)."""
    scales = scales or {}
    reference = max(logged_distance(stock, fp64, k, scales.get(k, 0.0)) for k in keys)
    return [compare(f"{what}: logged {k!r}", logged_distance(logs, stock, k, scales.get(k, 0.0)), reference,
                    ulps=SCALAR_ULPS) for k in keys]


def assert_within(*comparisons: Comparison) -> None:
    failed = [c for c in comparisons if not c.holds]
    if failed:
        raise AssertionError("out of bound:\n" + "\n".join(map(str, failed)))


def assert_caught(*comparisons: Comparison, margin: float = 10.0) -> None:
    """A planted error: every comparison fails its bound by at least ``margin`` times, with a reference that is
    rounding (so the bound itself was tight)."""
    missed = [c for c in comparisons if not (c.measured > margin * c.bound and c.reference <= c.reference_limit)]
    if missed:
        raise AssertionError(f"a planted error within {margin:g} x its bound:\n" + "\n".join(map(str, missed)))


def plant_wrong_weight(owner, scale: float, call: int = 0, rank: int = 0) -> None:
    """On rank ``rank``, the ``call``-th ``owner.backward(loss, ...)`` (a Trainer's ``accelerator``) backpropagates
    ``loss * scale`` instead: one microbatch weighted wrong (missing with ``scale=0``)."""
    import torch.distributed as dist
    if dist.get_rank() != rank:
        return
    backward, calls = owner.backward, [0]

    def planted(loss, *args, **kwargs):
        calls[0] += 1
        return backward(loss * scale if calls[0] == call + 1 else loss, *args, **kwargs)

    owner.backward = planted


@contextlib.contextmanager
def without_deepspeed():
    """Build and train a trainer without DeepSpeed in a process whose earlier trainers used it (the float64 runs:
    DeepSpeed refuses float64). Accelerate leaves ``ACCELERATE_USE_DEEPSPEED`` set and transformers may still hold the
    last ZeRO-3 config (models would be built under zero.Init): both are cleared while the block runs."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    saved = os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if saved is not None:
            os.environ["ACCELERATE_USE_DEEPSPEED"] = saved
