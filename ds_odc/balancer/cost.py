"""Cost models: how long one sample of ``L`` tokens keeps a rank busy.

The balancer only needs *relative* costs: a partition that evens out these numbers evens out the ranks' busy
time.  Token budgets (``max_tokens``) are always checked against raw token counts, never against costs, so a cost
model changes *which* samples go together, not whether a microbatch fits in memory.

Three models are provided:

* :class:`TokenCost` -- cost = L.  Right when linear layers dominate (short sequences, big models).
* :class:`QuadraticCost` -- cost = a*L + b*L^2.  The linear term is the dense-layer work, the quadratic term is
  attention.  :meth:`QuadraticCost.from_hf_config` derives both from a model shape (training FLOPs).
* :class:`FittedCost` -- cost = a*L + b*L^2 + c, least squares on measured (length, seconds) pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

import numpy as np

__all__ = [
    "CostModel",
    "TokenCost",
    "QuadraticCost",
    "FittedCost",
    "get_cost_model",
    "COST_MODELS",
]


class CostModel:
    """Base class.  Subclasses implement :meth:`costs` on a float64 array of lengths (vectorised)."""

    name: str = "cost"

    def costs(self, lengths: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, lengths: Union[int, float, Sequence[int], np.ndarray]) -> Any:
        """Cost of one length (returns a float) or of many (returns a float64 array)."""
        arr = np.asarray(lengths, dtype=np.float64)
        out = self.costs(arr)
        return float(out) if arr.ndim == 0 else out


@dataclass(frozen=True)
class TokenCost(CostModel):
    """cost = L (tokens).  The default: it needs no model knowledge and is exact for the token budget."""

    name = "tokens"

    def costs(self, lengths: np.ndarray) -> np.ndarray:
        return np.asarray(lengths, dtype=np.float64)


@dataclass(frozen=True)
class QuadraticCost(CostModel):
    """cost = a*L + b*L^2.

    With :meth:`from_hf_config` / :meth:`from_shape` the unit is training FLOPs (forward + backward):

    * ``a = 6 * P`` where ``P`` is the number of weights a token goes through once: the non-embedding parameters
      (attention projections and MLP of every layer) plus, by default, the LM head matmul (it is compute even when
      the embedding is tied).  6 = 2 FLOPs per multiply-add x 3 (forward, and backward for inputs and weights).
    * ``b = 6 * layers * hidden``: per layer, the score matmul QK^T and the value matmul AV cost 2*hidden FLOPs per
      (query, key) pair each in the forward, x3 for forward+backward = 12*hidden per pair; causal attention touches
      L^2/2 pairs, so the per-sequence attention cost is 6*layers*hidden*L^2.

    Recomputation under activation checkpointing adds one more forward (about 8 instead of 6 for both terms); it
    scales both terms alike and so does not change the balance.
    """

    a: float = 1.0
    b: float = 0.0

    name = "quadratic"

    def costs(self, lengths: np.ndarray) -> np.ndarray:
        L = np.asarray(lengths, dtype=np.float64)
        return self.a * L + self.b * L * L

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
        return cls(a=6.0 * per_token_params, b=6.0 * num_hidden_layers * q_dim)

    @classmethod
    def from_hf_config(cls, config: Any, *, include_lm_head: bool = True) -> "QuadraticCost":
        """Derive ``a`` and ``b`` from a Hugging Face config object (or a dict with the same keys).

        Reads ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads`` and, when
        present, ``num_key_value_heads``, ``head_dim`` and ``vocab_size``.
        """
        get = (lambda k: config.get(k)) if isinstance(config, Mapping) else (lambda k: getattr(config, k, None))
        return cls.from_shape(
            hidden_size=int(get("hidden_size")),
            intermediate_size=int(get("intermediate_size")),
            num_hidden_layers=int(get("num_hidden_layers")),
            num_attention_heads=int(get("num_attention_heads")),
            num_key_value_heads=get("num_key_value_heads"),
            head_dim=get("head_dim"),
            vocab_size=int(get("vocab_size") or 0),
            include_lm_head=include_lm_head,
        )

    @classmethod
    def qwen2_1_5b(cls) -> "QuadraticCost":
        """The default ``"quadratic"`` model: Qwen2.5-1.5B shape (the one in docs/baselines)."""
        return cls.from_shape(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
        )


@dataclass(frozen=True)
class FittedCost(CostModel):
    """cost = a*L + b*L^2 + c fitted to measurements, e.g. per-sample forward+backward seconds.

    Measure a spread of lengths covering the range you train on; the fit is an interpolation and may be
    meaningless outside it (a negative ``b`` from noisy data, for instance).
    """

    a: float
    b: float
    c: float = 0.0

    name = "fitted"

    def costs(self, lengths: np.ndarray) -> np.ndarray:
        L = np.asarray(lengths, dtype=np.float64)
        return self.a * L + self.b * L * L + self.c

    @classmethod
    def fit(cls, lengths: Sequence[float], times: Sequence[float]) -> "FittedCost":
        """Ordinary least squares of ``times`` on the columns [L, L^2, 1]; needs at least 3 distinct lengths."""
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


COST_MODELS = ("tokens", "quadratic")


def get_cost_model(name_or_obj: "str | CostModel | None") -> CostModel:
    """Resolve ``"tokens"`` / ``"quadratic"`` (Qwen2.5-1.5B shape) or pass a :class:`CostModel` through."""
    if name_or_obj is None:
        return TokenCost()
    if isinstance(name_or_obj, CostModel):
        return name_or_obj
    if name_or_obj in ("tokens", "linear"):
        return TokenCost()
    if name_or_obj == "quadratic":
        return QuadraticCost.qwen2_1_5b()
    raise ValueError(f"unknown cost model {name_or_obj!r}; use one of {COST_MODELS} or a CostModel instance")
