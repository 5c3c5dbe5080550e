"""Host time against device time of one training step, from the torch profiler.

ZeRO-3's weak spot is the host: per-parameter hooks and many small communication calls can keep the GPU waiting.
``profile_step`` wraps one step and reports the wall time, the host time spent inside profiled ops, the GPU's busy
time (sum of kernel and copy times) and its idle time (wall minus busy: the GPU waiting for the host or for peers).
Given the decoder layers, it also times every layer forward (recomputations under activation checkpointing
included) as a profiler range opened before any other forward pre-hook (so ZeRO's parameter fetch is inside) and
closed after every post-hook (the release too): host time in the range against the device time of the work the
range launched. A layer whose host time exceeds its device time keeps the GPU waiting. It writes the top ops and a
Chrome trace per rank.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Sequence

import torch

from ds_odc.metrics import device_sync

LAYER_RANGE = "ds_odc.layer_forward"


@contextlib.contextmanager
def _layer_ranges(layers: Sequence[torch.nn.Module]):
    """One profiler range around each layer call, outermost of all the layer's hooks."""
    from torch.autograd.profiler import record_function

    open_ranges: list = []

    def enter(module, args):
        scope = record_function(LAYER_RANGE)
        scope.__enter__()
        open_ranges.append(scope)

    def leave(module, args, output):
        open_ranges.pop().__exit__(None, None, None)

    handles = []
    for layer in layers:
        handles.append(layer.register_forward_pre_hook(enter, prepend=True))
        handles.append(layer.register_forward_hook(leave))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def profile_step(out_dir: str | Path, rank: int, layers: Sequence[torch.nn.Module] = (), top: int = 25):
    """Profile the enclosed code; the yielded dict is filled with the summary on exit."""
    from torch.profiler import ProfilerActivity, profile

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    summary: dict = {}
    device_sync()
    with profile(activities=activities, record_shapes=False) as prof, _layer_ranges(layers):
        started = time.perf_counter()
        yield summary
        device_sync()
        wall = time.perf_counter() - started
    events = prof.key_averages()
    host = sum(e.self_cpu_time_total for e in events) / 1e6
    device = sum(getattr(e, "self_device_time_total", 0.0) for e in events) / 1e6
    summary.update(wall_s=wall, host_op_s=host, device_busy_s=device, device_idle_s=max(wall - device, 0.0))
    ranges = [e for e in events if e.key == LAYER_RANGE]
    if ranges:
        calls = ranges[0].count
        summary.update(layer_forward_calls=calls,
                       layer_forward_host_ms=ranges[0].cpu_time_total / calls / 1e3,
                       layer_forward_device_ms=getattr(ranges[0], "device_time_total", 0.0) / calls / 1e3)
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    (out / f"profile_rank{rank}.txt").write_text(
        f"{summary}\n\n"
        + events.table(sort_by="self_cpu_time_total", row_limit=top)
        + ("\n\n" + events.table(sort_by=sort_by, row_limit=top) if cuda else ""))
    prof.export_chrome_trace(str(out / f"trace_rank{rank}.json"))


def describe(summary: dict) -> str:
    """One line for logs."""
    text = (f"wall {summary['wall_s']:.2f}s, device busy {summary['device_busy_s']:.2f}s, device idle "
            f"{summary['device_idle_s']:.2f}s, host in ops {summary['host_op_s']:.2f}s")
    if "layer_forward_calls" in summary:
        text += (f"; layer forward ({summary['layer_forward_calls']} calls): host {summary['layer_forward_host_ms']:.2f}"
                 f" ms, device {summary['layer_forward_device_ms']:.2f} ms per call")
    return text
