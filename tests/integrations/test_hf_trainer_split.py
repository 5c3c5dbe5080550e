"""OdcTrainer with lb-mini-sp on 2 CPU ranks: samples longer than the budget split over the ranks, same training."""

from __future__ import annotations

import os

from _support.launch import launch

WORKER = os.path.join(os.path.dirname(__file__), "hf_worker.py")


def test_split_samples_train_like_whole_ones():
    """4 steps, AdamW: losses and gradient norms within 1e-4 relative of lb-mini training every sample whole
    (measured 9e-8 and 1e-8)."""
    r = launch(WORKER, 2, ["split"], timeout=300).check().result
    assert r["attention"] == "ds_odc_sp" and r["truncated"] == 0
    assert r["split_samples"] >= 2, r  # the minibatches holding a long sample split it
    for key in ("loss", "grad_norm"):
        got, want = r[key]["split"], r[key]["whole"]
        assert len(got) == len(want) == 4, r
        assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(got, want)), (key, got, want)
