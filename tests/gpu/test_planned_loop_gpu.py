"""The stock DeepSpeed loop balanced by ``zero_optimization.odc.balancer`` on GPUs (NVSHMEM transport): the loader
that ``deepspeed.initialize(training_data=...)`` returns, the three-line loop of tests/training/planned_loop_worker.py,
LB-Mini's uneven microbatch counts, the parameters after 3 minibatches against one process of the same minibatches
(fp32 on the CPU; float64 as the truth), within the bound of tests/_support/tolerance.py. With ``cost: "auto"`` every
step is measured on the GPU and the record is the same on every rank (but each rank's own peak memory).

    python -m pytest tests/gpu/test_planned_loop_gpu.py -q
"""

from __future__ import annotations

import pytest

from _launch import REPO, launch_gpu, rank_params  # tests/gpu is on sys.path (rootdir conftest)
from _support.tolerance import assert_within, compare

WORKER = REPO / "tests" / "training" / "planned_loop_worker.py"

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

# ranks -> the worker's options: at 2 ranks the automatic cost (timings from the GPU), at 3 the token cost, whose plan
# gives the ranks different counts in 2 of the 3 minibatches (as on CPU)
OPTIONS = {2: ["--cost", "auto", "--seed", 5], 3: ["--cost", "tokens", "--seed", 6]}


@pytest.mark.parametrize("nproc", rank_params(2, 3))
def test_the_stock_loop_trains_the_global_mean_on_gpu(nvshmem_op, nproc):
    run = launch_gpu(WORKER, nproc, ["train", *OPTIONS[nproc]], timeout=420).check()
    ranks = sorted(run.results, key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == list(range(nproc)), run.stdout[-3000:]
    first = ranks[0]
    assert first["optimizer"] == "OdcOptimizer" and first["moved"] > 1e-2, first
    assert_within(compare(f"{nproc} ranks on GPU: params vs one process", first["measured"], first["reference"]))
    for report in ranks:
        assert report["steps"] == 3 and len(report["counts"]) == 3, report
        assert [a[0] for a in report["answers"]] == [k for k in report["counts"] for _ in range(k)], report
    if nproc == 3:
        per_step = list(zip(*(r["counts"] for r in ranks)))
        assert sum(len(set(c)) > 1 for c in per_step) >= 2, per_step
    else:
        # the gathered record is the same on every rank, but for the peak memory: each rank's own
        records = [{k: v for k, v in r["last_step"].items() if k != "peak_mem_bytes"} for r in ranks]
        assert all(rec == records[0] for rec in records), records
        assert records[0]["step_time_s"] > 0 and len(records[0]["per_rank"]) == nproc, records[0]
