"""Batch sampler: this rank's microbatches for every minibatch, with epochs, seeds and exact resume.

Every rank builds the same :class:`BalancedBatchSampler` (same lengths, seed, world size) and only ``rank``
differs, so all ranks draw the same global minibatches and compute the same plan without communicating.

Epoch order: with ``shuffle=True`` the dataset is permuted with ``numpy.random.default_rng([seed, epoch])``;
consecutive chunks of ``minibatch_size * world_size`` indices form the global minibatches.  Call
:meth:`set_epoch` before each epoch, as with ``torch.utils.data.DistributedSampler`` (without it every epoch
repeats the same order).

Typical loop::

    sampler = BalancedBatchSampler(lengths, world_size=W, rank=r, minibatch_size=4, max_tokens=65536)
    collate = PackedCollator()
    for epoch in range(E):
        sampler.set_epoch(epoch)
        for batch in sampler:                      # one optimizer step per batch
            for mb in batch.microbatches:          # may be a different count on every rank (lb-mini)
                inputs = collate([dataset[i] for i in mb])
                loss_sum = ...                     # sum of per-token losses of this microbatch
                (loss_sum / (batch.num_tokens - batch.num_samples)).backward()
            optimizer.step()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from .cost import CostModel, get_cost_model
from .planners import PLANNERS, plan_minibatch

__all__ = ["RankBatch", "BalancedBatchSampler", "lengths_from_dataset", "lengths_from_file"]


@dataclass(frozen=True)
class RankBatch:
    """This rank's share of one minibatch.

    Attributes:
        microbatches: dataset indices per microbatch, in execution order (may be empty on a rank only when the
            minibatch has fewer samples than ranks).
        num_samples: samples in the whole (global) minibatch: normaliser of a per-sample mean loss.
        num_tokens: tokens in the whole minibatch (after truncation); with labels = inputs the number of loss
            terms is ``num_tokens - num_samples``.
        step: index of this minibatch within the epoch.
        epoch: the epoch it belongs to.
        truncated: dataset indices (whole minibatch) that were truncated to ``max_tokens``.
        skipped: dataset indices (whole minibatch) that were left out (``oversize="skip"``).
    """

    microbatches: list[list[int]]
    num_samples: int
    num_tokens: int
    step: int
    epoch: int = 0
    truncated: tuple[int, ...] = ()
    skipped: tuple[int, ...] = ()

    @property
    def num_label_tokens(self) -> int:
        return self.num_tokens - self.num_samples


class BalancedBatchSampler:
    """Yields a :class:`RankBatch` per minibatch for one rank.

    Args:
        lengths: token count of every dataset sample.
        world_size, rank: plain ints (no ``torch.distributed`` needed).
        minibatch_size: samples *per rank* per minibatch; a global minibatch holds ``minibatch_size * world_size``.
        max_tokens: token budget per microbatch (``None``: one sample per microbatch).
        planner: ``"lb-mini"`` (ODC), ``"lb-micro"`` or ``"local-sort"`` (collective-compatible).
        cost: cost model name or instance.
        seed, shuffle: epoch permutation.
        drop_last: drop the final incomplete minibatch (default); otherwise plan it with fewer samples.
        oversize: planner policy for samples longer than ``max_tokens``.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        *,
        world_size: int,
        rank: int,
        minibatch_size: int,
        max_tokens: int | None,
        planner: str = "lb-mini",
        cost: "str | CostModel" = "tokens",
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        oversize: str = "error",
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if minibatch_size < 1:
            raise ValueError(f"minibatch_size must be >= 1, got {minibatch_size}")
        if planner not in PLANNERS:
            raise ValueError(f"unknown planner {planner!r}; choose one of {PLANNERS}")
        self.lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.minibatch_size = int(minibatch_size)
        self.max_tokens = max_tokens
        self.planner = planner
        self.cost = get_cost_model(cost)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.oversize = oversize
        self._epoch = 0
        self._step = 0  # next minibatch to yield in the current epoch

    @property
    def global_minibatch_size(self) -> int:
        return self.minibatch_size * self.world_size

    def __len__(self) -> int:
        n, g = len(self.lengths), self.global_minibatch_size
        return n // g if self.drop_last else -(-n // g)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's permutation and restart at its first minibatch."""
        self._epoch = int(epoch)
        self._step = 0

    def epoch_order(self, epoch: int | None = None) -> np.ndarray:
        """Dataset indices in the order minibatches are cut from for ``epoch`` (default: current)."""
        e = self._epoch if epoch is None else int(epoch)
        n = len(self.lengths)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, e]).permutation(n)

    def minibatch(self, step: int, epoch: int | None = None) -> RankBatch:
        """The :class:`RankBatch` of minibatch ``step`` (random access; does not move the iterator)."""
        if not 0 <= step < len(self):
            raise IndexError(f"step {step} out of range for {len(self)} minibatches")
        e = self._epoch if epoch is None else int(epoch)
        g = self.global_minibatch_size
        ids = self.epoch_order(e)[step * g : (step + 1) * g]
        plan = plan_minibatch(
            self.lengths[ids],
            self.world_size,
            planner=self.planner,
            max_tokens=self.max_tokens,
            cost=self.cost,
            oversize=self.oversize,
        )
        ids_l = ids.tolist()
        return RankBatch(
            microbatches=[[ids_l[j] for j in mb] for mb in plan.microbatches[self.rank]],
            num_samples=plan.num_samples,
            num_tokens=plan.num_tokens,
            step=step,
            epoch=e,
            truncated=tuple(ids_l[j] for j in plan.truncated),
            skipped=tuple(ids_l[j] for j in plan.skipped),
        )

    def __iter__(self) -> Iterator[RankBatch]:
        """Yield the remaining minibatches of the current epoch, starting at the resume point.

        The state advances as each batch is yielded, so :meth:`state_dict` taken after consuming batch ``s``
        resumes at ``s + 1``.  (If a DataLoader prefetches ahead of training, save ``batch.step + 1`` yourself.)
        """
        while self._step < len(self):
            batch = self.minibatch(self._step)
            self._step += 1
            yield batch
        self._step = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "step": self._step,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": int(len(self.lengths)),
            "world_size": self.world_size,
            "minibatch_size": self.minibatch_size,
            "planner": self.planner,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume exactly: the next batch yielded is the one after the last consumed one before saving."""
        for key in ("seed", "shuffle", "num_samples", "world_size", "minibatch_size", "planner"):
            mine = self.state_dict()[key]
            if key in state and state[key] != mine:
                raise ValueError(f"cannot resume: checkpoint has {key}={state[key]!r}, this sampler has {mine!r}")
        self._epoch = int(state["epoch"])
        self._step = int(state["step"])


def lengths_from_dataset(ds: Any, column: str = "input_ids") -> list[int]:
    """Per-sample lengths from an HF ``datasets.Dataset`` (or any mapping of columns).

    ``column`` may hold token lists (their lengths are taken) or integers (taken as lengths, e.g. a precomputed
    ``"length"`` column).
    """
    values = ds[column]
    out = []
    for v in values:
        out.append(int(v) if isinstance(v, (int, np.integer)) else len(v))
    return out


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
