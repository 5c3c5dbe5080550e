"""Host time against device time of one training step, from the torch profiler.

ZeRO-3's weak spot is the host: per-parameter hooks and many small communication calls can keep the GPU waiting.
``profile_step`` wraps one step and reports the wall time, the host time spent inside profiled ops, the GPU's busy
time (union of kernel and copy intervals) and its idle time (wall minus busy: the GPU waiting for the host or for peers).
Given the decoder layers, it also times every layer call from before its first forward pre-hook (so ZeRO's parameter
fetch is inside) to after its last post-hook (the release too): host time, measured per thread, against the GPU
span of that range and the GPU's busy time inside the span (from the trace). A layer whose host time reaches its GPU
span keeps the GPU waiting. It writes the top ops and a Chrome trace per rank.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Sequence

import torch

from ds_odc.training.metrics import device_sync

__all__ = ["profile_step", "describe", "decoder_layers", "LAYER_RANGE"]

LAYER_RANGE = "ds_odc.layer_forward"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (``model.model.layers``), or none for other shapes."""
    return list(getattr(getattr(model, "model", None), "layers", ()))


@contextlib.contextmanager
def _layer_ranges(layers: Sequence[torch.nn.Module], host_seconds: list[float]):
    """One profiler range around each layer call, outermost of all the layer's hooks; appends each call's host time.

    Host time is taken here, per thread (recomputation under activation checkpointing runs on autograd's thread),
    not from the profiler: a range that ends on another thread than it began is not closed in its trace."""
    import threading

    from torch.autograd.profiler import record_function

    local = threading.local()

    def enter(module, args):
        scope = record_function(LAYER_RANGE)
        scope.__enter__()
        local.__dict__.setdefault("stack", []).append((scope, time.perf_counter()))

    def leave(module, args, output):
        scope, started = local.stack.pop()
        host_seconds.append(time.perf_counter() - started)
        scope.__exit__(None, None, None)

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
    layer_host: list[float] = []
    device_sync()
    with profile(activities=activities, record_shapes=False) as prof, _layer_ranges(layers, layer_host):
        started = time.perf_counter()
        yield summary
        device_sync()
        wall = time.perf_counter() - started
    events = prof.key_averages()
    trace = out / f"trace_rank{rank}.json"
    prof.export_chrome_trace(str(trace))
    timeline = _timeline(json.loads(trace.read_text()).get("traceEvents", []))
    busy = timeline.pop("device_busy_s")
    summary.update(wall_s=wall, host_op_s=sum(e.self_cpu_time_total for e in events) / 1e6, device_busy_s=busy,
                   device_idle_s=max(wall - busy, 0.0), **timeline)
    if layer_host:
        summary.update(layer_forward_calls=len(layer_host),
                       layer_forward_host_ms=sum(layer_host) / len(layer_host) * 1e3)
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    (out / f"profile_rank{rank}.txt").write_text(
        f"{summary}\n\n"
        + events.table(sort_by="self_cpu_time_total", row_limit=top)
        + ("\n\n" + events.table(sort_by=sort_by, row_limit=top) if cuda else ""))


_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _covered(merged: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in merged)


def _timeline(trace_events: list) -> dict:
    """From the Chrome trace (times in us): device busy time (kernels, copies, memsets on any stream, overlaps counted
    once) and, per layer forward, the range's device span and the device's busy time inside it."""
    events = [e for e in trace_events if isinstance(e, dict) and "dur" in e]
    device = _union([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in _DEVICE_CATEGORIES])
    result = {"device_busy_s": sum(b - a for a, b in device) / 1e6}
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events
             if e.get("cat") == "gpu_user_annotation" and e.get("name") == LAYER_RANGE]
    if spans:
        result.update(layer_forward_device_span_ms=sum(b - a for a, b in spans) / len(spans) / 1e3,
                      layer_forward_device_ms=sum(_covered(device, a, b) for a, b in spans) / len(spans) / 1e3)
    return result


def describe(summary: dict) -> str:
    """One line for logs."""
    text = (f"wall {summary['wall_s']:.2f}s, device busy {summary['device_busy_s']:.2f}s, device idle "
            f"{summary['device_idle_s']:.2f}s, host in ops {summary['host_op_s']:.2f}s")
    if "layer_forward_calls" in summary:
        text += (f"; layer forward ({summary['layer_forward_calls']} calls): host {summary['layer_forward_host_ms']:.2f}"
                 f" ms, device busy {summary.get('layer_forward_device_ms', 0.0):.2f} ms of a "
                 f"{summary.get('layer_forward_device_span_ms', 0.0):.2f} ms span per call")
    return text
