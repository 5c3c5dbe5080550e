"""Synthetic sequence-length distributions for the simulator and benchmarks.

These are *approximations* of the shapes reported for real post-training data, not fits to any dataset; use
``--lengths FILE`` with your own tokenized lengths for real predictions.

``long-sft``
    Long-context SFT (LongAlign-like): 8,192 + lognormal excess (median 8,000, sigma 1.0), capped at 65,536.
    Median ~16k tokens, ~2% of samples at the 64k cap.
``agent``
    Agent trajectories (SWE-style multi-turn tool use): lognormal, median 10,000, sigma 1.1, clamped to
    [512, 131,072]: a heavy right tail (~4% above 64k).
``rl``
    RL rollouts: prompt (lognormal, median 300, clamped to [32, 2,048]) + response that either hits the
    generation limit 16,384 (30%) or stops early (lognormal, median 2,500, sigma 0.8, clamped to [16, 16,384]):
    bimodal.
``heavy-tail``
    Post-training mixes as they come: mostly short samples (99%: lognormal, median 1,000, sigma 1.0) and a few long
    documents or trajectories (1%: lognormal, median 40,000, sigma 0.6), clamped to [16, 131,072]. Median ~1k
    tokens; the longest of 512 samples is ~80k, and at 64 ranks it usually costs more than 8 ranks' fair share of
    the minibatch under a quadratic cost (Qwen2.5-1.5B), which is what a single rank cannot hide.
``baselines-longtail``
    Exactly the "long-tail SFT" workload of the project's baselines: ``floor(clamp(exp(ln 8000 + 0.8 z), 1024,
    32768))`` with z ~ N(0, 1).  Drawn with numpy here; feeding the normals of
    ``torch.Generator().manual_seed(0)`` (``torch.randn(8)`` per minibatch) through :func:`longtail_from_normals`
    reproduces the measured minibatches token for token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

__all__ = ["MODEL_SHAPES", "get_preset", "longtail_from_normals"]


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    draw: Callable[[int, np.random.Generator], np.ndarray]

    def sample(self, n: int, seed: int | np.random.Generator = 0) -> np.ndarray:
        """``n`` lengths (int64) from this distribution."""
        rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
        return np.asarray(self.draw(n, rng), dtype=np.int64)


def longtail_from_normals(z: np.ndarray) -> np.ndarray:
    """The baselines' long-tail length formula applied to standard normal draws ``z``."""
    z = np.asarray(z, dtype=np.float64)
    return np.floor(np.clip(np.exp(math.log(8000.0) + 0.8 * z), 1024, 32768)).astype(np.int64)


def _lognormal(rng: np.random.Generator, n: int, median: float, sigma: float) -> np.ndarray:
    return np.exp(math.log(median) + sigma * rng.standard_normal(n))


def _long_sft(n: int, rng: np.random.Generator) -> np.ndarray:
    return np.minimum(8192 + _lognormal(rng, n, 8000, 1.0), 65536).astype(np.int64)


def _agent(n: int, rng: np.random.Generator) -> np.ndarray:
    return np.clip(_lognormal(rng, n, 10000, 1.1), 512, 131072).astype(np.int64)


def _rl(n: int, rng: np.random.Generator) -> np.ndarray:
    prompt = np.clip(_lognormal(rng, n, 300, 0.6), 32, 2048)
    early = np.clip(_lognormal(rng, n, 2500, 0.8), 16, 16384)
    hit_limit = rng.random(n) < 0.3
    return (prompt + np.where(hit_limit, 16384, early)).astype(np.int64)


def _heavy_tail(n: int, rng: np.random.Generator) -> np.ndarray:
    short = _lognormal(rng, n, 1000, 1.0)
    long = _lognormal(rng, n, 40000, 0.6)
    return np.clip(np.where(rng.random(n) < 0.01, long, short), 16, 131072).astype(np.int64)


def _baselines_longtail(n: int, rng: np.random.Generator) -> np.ndarray:
    return longtail_from_normals(rng.standard_normal(n))


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("long-sft", "long-context SFT, 8k floor, median ~16k, capped at 64k", _long_sft),
        Preset("agent", "agent trajectories, lognormal median 10k, heavy tail to 128k", _agent),
        Preset("rl", "RL rollouts, prompt + bimodal response (30% hit the 16k limit)", _rl),
        Preset("heavy-tail", "mostly short (median ~1k) with 1% long documents (median 40k), to 128k", _heavy_tail),
        Preset("baselines-longtail", "baselines.md long-tail SFT: clamp(exp(ln 8000 + 0.8 N), 1024, 32768)",
               _baselines_longtail),
    )
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None


# Model shapes the examples, benchmarks and the simulator's cost use: Qwen2.5's config fields (random init, so
# nothing is downloaded). Plain numbers, so the balancer can price a model without importing torch.
MODEL_SHAPES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
