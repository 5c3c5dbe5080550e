"""TRL's per-microbatch metrics as stock TRL would log them, although ODC groups the samples differently.

TRL logs a per-token statistic (``kl``, ``entropy``, ``clip_ratio/*``, ``mean_token_accuracy``, ...) once per
microbatch: its value over that microbatch's tokens on all ranks (a ratio of sums all-reduced across ranks), or
the min / max over its sequences; ``log()`` then averages those values over the logging window. So the logged number
depends on which samples shared a microbatch. Under ODC + LB-Mini other samples share a microbatch, on other ranks,
in different numbers per rank, and a per-microbatch collective would deadlock anyway.

Every rank knows from the plan which *stock microbatch* (its "slot": the accumulation step of the stock trainer)
each sample came from. So the trainers record the statistic's ingredients per slot, rank-locally: the sum and the
count behind a token mean, or the min / max, for the samples of that slot they trained. At the optimizer step, where
ranks meet anyway, those records travel with the step's one all-gather; :func:`combine` then adds every rank's sums
for each slot and divides once, which is exactly what TRL's all-reduce computes for that stock microbatch, and the
trainer appends one value per slot, in slot order, as TRL appends one per accumulation step.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

__all__: list[str] = []

MEAN, MIN, MAX, VALUE = "mean", "min", "max", "value"


class SlotMetrics:
    """What TRL's loss logs, keyed by slot. Use :meth:`sink` in place of ``trainer._metrics["train"]`` and pass
    :meth:`on_reduce` to :func:`~ds_odc.integrations._hf_privates.rank_local_collectives`: a value TRL appends right
    after reducing ``[sum, count]`` is recorded as that sum and count; ``*_min`` / ``*_max`` values by min / max;
    anything else by its mean over the slot's groups."""

    def __init__(self) -> None:
        self.slot: int | None = None  # the stock microbatch of the samples TRL's loss is looking at now
        self.records: dict[str, dict[int, list]] = {}
        self._reduced: torch.Tensor | None = None

    def on_reduce(self, tensor: torch.Tensor) -> None:
        self._reduced = tensor

    def add_mean(self, name: str, slot: int, total: float, count: float) -> None:
        entry = self.records.setdefault(name, {}).setdefault(slot, [MEAN, 0.0, 0.0])
        entry[1] += total
        entry[2] += count

    def add(self, name: str, value: float) -> None:
        reduced, self._reduced = self._reduced, None
        if self.slot is None:
            raise RuntimeError(f"ds_odc: TRL logged {name!r} outside a stock microbatch")
        if reduced is not None and reduced.numel() == 2:
            total, count = (float(x) for x in reduced.detach().double().reshape(-1).tolist())
            self.add_mean(name, self.slot, total, count)
            return
        kind = MIN if name.endswith("_min") else MAX if name.endswith("_max") else VALUE
        entry = self.records.setdefault(name, {}).setdefault(self.slot, [kind, []])
        entry[1].append(float(value))

    def sink(self) -> "_Sink":
        return _Sink(self)


class _List(list):
    def __init__(self, metrics: SlotMetrics, name: str) -> None:
        super().__init__()
        self.records_to, self.name = metrics, name

    def append(self, value) -> None:
        self.records_to.add(self.name, value)


class _Sink(dict):
    """Stands in for TRL's ``defaultdict(list)`` of metrics."""

    def __init__(self, metrics: SlotMetrics) -> None:
        super().__init__()
        self.records_to = metrics

    def __missing__(self, name: str) -> _List:
        self[name] = _List(self.records_to, name)
        return self[name]


def combine(everyone: Iterable[dict[str, dict[int, list]]]) -> dict[str, list[float]]:
    """Every rank's :attr:`SlotMetrics.records` -> per metric, its value for each slot, in slot order."""
    merged: dict[str, dict[int, list[list]]] = {}
    for records in everyone:
        for name, slots in records.items():
            for slot, entry in slots.items():
                merged.setdefault(name, {}).setdefault(int(slot), []).append(entry)
    return {name: [_value(merged[name][slot]) for slot in sorted(merged[name])] for name in sorted(merged)}


def _value(entries: list[list]) -> float:
    kind = entries[0][0]
    if kind == MEAN:  # TRL: totals[0] / totals[1].clamp(min=1), over the stock microbatch's tokens on all ranks
        return math.fsum(e[1] for e in entries) / max(math.fsum(e[2] for e in entries), 1.0)
    values: list[Any] = [v for e in entries for v in e[1] if not math.isnan(v)]
    if not values:
        return math.nan
    if kind == MIN:
        return min(values)
    if kind == MAX:
        return max(values)
    return math.fsum(values) / len(values)
