"""``attn_implementation="ds_odc_varlen"`` on CPU: a packed row gives exactly what each document gives alone.

Reference: every document through the same model on its own (``sdpa``, no packing), per-token losses summed;
packed: the documents in one row (PackedCollator), one forward. Losses and every parameter gradient must agree
within fp32 rounding, for Qwen2 and Llama shapes, rows with length-1 documents, and the boundaries given either as
cu_seq_lens (collator) or only as restarting position ids. The bounds are those of tests/_support/tolerance.py, with
the reference's own distance from the same computation in float64 as the reference distance.
"""

import pytest
import torch
import torch.nn.functional as F

from _support.tolerance import SCALAR_ULPS, assert_caught, assert_within, compare
from ds_odc.training import attention
from ds_odc.training.collate import PackedCollator

LENGTHS = [7, 1, 12, 3, 1, 9]  # several documents, two of length 1
BUCKETED_LENGTHS = [37, 1, 21, 3, 1, 9]  # 37 and 21 are padded to their buckets (40, 22); 9 is a bucket


def _model(kind: str, impl: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=211, max_position_embeddings=128, use_cache=False)
    torch.manual_seed(0)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True))
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))
    model.set_attn_implementation(impl)
    return model.train()


def _docs(seed=1, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 211, (n,), generator=g) for n in lengths]


def _loss_sum(logits, labels):
    logits = logits[0, :-1]
    return F.cross_entropy(logits if logits.dtype == torch.float64 else logits.float(), labels[0, 1:],
                           ignore_index=-100, reduction="sum")


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference(kind, docs, dtype=torch.float32):
    model = _model(kind, "sdpa").to(dtype)
    total = sum(_loss_sum(model(input_ids=d[None]).logits, d[None]) for d in docs)
    total.backward()
    return total.detach(), _grads(model)


def _distances(got, want) -> tuple[float, float]:
    """(loss, gradients) of ``got`` from ``want``: the loss relative, the gradients as the largest over the
    parameters of max |got - want| / max |want|."""
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert grads.keys() == ref_grads.keys()
    far = max(float((g.double() - ref_grads[n].double()).abs().max() / ref_grads[n].double().abs().max())
              for n, g in grads.items())
    return abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), far


def _assert_close(got, kind, docs):
    """``got`` (loss, gradients) against the sdpa reference of ``docs``, with the reference's own distance from
    float64 as the reference distance."""
    want = _reference(kind, docs)
    (loss, grads), (loss_ref, grads_ref) = _distances(got, want), _distances(want, _reference(kind, docs,
                                                                                              torch.float64))
    assert_within(compare("packed vs documents alone: loss", loss, loss_ref, ulps=SCALAR_ULPS),
                  compare("packed vs documents alone: gradients (max over parameters of max|diff| / max|ref|)",
                          grads, grads_ref))


