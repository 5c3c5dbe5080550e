"""Whole training programs at 2 and 3 GPU ranks (one GPU each when there are enough, else all sharing GPU 0), each
against a reference with a stated tolerance:

* ``examples/sft.py`` (the 0.5B shape, long-tail lengths, packed rows, lb-mini, fp32) against one rank training the
  same global minibatches: the logged loss of every step; the same with ODC's lock-step baseline (``odc.lockstep``,
  lb-micro's equal counts, activation checkpointing: meetings before each block's forward and recomputation and after
  its backward, on the device);
* ``OdcTrainer`` (ODC + LB-Mini, uneven packs) against the stock Trainer with stock ZeRO-3 on the same minibatches
  (tests/integrations/hf_worker.py);
* lockstep-free generation (every rank its own prompts, lengths and EOS; the third rank none) against the unsharded
  model in the same process, token for token, fp32, with training steps in between
  (tests/integrations/generation_worker.py).

    python -m pytest tests/gpu/test_end_to_end_gpu.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _support.launch import cpu_env
from _launch import REPO, gpu_env, launch_gpu, placement, rank_params, retried  # tests/gpu is on sys.path (rootdir conftest)

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

SFT_ARGS = ["--deepspeed", str(REPO / "ds_configs" / "zero3_odc_fp32_cpu.json"), "--model", "qwen2.5-0.5b",
            "--preset", "baselines-longtail", "--length-scale", "0.125", "--max-tokens", "4096", "--oversize",
            "truncate", "--balancer", "lb-mini", "--steps", "3", "--num-samples", "64", "--gradient-checkpointing",
            "--quiet"]
SAMPLES_PER_STEP = 6  # a multiple of every rank count tested
# fp32, TF32 off: the same minibatch split over other ranks and rows sums the same terms in another order. Measured
# on CPU: the modes of examples/compare.py agree to 4e-8; AdamW turns rounding into updates of the learning rate's
# order where gradients nearly cancel, so three steps of a 0.5B model are compared at 1e-4.
SFT_LOSS_TOL = 1e-4


_SFT_RUNS: dict[tuple[int, bool], tuple[list[float], dict]] = {}
LOCKSTEP_TIMEOUT_S = 60  # a lock-step meeting waits one block's imbalance at most: longer is a fault, named


def _sft(nproc: int, tmp_path, lockstep: bool = False) -> tuple[list[float], dict]:
    """Per-step losses and the metrics of examples/sft.py at ``nproc`` ranks (each rank count runs once), with ODC's
    lock-step baseline and lb-micro when ``lockstep``."""
    if (nproc, lockstep) in _SFT_RUNS:
        return _SFT_RUNS[nproc, lockstep]
    args = list(SFT_ARGS)
    if lockstep:
        config = json.loads((REPO / "ds_configs" / "zero3_odc_fp32_cpu.json").read_text())
        config["zero_optimization"]["odc"].update(lockstep=True, timeout_s=LOCKSTEP_TIMEOUT_S)
        (tmp_path / "lockstep.json").write_text(json.dumps(config))
        args[args.index("--deepspeed") + 1] = str(tmp_path / "lockstep.json")
        args[args.index("--balancer") + 1] = "lb-micro"
    out = tmp_path / f"sft{nproc}{'-lockstep' if lockstep else ''}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(REPO / "examples" / "sft.py"), *args, "--minibatch-size", str(SAMPLES_PER_STEP // nproc),
           "--metrics-json", str(out)]
    if placement(nproc) == "shared":
        cmd.append("--shared-gpu")
    # shared: the example's own --shared-gpu; partitions: DS_ODC_SHARED_GPU=partition with the MPS environment
    env = cpu_env({k: v for k, v in gpu_env(nproc).items() if not (k == "DS_ODC_SHARED_GPU" and v == "1")})
    proc = retried(lambda: subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540, cwd=REPO),
                   lambda p: p.stdout + p.stderr, f"examples/sft.py at {nproc} ranks")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    run = json.loads(out.read_text())
    assert run["config"]["world_size"] == nproc
    _SFT_RUNS[nproc, lockstep] = [step["loss"] for step in run["steps"]], run
    return _SFT_RUNS[nproc, lockstep]


@pytest.mark.xdist_group("sft-example")
@pytest.mark.parametrize("nproc", rank_params(2, 3))
def test_sft_example_matches_one_rank(nvshmem_op, nproc, tmp_path, record_property):
    one, _ = _sft(1, tmp_path)
    many, run = _sft(nproc, tmp_path)
    assert len(one) == len(many) == 3
    worst = max(abs(a - b) / abs(b) for a, b in zip(many, one))
    record_property("measured", json.dumps({"loss_rel_diff": worst, "microbatches": [
        [r["microbatches"] for r in step["per_rank"]] for step in run["steps"]]}))
    assert worst <= SFT_LOSS_TOL, (many, one)
    assert one[-1] < one[0], one  # it trained
    counts = [[r["microbatches"] for r in step["per_rank"]] for step in run["steps"]]
    assert all(sum(c) > 0 for c in counts), counts


@pytest.mark.xdist_group("sft-example")
@pytest.mark.parametrize("nproc", rank_params(2))
def test_sft_example_with_lockstep_matches_one_rank(nvshmem_op, nproc, tmp_path):
    """The lock-step baseline at model scale (24 blocks, activation checkpointing, ranks' rows of other lengths):
    every rank meets equally often, and it trains what one rank trains."""
    one, _ = _sft(1, tmp_path)
    many, run = _sft(nproc, tmp_path, lockstep=True)
    assert run["config"]["lockstep"] is True, run["config"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(many, one))
    assert len(many) == 3 and worst <= SFT_LOSS_TOL, (many, one)
    counts = [[r["microbatches"] for r in step["per_rank"]] for step in run["steps"]]
    assert all(len(set(c)) == 1 for c in counts), counts  # lb-micro: the same count on every rank


@pytest.mark.parametrize("nproc", rank_params(2))
def test_odc_trainer_matches_the_stock_trainer(nvshmem_op, nproc):
    r = launch_gpu(REPO / "tests" / "integrations" / "hf_worker.py", nproc, ["equivalence"], timeout=420).check().result
    assert r["optimizer"] == "OdcOptimizer" and r["stock_optimizer"] != "OdcOptimizer"
    for key in ("loss", "grad_norm"):
        odc, stock = r[key]["odc"], r[key]["stock"]
        assert len(odc) == len(stock) == 4
        assert max(abs(a - b) / abs(b) for a, b in zip(odc, stock)) <= 1e-4, r[key]
    assert any(len(set(c)) > 1 for c in r["microbatch_counts"]), r["microbatch_counts"]


@pytest.mark.parametrize("nproc", rank_params(2, 3))
def test_lockstep_free_generation_matches_the_unsharded_model(nvshmem_op, nproc):
    r = launch_gpu(REPO / "tests" / "integrations" / "generation_worker.py", nproc, timeout=420).check().result
    for report in r["ranks"]:
        for name, result in report["rounds"].items():
            assert result["mismatch"] == [], (report["rank"], name, result["mismatch"])
        assert report["collectives_during_generation"] == {}, report
        assert max(report["param_diff"]) <= 1e-5, report["param_diff"]
    forwards = [rep["rounds"]["initial/block"]["forwards"] for rep in r["ranks"]]
    assert len(set(forwards)) == nproc, forwards
