"""Slicing a split sample, in one process: positions, labels across slice boundaries, padding, the attention switch."""

import pytest
import torch

from ds_odc.training.sequence_parallel import ATTENTION_NAME, slice_loss_sum, slice_sample, sp_attention_forward


def _slices(sample, g):
    return [slice_sample(sample, tuple(range(g)), k) for k in range(g)]


@pytest.mark.parametrize("n,g", [(12, 2), (13, 2), (13, 4), (3, 4)])
def test_slices_cover_the_sample_with_its_positions_and_every_next_token_label(n, g):
    ids = torch.arange(100, 100 + n)
    pieces = _slices(ids, g)
    size = -(-n // g)
    assert all(p.input_ids.shape == (1, size) for p in pieces)  # Ulysses needs equal slices
    tokens = torch.cat([p.input_ids[0] for p in pieces])
    labels = torch.cat([p.shift_labels[0] for p in pieces])
    positions = torch.cat([p.position_ids[0] for p in pieces])
    assert torch.equal(tokens[:n], ids)
    assert torch.equal(positions[:n], torch.arange(n))  # global positions, not 0.. per slice
    assert torch.equal(labels[:n - 1], ids[1:])  # the label of a slice's last token is the next slice's first
    assert (labels[n - 1:] == -100).all()  # the sample's last token and the padding predict nothing
    pad = size * g - n
    if pad:  # padding restarts positions: a document of its own after the real tokens
        assert torch.equal(positions[n:], torch.arange(pad))
    assert sum(p.num_label_tokens for p in pieces) == n - 1


def test_slice_keeps_given_labels_and_packed_positions():
    sample = {"input_ids": torch.arange(8), "labels": torch.tensor([-100, 1, 2, 3, -100, 5, 6, 7]),
              "position_ids": torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])}  # two documents of 4 tokens
    a, b = _slices(sample, 2)
    assert a.shift_labels.tolist() == [[1, 2, 3, -100]]  # no prediction across the document boundary
    assert b.shift_labels.tolist() == [[5, 6, 7, -100]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3]]


def test_slice_losses_add_up_to_the_sample_loss():
    torch.manual_seed(0)
    n, vocab = 11, 7
    ids = torch.randint(0, vocab, (n,))
    logits = torch.randn(1, n + 1, vocab)  # n tokens + 1 padding position at g = 2
    pieces = _slices(ids, 2)
    parts = [slice_loss_sum(logits[:, k * 6:(k + 1) * 6], p) for k, p in enumerate(pieces)]
    whole = torch.nn.functional.cross_entropy(logits[0, :n - 1], ids[1:], reduction="sum")
    assert torch.allclose(sum(parts), whole, rtol=1e-6)


def test_slice_refuses_bad_input():
    with pytest.raises(ValueError, match="no tokens"):
        slice_sample(torch.tensor([], dtype=torch.long), (0, 1), 0)
    with pytest.raises(ValueError, match="member 2 of a group of 2"):
        slice_sample(torch.arange(4), (0, 1), 2)
    with pytest.raises(ValueError, match="labels 3"):
        slice_sample({"input_ids": torch.arange(4), "labels": torch.arange(3)}, (0, 1), 0)


def test_without_a_split_sample_the_attention_is_ds_odc_varlen():
    """``ds_odc_sp`` outside SequenceParallel.run: per-document causal attention of a packed row, as ds_odc_varlen."""
    from transformers import AttentionInterface

    from ds_odc.training.attention import varlen_attention_forward
    assert AttentionInterface()[ATTENTION_NAME] is sp_attention_forward
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    module = torch.nn.Module()
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    got, _ = sp_attention_forward(module, q, k, v, None, position_ids=positions, scaling=0.3)
    want, _ = varlen_attention_forward(module, q, k, v, None, position_ids=positions, scaling=0.3)
    assert torch.equal(got, want)


