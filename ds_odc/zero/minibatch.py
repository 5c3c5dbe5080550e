"""Which minibatch a rank is stepping: the tag a training loop gives each minibatch, and the check at the step's
meeting that every rank is on the same one.

Ranks meet only at the optimizer step, so a rank that misses one (a rank with no microbatch in the minibatch that
forgets ``engine.step()``) is not noticed by the meeting itself: its next step's arrival completes the others' fence,
and one update silently mixes two minibatches. When the loop tags each minibatch (:func:`ds_odc.tag_minibatch`:
its epoch, its step in the epoch and the global label-token count that ``global_mean_weight`` was given), every rank
posts its tag with its arrival at the fence and reads the others' once all have arrived; ranks on different
minibatches make every rank raise :class:`MinibatchMismatch` at that step, before any update, naming them. A loop
that does not tag but iterates a :class:`~ds_odc.balancer.sampler.BalancedBatchSampler` is tagged by it: the step
takes the minibatch the sampler drew last (:func:`~ds_odc.balancer.sampler.last_drawn`). A rank with neither posts
and reads nothing, so such a loop's step costs what it did; a rank that skips tagging while others tag is named by
them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ds_odc.ops.transport import OdcError

__all__ = ["MinibatchMismatch"]


@dataclass(frozen=True)
class MinibatchTag:
    """What a rank believes about the minibatch it steps next (any field may be unknown: None)."""

    epoch: int | None = None
    step: int | None = None
    label_tokens: int | None = None  # the global count the loss is normalised by (``global_mean_weight``'s)

    @classmethod
    def of(cls, batch) -> "MinibatchTag | None":
        """The tag of a sampler's ``RankBatch`` (its epoch, step and global label-token count); None for None."""
        if batch is None:
            return None
        return cls(batch.epoch, batch.step, batch.num_label_tokens)

    def encode(self) -> str:
        return ",".join("" if v is None else str(int(v)) for v in (self.epoch, self.step, self.label_tokens))

    @classmethod
    def decode(cls, text: str) -> MinibatchTag:
        epoch, step, tokens = (int(v) if v else None for v in text.split(","))
        return cls(epoch, step, tokens)

    def __str__(self) -> str:
        parts = [f"epoch {self.epoch}" if self.epoch is not None else "",
                 f"step {self.step}" if self.step is not None else "",
                 f"{self.label_tokens} label tokens" if self.label_tokens is not None else ""]
        return ", ".join(p for p in parts if p) or "no fields"


class MinibatchMismatch(OdcError):
    """Ranks met at an optimizer step on different minibatches; ``ranks``: those not on the most common one."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def check_same_minibatch(notes: dict[int, str | None], rank: int) -> None:
    """Raise :class:`MinibatchMismatch` if the ranks' tags (``notes``: job rank -> encoded tag, None where that rank
    posted none at this step) are not all the same; every tagged rank reads the same notes and raises the same
    error. ``rank``: this rank, for the message."""
    if len(set(notes.values())) <= 1:
        return
    by_tag: dict[str | None, list[int]] = defaultdict(list)
    for r in sorted(notes):
        by_tag[notes[r]].append(r)
    common = max(by_tag.values(), key=len)
    odd = sorted(r for r in notes if r not in common) if sum(len(v) == len(common) for v in by_tag.values()) == 1 \
        else sorted(notes)
    seen = "; ".join(f"{_ranks(ranks)}: " + ("no tag" if tag is None else str(MinibatchTag.decode(tag)))
                     for tag, ranks in sorted(by_tag.items(), key=lambda item: item[1]))
    untagged = by_tag.get(None, [])
    every_step = ("every rank must call engine.step() exactly once per minibatch, also a rank with no microbatch in "
                  "it (k == 0: engine.set_gradient_accumulation_boundary(True), then engine.step())")
    if untagged:
        advice = (f"{_ranks(untagged).capitalize()} did not tag this minibatch: call ds_odc.tag_minibatch(engine, "
                  "...) on every rank, once per minibatch before its first microbatch, also on a rank that has no "
                  "microbatch in it.")
    elif _ahead([notes[r] for r in odd], notes[common[0]]) and odd != sorted(notes):
        advice = (f"{_ranks(odd).capitalize()} went past the minibatch the others are on without calling "
                  f"engine.step(): {every_step}.")
    else:
        advice = (f"Look at the loop of {_ranks(odd)}: {every_step}; every rank must draw the same minibatches (same "
                  "sampler lengths, seed, world size and epoch) and tag each with its own numbers.")
    raise MinibatchMismatch(f"ds_odc: rank {rank}: the ranks met at this optimizer step on different minibatches "
                            f"({seen}). No update was applied. {advice}", odd)


def _ahead(tags: list[str | None], common: str | None) -> bool:
    """Whether every one of ``tags`` is a later (epoch, step) than ``common``."""
    def position(tag):
        if not tag:
            return None
        decoded = MinibatchTag.decode(tag)
        return None if decoded.epoch is None or decoded.step is None else (decoded.epoch, decoded.step)
    base = position(common)
    return base is not None and all(position(t) is not None and position(t) > base for t in tags)
