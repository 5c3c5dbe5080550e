"""Every read of gradient state between backward and step returns stock ZeRO-3's value at its first call (see
[Note: gradient reads] in ds_odc/zero/_deepspeed_privates.py).

Two halves:

* the register: every member of DeepSpeed's stage-3 optimizer whose code touches the gradient partitions (found in
  DeepSpeed's own source, so a DeepSpeed that adds one fails here) is either overridden through the gate
  (``reads_gradients``, on ``OdcOptimizer`` with nothing above it) or listed with the reason it needs none;
* DeepSpeed's gradient-clipping test sequence (norm groups right after backward, clamp every local gradient, read
  again, step) at 1, 2 and 3 CPU ranks, fp32 and bf16, with and without ``offload_optimizer``: ODC within stock's
  own rounding of each read (tests/_support/tolerance.py). Before the gate, the first norm read was 0 under ODC.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path

import pytest

from _support.launch import launch
from _support.tolerance import BF16_EPS, FP32_EPS, SCALAR_ULPS, assert_caught, assert_within, compare

WORKER = Path(__file__).with_name("grad_reads_worker.py")

# What "gradient state" is in stage3.py: the per-group lists and the flat buffer of reduced partitions, the map of
# each parameter's partition, the host copies under offload_optimizer (fp32 master's .grad) and their norms.
_STATE_NAMES = {"averaged_gradients", "grad_partitions_flat_buffer", "__param_id_to_grad_partition",
                "norm_for_param_grads"}
_HOST_GRAD = re.compile(r"\bfp32_part|\bfp32_param\b")  # the fp32 master (its flat groups, a partition of them)


def members_touching_gradient_state(source: str, class_name: str) -> set[str]:
    """Methods of ``class_name`` in ``source`` whose code (comments excluded) reads or writes gradient state."""
    tree = ast.parse(source)
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    found = set()
    for fn in cls.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if (isinstance(node, ast.Attribute) and (
                    node.attr in _STATE_NAMES
                    or (node.attr == "grad" and _HOST_GRAD.search(ast.unparse(node.value))))) or (
                    isinstance(node, ast.Constant) and node.value in _STATE_NAMES):  # getattr(self, "...")
                found.add(fn.name)
                break
    return found


def unrouted(found: set[str], owner: type, without_gate: dict[str, str]) -> dict[str, str]:
    """What is wrong with the register: members that touch gradient state but are neither gated on ``owner`` nor
    listed, gated ones that ``owner`` reaches around the gate, and listed ones DeepSpeed no longer has."""
    problems = {}
    for name in sorted(found):
        member = inspect.getattr_static(owner, name, None)
        gated = getattr(member, "gradient_read", None)
        if gated is None and name not in without_gate:
            problems[name] = "touches gradient state, neither gated nor listed in GRADIENT_STATE_WITHOUT_GATE"
        if gated is not None and name in without_gate:
            problems[name] = "gated and listed as needing no gate"
    for name in sorted(set(without_gate) - found):
        problems[name] = "listed in GRADIENT_STATE_WITHOUT_GATE, but DeepSpeed's stage 3 no longer touches it"
    return problems


def _stage3():
    import deepspeed.runtime.zero.stage3 as stage3
    return inspect.getsource(stage3), stage3.DeepSpeedZeroOptimizer_Stage3


def test_every_gradient_read_of_stage3_goes_through_the_gate():
    from ds_odc.zero._deepspeed_privates import GRADIENT_STATE_WITHOUT_GATE
    from ds_odc.zero.optimizer import OdcOptimizer
    source, _ = _stage3()
    found = members_touching_gradient_state(source, "DeepSpeedZeroOptimizer_Stage3")
    # mangled privates keep their source spelling here, so the names in the register are the source's
    assert {"_get_norm_groups", "has_overflow", "get_fp32_grad_partitions", "_get_fp32_grad_state_partition",
            "partition_grads", "step"} <= found, found
    assert unrouted(found, OdcOptimizer, GRADIENT_STATE_WITHOUT_GATE) == {}
    gated = {n for n in dir(OdcOptimizer) if getattr(inspect.getattr_static(OdcOptimizer, n), "gradient_read", None)}
    assert gated == {"_get_norm_groups", "has_overflow", "has_overflow_partitioned_grads_serial",
                     "get_fp32_grad_partitions", "_get_fp32_grad_state_partition", "set_fp32_grad_for_param",
                     "set_local_grad_for_param", "update_fp32_grad_for_param_vectorized"}, gated


def test_the_register_check_catches_a_new_reader_and_a_reader_reached_around_the_gate():
    """Planted: a DeepSpeed that grows a new reader, and an optimizer subclass whose own override hides the gate."""
    from ds_odc.zero._deepspeed_privates import GRADIENT_STATE_WITHOUT_GATE
    from ds_odc.zero.optimizer import OdcOptimizer
    source, _ = _stage3()
    grown = source + textwrap.dedent("""
        class DeepSpeedZeroOptimizer_Stage3Grown(DeepSpeedZeroOptimizer_Stage3):
            def peek_gradients(self):
                # self.grad_partitions_flat_buffer in a comment does not count; the read below does
                return [g.norm() for g in self.averaged_gradients[0]]
        """)
    found = members_touching_gradient_state(grown, "DeepSpeedZeroOptimizer_Stage3Grown")
    assert found == {"peek_gradients"}
    assert "peek_gradients" in unrouted(found, OdcOptimizer, GRADIENT_STATE_WITHOUT_GATE)

    class Around(OdcOptimizer):
        def _get_norm_groups(self):  # an override above the gate: its first read would see unlanded pushes
            return []

    problems = unrouted({"_get_norm_groups"}, Around, {})
    assert "_get_norm_groups" in problems, problems


# ---------------------------------------------------------------------------------------------------------------------
# DeepSpeed's grad-clip sequence, ODC against stock


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"{n}ranks")
def clip_run(request):
    return launch(WORKER, request.param, [], timeout=400).check().result


def _comparisons(result: dict, case: str) -> list:
    precision = case.split("-")[0]
    rounding = result["rounding"][precision]
    eps = BF16_EPS if precision == "bf16" else FP32_EPS
    out = []
    for key, measured in result["cases"][case]["odc_vs_stock"].items():
        kind, ulps = ("params", 1.0) if key.startswith("params") else ("grads", 1.0)
        if key.startswith("grad_norm"):
            ulps = SCALAR_ULPS
        # in bf16 the reference is the bf16 engine's distance from float64: far above fp32 rounding by nature
        out.append(compare(f"{case} {key}: odc vs stock", measured, rounding[kind], eps=eps, ulps=ulps,
                           limit=None if precision == "fp32" else 0.1))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fp32-device", "fp32-offload", "bf16-device", "bf16-offload"])
def test_grad_clip_sequence_reads_what_stock_reads(clip_run, case):
    stock, odc = clip_run["cases"][case]["stock_norms"], clip_run["cases"][case]["odc_norms"]
    assert stock[0] > 0 and stock[1] < stock[0], stock  # the clamp bit: DeepSpeed's own assertion
    assert odc[1] < odc[0], odc
    assert_within(*_comparisons(clip_run, case))


@pytest.mark.slow
def test_a_norm_read_before_the_pushes_landed_would_be_caught(clip_run):
    """The bound is tight enough for the failure it guards against: a first read that sees none of the pushes (0, as
    before the gate), or only this rank's own share, is far outside it."""
    from _support.tolerance import compare as c
    for case in ("fp32-device", "bf16-device"):
        ref = clip_run["rounding"][case.split("-")[0]]["grads"]
        eps = BF16_EPS if case.startswith("bf16") else FP32_EPS
        limit = None if case.startswith("fp32") else 0.1
        assert_caught(c(f"{case}: a norm of 0", 1.0, ref, eps=eps, ulps=SCALAR_ULPS, limit=limit), margin=5)
