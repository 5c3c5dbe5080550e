"""The samples checked before the first step: lengths against the budget, empty samples, labels of the wrong size.

A sampler checks every sample when it is built (vectorised: seconds for ten million samples), so a bad sample stops
the run before any training instead of hours in, and the error names the sample by its dataset index. Samples over
the budget are handled by the ``oversize`` policy; the counts land in the :class:`DataReport` that the sampler
keeps, logs and that the examples write into their metrics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

__all__: list[str] = []

logger = logging.getLogger("ds_odc.balancer")

SHOWN = 5  # indices named in messages and reports


class DataError(ValueError):
    """A sample that cannot be trained as configured; the message names it and the ways out."""


@dataclass(frozen=True)
class DataReport:
    """What the oversize policy did to the dataset: dataset indices of truncated and skipped samples."""

    num_samples: int
    max_tokens: int | None
    oversize: str
    truncated: np.ndarray
    skipped: np.ndarray

    def as_dict(self) -> dict:
        """Counts and the first few indices (JSON-friendly)."""
        return {"num_samples": self.num_samples, "max_tokens": self.max_tokens, "oversize": self.oversize,
                "truncated_samples": int(self.truncated.size), "first_truncated": self.truncated[:SHOWN].tolist(),
                "skipped_samples": int(self.skipped.size), "first_skipped": self.skipped[:SHOWN].tolist()}

    def message(self) -> str | None:
        """One line for the log, or None when the policy touched nothing."""
        parts = []
        for what, idx in (("truncated to", self.truncated), ("skipped, longer than", self.skipped)):
            if idx.size:
                parts.append(f"{idx.size} samples {what} max_tokens={self.max_tokens} (dataset indices "
                             f"{_few(idx)})")
        return "ds_odc balancer: " + "; ".join(parts) if parts else None


def check_lengths(lengths: np.ndarray, max_tokens: int | None, oversize: str,
                  describe: Callable[[int], str] | None = None) -> DataReport:
    """Check every sample's length; raise :class:`DataError` or return what ``oversize`` will do.

    ``describe(index)`` may add a few words about a sample to error messages (e.g. its dataset row).
    """
    lengths = np.asarray(lengths)
    if lengths.ndim != 1:
        raise DataError(f"lengths must be one number per sample, got an array of shape {lengths.shape}")
    if lengths.size and not np.issubdtype(lengths.dtype, np.integer):
        raise DataError(f"lengths must be integers (token counts), got dtype {lengths.dtype}")
    empty = np.flatnonzero(lengths <= 0)
    if empty.size:
        i = int(empty[0])
        raise DataError(f"sample at dataset index {i}{_about(describe, i)} has {int(lengths[i])} tokens "
                        f"({_count(empty)}). A sample with no tokens trains nothing and has no loss terms: drop "
                        "empty samples from the dataset (e.g. dataset.filter(lambda s: len(s['input_ids']) > 0))")
    none = np.zeros(0, dtype=np.int64)
    if max_tokens is None:
        return DataReport(int(lengths.size), None, oversize, none, none)
    over = np.flatnonzero(lengths > max_tokens)
    if over.size and oversize == "error":
        i = int(over[0])
        raise DataError(
            f"sample at dataset index {i}{_about(describe, i)} has {int(lengths[i])} tokens, more than "
            f"max_tokens={max_tokens} ({_count(over)}). Raise max_tokens, filter long samples out of the dataset, "
            "or choose oversize='truncate' (train the first max_tokens tokens) or oversize='skip' (leave them out); "
            "both are counted in the log and the metrics")
    report = DataReport(int(lengths.size), int(max_tokens), oversize,
                        over if oversize == "truncate" else none, over if oversize == "skip" else none)
    if report.message():  # callers show it once (rank 0); the library only logs at info level
        logger.info(report.message())
    return report


def check_label_lengths(input_lengths: Sequence[int], label_lengths: Sequence[int],
                        describe: Callable[[int], str] | None = None) -> None:
    """Every sample's ``labels`` must have as many entries as its ``input_ids``."""
    a, b = np.asarray(input_lengths), np.asarray(label_lengths)
    bad = np.flatnonzero(a != b)
    if bad.size:
        i = int(bad[0])
        raise DataError(f"sample at dataset index {i}{_about(describe, i)} has {int(a[i])} input_ids but "
                        f"{int(b[i])} labels ({_count(bad)}). Labels are per token: give each sample exactly one "
                        "label per input id (-100 for tokens without loss)")


def _few(idx: np.ndarray) -> str:
    shown = ", ".join(str(int(i)) for i in idx[:SHOWN])
    return shown + (", ..." if idx.size > SHOWN else "")


def _count(idx: np.ndarray) -> str:
    return "the only such sample" if idx.size == 1 else f"{idx.size} such samples: {_few(idx)}"


def _about(describe: Callable[[int], str] | None, i: int) -> str:
    if describe is None:
        return ""
    try:
        return f" ({describe(i)})"
    except Exception:  # describing a sample must never hide the real error
        return ""
