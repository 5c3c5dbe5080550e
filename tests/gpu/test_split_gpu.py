"""Split samples (lb-mini-sp) under ZeRO-3 + ODC on GPUs: the CPU scenarios of tests/sp/split_worker.py on CUDA
(NVSHMEM transport, fp32; the ``ds_odc_sp`` attention's all-to-alls and the ring's gathers over NCCL, or over gloo
when the ranks share one GPU), against one process training the same minibatches; and the ring's attention kernels
on CUDA (flash / memory-efficient with a lower-right causal mask) against per-document attention.

    python -m pytest tests/gpu/test_split_gpu.py -q
"""

from pathlib import Path

import pytest
import torch

from _launch import launch_gpu, rank_params  # tests/gpu is on sys.path (rootdir conftest)

WORKER = Path(__file__).resolve().parents[1] / "sp" / "split_worker.py"

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

# Per rank count: the models of one launch and the group shapes (Ulysses x ring) their plans must use.
MODELS = {2: {"llama": {"2x1"}, "qwen2-ring": {"1x2"}},
          4: {"qwen2": {"2x1", "4x1"}, "llama-2x": {"2x1", "2x2"}, "qwen2-ring": {"1x2", "1x4"}}}


def _check(r, shapes):
    assert r["moved"] > 1e-2, r
    assert r["max_rel_diff"] < 1e-4, r  # GPU reductions are not bit-identical to the reference's order
    for got, want in zip(r["losses"], r["ref_losses"]):
        assert abs(got - want) <= 1e-4 * abs(want), r
    used = {shape for step in r["splits"] for _, _, shape in step}
    assert used == shapes, (used, shapes)
    counts = r["counts"]
    assert any(len({rank[s] for rank in counts}) > 1 for s in range(len(counts[0]))), counts


@pytest.mark.parametrize("nproc", rank_params(2, 4))
def test_split_samples_match_reference_on_gpu(nvshmem_op, nproc):
    """Groups of 2 and 4: Ulysses alone, ring alone (3 heads), and 2 Ulysses x 2 ring ranks, activation
    checkpointing on; 3 SGD steps within 1e-4 relative of one process."""
    models = MODELS[nproc]
    results = launch_gpu(WORKER, nproc, ["train", "--model", ",".join(models), "--checkpointing"],
                         timeout=600).check().result
    for kind, shapes in models.items():
        _check(results[kind], shapes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_ring_attention_kernels_on_gpu(monkeypatch, dtype, tol):
    """One process: each ring rank's queries against the whole sample's keys (the gather stood in for), through
    the CUDA kernels, give per-document causal attention of the whole sample; forward and the query gradient."""
    from ds_odc.training import context_parallel as cp
    torch.manual_seed(0)
    documents, r, heads, kv_heads, dim = (700, 2300, 1000), 4, 8, 2, 64
    layout = cp.SplitLayout(documents, 1, r)
    dev = torch.device("cuda")
    q = torch.randn(1, heads, layout.tokens, dim, device=dev, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, layout.tokens, dim, device=dev, dtype=dtype) for _ in range(2))
    want, start = [], 0
    for n in documents:
        kk, vv = (x[:, :, start:start + n].float().repeat_interleave(heads // kv_heads, 1) for x in (k, v))
        want.append(torch.nn.functional.scaled_dot_product_attention(q[:, :, start:start + n].float(), kk, vv,
                                                                     is_causal=True))
        start += n
    want = torch.cat(want, 2).transpose(1, 2)
    index = [torch.cat([torch.arange(a, b) for a, b in layout.ring_ranges(j)]).to(dev) for j in range(r)]
    gathered = {"k": torch.stack([k[:, :, i] for i in index]), "v": torch.stack([v[:, :, i] for i in index])}
    got = torch.zeros_like(want)
    for j in range(r):
        mine_k, mine_v = k[:, :, index[j]], v[:, :, index[j]]
        monkeypatch.setattr(cp, "gather_sequence", lambda x, group: gathered["k" if x is mine_k else "v"])
        got[:, index[j]] = cp.ring_attention(q[:, :, index[j]], mine_k, mine_v, layout, j, None).float()
    assert (got - want).abs().max().item() <= tol * want.abs().max().item()
    grad = torch.randn_like(want)
    (g_got,) = torch.autograd.grad((got * grad).sum(), q)
    (g_want,) = torch.autograd.grad((want * grad).sum(), q)
    assert (g_got.float() - g_want.float()).abs().max().item() <= tol * 10 * g_want.abs().max().item()
