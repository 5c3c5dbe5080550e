"""Shared setup for the GPU tests: build the NVSHMEM op once, in this process, before any rank needs it; and show
what the ranks of each multi-rank test measured (differences from the reference, seconds to an error) at the end."""

from __future__ import annotations

import json
import numbers

import pytest
import torch

import _launch


@pytest.fixture(scope="session")
def nvshmem_op():
    """The compiled ds_odc NVSHMEM extension (workers launched afterwards load it from the build cache)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ds_odc.ops.builder import load_op
    return load_op(verbose=True)


@pytest.fixture(scope="session", autouse=True)
def _gpu_partitions():
    """With ``ODC_TEST_GPU_PARTITIONS=1``: one MPS daemon for the session (ranks that share GPU 0 then run on SM
    partitions of it; ``_launch.gpu_env``), started before any test's own temporary folder exists and stopped at the
    end of the session."""
    if not _launch.PARTITIONS or _launch.gpu_count() == 0:
        yield
        return
    from ds_odc.training.partition import gpu_partitions
    with gpu_partitions(1) as env:
        _launch.MPS.update(env)
        yield
        _launch.MPS.clear()


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory():
    """Tests in this process (kernel checks) must not keep GPU memory cached while other tests' ranks need it."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _attach_rank_reports(request):
    _launch.RUNNING_TEST.append(request.node)
    yield
    _launch.RUNNING_TEST.pop()


def measured_values(value, prefix: str = "") -> list[str]:
    """``key=number`` for every number or flag in what ranks reported (lists of more than 6 numbers as their max)."""
    if isinstance(value, bool) or value is None:
        return [f"{prefix}={value}"] if prefix and isinstance(value, bool) else []
    if isinstance(value, numbers.Number):
        return [f"{prefix}={value:.3g}" if isinstance(value, float) else f"{prefix}={value}"]
    if isinstance(value, dict):
        return [item for key, sub in value.items() for item in measured_values(sub, f"{prefix}.{key}".lstrip("."))]
    if isinstance(value, list):
        if len(value) > 6 and all(isinstance(v, numbers.Number) and not isinstance(v, bool) for v in value):
            return [f"{prefix}.max={max(value):.3g}"]
        return [item for i, sub in enumerate(value) for item in measured_values(sub, f"{prefix}[{i}]")]
    return []


def pytest_terminal_summary(terminalreporter):
    lines = []
    for outcome in ("passed", "failed"):
        for report in terminalreporter.stats.get(outcome, []):
            if report.when != "call":
                continue
            for name, text in report.user_properties:
                if name == "measured":
                    shown = " ".join(measured_values(json.loads(text)))
                    lines.append(f"{report.nodeid.split('::')[-1]} [{outcome}]: {shown[:600]}")
    if lines:
        terminalreporter.section("what the multi-rank GPU tests measured")
        for line in lines:
            terminalreporter.write_line(line)
