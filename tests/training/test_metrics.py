"""summarize: what the compile counters say about the timed steps (no compiler needed: counters set by hand)."""

from dataclasses import replace

from ds_odc.training.metrics import record_from_rows, summarize


def _steps(frames_after_each: list[int | None]):
    base = record_from_rows([[0.5, 1.0, 1.0, 2, 100, 5000]], num_samples=4)
    return [replace(base, compiled=None if f is None else {"frames": f, "graphs": f, "graph_breaks": 0})
            for f in frames_after_each]


def test_frames_compiled_while_timed_leave_out_the_warmup_and_the_untimed_steps():
    # 5 frames in the warm-up step, 2 more in step 2 (timed), none in step 3, 1 in step 4 (the profiled, untimed one)
    compiled = summarize(_steps([5, 7, 7, 8]), warmup_steps=1, world_size=1, untimed=[3])["compile"]
    assert compiled["compiled_while_timed"] == 2
    assert compiled["compiled_after_step_2"] == 1
    assert compiled["frames"] == 8
    # two warm-up steps leave step 2's compiling out of the timed ones
    assert summarize(_steps([5, 7, 7]), warmup_steps=2, world_size=1)["compile"]["compiled_while_timed"] == 0


def test_no_compile_counters_no_compile_summary():
    assert "compile" not in summarize(_steps([None, None]), warmup_steps=1, world_size=1)
