"""Compiled blocks (inductor) and Liger's fused kernels under ODC on GPUs, against eager ODC and eager stock ZeRO-3:
the scenario of tests/training/compile_worker.py in bf16 on CUDA (2 ranks: a GPU each, or sharing GPU 0).

    python -m pytest tests/gpu/test_compile_gpu.py -q
"""

from pathlib import Path

import pytest

from _launch import launch_gpu, rank_params  # tests/gpu is on sys.path (rootdir conftest)

WORKER = Path(__file__).resolve().parents[1] / "training" / "compile_worker.py"
# "fused" last: Liger's layer kernels replace transformers' layer classes for every model the process builds later,
# and dynamo cannot trace those (compiled+fused leaves them to inductor).
VARIANTS = ["odc:eager", "odc:compiled/varlen", "odc:compiled+fused", "stock:compiled+fused", "odc:fused"]

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.parametrize("nproc", rank_params(2))
def test_compiled_and_fused_match_eager_odc_and_stock_in_bf16(nvshmem_op, nproc):
    """Packed rows, activation checkpointing, uneven counts under ODC (3 and 1 rows): every kernel choice trains the
    parameters eager stock ZeRO-3 trains, within bf16 resolution (the GPU suite's 1e-2), and compiles nothing after
    the first minibatch although every minibatch brings new lengths. ``/varlen``: the attention kernel that stays
    in the compiled graph."""
    pytest.importorskip("liger_kernel", reason="fused kernels need liger-kernel (pip install 'ds_odc[liger]')")
    r = launch_gpu(WORKER, nproc, ["kernels", "--bf16", "--backend", "inductor", "--variants", ",".join(VARIANTS)],
                   timeout=900).check().result
    for variant in VARIANTS:
        got = r[variant]
        assert "error" not in got, (variant, got)
        assert got["vs_stock"] < 1e-2, (variant, got["vs_stock"])
        if "vs_odc_eager" in got:
            assert got["vs_odc_eager"] < 1e-2, (variant, got["vs_odc_eager"])
        assert max(abs(a - b) for a, b in zip(got["losses"], r["loss_stock"])) < 2e-2, (variant, got["losses"])
        if "compiled" in variant.split(":")[1]:
            assert "inductor" in got["compiled"] and "eager (" not in got["compiled"], (variant, got["compiled"])
            counts = got["counts"]
            assert counts[0]["graphs"] > 0 and counts[1] == counts[-1], (variant, counts)
