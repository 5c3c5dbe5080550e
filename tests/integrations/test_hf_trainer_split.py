"""OdcTrainer with lb-mini-sp on 2 CPU ranks: samples longer than the budget split over the ranks, same training."""

from __future__ import annotations

import os

from _hf_workload import equal_to
from _support.launch import launch
from _support.tolerance import assert_within

WORKER = os.path.join(os.path.dirname(__file__), "hf_worker.py")


def test_split_samples_train_like_whole_ones():
    """4 steps, AdamW: losses and gradient norms against lb-mini training every sample whole, within the bounds of
    tests/_support/tolerance.py (the reference: lb-mini's distance from the stock Trainer in float64)."""
    r = launch(WORKER, 2, ["split"], timeout=300).check().result
    assert r["attention"] == "ds_odc_sp" and r["truncated"] == 0
    assert r["split_samples"] >= 2, r  # the minibatches holding a long sample split it
    assert all(len(r[key][run]) == 4 for key in ("loss", "grad_norm") for run in ("split", "whole", "fp64")), r
    assert_within(*equal_to(r, "split", stock="whole"))
