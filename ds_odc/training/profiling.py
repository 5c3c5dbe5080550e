"""Host time against device time of one training step, from the torch profiler.

ZeRO-3's weak spot is the host: per-parameter hooks and many small communication calls can keep the GPU waiting.
``profile_step`` wraps one step and reports the wall time, the host time spent inside profiled ops, the GPU's busy
time (union of kernel and copy intervals) and its idle time (wall minus busy: the GPU waiting for the host or for peers).
Given the decoder layers, it also times every layer call from before its first forward pre-hook (so ZeRO's parameter
fetch is inside) to after its last post-hook (the release too): host time, measured per thread, against the GPU
span of that range and the GPU's busy time inside the span (from the trace). A layer whose host time reaches its GPU
span keeps the GPU waiting. And it says what the host was doing while the GPU idled: every moment of device idle time
is charged to the innermost host event then running on each thread (an op, a CUDA call, a ``record_function`` range
or, with ``python_stacks``, a Python function), and, with ``python_stacks``, to the innermost Python frame of the
training code (DeepSpeed, ds_odc, transformers, TRL, the script): where a fix would go. It writes the top ops and a
Chrome trace per rank.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Sequence

import torch

from ds_odc.training.metrics import device_sync

__all__ = ["profile_step", "describe", "decoder_layers"]

LAYER_RANGE = "ds_odc.layer_forward"
IDLE_TOP = 15  # host events listed against the device's idle time


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
def profile_step(out_dir: str | Path, rank: int, layers: Sequence[torch.nn.Module] = (), top: int = 25,
                 python_stacks: bool = False):
    """Profile the enclosed code; the yielded dict is filled with the summary on exit. ``python_stacks`` records
    Python calls too (slower host: for finding where the host time goes, not for timing)."""
    from torch.profiler import ProfilerActivity, profile

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    summary: dict = {}
    layer_host: list[float] = []
    device_sync()
    with (profile(activities=activities, record_shapes=False, with_stack=python_stacks) as prof,
          _layer_ranges(layers, layer_host)):
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
    idle = "\n".join(f"{seconds * 1e3:10.1f} ms  {name}" for name, seconds in summary["idle_host"])
    frames = "\n".join(f"{seconds * 1e3:10.1f} ms  {name}" for name, seconds in summary["idle_python"])
    (out / f"profile_rank{rank}.txt").write_text(
        f"{summary}\n\ndevice idle, by the host event running meanwhile (innermost, per thread):\n{idle}\n\n"
        f"device idle, by the training code's Python frame running meanwhile (innermost, per thread; "
        f"with python_stacks):\n{frames}\n\n"
        + events.table(sort_by="self_cpu_time_total", row_limit=top)
        + ("\n\n" + events.table(sort_by=sort_by, row_limit=top) if cuda else ""))


_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")


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


def _innermost(events: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """One thread's nested events -> the intervals where each is the innermost one running (its self time)."""
    segments, stack, cursor = [], [], 0.0
    for start, end, name in sorted(events, key=lambda e: (e[0], -e[1])):
        while stack and stack[-1][1] <= start:
            _, top_end, top_name = stack.pop()
            segments.append((cursor, top_end, top_name))
            cursor = top_end
        if stack:
            segments.append((cursor, start, stack[-1][2]))
            end = min(end, stack[-1][1])
        stack.append((start, end, name))
        cursor = start
    while stack:
        _, top_end, top_name = stack.pop()
        segments.append((cursor, top_end, top_name))
        cursor = top_end
    return [s for s in segments if s[1] > s[0]]


def _short(name: str) -> str:
    """``/long/path/site-packages/deepspeed/x.py(12): f`` -> ``deepspeed/x.py(12): f``."""
    for root in ("site-packages/", "dist-packages/"):
        if root in name:
            return name.split(root, 1)[1]
    return name


def _idle_gaps(host: list[dict], device: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The device's idle intervals within the host events' extent."""
    first, last = min(e["ts"] for e in host), max(e["ts"] + e["dur"] for e in host)
    idle, cursor = [], first
    for a, b in device:
        if a > cursor:
            idle.append((cursor, min(a, last)))
        cursor = max(cursor, b)
    if cursor < last:
        idle.append((cursor, last))
    return idle


def _thread_names(threads: dict) -> dict:
    """``main`` for the thread whose first event is the earliest, ``autograd`` for another that runs autograd's
    backward nodes (a GPU's backward runs on a thread of its own; a CPU's on the main thread), ``thread N`` else."""
    names, n = {}, 0
    for key in sorted(threads, key=lambda k: min(e[0] for e in threads[k])):
        if not names:
            names[key] = "main"
        elif "autograd" not in names.values() and any(
                e[2].startswith("autograd::engine::evaluate_function") for e in threads[key]):
            names[key] = "autograd"
        else:
            n += 1
            names[key] = f"thread {n}"
    return names


def _charge(threads: dict, idle: list[tuple[float, float]], names: dict) -> list[tuple[str, float]]:
    """Idle time charged to each thread's innermost event, as ``[thread] event``."""
    charged: dict[str, float] = {}
    for key in threads:
        label = f"[{names[key]}] "
        gap = 0
        for start, end, name in _innermost(threads[key]):
            while gap < len(idle) and idle[gap][1] <= start:
                gap += 1
            g = gap
            while g < len(idle) and idle[g][0] < end:
                overlap = min(end, idle[g][1]) - max(start, idle[g][0])
                if overlap > 0:
                    charged[label + _short(name)] = charged.get(label + _short(name), 0.0) + overlap / 1e6
                g += 1
    return sorted(charged.items(), key=lambda kv: -kv[1])[:IDLE_TOP]


# Python frames of the training code, as opposed to torch's and the standard library's: where a fix would go.
_TRAINING_CODE = ("deepspeed/", "ds_odc/", "transformers/", "trl/", "accelerate/", "examples/", "benchmarks/")


def _idle_host(events: list[dict], device: list[tuple[float, float]]) -> dict[str, list[tuple[str, float]]]:
    """Device idle time charged, per thread, to the innermost host event (``idle_host``) and to the innermost Python
    frame of the training code (``idle_python``; empty without Python stacks)."""
    host = [e for e in events if e.get("cat") in _HOST_CATEGORIES]
    if not host:
        return {"idle_host": [], "idle_python": []}
    idle = _idle_gaps(host, device)
    # Threads that ran no op and no CUDA call (a Python thread sleeping in a loop, say) did no work for the GPU.
    working = {(e.get("pid"), e.get("tid")) for e in host if e.get("cat") != "python_function"}
    every, frames = {}, {}
    for e in host:
        key = (e.get("pid"), e.get("tid"))
        if key not in working:
            continue
        event = (e["ts"], e["ts"] + e["dur"], e.get("name", "?"))
        every.setdefault(key, []).append(event)
        if e.get("cat") == "python_function" and any(root in event[2] for root in _TRAINING_CODE):
            frames.setdefault(key, []).append(event)
    names = _thread_names(every)
    return {"idle_host": _charge(every, idle, names), "idle_python": _charge(frames, idle, names)}


def _timeline(trace_events: list) -> dict:
    """From the Chrome trace (times in us): device busy time (kernels, copies, memsets on any stream, overlaps counted
    once), what the host did while the device idled, and, per layer forward, the range's device span and the device's
    busy time inside it."""
    events = [e for e in trace_events if isinstance(e, dict) and "dur" in e and "ts" in e]
    device = _union([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in _DEVICE_CATEGORIES])
    result = {"device_busy_s": sum(b - a for a, b in device) / 1e6, **_idle_host(events, device)}
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