def _max_abs(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("boundaries", ["cu_seq_lens", "position_ids"])
@pytest.mark.parametrize("choice", ["sdpa", "bucketed"])
def test_packed_row_equals_documents_alone(kind, boundaries, choice):
    """``bucketed`` with ``long_document=5``: the 37-, 21- and 9-token documents get their own (padded) sdpa call, the
    others run per document in between."""
    docs = _docs(lengths=BUCKETED_LENGTHS if choice == "bucketed" else LENGTHS)
    row = PackedCollator(return_flash_attn_kwargs=boundaries == "cu_seq_lens")([{"input_ids": d} for d in docs])
    model = _model(kind, attention.ATTENTION_NAME)
    attention.use_kernel(model, choice, long_document=5)
    labels = row.pop("labels")
    loss = _loss_sum(model(**row).logits, labels)
    loss.backward()
    _assert_close((loss.detach(), _grads(model)), kind, docs)


def test_bucket_lengths_bound_the_padding_and_the_number_of_shapes():
    lengths = range(1, 131073)
    buckets = {n: attention.bucket_length(n) for n in lengths}
    assert all(n <= b <= n * 1.125 for n, b in buckets.items())
    assert buckets[2048] == 2048 and buckets[2049] == 2304 and buckets[65536] == 65536
    assert len({b for n, b in buckets.items() if n >= 2048}) == 49  # 8 per power of two from 2k to 128k, and 128k


def test_padding_at_the_end_is_exact_only_because_attention_is_causal():
    """The bucketed kernel's premise, checked directly: padded at its end, a document attends exactly as alone under
    the causal mask; without the mask the padding leaks in (so the check can fail)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 37, 8, generator=g) for _ in range(3))
    padded = [F.pad(x, (0, 0, 0, attention.bucket_length(37) - 37)) for x in (q, k, v)]
    for causal in (True, False):
        alone = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
        with_padding = F.scaled_dot_product_attention(*padded, is_causal=causal)[:, :, :37]
        padded_vs_alone = compare(f"causal={causal}: padded vs alone (max abs)", _max_abs(with_padding, alone),
                                  _max_abs(alone, exact))
        (assert_within if causal else assert_caught)(padded_vs_alone)


def test_without_document_boundaries_the_row_mixes_documents():
    """The check above can fail: the same row as one document (no boundaries) gives another loss."""
    docs = _docs()
    row = torch.cat(docs)[None]
    model = _model("qwen2", attention.ATTENTION_NAME)
    mixed = _loss_sum(model(input_ids=row).logits, PackedCollator()([{"input_ids": d} for d in docs])["labels"])
    assert abs(mixed.item() - _reference("qwen2", docs)[0].item()) > 1e-3


def test_batches_of_unpacked_rows_and_the_collators_of_transformers_and_trl():
    """Rows of a [B, T] batch are documents of their own; DataCollatorWithFlattening's and TRL's padding-free batches
    go in unchanged."""
    from transformers import DataCollatorWithFlattening
    docs = _docs()
    model = _model("llama", attention.ATTENTION_NAME).eval()
    sdpa, exact = _model("llama", "sdpa").eval(), _model("llama", "sdpa").eval().double()

    def logits(reference, inputs):  # a [B, T] batch, or documents each alone, concatenated
        if torch.is_tensor(inputs):
            return reference(input_ids=inputs).logits
        return torch.cat([reference(input_ids=d[None]).logits[0] for d in inputs])

    def same_logits(what, got, inputs):  # against sdpa's, with sdpa's own distance from float64 as the reference
        want = logits(sdpa, inputs)
        return compare(f"{what}: logits vs sdpa (max abs)", _max_abs(got, want), _max_abs(want, logits(exact, inputs)))

    batch = torch.stack([docs[0], docs[0].flip(0)])
    with torch.no_grad():
        checks = [same_logits("[B, T] batch", model(input_ids=batch).logits, batch)]
        hf = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d.tolist()} for d in docs])
        assert hf["cu_seq_lens_q"].tolist()[-1] == sum(LENGTHS)
        hf.pop("labels")
        checks.append(same_logits("DataCollatorWithFlattening", model(**hf).logits[0], docs))
        trl = pytest.importorskip("trl.trainer.sft_trainer")
        padding_free = trl.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
        tb = padding_free([{"input_ids": d.tolist()} for d in docs])
        assert "cu_seq_lens_q" in tb
        checks.append(same_logits("TRL padding-free", model(
            input_ids=tb["input_ids"], position_ids=tb["position_ids"], cu_seq_lens_q=tb["cu_seq_lens_q"],
            cu_seq_lens_k=tb["cu_seq_lens_k"], max_length_q=tb["max_length_q"],
            max_length_k=tb["max_length_k"]).logits[0], docs))
    assert_within(*checks)


def test_padding_and_unsupported_options_are_refused_with_the_fix():
    model = _model("qwen2", attention.ATTENTION_NAME)
    ids = torch.randint(0, 211, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    with pytest.raises(ValueError, match="padding-free rows"):
        model(input_ids=ids, attention_mask=mask)
    q = torch.zeros(1, 4, 3, 8)
    with pytest.raises(ValueError, match="sliding windows"):
        attention.varlen_attention_forward(torch.nn.Module(), q, q, q, None, sliding_window=2)
    with pytest.raises(ValueError, match="needs torch.nn.attention.varlen"):
        attention.KernelChoice("varlen").resolve(q)
    with pytest.raises(ValueError, match="choose one of"):
        attention.use_kernel(model, "fast")
    with pytest.raises(ValueError, match="long_document=0"):
        attention.use_kernel(model, "bucketed", long_document=0)
    assert attention.KernelChoice().resolve(q) == "sdpa"  # CPU, fp32
    bucketed = attention.KernelChoice("bucketed")
    assert bucketed.resolve(q) == "bucketed" and bucketed.resolve(q, causal=False) == "sdpa"


def _sdpa_lengths(monkeypatch) -> list[int]:
    """Record the sequence length of every scaled_dot_product_attention call from now on."""
    seen, real = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda q, *a, **k: seen.append(q.shape[2]) or real(q, *a, **k))
    return seen


def test_the_kernel_choice_belongs_to_one_model(monkeypatch):
    """Two models in one process: the one chosen ``bucketed`` pads its 37-token document to its bucket (40), the
    other keeps the default (one sdpa call of 37 tokens on CPU); choosing for one changes nothing for the other."""
    docs = _docs(lengths=BUCKETED_LENGTHS)
    row = PackedCollator(return_flash_attn_kwargs=True)([{"input_ids": d} for d in docs])
    row.pop("labels")
    bucketed, default = _model("qwen2", attention.ATTENTION_NAME), _model("qwen2", attention.ATTENTION_NAME)
    attention.use_kernel(bucketed, "bucketed", long_document=5)
    assert attention.kernel_choice(default) == attention.KernelChoice()
    assert all(attention.kernel_choice(m).kernel == "bucketed" for m in bucketed.modules())
    seen = _sdpa_lengths(monkeypatch)
    with torch.no_grad():
        bucketed(**row)
        assert 40 in seen and 37 not in seen, seen
        seen.clear()
        default(**row)
        assert 37 in seen and 40 not in seen, seen


def _flash_allowed_at_each_sdpa_call(monkeypatch) -> list[bool]:
    """From now on, whether sdpa may pick its flash kernel, as seen by every scaled_dot_product_attention call."""
    seen, real = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **k: seen.append(torch.backends.cuda.flash_sdp_enabled()) or real(*a, **k))
    return seen


@pytest.mark.parametrize("impl", ["sdpa", attention.ATTENTION_NAME])
def test_sdpa_backends_are_limited_inside_the_model_only(impl, monkeypatch):
    """Limited to ``math``: every sdpa call of the model (including the recomputation of activation checkpointing,
    during backward) sees flash disabled; outside the model, and in another model, it stays enabled."""
    assert torch.backends.cuda.flash_sdp_enabled()
    limited, other = _model("llama", impl), _model("llama", impl)
    attention.limit_sdpa_backends(limited, "math")
    limited.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    seen = _flash_allowed_at_each_sdpa_call(monkeypatch)
    ids = _docs()[2][None]
    limited(input_ids=ids, labels=ids).loss.backward()
    assert seen == [False] * 4  # 2 layers, forward and recomputation
    assert torch.backends.cuda.flash_sdp_enabled()
    seen.clear()
    other(input_ids=ids, labels=ids).loss.backward()
    assert seen == [True] * 2
    with pytest.raises(ValueError, match="unknown \\['fast'\\]"):
        attention.limit_sdpa_backends(other, "math,fast")
    attention.limit_sdpa_backends(other, None)  # torch's choice: nothing to limit
    with pytest.raises(ValueError, match="no attention layers"):
        attention.limit_sdpa_backends(torch.nn.Linear(2, 2), "math")


def test_boundaries_from_position_ids_are_computed_once_per_tensor():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1], [5, 6, 7, 8, 0, 1]])
    first = attention.boundaries_from_position_ids(pos)
    assert first.cu_seqlens.tolist() == [0, 3, 4, 6, 10, 12] and first.lengths == (3, 1, 2, 4, 2)
    assert attention.boundaries_from_position_ids(pos) is first  # every layer reuses it
    pos[0, 3] = 3  # changed in place: recomputed
    assert attention.boundaries_from_position_ids(pos).lengths == (4, 2, 4, 2)


@pytest.mark.parametrize("boundaries", ["cu_seq_lens", "position_ids"])
def test_boundaries_moved_to_the_device_keep_their_host_lengths(monkeypatch, boundaries):
    """A batch moved by ``on_device`` (or OdcTrainer) keeps the lengths of its CPU boundaries: no layer copies them
    back from the device (a copy that would wait for all queued GPU work). Without the note, the copy happens."""
    from ds_odc.recipes.sft import on_device
    copies = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies.append(1) or real_cpu(self, *a, **k))
    host = PackedCollator(return_flash_attn_kwargs=boundaries == "cu_seq_lens")([{"input_ids": d} for d in _docs()])
    q = torch.zeros(1, 4, sum(LENGTHS), 8)

    def lengths_seen_by_a_layer(batch):
        return attention._boundaries(q, batch).host_lengths()

    moved = {k: v.clone() if torch.is_tensor(v) else v for k, v in host.items()}  # as a copy to another device
    assert lengths_seen_by_a_layer(moved) == tuple(LENGTHS) and copies  # not noted: copied back
    copies.clear()
    moved = {k: v.clone() if torch.is_tensor(v) else v for k, v in host.items()}
    attention.remember_host_boundaries(host, moved)  # reads the host tensors (free: already there)
    copies.clear()
    assert lengths_seen_by_a_layer(moved) == tuple(LENGTHS) and not copies
    assert on_device(host, torch.device("cpu"))["input_ids"] is host["input_ids"]  # same device: no copy
    # Host work per microbatch: the documents are found once, from the boundaries the layers will read.
    assert (attention._position_cache.get(moved["position_ids"]) is None) == (boundaries == "cu_seq_lens")


def test_planning_buckets_is_a_no_op_without_the_bucketed_kernel():
    model = _model("qwen2", attention.ATTENTION_NAME)
    assert attention.plan_buckets(model, 65536, torch.device("cpu"), torch.float32) == (0, 0.0)
    assert attention.bucket_lengths(65536)[0] == attention.LONG_DOCUMENT and len(attention.bucket_lengths(65536)) == 29
    assert attention.bucket_lengths(100, shortest=1) == sorted({attention.bucket_length(n) for n in range(1, 101)})


@pytest.mark.parametrize("choice", ["sdpa", "bucketed"])
@pytest.mark.parametrize("lengths", [[37], [7, 1, 12], [37, 3]])
def test_every_kernel_returns_one_layout(choice, lengths):
    """The output is a contiguous ``[B, T, H, D]`` view of a contiguous ``[B * T, H, D]`` tensor of its own, whichever
    path computed it (a lone long document's padded call gives a strided view, varlen a tensor of its own): code
    compiled after the attention's graph break guards on these strides and on the tensor viewed."""
    layer = torch.nn.Module()
    attention.use_kernel(layer, choice, long_document=5)
    tokens = sum(lengths)
    q, k, v = (torch.randn(1, heads, tokens, 8) for heads in (4, 2, 2))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    out, _ = attention.varlen_attention_forward(layer, q, k, v, None, position_ids=position_ids)
    assert out.shape == (1, tokens, 4, 8) and out.is_contiguous(), (out.shape, out.stride())
    assert out._base is not None and out._base.shape == (tokens, 4, 8) and out._base._base is None