@pytest.mark.parametrize("n,u,r", [(24, 1, 2), (23, 2, 2), (50, 1, 4), (7, 2, 4)])
def test_ring_slices_hold_head_and_tail_chunks_and_cover_the_sample(n, u, r):
    """With a ring, the padded sample is cut into 2r chunks and ring rank j holds chunks j and 2r-1-j, its Ulysses
    members consecutive slices of them; together the members hold every token once, with its global position and
    its next-token label."""
    ids = torch.arange(1000, 1000 + n)
    pieces = [slice_sample(ids, tuple(range(u * r)), m, ulysses=u) for m in range(u * r)]
    layout = pieces[0].layout
    assert (layout.ulysses, layout.ring) == (u, r) and layout.tokens % (2 * u * r) == 0
    c = layout.tokens // (2 * r)
    assert layout.ring_ranges(0) == ((0, c), ((2 * r - 1) * c, 2 * r * c))
    order = torch.cat([layout.member_index(m) for m in range(u * r)])
    assert sorted(order.tolist()) == list(range(layout.tokens))
    tokens, labels = torch.cat([p.input_ids[0] for p in pieces]), torch.cat([p.shift_labels[0] for p in pieces])
    real = order < n
    assert torch.equal(tokens[real], ids[order[real]]) and torch.equal(
        torch.cat([p.position_ids[0] for p in pieces])[real], order[real])
    assert torch.equal(labels[real & (order < n - 1)], ids[order[real & (order < n - 1)] + 1])
    assert sum(p.num_label_tokens for p in pieces) == n - 1
    assert layout.documents == ((n, layout.tokens - n) if layout.tokens > n else (n,))


@pytest.mark.parametrize("documents,r,heads,kv_heads", [((24,), 2, 4, 2), ((5, 11, 8), 2, 2, 1),
                                                        ((3, 29, 16), 4, 4, 4), ((48,), 3, 2, 2)])
def test_ring_attention_is_per_document_causal_attention_of_the_whole_sample(monkeypatch, documents, r, heads,
                                                                            kv_heads):
    """Each ring rank's queries against the gathered keys give exactly what causal attention within each document
    of the whole sample gives (float64; the gather is stood in for by the other ranks' tensors)."""
    from ds_odc.training import context_parallel as cp
    torch.manual_seed(0)
    layout = cp.SplitLayout(documents, 1, r)
    P = layout.tokens
    q = torch.randn(1, heads, P, 8, dtype=torch.float64)
    k, v = (torch.randn(1, kv_heads, P, 8, dtype=torch.float64) for _ in range(2))
    want, start = [], 0
    for n in documents:
        kk, vv = (x[:, :, start:start + n].repeat_interleave(heads // kv_heads, 1) for x in (k, v))
        want.append(torch.nn.functional.scaled_dot_product_attention(q[:, :, start:start + n], kk, vv,
                                                                     is_causal=True, scale=0.3))
        start += n
    want = torch.cat(want, 2).transpose(1, 2)
    index = [torch.cat([torch.arange(a, b) for a, b in layout.ring_ranges(j)]) for j in range(r)]
    gathered = {id_: torch.stack([x[:, :, i] for i in index]) for id_, x in (("k", k), ("v", v))}
    got = torch.empty_like(want)
    for j in range(r):
        mine_k, mine_v = k[:, :, index[j]], v[:, :, index[j]]
        monkeypatch.setattr(cp, "gather_sequence", lambda x, group: gathered["k" if x is mine_k else "v"])
        got[:, index[j]] = cp.ring_attention(q[:, :, index[j]], mine_k, mine_v, layout, j, None, scaling=0.3)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_ring_refuses_what_it_cannot_attend(monkeypatch):
    """Inside a split sample's run over a ring, attention features the ring does not implement are refused by
    name (before any collective), not silently ignored."""
    from ds_odc.training import sequence_parallel as spm
    from ds_odc.training.context_parallel import SplitLayout
    monkeypatch.setattr(spm, "_active", spm._Active((0, 1), SplitLayout((8,), 1, 2), 0, None, None))
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8)
    positions = torch.arange(4)[None]
    with pytest.raises(ValueError, match="sliding windows"):
        sp_attention_forward(torch.nn.Module(), q, k, k, None, position_ids=positions, sliding_window=2)
    encoder = torch.nn.Module()
    encoder.is_causal = False
    with pytest.raises(ValueError, match="causal only"):
        sp_attention_forward(encoder, q, k, k, None, position_ids=positions)
    with pytest.raises(ValueError, match="position_ids only"):
        sp_attention_forward(torch.nn.Module(), q, k, k, None, position_ids=positions, cu_seq_lens_q=positions)


def test_packed_documents_of_a_split_sample_are_found_once_for_the_whole_sample():
    sample = {"input_ids": torch.arange(13), "position_ids": torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4])}
    layout = slice_sample(sample, (0, 1, 2, 3), 0, ulysses=2).layout
    assert layout.documents == (5, 3, 5, 3) and (layout.ulysses, layout.ring) == (2, 2)  # 3 padding tokens last
