"""The bound of every equality test: how far two computations of the same step may legitimately differ.

[Note: the bound]
An equality test compares two fp32 computations of the same training: ODC against stock ZeRO-3, the stock Trainer or
stock TRL, or a distributed run against one process computing the same minibatches. Done right, they differ only by
rounding: the same terms summed in another order, the same sequence computed in another microbatch shape. How large
that rounding grows depends on the CPU's kernels (MKL's and ATen's AVX-512, AVX2 or scalar paths), the model, the loss
and the number of steps, so a constant tuned on one CPU fails on another. Each test therefore measures, in the same
launch, two distances of the same kind (the same norm, the same scale):

* ``measured``: the run under test from the run it must equal (ODC from stock, ODC from the one-process reference);
* ``reference``: the run it must equal from the same computation in float64, i.e. how far fp32 rounding moved the
  legitimate implementation itself on this machine's kernels. The float64 computation is the one-process reference
  in float64 where the test has one, and otherwise the stock trainer in float64 on the same ranks (DDP instead of
  ZeRO-3, which refuses float64: the same data, weights and optimizer, gradients averaged over the ranks alike);

and passes when::

    measured <= FACTOR * reference + ulps * eps

``FACTOR`` = 4: two fp32 approximations of one float64 answer, each off by about the reference distance, differ by
up to about twice it (by about 1.4 times it on average when their roundings are independent); 4 leaves room for the
run under test rounding less luckily than the reference does on some machine. Over the suite's equality tests on an
AVX-512 Xeon with its own, AVX2 and scalar kernels, measured / reference of the parameter comparisons stayed at or
below 1.7 and no comparison came closer than 0.4 of its bound. The floor is in units of roundoff ``eps`` of the compared dtype (1.2e-7 in fp32), for a reference that
happens to round exactly: one unit (``ulps=1``) for distances between whole parameter sets, which pool the rounding
of many elements; ``SCALAR_ULPS`` = 16 for single logged values (a loss, a gradient norm), which are one draw of
their rounding each: ODC sums a norm's squares in fp32 (up to log2(n) ~ 16 roundings over the model's elements) where
stock sums them in float64, and TRL logs every value in fp32, so the float64 run's values are rounded too. A single
logged value's rounding is also a single draw, which may happen to be small: the logged values of a run share one
reference, the largest distance of any of them from float64 over all its steps (see :func:`compare_logs`), pooled
over every case of a launch where a launch trains several (tests/integrations/test_trl_grpo.py). A value that is a
sum of terms of order 1 that nearly cancel (a GRPO loss, TRL's KL) is compared relative to max(|value|, 1): its
rounding is that of its terms, not of the small result.

What a real error gives: a missing microbatch or a wrong loss weight changes a step's gradient by a fraction of
itself, so the parameters by a fraction of how far the steps moved them (1e-2 of their norm or more in every test):
1e-4 and more, while the references are 1e-8 to 1e-5 and the bounds at most a few times that. Each kind of comparison
has a planted-error check (:func:`assert_caught`) showing its bound fails when a microbatch is dropped or a weight is
wrong.

A reference larger than ``limit`` (default ``1000 * eps``: 1.2e-4 in fp32) is not rounding: the float64 computation
computes something else (another weight, other data), which would make the bound loose; :func:`assert_within` fails
then too, saying so.

Every comparison is appended as a JSON line to the file named by ``ODC_TOLERANCE_LOG`` when it is set (with the
test's id and the CPU kernels in use), to tabulate the distances of a whole run.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass

FACTOR = 4.0
SCALAR_ULPS = 16.0
FP32_EPS = 2.0 ** -23  # torch.finfo(torch.float32).eps
BF16_EPS = 2.0 ** -7  # torch.finfo(torch.bfloat16).eps
LIMIT_IN_EPS = 1000.0

__all__ = ["BF16_EPS", "FACTOR", "FP32_EPS", "SCALAR_ULPS", "Comparison", "assert_caught", "assert_within", "compare",
           "compare_logs", "logged_distance", "logs_reference", "plant_wrong_weight"]


@dataclass(frozen=True)
class Comparison:
    """One measured distance against its bound (see [Note: the bound] in this module)."""

    what: str
    measured: float
    reference: float
    eps: float = FP32_EPS  # one unit of roundoff of the compared dtype
    ulps: float = 1.0  # the floor, in units of eps
    limit: float | None = None  # the largest reference that is still rounding (default LIMIT_IN_EPS * eps)

    @property
    def bound(self) -> float:
        return FACTOR * self.reference + self.ulps * self.eps

    @property
    def reference_limit(self) -> float:
        return LIMIT_IN_EPS * self.eps if self.limit is None else self.limit

    @property
    def holds(self) -> bool:
        return self.measured <= self.bound and self.reference <= self.reference_limit

    def __str__(self) -> str:
        text = (f"{self.what}: measured {self.measured:.4g}, reference {self.reference:.4g}, bound {self.bound:.4g} "
                f"(= {FACTOR:g} x reference + {self.ulps:g} x {self.eps:.3g})")
        if self.reference > self.reference_limit:
            text += (f"; the reference is above {self.reference_limit:.3g}, more than rounding: the float64 "
                     "computation is not the same computation")
        return text


def compare(what: str, measured: float, reference: float, *, eps: float = FP32_EPS, ulps: float = 1.0,
            limit: float | None = None) -> Comparison:
    """A :class:`Comparison`; NaN counts as infinitely far (a NaN on one side only is a failure)."""
    measured, reference = (math.inf if math.isnan(x) else float(x) for x in (measured, reference))
    return Comparison(what, measured, reference, eps, ulps, limit)


def logged_distance(logs: list[dict], reference: list[dict], key: str, scale: float = 0.0) -> float:
    """The largest relative difference ``|a - b| / max(|b|, scale)`` of the value ``key`` over the steps (entries)
    that log it; a step that logs it on one side only, or NaN on one side only, counts as infinitely far."""
    if len(logs) != len(reference) or not logs:
        return math.inf
    far = 0.0
    for mine, theirs in zip(logs, reference):
        if key not in mine and key not in theirs:
            continue
        if key not in mine or key not in theirs:
            return math.inf
        a, b = mine[key], theirs[key]
        if isinstance(b, float) and math.isnan(b):
            far = far if isinstance(a, float) and math.isnan(a) else math.inf
            continue
        far = max(far, abs(a - b) / max(abs(b), scale, 1e-300))
    return far


def logs_reference(stock: list[dict], fp64: list[dict], scales: dict[str, float] | None = None,
                   default_scale: float = 0.0) -> float:
    """The reference distance of a run's logged values: the largest distance of any value ``stock`` logs from the
    same value ``fp64`` logs, over all steps (see [Note: the bound] for why one for all)."""
    scales = scales or {}
    return max(logged_distance(stock, fp64, k, scales.get(k, default_scale)) for k in sorted(set().union(*stock)))


def compare_logs(what: str, logs: list[dict], stock: list[dict], fp64: list[dict], keys=None, *,
                 scales: dict[str, float] | None = None, default_scale: float = 0.0,
                 reference: float | None = None) -> list[Comparison]:
    """Every value ``logs`` or ``stock`` log, at every step: ``logs`` (the run under test) against ``stock``, with
    one reference for all: ``reference``, by default :func:`logs_reference` of ``stock`` and ``fp64``. ``scales``:
    per key, the smallest size a difference is taken relative to (``default_scale`` for the others), for values that
    sit near 0. ``keys``: only these values (default: every one either run logs)."""
    scales = scales or {}
    keys = sorted(set().union(*logs, *stock)) if keys is None else sorted(keys)
    if reference is None:
        reference = logs_reference(stock, fp64, scales, default_scale)
    return [compare(f"{what}: logged {k!r}", logged_distance(logs, stock, k, scales.get(k, default_scale)),
                    reference, ulps=SCALAR_ULPS) for k in keys]


def assert_within(*comparisons: Comparison) -> None:
    """Fail, listing every comparison out of its bound with its three numbers, unless all hold."""
    _log(comparisons, planted=False)
    failed = [c for c in comparisons if not c.holds]
    if failed:
        raise AssertionError("out of bound (see tests/_support/tolerance.py):\n" + "\n".join(map(str, failed)))


def assert_caught(*comparisons: Comparison, margin: float = 10.0) -> None:
    """A planted error: every comparison must fail its bound, by at least ``margin`` times (so the bound did not
    catch it by luck), with a reference that is rounding (so the bound itself was tight)."""
    _log(comparisons, planted=True)
    missed = [c for c in comparisons if not (c.measured > margin * c.bound and c.reference <= c.reference_limit)]
    if missed:
        raise AssertionError(f"a planted error within {margin:g} x its bound: the bound would not catch it:\n"
                             + "\n".join(map(str, missed)))


def plant_wrong_weight(owner, scale: float, call: int = 0, rank: int = 0) -> None:
    """Plant a real error for :func:`assert_caught`: on rank ``rank``, the ``call``-th ``owner.backward(loss, ...)``
    (a DeepSpeed engine's, or a Trainer's ``accelerator``) backpropagates ``loss * scale`` instead: one microbatch
    weighted wrong, or missing altogether with ``scale=0`` (its forward and backward still run, so nothing but the
    gradient changes)."""
    import torch.distributed as dist
    if dist.get_rank() != rank:
        return
    backward, calls = owner.backward, [0]

    def planted(loss, *args, **kwargs):
        calls[0] += 1
        return backward(loss * scale if calls[0] == call + 1 else loss, *args, **kwargs)

    owner.backward = planted


def _log(comparisons, planted: bool) -> None:
    path = os.environ.get("ODC_TOLERANCE_LOG")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    kernels = {k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "OPENBLAS_CORETYPE")}
    with open(path, "a") as f:
        for c in comparisons:
            f.write(json.dumps({"test": test, **asdict(c), "bound": c.bound, "holds": c.holds, "planted": planted,
                                "kernels": kernels}) + "\n")
