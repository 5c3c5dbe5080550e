"""Cost models: how long a microbatch keeps a rank busy.

Every model here has the same form: a microbatch of samples costs

    a * tokens + b * sum(document length^2) + c

The linear term is the dense-layer work, the quadratic term attention (a packed row of several documents attends
within each document only, so a 64k row of one document costs more than a 64k row of sixty short ones), and ``c``
the fixed cost of running one microbatch at all (host work, kernel launches, hooks: measured at 0.27-0.83 s on
GPUs, where it can outweigh the compute of a short sample). A sample's own cost is ``a*L + b*S`` (``S`` = the sum
of its documents' squared lengths, ``L^2`` for one document); ``c`` is paid once per microbatch however many
samples it packs.

The balancer only needs *relative* costs. Token budgets (``max_tokens``) are always checked against raw token
counts, never against costs, so a cost model changes *which* samples go together, not whether a microbatch fits.

* :class:`TokenCost` -- cost = tokens. Right when linear layers dominate and microbatches are cheap to launch.
* :class:`QuadraticCost` -- ``a*L + b*L^2 (+ c)`` in training FLOPs, derived from a model shape
  (:meth:`QuadraticCost.from_hf_config`): the prior the automatic cost starts from.
* :class:`FittedCost` -- ``a*L + b*L^2 + c`` in seconds, fitted to measurements (by hand with
  :meth:`FittedCost.fit` or ``python -m ds_odc.balancer.fit``, or online by ``BalancedBatchSampler(cost="auto")``,
  see :mod:`ds_odc.balancer.autocost`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

import numpy as np

__all__ = ["QuadraticCost"]

# Until it is measured, a microbatch's fixed cost is taken to be worth this many tokens of compute. On the GPUs
# measured so far it was worth several thousand (0.27 s per microbatch at 1.5B on H200), on 2 CPU cores with a tiny
# model far more; any positive value keeps the first plans from splitting work into needlessly many microbatches.
MICROBATCH_PRIOR_TOKENS = 2048

Lengths = Union[int, float, Sequence[int], np.ndarray]


class CostModel:
    """Base class: a microbatch costs ``a * tokens + b * sum(doc length^2) + c``.

    Subclasses provide ``a``, ``b`` and ``c`` (attributes or dataclass fields).
    """

    name: str = "cost"
    a: float
    b: float
    c: float

    @property
    def per_microbatch(self) -> float:
        """``c``: the fixed cost of one microbatch, whatever it holds."""
        return float(self.c)

    def sample_costs(self, lengths: Lengths, sq_lengths: Lengths | None = None) -> np.ndarray:
        """Each sample's share of a microbatch's cost, ``a*L + b*S`` (float64 array; no ``c``).

        ``sq_lengths``: per sample, the sum of its documents' squared lengths (for rows that already pack several
        documents); ``None`` means one document per sample (``S = L^2``).
        """
        L = np.asarray(lengths, dtype=np.float64)
        S = L * L if sq_lengths is None else np.asarray(sq_lengths, dtype=np.float64)
        return self.a * L + self.b * S

    def costs(self, lengths: np.ndarray) -> np.ndarray:
        """Cost of each sample run alone in its own microbatch: ``a*L + b*L^2 + c``."""
        return self.sample_costs(lengths) + self.per_microbatch

    def __call__(self, lengths: Lengths) -> Any:
        """Cost of one length alone in a microbatch (a float) or of many (a float64 array)."""
        arr = np.asarray(lengths, dtype=np.float64)
        out = self.costs(arr)
        return float(out) if arr.ndim == 0 else out

    def coefficients(self) -> tuple[float, float, float]:
        return float(self.a), float(self.b), float(self.c)


@dataclass(frozen=True)
class TokenCost(CostModel):
    """cost = tokens: needs no model knowledge and is exact for the token budget."""

    name = "tokens"
    a = 1.0
    b = 0.0
    c = 0.0


@dataclass(frozen=True)
class QuadraticCost(CostModel):
    """cost = a*L + b*L^2 (+ c per microbatch), in training FLOPs when derived from a model shape.

    With :meth:`from_hf_config` / :meth:`from_shape`:

    * ``a = 6 * P`` where ``P`` is the number of weights a token goes through once: the non-embedding parameters
      (attention projections and MLP of every layer) plus, by default, the LM head matmul (it is compute even when
      the embedding is tied).  6 = 2 FLOPs per multiply-add x 3 (forward, and backward for inputs and weights).
    * ``b = 6 * layers * hidden``: per layer, the score matmul QK^T and the value matmul AV cost 2*hidden FLOPs per
      (query, key) pair each in the forward, x3 for forward+backward = 12*hidden per pair; causal attention touches
      L^2/2 pairs, so the per-sequence attention cost is 6*layers*hidden*L^2.
    * ``c = a * microbatch_tokens``: a microbatch's fixed cost, expressed as that many tokens of compute.

    Recomputation under activation checkpointing adds one more forward (about 8 instead of 6 for both terms); it
    scales both terms alike and so does not change the balance.
    """

    a: float = 1.0
    b: float = 0.0
    c: float = 0.0

    name = "quadratic"

    @classmethod
    def from_shape(
        cls,
        *,
        hidden_size: int,
        intermediate_size: int,
        num_hidden_layers: int,
        num_attention_heads: int,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        vocab_size: int = 0,
        include_lm_head: bool = True,
        microbatch_tokens: float = 0.0,
    ) -> "QuadraticCost":
        """Coefficients for a Llama/Qwen2-style decoder (GQA attention, gated MLP) in training FLOPs."""
        h = hidden_size
        kv_heads = num_key_value_heads or num_attention_heads
        hd = head_dim or h // num_attention_heads
        q_dim, kv_dim = num_attention_heads * hd, kv_heads * hd
        attn_params = h * q_dim + 2 * h * kv_dim + q_dim * h  # q, k, v, o projections
        mlp_params = 3 * h * intermediate_size  # gate, up, down
        per_token_params = num_hidden_layers * (attn_params + mlp_params)
        if include_lm_head:
            per_token_params += h * vocab_size
        a = 6.0 * per_token_params
        return cls(a=a, b=6.0 * num_hidden_layers * q_dim, c=a * float(microbatch_tokens))

    @classmethod
    def from_hf_config(cls, config: Any, *, include_lm_head: bool = True,
                       microbatch_tokens: float = 0.0) -> "QuadraticCost":
        """Derive ``a`` and ``b`` from a Hugging Face config object (or a dict with the same keys).

        Reads ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads`` and, when
        present, ``num_key_value_heads``, ``head_dim`` and ``vocab_size``. ``microbatch_tokens`` sets ``c`` (see the
        class docstring); the automatic cost starts from :data:`MICROBATCH_PRIOR_TOKENS`.
        """
        get = (lambda k: config.get(k)) if isinstance(config, Mapping) else (lambda k: getattr(config, k, None))
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
                   if get(k) is None]
        if missing:
            raise ValueError(f"the model config has no {', '.join(missing)}: QuadraticCost.from_hf_config needs a "
                             "decoder's shape; pass cost='tokens' or a FittedCost(a, b, c) instead")
        return cls.from_shape(
            hidden_size=int(get("hidden_size")),
            intermediate_size=int(get("intermediate_size")),
            num_hidden_layers=int(get("num_hidden_layers")),
            num_attention_heads=int(get("num_attention_heads")),
            num_key_value_heads=get("num_key_value_heads"),
            head_dim=get("head_dim"),
            vocab_size=int(get("vocab_size") or 0),
            include_lm_head=include_lm_head,
            microbatch_tokens=microbatch_tokens,
        )


@dataclass(frozen=True)
class FittedCost(CostModel):
    """cost = a*L + b*L^2 per sample + c per microbatch, fitted to measurements (seconds).

    Measure a spread of lengths covering the range you train on; the fit is an interpolation and may be
    meaningless outside it.
    """

    a: float
    b: float
    c: float = 0.0

    name = "fitted"

    @classmethod
    def fit(cls, lengths: Sequence[float], times: Sequence[float]) -> "FittedCost":
        """Least squares of ``times`` (one sample per microbatch) on [L, L^2, 1]; needs 3 distinct lengths."""
        L = np.asarray(lengths, dtype=np.float64)
        t = np.asarray(times, dtype=np.float64)
        if L.shape != t.shape or L.ndim != 1:
            raise ValueError("lengths and times must be 1-D sequences of the same size")
        if np.unique(L).size < 3:
            raise ValueError("FittedCost.fit needs at least 3 distinct lengths to fit a, b and c")
        # Scale columns so the normal equations are well conditioned when L ~ 1e5 and L^2 ~ 1e10.
        s = float(L.max())
        X = np.stack([L / s, (L / s) ** 2, np.ones_like(L)], axis=1)
        (a, b, c), *_ = np.linalg.lstsq(X, t, rcond=None)
        return cls(a=float(a / s), b=float(b / (s * s)), c=float(c))


COST_MODELS = ("auto", "tokens", "quadratic")


def get_cost_model(name_or_obj: "str | CostModel | None", model_config: Any = None) -> CostModel:
    """Resolve a cost given by name, or pass a :class:`CostModel` through.

    ``"tokens"``: :class:`TokenCost`. ``"quadratic"``: :meth:`QuadraticCost.from_hf_config` of ``model_config``
    (required: the coefficients depend on the model). ``"auto"`` is not a fixed model: it learns from measured step
    times, which only :class:`~ds_odc.balancer.sampler.BalancedBatchSampler` (``cost="auto"``) observes.
    """
    if name_or_obj is None:
        return TokenCost()
    if isinstance(name_or_obj, CostModel):
        return name_or_obj
    if name_or_obj in ("tokens", "linear"):
        return TokenCost()
    if name_or_obj == "quadratic":
        if model_config is None:
            raise ValueError("cost='quadratic' derives its coefficients from the model's shape: pass "
                             "QuadraticCost.from_hf_config(model.config) (or model_config=model.config where the "
                             "call takes one), or use cost='tokens'")
        return QuadraticCost.from_hf_config(model_config)
    if name_or_obj == "auto":
        raise ValueError("cost='auto' learns from the step times measured in training: use it with "
                         "BalancedBatchSampler(cost='auto') and call sampler.observe(...) after every step; a single "
                         "plan needs a fixed CostModel (e.g. QuadraticCost.from_hf_config(model.config))")
    raise ValueError(f"unknown cost model {name_or_obj!r}; use one of {COST_MODELS} or a CostModel instance")
