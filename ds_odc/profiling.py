"""Host time against device time of one training step, from the torch profiler.

ZeRO-3's weak spot is the host: per-parameter hooks and many small communication calls can keep the GPU waiting.
``profile_step`` wraps one step and reports the wall time, the host time spent inside profiled ops, the GPU's busy
time (sum of kernel and copy times) and its idle time (wall minus busy: the GPU waiting for the host or for peers),
per step and per decoder layer, and writes the top ops and a Chrome trace per rank.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from ds_odc.metrics import device_sync


@contextlib.contextmanager
def profile_step(out_dir: str | Path, rank: int, num_layers: int, top: int = 25):
    """Profile the enclosed code; the yielded dict is filled with the summary on exit."""
    from torch.profiler import ProfilerActivity, profile

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    summary: dict = {}
    device_sync()
    with profile(activities=activities, record_shapes=False) as prof:
        started = time.perf_counter()
        yield summary
        device_sync()
        wall = time.perf_counter() - started
    events = prof.key_averages()
    host = sum(e.self_cpu_time_total for e in events) / 1e6
    device = sum(getattr(e, "self_device_time_total", 0.0) for e in events) / 1e6
    summary.update(wall_s=wall, host_op_s=host, device_busy_s=device, device_idle_s=max(wall - device, 0.0),
                   layers=num_layers,
                   host_per_layer_s=host / max(num_layers, 1), device_per_layer_s=device / max(num_layers, 1))
    sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    (out / f"profile_rank{rank}.txt").write_text(
        f"wall {wall:.3f} s, host in ops {host:.3f} s, device busy {device:.3f} s\n\n"
        + events.table(sort_by="self_cpu_time_total", row_limit=top)
        + ("\n\n" + events.table(sort_by=sort_by, row_limit=top) if torch.cuda.is_available() else ""))
    prof.export_chrome_trace(str(out / f"trace_rank{rank}.json"))
