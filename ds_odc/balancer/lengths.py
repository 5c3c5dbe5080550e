"""Sample lengths, where the balancer reads them from: a lengths file, a dataset's columns, or a text file.

* :func:`read_lengths`: a file of one token count per line (``#`` comments and blank lines allowed), as the
  simulator's ``--lengths`` and the examples' ``--lengths-file`` take, and ``benchmarks/e2e.py`` writes.
* :func:`lengths_from_dataset` / :func:`sq_lengths_from_dataset`: a Hugging Face dataset's token lists (or a
  precomputed length column) and, for rows that pack several documents, the sums of their squared lengths.
* :func:`lengths_from_file`: a local JSONL or parquet text file, tokenized.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["read_lengths"]


def read_lengths(path: "str | Path") -> np.ndarray:
    """The token counts in a lengths file (int64), one per line; blank lines and ``#`` comments are skipped.
    Raises ``ValueError`` naming the file and line of anything else, or when the file holds no length."""
    values = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                value = float(line)
            except ValueError:
                raise ValueError(f"{path}:{lineno}: expected one integer length per line, got {line!r}") from None
            if value != int(value) or value < 0:
                raise ValueError(f"{path}:{lineno}: a length is a non-negative whole number of tokens, got {line!r}")
            values.append(int(value))
    if not values:
        raise ValueError(f"{path}: no lengths found (one token count per line)")
    return np.asarray(values, dtype=np.int64)


def lengths_from_dataset(ds: Any, column: str = "input_ids") -> np.ndarray:
    """Per-sample lengths (int64 array) from an HF ``datasets.Dataset`` (or any mapping of columns).

    ``column`` may hold token lists (their lengths are taken) or integers (taken as lengths, e.g. a precomputed
    ``"length"`` column). An HF dataset is read as Arrow in batches, without converting rows to Python: seconds
    for ten million rows.
    """
    if hasattr(ds, "with_format") and hasattr(ds, "column_names"):
        return _arrow_column(ds, column, lambda col, pc: pc.list_value_length(col))
    values = ds[column]
    return np.asarray([int(v) if isinstance(v, (int, np.integer)) else len(v) for v in values], dtype=np.int64)


def sq_lengths_from_dataset(ds: Any, column: str = "seq_lengths") -> np.ndarray:
    """Per row, the sum of its documents' squared lengths, from a column of document lengths (TRL's packed datasets
    carry one, ``seq_lengths``): what attention costs in a row that packs several documents."""
    if hasattr(ds, "with_format") and hasattr(ds, "column_names"):
        def sums_of_squares(col, pc):
            import pyarrow as pa
            col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
            flat = np.asarray(pc.list_flatten(col), dtype=np.float64)
            offsets = np.asarray(col.offsets, dtype=np.int64)
            offsets = offsets - offsets[0]  # a sliced array's offsets start where its first list does
            csum = np.concatenate([[0.0], np.cumsum(flat * flat)])
            return csum[offsets[1:]] - csum[offsets[:-1]]
        return _arrow_column(ds, column, sums_of_squares, dtype=np.float64)
    return np.asarray([float(sum(int(x) ** 2 for x in v)) for v in ds[column]], dtype=np.float64)


def _arrow_column(ds: Any, column: str, of_lists, dtype=np.int64) -> np.ndarray:
    if column not in ds.column_names:
        raise ValueError(f"the dataset has no column {column!r} (columns: {ds.column_names})")
    import pyarrow as pa
    import pyarrow.compute as pc
    parts = []
    for table in ds.select_columns([column]).with_format("arrow").iter(batch_size=1_000_000):
        col = table.column(column)
        if pa.types.is_integer(col.type):
            parts.append(np.asarray(col, dtype=dtype))
        elif pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            parts.append(np.asarray(of_lists(col, pc), dtype=dtype))
        else:
            raise ValueError(f"column {column!r} holds {col.type}: expected token lists or integer lengths")
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def lengths_from_file(
    path: str,
    tokenizer: Any,
    text_field: str = "text",
    *,
    batch_size: int = 1000,
    add_special_tokens: bool = True,
) -> list[int]:
    """Tokenize a local JSONL (``.json``/``.jsonl``) or parquet file with ``tokenizer`` and return the lengths.

    Reads with HF ``datasets`` (no network).  ``tokenizer`` is any callable returning ``{"input_ids": [...]}``
    for a list of strings, e.g. a ``transformers`` tokenizer.
    """
    from datasets import load_dataset  # optional dependency, imported lazily

    fmt = "parquet" if str(path).endswith(".parquet") else "json"
    ds = load_dataset(fmt, data_files=str(path), split="train")
    lengths: list[int] = []
    for start in range(0, len(ds), batch_size):
        texts = ds[start : start + batch_size][text_field]
        enc = tokenizer(texts, add_special_tokens=add_special_tokens)
        lengths.extend(len(ids) for ids in enc["input_ids"])
    return lengths
