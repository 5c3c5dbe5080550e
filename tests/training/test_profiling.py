"""profile_step: summary numbers and files from one profiled region (in-process, CPU)."""

import torch

from ds_odc.training.profiling import describe, profile_step


def test_profile_step_reports_and_writes(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    with profile_step(tmp_path, rank=0, layers=[model[0], model[2]]) as summary:
        for _ in range(5):
            model(torch.randn(32, 64)).sum().backward()
    assert summary["wall_s"] > 0 and 0 < summary["host_op_s"] <= summary["wall_s"] * 1.5
    assert summary["device_idle_s"] <= summary["wall_s"]
    assert summary["layer_forward_calls"] == 10
    assert 0 < summary["layer_forward_host_ms"] * 10 / 1e3 <= summary["wall_s"]
    assert "layer forward (10 calls)" in describe(summary)
    text = (tmp_path / "profile_rank0.txt").read_text()
    assert "aten::addmm" in text or "aten::mm" in text
    assert (tmp_path / "trace_rank0.json").stat().st_size > 0
    model(torch.randn(2, 64))  # the layer hooks are gone afterwards
    assert not model[0]._forward_pre_hooks and not model[0]._forward_hooks


def test_timeline_counts_overlapping_device_work_once_and_splits_it_by_layer():
    from ds_odc.training.profiling import LAYER_RANGE, _timeline
    trace = [
        {"cat": "kernel", "ts": 0, "dur": 100}, {"cat": "gpu_memcpy", "ts": 50, "dur": 100},  # overlap: 150 busy
        {"cat": "kernel", "ts": 300, "dur": 50},
        {"cat": "gpu_user_annotation", "name": LAYER_RANGE, "ts": 0, "dur": 400},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}, {"ph": "M", "name": "process_name"},
    ]
    t = _timeline(trace)
    assert abs(t["device_busy_s"] - 200e-6) < 1e-12
    assert t["layer_forward_device_span_ms"] == 0.4 and abs(t["layer_forward_device_ms"] - 0.2) < 1e-12


def test_device_idle_time_is_charged_to_the_innermost_host_event():
    from ds_odc.training.profiling import _timeline
    trace = [
        {"cat": "kernel", "ts": 0, "dur": 10}, {"cat": "kernel", "ts": 50, "dur": 50},  # idle 10-50 and 100-120
        {"cat": "python_function", "name": "/x/site-packages/deepspeed/hooks.py(3): fetch", "ts": 0, "dur": 120,
         "pid": 1, "tid": 1},
        {"cat": "cuda_runtime", "name": "cudaEventSynchronize", "ts": 20, "dur": 20, "pid": 1, "tid": 1},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 105, "dur": 5, "pid": 1, "tid": 1},
        {"cat": "cpu_op", "name": "autograd::engine::evaluate_function: MmBackward0", "ts": 30, "dur": 40, "pid": 1,
         "tid": 2},
    ]
    timeline = _timeline(trace)
    (frame, seconds), = timeline["idle_python"]  # all the idle time (10-50, 100-120) ran inside thread 1's frame
    assert frame == "[main] deepspeed/hooks.py(3): fetch" and abs(seconds - 60e-6) < 1e-12
    idle = dict(timeline["idle_host"])
    # thread 1, idle parts: fetch's own time 10-20, 40-50, 100-105, 110-120; the sync 20-40; mm 105-110
    expected = {"[main] deepspeed/hooks.py(3): fetch": 35e-6, "[main] cudaEventSynchronize": 20e-6,
                "[main] aten::mm": 5e-6, "[autograd] autograd::engine::evaluate_function: MmBackward0": 20e-6}
    assert idle.keys() == expected.keys()
    assert all(abs(idle[k] - v) < 1e-12 for k, v in expected.items()), idle
