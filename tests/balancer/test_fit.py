"""Cost-model fit from measured rank-steps (ds_odc.balancer.fit)."""

import json

import numpy as np
import pytest

from ds_odc.balancer.fit import fit, main, rank_steps


def _metrics(a, b, c, d, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(6):
        per_rank = []
        for _ in range(2):
            lengths = rng.integers(500, 20000, size=rng.integers(1, 6))
            busy = a * lengths.sum() + b * (lengths ** 2).sum() + c * len(lengths) + d + noise * rng.normal()
            per_rank.append({"busy_s": float(busy), "wait_s": 0.0, "microbatches": int(len(lengths)),
                             "tokens": int(lengths.sum()), "sq_tokens": int((lengths ** 2).sum())})
        steps.append({"per_rank": per_rank})
    return {"steps": steps}


def test_fit_recovers_the_coefficients():
    coef, rms = fit(rank_steps(_metrics(2e-5, 1.2e-9, 0.3, 0.5)))
    assert np.allclose(coef, [2e-5, 1.2e-9, 0.3, 0.5], rtol=1e-6) and rms < 1e-9


def test_profiled_step_is_left_out():
    metrics = _metrics(2e-5, 1.2e-9, 0.3, 0.5)
    metrics["steps"][3]["per_rank"][0]["busy_s"] = 99.0  # the profiler's overhead
    metrics["config"] = {"profile_step": 3}
    coef, rms = fit(rank_steps(metrics))
    assert rms < 1e-9 and len(rank_steps(metrics)) == 8


def test_fit_never_returns_negative_costs():
    coef, _ = fit(rank_steps(_metrics(0.0, 1e-9, 0.2, 0.1, noise=0.05)))
    assert (coef >= 0).all()


def test_cli_prints_the_flag_and_rejects_old_files(tmp_path, capsys):
    good = tmp_path / "run.json"
    good.write_text(json.dumps(_metrics(2e-5, 1.2e-9, 0.3, 0.5)))
    assert main([str(good)]) == 0
    assert "--cost fitted --cost-coeffs 2e-05,1.2e-09,0.3" in capsys.readouterr().out
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"steps": [{"per_rank": [{"busy_s": 1.0, "tokens": 5, "microbatches": 1}]}] * 3}))
    assert main([str(old)]) == 2
    assert "sq_tokens" in capsys.readouterr().err


def test_cli_warns_when_counts_never_vary(tmp_path, capsys):
    metrics = _metrics(2e-5, 1.2e-9, 0.3, 0.5)
    for step in metrics["steps"]:
        for r in step["per_rank"]:
            r["microbatches"] = 4
    path = tmp_path / "run.json"
    path.write_text(json.dumps(metrics))
    assert main([str(path)]) == 0
    assert "cannot be told apart" in capsys.readouterr().err


@pytest.mark.parametrize("n", [1, 3])
def test_too_few_rank_steps_is_an_error(n):
    with pytest.raises(ValueError, match="at least 4"):
        fit(np.ones((n, 5)))


def test_cli_shows_the_runs_own_automatic_cost_next_to_the_fit(tmp_path, capsys):
    metrics = _metrics(2e-5, 1.2e-9, 0.3, 0.5)
    metrics["steps"][-1]["cost"] = {"a": 2.1e-5, "b": 1.1e-9, "c": 0.29, "d": 0.52, "fitted": True}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(metrics))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "automatic" in out and "0.29" in out and "0.3 " in out
