import json
import math

import numpy as np
import pytest

from ds_odc.balancer.presets import PRESETS, get_preset, longtail_from_normals
from hypothesis import given, settings, strategies as st

from ds_odc.balancer import FittedCost
from ds_odc.balancer.plan import step_time
from ds_odc.balancer.simulate import PLAN_COSTS, main, simulate, simulate_step


def test_step_time_collective_vs_odc_by_hand():
    # rank 0: microbatches costing 5, 1 ; rank 1: 2, 2, 2
    mb = [[5.0, 1.0], [2.0, 2.0, 2.0]]
    assert step_time(mb, "collective") == 5 + 2 + 2
    assert step_time(mb, "odc") == 6


def test_bubble_definition_on_a_tiny_case():
    # 2 ranks, lengths 3,1 on one side and 2,2 on the other under local-sort: slots (max(1,2), max(3,2)) = 5
    res = simulate(np.array([3, 2, 1, 2]), ranks=2, minibatch_size=2, max_tokens=None, steps=1, seed=0)
    ls = res["local-sort"]
    assert res["lb-mini"]["bubble_rate"] == pytest.approx(0.0)
    assert 0.0 <= ls["bubble_rate"] < 1.0
    assert ls["busy_time_per_rank"] == pytest.approx(4.0)
    assert ls["bubble_rate"] == pytest.approx(1 - 8 / (2 * ls["step_time"]))


def test_long_sft_lb_mini_well_below_lb_micro():
    res = simulate("long-sft", ranks=64, minibatch_size=4, max_tokens=65536, steps=5, seed=0)
    mini, micro, ls = (res[p]["bubble_rate"] for p in ("lb-mini", "lb-micro", "local-sort"))
    assert mini < 0.05 and micro > 0.15 and ls > micro and mini < micro / 5  # measured 2.6%, 24%, 51%
    assert res["lb-mini"]["speedup_vs_local_sort"] > 1.3
    assert res["lb-micro"]["microbatches_per_rank_min"] == res["lb-micro"]["microbatches_per_rank_max"]


def test_balance_bound_reported_when_one_sample_dominates():
    lengths = np.array([100] * 7 + [10000])
    res = simulate(lengths, ranks=4, minibatch_size=2, max_tokens=None, steps=3, seed=0)
    s = res["lb-mini"]
    assert s["steps_with_dominant_sample"] >= 1
    assert s["balance_bound_step_time"] >= 10000 * s["steps_with_dominant_sample"] / 3


def test_baselines_preset_reproduces_measured_minibatches():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    sums = [int(longtail_from_normals(torch.randn(8, generator=g).numpy()).sum()) for _ in range(5)]
    assert sums[1:] == [60056, 90425, 65692, 55536]  # docs baselines: tokens per timed minibatch
    x = get_preset("baselines-longtail").sample(10000, seed=0)
    assert x.min() >= 1024 and x.max() <= 32768 and abs(np.median(x) - 8000) < 300


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_in_range_and_seeded(name):
    a = get_preset(name).sample(5000, seed=1)
    assert a.dtype == np.int64 and a.min() > 0
    assert np.array_equal(a, get_preset(name).sample(5000, seed=1))
    if name == "long-sft":
        assert a.min() >= 8192 and a.max() <= 65536 and 14000 < np.median(a) < 18000
    if name == "agent":
        assert a.max() <= 131072 and (a > 65536).mean() > 0.02
    if name == "rl":
        assert 0.25 < (a > 16384).mean() < 0.35


QWEN2_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936)


def _config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN2_1_5B))
    return str(path)


