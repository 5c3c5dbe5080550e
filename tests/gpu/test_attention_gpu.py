"""``ds_odc_varlen``'s GPU kernels on one packed bf16 row, against the exact answer.

Row: long documents (their own padded sdpa call under ``bucketed``: 9000 -> 9216, 6500 -> 6656, 7000 -> 7168) with
runs of short ones between them (one varlen launch per run), including a length-1 document. Reference: sdpa per
document in fp32 (math kernel) on the same bf16 values. Each kernel's output and q/k/v gradients must be as close
to it as bf16 sdpa per document (what a model without packing computes): within 2x its max error, plus 1e-3.
"""

import threading

import pytest
import torch
import torch.nn.functional as F

from ds_odc.training import attention

LENGTHS = [9000, 300, 17, 1, 6500, 900, 7000, 64]
HEADS, KV_HEADS, DIM = 12, 2, 128
MAIN = threading.get_ident()


def _row():
    g = torch.Generator().manual_seed(0)
    tokens = sum(LENGTHS)
    q, k, v = (torch.randn(1, h, tokens, DIM, generator=g).to("cuda", torch.bfloat16)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    grad_out = torch.randn(1, HEADS, tokens, DIM, generator=g).to("cuda", torch.bfloat16)
    return q, k, v, grad_out


def _run(forward, q, k, v, grad_out, dtype):
    leaves = [x.detach().clone().to(dtype).requires_grad_() for x in (q, k, v)]
    out = forward(*leaves)
    out.backward(grad_out.to(dtype))
    return [out.detach().float()] + [x.grad.float() for x in leaves]


def _per_document(q, k, v):
    parts = [F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)
             for a, b, c in zip(q.split(LENGTHS, 2), k.split(LENGTHS, 2), v.split(LENGTHS, 2))]
    return torch.cat(parts, 2)


def _ds_odc_varlen(kernel):
    cu = F.pad(torch.tensor(LENGTHS, device="cuda").cumsum(0), (1, 0)).to(torch.int32)

    layer = torch.nn.Module()
    attention.use_kernel(layer, kernel)

    def forward(q, k, v):
        out, _ = attention.varlen_attention_forward(layer, q, k, v, None, cu_seq_lens_q=cu, max_length_q=max(LENGTHS))
        return out.transpose(1, 2)
    return forward


@pytest.mark.parametrize("kernel", ["bucketed", "varlen", "auto"])
def test_gpu_kernels_are_as_exact_as_sdpa_per_document(kernel):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("torch.nn.attention.varlen")
    row = _row()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.MATH]):
        exact = _run(_per_document, *row, torch.float32)
    stock = _run(_per_document, *row, torch.bfloat16)
    got = _run(_ds_odc_varlen(kernel), *row, torch.bfloat16)
    for name, e, s, g in zip(("out", "dq", "dk", "dv"), exact, stock, got):
        stock_err = (s - e).abs().max().item()
        err = (g - e).abs().max().item()
        assert err <= 2 * stock_err + 1e-3, f"{kernel} {name}: {err:.3e} from exact, bf16 sdpa {stock_err:.3e}"


def test_planning_runs_every_bucket_once(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("torch.nn.attention.varlen")
    from transformers import Qwen2Config
    model = torch.nn.Module()  # plan_buckets reads the model's config and kernel choice only
    model.config = Qwen2Config(hidden_size=HEADS * DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS)
    # cuDNN keeps its plans per thread: every bucket's forward must run on this thread with and without autograd,
    # and again on autograd's thread (where activation checkpointing recomputes it).
    seen, bucketed = set(), attention._bucketed

    def recorded(q, k, v, lengths, *rest):
        seen.add((attention.bucket_length(lengths[0]), threading.get_ident() == MAIN, torch.is_grad_enabled()))
        return bucketed(q, k, v, lengths, *rest)

    monkeypatch.setattr(attention, "_bucketed", recorded)
    shapes, _ = attention.plan_buckets(model, 20000, torch.device("cuda"), torch.bfloat16)
    assert shapes == len(attention.bucket_lengths(20000)) == 15
    assert seen == {(n, *where) for n in attention.bucket_lengths(20000)
                    for where in [(True, True), (True, False), (False, True)]}
    monkeypatch.undo()
    attention.use_kernel(model, "varlen")
    assert attention.plan_buckets(model, 20000, torch.device("cuda"), torch.bfloat16) == (0, 0.0)
