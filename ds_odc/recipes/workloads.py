"""Synthetic SFT workloads: model shapes, sample lengths and token ids that are the same in every run.

What the examples and benchmarks train on when nothing is downloaded: a Qwen2.5-shaped model with random weights,
sample lengths from a file or a preset distribution, and random token ids derived from the sample's index (so a
sample is identical in every mode, on every rank, in every process that needs it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ds_odc.balancer.lengths import read_lengths
from ds_odc.balancer.presets import MODEL_SHAPES, get_preset

__all__ = ["model_config", "sample_tokens", "SampleSet"]


def model_config(shape: str, max_position_embeddings: int = 131072, num_layers: int | None = None):
    """A ``Qwen2Config`` of one of :data:`MODEL_SHAPES` (with ``num_layers`` decoder layers instead of the shape's
    own, if given: the same width, fewer or more layers), without a KV cache.

    ``use_cache=False``: transformers detects the sample boundaries of a packed row only when no cache exists."""
    from transformers import Qwen2Config
    try:
        shape_kwargs = MODEL_SHAPES[shape]
    except KeyError:
        raise ValueError(f"unknown model shape {shape!r}; choose one of {sorted(MODEL_SHAPES)}") from None
    if num_layers:
        shape_kwargs = {**shape_kwargs, "num_hidden_layers": num_layers}
    return Qwen2Config(**shape_kwargs, max_position_embeddings=max_position_embeddings, use_cache=False)


def load_lengths(*, lengths_file: str | Path | None = None, preset: str | None = None,
                 equal_lengths: int | None = None, num_samples: int | None = None, length_scale: float = 1.0,
                 seed: int = 0) -> np.ndarray:
    """Per-sample token counts (int64, each >= 2): from a file (one length per line), all ``equal_lengths``, or drawn
    from a preset (default ``baselines-longtail``); then multiplied by ``length_scale`` (tiny CPU runs)."""
    needed = num_samples or 10_000
    if lengths_file:
        lengths = read_lengths(lengths_file)
    elif equal_lengths:
        lengths = np.full(needed, equal_lengths, dtype=np.int64)
    else:
        lengths = get_preset(preset or "baselines-longtail").sample(needed, seed)
    return np.maximum(2, np.round(lengths * length_scale)).astype(np.int64)


def tokenize_text_file(path: str | Path, tokenizer_dir: str | Path) -> list[list[int]]:
    """Token ids of every ``text`` field of a local ``.jsonl`` or ``.parquet`` file, with a local tokenizer."""
    from datasets import load_dataset
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    kind = "parquet" if str(path).endswith(".parquet") else "json"
    texts = load_dataset(kind, data_files=str(path), split="train")["text"]
    return [tokenizer(t)["input_ids"] for t in texts]


def sample_tokens(index: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """Random token ids of sample ``index``, a function of (index, length, vocab, seed) only."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.randint(0, vocab, (length,), generator=g)


@dataclass(frozen=True, eq=False)
class SampleSet:
    """A run's samples as a dataset (what ``deepspeed.initialize(training_data=...)`` takes): item ``j`` is
    ``{"input_ids": its token ids}``, from ``token_ids`` (real text) or else :func:`sample_tokens` of sample ``j``
    (random ids of its length, drawn again on every read)."""

    lengths: np.ndarray
    token_ids: list[list[int]] | None
    vocab_size: int
    seed: int

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self.token_ids:
            return {"input_ids": torch.as_tensor(self.token_ids[index])}
        return {"input_ids": sample_tokens(index, int(self.lengths[index]), self.vocab_size, self.seed)}
