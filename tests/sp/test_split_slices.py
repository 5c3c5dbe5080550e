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