def test_cli_json_is_one_object(capsys, tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("\n".join(str(x) for x in get_preset("long-sft").sample(300, seed=0)) + "\n")
    png = tmp_path / "bars.png"
    rc = main(["--lengths", str(f), "--ranks", "8", "--minibatch-size", "4", "--max-tokens", "65536",
               "--steps", "3", "--json", "--plot", str(png), "--cost", "quadratic",
               "--model-config", _config_file(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    data = json.loads(out)
    assert set(data) == {"local-sort", "lb-micro", "lb-mini"}
    for v in data.values():
        assert 0.0 <= v["bubble_rate"] < 1.0 and math.isfinite(v["step_time"])
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_cli_text_and_errors(capsys):
    with pytest.raises(SystemExit):
        main(["--preset", "rl", "--ranks", "4", "--minibatch-size", "2", "--max-tokens", "8192", "--cost",
              "quadratic"])
    assert "--model-config" in capsys.readouterr().err
    assert main(["--preset", "rl", "--ranks", "4", "--minibatch-size", "2", "--max-tokens", "8192",
                 "--steps", "2", "--oversize", "error"]) == 2
    assert "max_tokens=8192" in capsys.readouterr().err
    assert main(["--preset", "agent", "--ranks", "4", "--minibatch-size", "2", "--max-tokens", "65536",
                 "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "lb-mini" in out and "balance bound" in out


def test_cli_module_entry_point_prints_only_json(tmp_path):
    """`python -m ds_odc.balancer.simulate --json` as a user runs it.  DS_ACCELERATOR=cpu keeps DeepSpeed's
    accelerator-detection warning (logged to stdout by `import ds_odc` on machines without a GPU) off stdout."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, DS_ACCELERATOR="cpu")
    out = subprocess.run(
        [sys.executable, "-m", "ds_odc.balancer.simulate", "--preset", "baselines-longtail", "--ranks", "2",
         "--minibatch-size", "4", "--max-tokens", "32768", "--cost", "quadratic", "--model-config",
         _config_file(tmp_path), "--steps", "50", "--json"],
        capture_output=True, text=True, env=env, check=True,
    ).stdout
    data = json.loads(out)
    # 2 ranks of the baselines workload: collectives waste ~22% (measured 7.76 s vs 6.07 s), LB-Mini ~1%
    assert 0.15 < data["local-sort"]["bubble_rate"] < 0.35
    assert data["lb-mini"]["bubble_rate"] < 0.03


def test_microbatch_overhead_is_charged_per_microbatch_and_hidden_from_planners():
    """A fixed per-microbatch cost adds exactly overhead x microbatches to every rank's busy time, and does not
    change the plans (the planners do not know it), so lb-mini can lose to lb-micro once it dominates."""
    lengths = [900, 100, 100, 100, 100, 100, 100, 100]
    plain = simulate_step(lengths, 2, None, "tokens")
    charged = simulate_step(lengths, 2, None, "tokens", microbatch_overhead=1000.0)
    for name in plain:
        assert list(charged[name].num_microbatches) == list(plain[name].num_microbatches)
        assert list(charged[name].busy) == [b + 1000.0 * n for b, n in zip(plain[name].busy,
                                                                          plain[name].num_microbatches)]
    assert plain["lb-mini"].step_time < plain["lb-micro"].step_time
    assert charged["lb-mini"].step_time > charged["lb-micro"].step_time  # 1 vs 7 microbatches: overhead dominates


def test_cli_fitted_cost_and_no_packing(capsys):
    assert main(["--preset", "baselines-longtail", "--ranks", "2", "--minibatch-size", "4", "--max-tokens", "0",
                 "--cost", "fitted", "--cost-coeffs", "0,1.17e-9,0.83", "--steps", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lb-mini"]["microbatches_per_rank_max"] <= 5  # the intercept keeps counts near 4


def test_in_order_takes_the_file_minibatch_by_minibatch():
    """--in-order predicts a measured run: minibatch k is the k-th run of R*M lengths, so swapping two lengths
    between minibatches changes the prediction, and the step count stops at the end of the file."""
    lengths = [1000, 1000, 1000, 8000, 2000, 2000, 2000, 2000]
    same = simulate(lengths, ranks=2, minibatch_size=2, max_tokens=None, steps=10, in_order=True)
    swapped = simulate(lengths[4:] + lengths[:4], ranks=2, minibatch_size=2, max_tokens=None, steps=10,
                       in_order=True)
    assert same["lb-mini"]["step_time"] == swapped["lb-mini"]["step_time"]  # same minibatches, other order
    # two 8k samples in one minibatch balance (8k+1k each); one per minibatch cannot (8k vs 3k), by tokens
    together = simulate([8000, 8000, 1000, 1000] + [1000] * 4, ranks=2, minibatch_size=2, max_tokens=None,
                        steps=10, in_order=True)
    apart = simulate([8000, 1000, 1000, 1000] * 2, ranks=2, minibatch_size=2, max_tokens=None, steps=10,
                     in_order=True)
    assert together["lb-mini"]["step_time"] == (9000 + 2000) / 2 and apart["lb-mini"]["step_time"] == 8000
    with pytest.raises(ValueError, match="at least 4"):
        simulate([1000, 2000], ranks=2, minibatch_size=2, max_tokens=None, in_order=True)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9000), min_size=1, max_size=40),
    ranks=st.integers(1, 6),
    max_tokens=st.sampled_from([None, 4096, 12000]),
    overhead=st.sampled_from([0.0, 50.0, 5000.0, 1e5]),
    plan_cost=st.sampled_from(PLAN_COSTS),
    oversize=st.sampled_from(["truncate", "skip"]),
    fixed=st.sampled_from([0.0, 300.0]),
)
def test_balance_bound_and_bubbles_are_never_negative(lengths, ranks, max_tokens, overhead, plan_cost, oversize,
                                                       fixed):
    """With a per-microbatch cost the planners do not know, no planner beats the bound and no bubble is negative
    (the docs' own command once printed -114% for the bound)."""
    res = simulate(np.array(lengths), ranks=ranks, minibatch_size=max(1, len(lengths) // ranks), max_tokens=max_tokens,
                   cost=FittedCost(1.0, 1e-4, fixed), steps=3, seed=0, oversize=oversize,
                   microbatch_overhead=overhead, plan_cost=plan_cost)
    for s in res.values():
        assert 0.0 <= s["balance_bound_bubble_rate"] < 1.0 + 1e-12
        assert 0.0 <= s["bubble_rate"] < 1.0
        assert s["balance_bound_step_time"] <= s["step_time"] * (1 + 1e-9) + 1e-9


def test_auto_plans_learn_an_unknown_overhead():
    """0.83 s per microbatch that the given cost does not know: blind lb-mini loses to lb-micro, the auto cost
    learns the overhead within a few steps and then plans as well as the oracle."""
    kw = dict(ranks=8, minibatch_size=4, max_tokens=None, cost=FittedCost(0.0, 1.17e-9, 0.0), steps=30, seed=0,
              microbatch_overhead=0.83)
    blind = simulate("baselines-longtail", plan_cost="given", **kw)
    auto = simulate("baselines-longtail", plan_cost="auto", noise=0.03, **kw)
    assert blind["lb-mini"]["step_time"] > blind["lb-micro"]["step_time"]
    mini = auto["lb-mini"]
    assert mini["converged_step"] is not None and mini["converged_step"] <= 10, mini["vs_oracle_per_step"]
    assert max(mini["vs_oracle_per_step"][10:]) <= 1.02
    assert mini["step_time"] < auto["lb-micro"]["step_time"]
    assert mini["fitted"]["c"] == pytest.approx(0.83, rel=0.1) and mini["truth"]["c"] == 0.83


def test_plot_draws_every_planner_on_one_time_axis(tmp_path):
    png = tmp_path / "timeline.png"
    assert main(["--preset", "baselines-longtail", "--ranks", "4", "--minibatch-size", "4", "--max-tokens", "0",
                 "--steps", "5", "--plot", str(png), "--plot-steps", "3", "--microbatch-overhead", "2000"]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000


LOCKSTEP = {"odc": True, "lockstep": True}


@pytest.mark.parametrize("planner,engine,runtime,waits_in_busy", [
    ("lb-mini", {}, "odc", False), ("lb-micro", {}, "collective", False), ("lb-micro", {"odc": True}, "odc", False),
    ("lb-micro", LOCKSTEP, "collective", False), ("lb-micro", LOCKSTEP, "collective", True),
    ("lb-micro", {"odc": False}, "collective", False)])
def test_replay_predicts_a_run_that_follows_the_model(planner, engine, runtime, waits_in_busy):
    """A run whose every rank-step took exactly a*tokens + b*sum(L^2) + c*microbatches + d (and whose steps took what
    its sync makes of that: ODC's once per minibatch, or every microbatch at once under collectives or ODC's
    lock-step meetings) is predicted exactly: its own minibatches in order, the warm-up and the profiled step left out
    (they took 100 s here, and would show in the totals), the per-step term d added once. ``waits_in_busy``: as
    lock-step runs on CUDA record it, every rank busy for the whole step, its meetings' waits inside (device_wait_s):
    the fit prices the work alone (with the waits in, it predicted measured lock-step runs 15-26% long)."""
    from ds_odc.balancer.simulate import replay_run

    truth, d = FittedCost(a=2e-5, b=1e-9, c=0.2), 0.1
    ranks, per_rank, max_tokens = 2, 4, 16384
    lengths = [int(x) for x in longtail_from_normals(np.random.default_rng(3).standard_normal(6 * ranks * per_rank))]
    steps, waited = [], []
    for i in range(6):
        minibatch = lengths[i * ranks * per_rank:(i + 1) * ranks * per_rank]
        run = simulate_step(minibatch, ranks, max_tokens, truth, [planner], "truncate", runtime=runtime)[planner]
        busy = run.busy + d
        waits = np.full_like(busy, run.step_time + d) - busy if waits_in_busy else np.zeros_like(busy)
        slow = i in (0, 5)  # warm-up and profiled: not timed
        steps.append({"step_time_s": 100.0 if slow else run.step_time + d, "per_rank": [
            {"busy_s": float(b + w), "device_wait_s": float(w), "tokens": int(t), "sq_tokens": int(q),
             "microbatches": int(k)}
            for b, w, t, q, k in zip(busy, waits, run.tokens, run.sq_tokens, run.num_microbatches)]})
        waited.append(float(waits.sum()) / ranks / (run.step_time + d))
    metrics = {"config": {"no_shuffle": True, "warmup_steps": 1, "profile_step": 5, "world_size": ranks,
                          "minibatch_size": per_rank, "max_tokens": max_tokens, "balancer": planner, **engine},
               "steps": steps}
    assert not waits_in_busy or max(waited) > 0.01, waited  # the share of a step the ranks waited: to price out
    replay = replay_run(metrics, lengths)
    assert replay["steps"] == 4 and replay["cost"]["source"].startswith("fit")
    assert replay["ratio"] == pytest.approx(1.0, rel=1e-6), replay
    assert replay["measured_s"] < 4 * 100.0
    # The balance bound of the same timed minibatches at the same cost: no whole-sample plan is faster, and the
    # planned step is not faster than it either (measured / bound is what any plan could still gain).
    from ds_odc.balancer.simulate import Machine, balance_bound
    fitted = FittedCost(**{k: replay["cost"][k] for k in "abc"})
    bounds = [balance_bound(np.asarray(lengths[i * ranks * per_rank:(i + 1) * ranks * per_rank]), ranks, max_tokens,
                            "truncate", Machine(fitted))[1] + replay["cost"]["d"] for i in range(1, 5)]
    assert replay["bound_s"] == pytest.approx(sum(bounds), rel=1e-9)
    assert replay["bound_s"] <= replay["measured_s"] * (1 + 1e-9)

    given = replay_run(metrics, lengths, cost=replay["cost"])  # a cost measured elsewhere: here the same one
    assert given["ratio"] == replay["ratio"] and given["cost"]["source"] == replay["cost"]["source"]
    slower = replay_run(metrics, lengths, cost={**replay["cost"], "a": 2 * replay["cost"]["a"], "source": "x2"})
    assert slower["ratio"] > 1.05 and slower["cost"]["source"] == "x2", slower
    shifted = replay_run(metrics, lengths[ranks * per_rank:] + lengths[:ranks * per_rank])  # other minibatches
    assert shifted["ratio"] != pytest.approx(1.0, rel=1e-3), shifted
    with pytest.raises(ValueError, match="no-shuffle"):
        replay_run({**metrics, "config": {**metrics["config"], "no_shuffle": False}}, lengths)
