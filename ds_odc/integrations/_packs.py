"""Loader items for ODC + LB-Mini under a trainer: one *pack* per optimizer step.

A pack is this rank's whole share of one global minibatch: the list of collated microbatches the LB-Mini plan gave
this rank (possibly none), plus the plan's position (epoch, step). Every rank builds the same
:class:`~ds_odc.balancer.sampler.BalancedBatchSampler` and so yields the same number of packs per epoch, which is
what a trainer loop needs (one loader item = one optimizer step on every rank), whatever the microbatch counts.

The pieces fit a plain ``torch.utils.data.DataLoader``:
``PackLoader(PackDataset(ds), batch_sampler=PackBatchSampler(sampler), collate_fn=PackCollator(collate))``.
That shape matters for resuming: Accelerate's ``skip_first_batches`` rebuilds a loader from exactly
``dataset``/``batch_sampler``/``collate_fn`` and drops the first batches of the batch sampler.

Also here: what the loader needs from the train dataset before it starts (:func:`dataset_lengths`, every sample
checked; :func:`describe_row` for error messages), and a split sample's inputs on one rank (:class:`SplitInputs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from ds_odc.balancer.checks import check_label_lengths
from ds_odc.balancer.lengths import lengths_from_dataset, sq_lengths_from_dataset
from ds_odc.balancer.sampler import BalancedBatchSampler, RankBatch
from ds_odc.balancer.sp import SplitPolicy
from ds_odc.training.sequence_parallel import slice_sample

__all__: list[str] = []

SPLIT_INPUTS_KEY = "ds_odc_split"  # in a split sample's model inputs: the SplitSlice, taken out before the forward


@dataclass(frozen=True)
class SkippedStep:
    """Stands in for a minibatch that a resumed run already trained. Accelerate's ``skip_first_batches`` drops these
    without looking at them; if one is ever fetched, the trainer and the restored sampler disagree on the position."""

    epoch: int
    step: int


@dataclass
class Pack:
    """This rank's microbatches of one optimizer step.

    ``microbatches`` holds collated model inputs (dicts of tensors), in execution order; it may be empty.
    ``num_samples``/``num_tokens`` are the *global* counts of the minibatch (from the plan, the same on every rank).
    ``label_tokens`` (each microbatch's loss tokens) and ``step_label_tokens`` (the loss tokens of the whole step,
    all ranks; ``None``: no labels anywhere) are counted by the trainer once the pack is drawn, before its step.
    """

    microbatches: list[dict[str, Any]]
    epoch: int
    step: int
    num_samples: int
    num_tokens: int
    sample_ids: list[list[int]] = field(default_factory=list)
    splits: dict[int, tuple[int, ...]] = field(default_factory=dict)  # split samples: {dataset index: ranks}
    label_tokens: list[int] = field(default_factory=list)
    step_label_tokens: int | None = None

    def __len__(self) -> int:
        return len(self.microbatches)

    # The trainer's token counter (``include_num_input_tokens_seen``) reads ``inputs["input_ids"]``: answer it with
    # this rank's tokens, so the count is right without special-casing packs there.
    def __contains__(self, key: object) -> bool:
        return key == "input_ids" or (bool(self.microbatches) and all(key in mb for mb in self.microbatches))

    def __getitem__(self, key: str) -> torch.Tensor:
        if not self.microbatches:
            return torch.zeros(0, dtype=torch.long)
        return torch.cat([mb[key].reshape(-1) for mb in self.microbatches])

    def pin_memory(self) -> "Pack":
        """Called by ``DataLoader(pin_memory=True)`` on each item."""
        self.microbatches = [{k: v.pin_memory() if torch.is_tensor(v) else v for k, v in mb.items()}
                             for mb in self.microbatches]
        return self


class PackBatchSampler:
    """A ``batch_sampler`` yielding, per optimizer step, ``[RankBatch]``: one key that :class:`PackDataset` expands.

    Resuming: :meth:`resume` loads a saved :class:`BalancedBatchSampler` state (validated against this sampler's
    seed, world size, minibatch size and planner). When the trainer then calls ``set_epoch`` for that epoch, the
    sampler restarts at the saved step; the steps before it are yielded as :class:`SkippedStep` placeholders, so the
    trainer's own fast-forward (``skip_first_batches``) drops them without re-planning or loading any data.
    """

    def __init__(self, sampler: BalancedBatchSampler) -> None:
        self.sampler = sampler
        self._resume: dict[str, Any] | None = None

    def __len__(self) -> int:
        return len(self.sampler)

    def resume(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(dict(state))  # raises on a mismatched seed / world size / planner / ...
        self._resume = dict(state)

    def set_epoch(self, epoch: int) -> None:
        if self._resume is not None and int(self._resume["epoch"]) == int(epoch):
            self.sampler.load_state_dict(self._resume)
        else:
            self.sampler.set_epoch(epoch)
        self._resume = None

    def state_at(self, epoch: int, next_step: int) -> dict[str, Any]:
        """The sampler state of a run that has trained every minibatch before ``next_step`` of ``epoch``.

        Taken from the trainer's progress, not the sampler's own counter: a loader with workers runs ahead."""
        return {**self.sampler.state_dict(), "epoch": int(epoch), "step": int(next_step)}

    def __iter__(self) -> Iterator[list]:
        state = self.sampler.state_dict()
        for step in range(state["step"]):
            yield [SkippedStep(state["epoch"], step)]
        for batch in self.sampler:
            yield [batch]


class PackDataset(torch.utils.data.Dataset):
    """Maps a :class:`RankBatch` to the samples of its microbatches (``dataset[i]`` for every index)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: RankBatch) -> tuple[RankBatch, list[list[Any]]]:
        if isinstance(key, SkippedStep):
            raise RuntimeError(
                f"ds_odc: the loader reached minibatch {key.step} of epoch {key.epoch}, which the restored balancer "
                "state marks as already trained, but the trainer did not skip it. The checkpoint's trainer state and "
                "its ds_odc balancer state disagree; resume from an untouched checkpoint folder.")
        return key, [[self.dataset[i] for i in mb] for mb in key.microbatches]


