"""Compiled blocks (inductor) and Liger's fused kernels under ODC on GPUs, against eager ODC and eager stock ZeRO-3:
the scenario of tests/training/compile_worker.py in bf16 on CUDA (2 ranks: a GPU each, or sharing GPU 0).

    python -m pytest tests/gpu/test_compile_gpu.py -q
"""

from pathlib import Path

import pytest
import torch

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


# Rows of one process's run, in the order met (tokens per document). At width 256 inductor's mix-order reduction
# (RMSNorm's backward) would put rows in three classes, under 4096 tokens, 4096-20479 and 20480 or more; the rows
# bring each class, a lone long document (its padded attention call comes out as a strided view) and runs of
# short documents (one varlen launch).
NEW_ROWS = [[8000], [1500, 1000], [3000], [30000], [6200, 700, 90], [4100]]


def test_rows_of_new_lengths_compile_nothing_after_the_first():
    """One compiled model (inductor, bf16, activation checkpointing, ``ds_odc_varlen``) trains rows of every length
    class and attention path: everything compiles on the first row, nothing on the others."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ds_odc.training import attention  # noqa: F401  (registers ds_odc_varlen)
    from ds_odc.training.collate import PackedCollator
    from ds_odc.training.compile import compile_blocks, compile_counts
    from ds_odc.recipes.sft import on_device

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=32768, use_cache=False,
                         attn_implementation="ds_odc_varlen")
    model = Qwen2ForCausalLM(config).to("cuda", torch.bfloat16).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = compile_blocks(model)
    collate, g = PackedCollator(), torch.Generator().manual_seed(0)
    frames = []
    for row in NEW_ROWS:
        batch = collate([{"input_ids": torch.randint(0, 1000, (n,), generator=g)} for n in row])
        model(**on_device(batch, torch.device("cuda"))).loss.backward()
        frames.append(compile_counts().frames)
    assert compiled.compiled, compiled.describe()
    assert frames[0] > 0 and frames[-1] == frames[0], dict(zip(map(str, NEW_ROWS), frames))
