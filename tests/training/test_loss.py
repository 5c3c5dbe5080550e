"""The chunked causal-LM loss equals transformers' own loss (value and gradients) without building the full logits.

Bounds: tests/_support/tolerance.py, the plain loss's own distance from the same loss in float64 as the reference."""

import pytest
import torch

from _support.tolerance import SCALAR_ULPS, assert_within, compare
from ds_odc.training.attention import ATTENTION_NAME
from ds_odc.training.collate import PackedCollator
from ds_odc.training.loss import chunked_causal_lm_loss, count_loss_tokens, use_chunked_loss


def _model(tied=True):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=157,
                                         tie_word_embeddings=tied, use_cache=False))
    model.set_attn_implementation(ATTENTION_NAME)
    return model.train()


def _row():
    g = torch.Generator().manual_seed(3)
    return PackedCollator()([{"input_ids": torch.randint(0, 157, (n,), generator=g)} for n in (9, 1, 14, 6)])


def _loss_and_grads(model, row, **kwargs):
    out = model(**row, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out, grads


def _exact_loss_and_grads(tied, row, num_items_in_batch=None):
    """The plain loss in float64: transformers' loss computes in fp32 (it upcasts to float), so the cross-entropy of
    the float64 logits is taken here, the same way (shifted labels, mean over the label tokens or sum over
    ``num_items_in_batch``)."""
    model = _model(tied).double()
    inputs = {k: v for k, v in row.items() if k != "labels"}
    logits = model(**inputs).logits[0, :-1]
    labels = row["labels"][0, 1:]
    if num_items_in_batch is None:
        loss = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100)
    else:
        loss = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
        loss = loss / num_items_in_batch
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _distances(a, b) -> tuple[float, float]:
    """(loss, gradients) of run ``a`` from run ``b``: the loss relative, the gradients as the largest over the
    parameters of max |a - b| / max |b|."""
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    grads = max(float((g.double() - grads_b[n].double()).abs().max() / grads_b[n].double().abs().max())
                for n, g in grads_a.items())
    return abs(loss_a - loss_b) / abs(loss_b), grads


def _assert_same(chunked, plain, exact):
    """``chunked`` against ``plain`` (fp32), each distance against plain's own from ``exact`` (float64)."""
    chunked, plain = [(out.loss.item(), grads) for out, grads in (chunked, plain)]
    (loss, grads), (loss_ref, grads_ref) = _distances(chunked, plain), _distances(plain, exact)
    assert_within(compare("chunked vs plain: loss", loss, loss_ref, ulps=SCALAR_ULPS),
                  compare("chunked vs plain: gradients (max over parameters of max|diff| / max|plain|)", grads,
                          grads_ref))


@pytest.mark.parametrize("chunk_tokens", [1000, 7, 1])  # one chunk, uneven chunks, one position per chunk
@pytest.mark.parametrize("tied", [True, False])
def test_chunked_model_loss_equals_the_plain_loss(chunk_tokens, tied):
    row = _row()
    plain = _loss_and_grads(_model(tied), row)
    chunked_model = use_chunked_loss(_model(tied), chunk_tokens=chunk_tokens)
    chunked = _loss_and_grads(chunked_model, row)
    assert chunked[0].logits is None
    _assert_same(chunked, plain, _exact_loss_and_grads(tied, row))
    n = count_loss_tokens(row)  # as a trainer passes it: the loss is then the sum over n
    _assert_same(_loss_and_grads(chunked_model, row, num_items_in_batch=torch.tensor(n / 2)),
                 _loss_and_grads(_model(tied), row, num_items_in_batch=torch.tensor(n / 2)),
                 _exact_loss_and_grads(tied, row, num_items_in_batch=n / 2))


def test_shift_labels_eval_mode_and_refusals():
    row = _row()
    model = use_chunked_loss(_model(), chunk_tokens=5)
    hidden = torch.randn(1, 30, 32)
    labels = torch.randint(0, 157, (1, 30))
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    head = model.get_output_embeddings()
    assert torch.allclose(chunked_causal_lm_loss(hidden, head, labels),
                          chunked_causal_lm_loss(hidden, head, shift_labels=shifted, chunk_tokens=30))
    model.eval()
    with torch.no_grad():
        out = model(**row)
    assert out.logits.shape == (1, row["input_ids"].shape[1], 157) and out.loss is not None  # eval: HF's own forward
    with pytest.raises(ValueError, match="already replaced"):
        use_chunked_loss(model)
    with pytest.raises(ValueError, match="not a causal LM"):
        use_chunked_loss(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="labels or shift_labels"):
        chunked_causal_lm_loss(hidden, head)


def test_the_head_is_shared_with_the_model_for_zero3():
    """The chunked loss reads the head's weight and bias, not the head module (the number of chunks differs between
    ranks; ZeRO-3 would gather per call): both are external parameters of the model, so ZeRO-3 fetches them with the
    model's forward and backward, once per microbatch; a head that is not a Linear is refused at the call."""
    model = _model(tied=False)
    model.lm_head = torch.nn.Linear(32, 157, bias=True)
    use_chunked_loss(model, chunk_tokens=5)
    shared = {id(p) for _, p in model.ds_external_parameters()}
    assert shared == {id(model.lm_head.weight), id(model.lm_head.bias)}, shared
    calls = []
    model.lm_head.register_forward_pre_hook(lambda *_: calls.append(1))
    model(**_row()).loss.backward()
    assert calls == [] and model.lm_head.bias.grad is not None  # read, never called; the bias trained too
    with pytest.raises(ValueError, match="must be a torch.nn.Linear"):
        chunked_causal_lm_loss(torch.randn(1, 3, 32), torch.nn.Sequential(model.lm_head), torch.zeros(1, 3).long())