class PackCollator:
    """Collates each microbatch of a pack with ``collate`` (a list of samples -> dict of tensors); a split sample's
    microbatch with ``split(sample, ranks)`` instead (this rank's slice of it, as model inputs)."""

    def __init__(self, collate: Callable[[Sequence[Any]], dict[str, Any]],
                 split: Callable[[Any, tuple[int, ...]], dict[str, Any]] | None = None) -> None:
        self.collate = collate
        self.split = split

    def __call__(self, items: Sequence[tuple[RankBatch, list[list[Any]]]]) -> Pack:
        if len(items) != 1:
            raise ValueError(f"ds_odc: expected one pack per loader item, got {len(items)}")
        batch, samples = items[0]
        microbatches = []
        for ids, mb in zip(batch.microbatches, samples):
            if ids[0] in batch.splits:
                microbatches.append(dict(self.split(mb[0], batch.splits[ids[0]])))
            else:
                microbatches.append(dict(self.collate(mb)))
        return Pack(microbatches=microbatches, epoch=batch.epoch, step=batch.step, num_samples=batch.num_samples,
                    num_tokens=batch.num_tokens, sample_ids=batch.microbatches, splits=dict(batch.splits))


class PackLoader(torch.utils.data.DataLoader):
    """A DataLoader whose ``set_epoch`` reaches the pack sampler (the Trainer calls it at every epoch start)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


class SplitInputs:
    """A split sample's model inputs on this rank: its slice (``slice_sample``), labels already shifted over the whole
    sample; ``labels`` switch the model's loss on and ``shift_labels`` replace them. Plain data, so loader workers
    can run it."""

    def __init__(self, policy: SplitPolicy, rank: int, pad_token_id: int) -> None:
        self.policy, self.rank, self.pad_token_id = policy, rank, pad_token_id

    def __call__(self, sample: Any, ranks: tuple[int, ...]) -> dict[str, Any]:
        piece = slice_sample(sample, ranks, ranks.index(self.rank), ulysses=self.policy.ulysses_size(len(ranks)),
                             pad_token_id=self.pad_token_id)
        return {"input_ids": piece.input_ids, "position_ids": piece.position_ids, "labels": piece.shift_labels,
                "shift_labels": piece.shift_labels, SPLIT_INPUTS_KEY: piece}


def dataset_lengths(dataset, column: str):
    """(lengths, sums of squared document lengths or None) of every sample, labels checked against input_ids."""
    describe = lambda i: describe_row(dataset, i)  # noqa: E731
    if hasattr(dataset, "column_names"):  # datasets.Dataset: read the columns as Arrow, not row by row
        if column not in dataset.column_names:
            raise ValueError(f"ds_odc: length_column {column!r} is not a column of the train dataset "
                             f"({dataset.column_names})")
        lengths = lengths_from_dataset(dataset, column)
        if "labels" in dataset.column_names and column == "input_ids":
            check_label_lengths(lengths, lengths_from_dataset(dataset, "labels"), describe)
        sq = sq_lengths_from_dataset(dataset) if "seq_lengths" in dataset.column_names else None
        return lengths, sq
    lengths, labels = [], []
    for i in range(len(dataset)):
        row = dataset[i]
        value = row[column]
        lengths.append(int(value) if isinstance(value, int) else len(value))
        labels.append(len(row["labels"]) if column == "input_ids" and "labels" in row else lengths[-1])
    check_label_lengths(lengths, labels, describe)
    return lengths, None


def describe_row(dataset, index: int) -> str:
    """``row N of the train dataset: input_ids [1, 2, 3, ...] (5 items), ...`` for error messages."""
    row = dataset[index]
    parts = []
    for key, value in list(row.items())[:4] if hasattr(row, "items") else []:
        if isinstance(value, (list, tuple)) or hasattr(value, "shape"):
            items = list(value[:3]) if not hasattr(value, "shape") else value.reshape(-1)[:3].tolist()
            parts.append(f"{key} {items}{' ...' if len(value) > 3 else ''} ({len(value)} items)")
        else:
            text = repr(value)
            parts.append(f"{key} {text[:40]}{'...' if len(text) > 40 else ''}")
    return f"row {index} of the train dataset" + (": " + ", ".join(parts) if parts else "")
