import numpy as np
import pytest

from ds_odc.balancer import FittedCost, QuadraticCost, TokenCost, get_cost_model

QWEN2_1_5B = dict(
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, vocab_size=151936,
)


def test_token_cost_is_length():
    c = TokenCost()
    assert c(7) == 7.0
    np.testing.assert_array_equal(c([1, 2, 30]), [1.0, 2.0, 30.0])


def test_quadratic_from_hf_config_matches_hand_count():
    from transformers import Qwen2Config

    qc = QuadraticCost.from_hf_config(Qwen2Config(**QWEN2_1_5B))
    # per layer: q,o 1536x1536 each; k,v 1536x256 each; gated MLP 3x1536x8960
    per_layer = 2 * 1536 * 1536 + 2 * 1536 * 256 + 3 * 1536 * 8960
    assert per_layer * 28 == 1_310_195_712  # Qwen2.5-1.5B's published non-embedding count is 1.31B
    assert qc.a == 6 * (per_layer * 28 + 1536 * 151936)
    assert qc.b == 6 * 28 * 1536
    # from a dict, without the LM head
    qd = QuadraticCost.from_hf_config(QWEN2_1_5B, include_lm_head=False)
    assert qd.a == 6 * 1_310_195_712 and qd.b == qc.b
    # attention dominates the linear part beyond L = a / b tokens (~36k for this shape)
    assert 30_000 < qc.a / qc.b < 40_000
    assert qc(1000) == pytest.approx(qc.a * 1000 + qc.b * 1e6)


def test_quadratic_by_name_needs_the_model_config():
    """"quadratic" is the model's own FLOPs: without a config it is an error naming the fix, never some other
    model's coefficients."""
    with pytest.raises(ValueError, match="from_hf_config"):
        get_cost_model("quadratic")
    assert get_cost_model("quadratic", QWEN2_1_5B) == QuadraticCost.from_shape(**QWEN2_1_5B)
    tiny = dict(QWEN2_1_5B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    assert get_cost_model("quadratic", tiny).a < get_cost_model("quadratic", QWEN2_1_5B).a / 100
    with pytest.raises(ValueError, match="no hidden_size"):
        QuadraticCost.from_hf_config({"vocab_size": 10})
    with pytest.raises(ValueError, match="observe"):
        get_cost_model("auto")
    assert isinstance(get_cost_model("tokens"), TokenCost)
    obj = QuadraticCost(1.0, 2.0)
    assert get_cost_model(obj) is obj
    with pytest.raises(ValueError, match="unknown cost model"):
        get_cost_model("flops!")


def test_per_microbatch_cost_and_documents():
    """A microbatch costs its samples' a*L + b*S plus c once; S counts a packed row's documents, so a row of one
    64k document costs more attention than a 64k row of sixty-four 1k documents."""
    m = FittedCost(a=2.0, b=0.5, c=100.0)
    np.testing.assert_allclose(m.sample_costs([10, 20]), [2 * 10 + 0.5 * 100, 2 * 20 + 0.5 * 400])
    assert m(10) == 2 * 10 + 0.5 * 100 + 100  # alone in its microbatch
    assert m.per_microbatch == 100.0 and TokenCost().per_microbatch == 0.0
    one, sixty_four = m.sample_costs([65536, 65536], [65536.0 ** 2, 64 * 1024.0 ** 2])
    assert one - sixty_four == pytest.approx(0.5 * (65536 ** 2 - 64 * 1024 ** 2))
    q = QuadraticCost.from_shape(**QWEN2_1_5B, microbatch_tokens=2048)
    assert q.c == pytest.approx(2048 * q.a)


def test_fitted_cost_recovers_coefficients():
    L = np.array([1000, 4000, 8000, 16000, 32000, 64000], dtype=float)
    t = 3e-5 * L + 2e-10 * L**2 + 0.05
    f = FittedCost.fit(L, t)
    assert f.a == pytest.approx(3e-5, rel=1e-6)
    assert f.b == pytest.approx(2e-10, rel=1e-6)
    assert f.c == pytest.approx(0.05, rel=1e-6)
    # with 2% multiplicative noise the predictions stay within 3% inside the well-sampled range
    rng = np.random.default_rng(0)
    Ln = rng.uniform(1000, 64000, 200)
    tn = (3e-5 * Ln + 2e-10 * Ln**2 + 0.05) * (1 + 0.02 * rng.standard_normal(200))
    fn = FittedCost.fit(Ln, tn)
    Lc = L[1:]
    true = 3e-5 * Lc + 2e-10 * Lc**2 + 0.05
    assert np.max(np.abs(fn(Lc) / true - 1)) < 0.03


def test_fitted_cost_needs_three_lengths():
    with pytest.raises(ValueError, match="3 distinct"):
        FittedCost.fit([1, 1, 2], [1.0, 1.0, 2.0])
