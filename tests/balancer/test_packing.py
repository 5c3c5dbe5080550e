"""Packed collation: the packed forward must equal the unpacked per-sample forwards token for token."""

import pytest
import torch
import torch.nn.functional as F

from ds_odc.training.collate import IGNORE_INDEX, PackedCollator
from ds_odc.training.loss import count_loss_tokens

LENS = [5, 9, 1, 3, 7]


def _samples(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 1000, (n,), generator=g).tolist()} for n in LENS]


def test_collator_layout():
    samples = _samples()
    b = PackedCollator()(samples)
    T = sum(LENS)
    starts = [0, 5, 14, 15, 18]
    assert set(b) == {"input_ids", "position_ids", "labels", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                      "max_length_k"}  # no attention_mask
    assert all(b[k].shape == (1, T) and b[k].dtype == torch.long for k in ("input_ids", "position_ids", "labels"))
    assert b["cu_seq_lens_q"].dtype == torch.int32 and b["cu_seq_lens_q"].tolist() == starts + [T]
    assert b["cu_seq_lens_k"] is b["cu_seq_lens_q"] and b["max_length_q"] == b["max_length_k"] == max(LENS)
    assert set(PackedCollator(return_flash_attn_kwargs=False)(samples)) == {"input_ids", "position_ids", "labels"}
    assert b["position_ids"][0].tolist() == [p for n in LENS for p in range(n)]
    assert all(b["labels"][0, s] == IGNORE_INDEX for s in starts)
    keep = [t for t in range(T) if t not in starts]
    assert torch.equal(b["labels"][0, keep], b["input_ids"][0, keep])
    assert count_loss_tokens(b) == sum(n - 1 for n in LENS) == T - len(LENS)


def test_collator_given_labels_and_padding():
    samples = [{"input_ids": [1, 2, 3], "labels": [-100, 7, 8]}, {"input_ids": [4, 5], "labels": [9, 10]}]
    b = PackedCollator(pad_token_id=99, pad_to_multiple_of=8)(samples)
    assert b["input_ids"][0].tolist() == [1, 2, 3, 4, 5, 99, 99, 99]
    assert b["labels"][0].tolist() == [-100, 7, 8, -100, 10, -100, -100, -100]
    assert b["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert b["cu_seq_lens_q"].tolist() == [0, 3, 5, 8]  # the padding is a document of its own
    assert count_loss_tokens(b) == 3
    with pytest.raises(ValueError):
        PackedCollator()([{"input_ids": [1, 2], "labels": [1]}])
    with pytest.raises(ValueError):
        PackedCollator()([])


def _tiny_model(impl):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256)
    torch.manual_seed(0)
    return Qwen2ForCausalLM._from_config(cfg, attn_implementation=impl, torch_dtype=torch.float32).eval()


def _token_losses(logits, labels):
    return F.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=IGNORE_INDEX, reduction="none")


@pytest.mark.parametrize("impl", ["sdpa", "eager", "flex_attention"])
def test_packed_forward_equals_unpacked(impl):
    model = _tiny_model(impl)
    samples = _samples(1)
    batch = PackedCollator()(samples)
    with torch.no_grad():
        out = model(**batch, use_cache=False)
        packed = _token_losses(out.logits, batch["labels"])
        packed = packed[batch["labels"][0, 1:] != IGNORE_INDEX]
        ref = []
        for s in samples:
            ids = torch.tensor(s["input_ids"])[None]
            ref.append(_token_losses(model(input_ids=ids, use_cache=False).logits, ids))
        ref = torch.cat(ref)
    assert packed.shape == ref.shape == (sum(LENS) - len(LENS),)
    torch.testing.assert_close(packed, ref, atol=1e-5, rtol=1e-5)
    # HF's own loss is the mean over exactly count_loss_tokens(batch) terms
    assert out.loss.item() == pytest.approx(ref.sum().item() / count_loss_tokens(batch), abs=1e-5)


def test_packing_detection_needs_use_cache_false():
    """Documented pitfall: with a KV cache (use_cache defaults to True) transformers skips packed-sequence
    detection, so packed samples attend to each other and the losses differ."""
    model = _tiny_model("sdpa")
    samples = _samples(2)
    batch = PackedCollator()(samples)
    with torch.no_grad():
        good = _token_losses(model(**batch, use_cache=False).logits, batch["labels"])
        bad = _token_losses(model(**batch, use_cache=True).logits, batch["labels"])
    assert (good - bad).abs().max() > 1e-3
