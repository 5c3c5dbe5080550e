"""The training loader of ``deepspeed.initialize(training_data=..., collate_fn=...)`` when the ds_config sets
``zero_optimization.odc.balancer``: this rank's microbatches of each planned minibatch, for the stock loop::

    engine, _, loader, _ = deepspeed.initialize(model=model, config=ds_config, training_data=dataset,
                                                collate_fn=collate)        # collate_fn optional: packed rows
    for epoch in range(epochs):
        for batch in loader:                    # this rank's microbatches, minibatch after minibatch
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()

Every rank draws the same minibatches of ``minibatch_size`` samples per rank and plans them alike
(:class:`~ds_odc.balancer.sampler.BalancedBatchSampler`), so LB-Mini may give ranks different numbers of
microbatches; each rank gets at least one, since a minibatch holds at least one sample per rank (a final minibatch
with fewer samples is dropped). As each microbatch is yielded, the engine is told what it is
(:mod:`ds_odc.zero.planned`): ``engine.backward`` weighs its loss so that the step trains the gradient of the
minibatch's global mean loss, the accumulation boundary falls on the rank's last microbatch, and the optimizer step
checks that every rank steps the same minibatch. With ``cost: "auto"`` (or :attr:`PlannedLoader.measure` set) the
loader measures each step (this rank's busy time, tokens and microbatches, from its first microbatch to the end of
its ``engine.step()``), gathers every rank's numbers once per step, as that step returns, and refits the cost from
them; :attr:`PlannedLoader.last_step` holds that record (loss, samples/s, bubble, per-rank busy and wait, the cost
after the step) for logging.

The microbatches must be consumed in order, one optimizer step per minibatch (the loop above): asking for the next
minibatch before ``engine.step()`` ended the last one is an error on the rank that did it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from ds_odc.balancer.checks import DataError
from ds_odc.balancer.lengths import lengths_from_dataset
from ds_odc.balancer.sampler import BalancedBatchSampler, RankBatch
from ds_odc.ops.transport import OdcError
from ds_odc.training.collate import PackedCollator, on_device
from ds_odc.training.loss import IGNORE_INDEX, count_loss_tokens
from ds_odc.training.metrics import StepClock, StepRecord, gather_step
from ds_odc.zero.engine import lockstep_waits, tag_minibatch, wait_seconds
from ds_odc.zero.planned import EnginePlan, PlannedMicrobatch, attach_plan

__all__: list[str] = []

logger = logging.getLogger("ds_odc.balancer")


def make_planned_loader(engine, dataset, collate_fn: Callable | None) -> "PlannedLoader":
    """What ``engine.deepspeed_io`` returns for the training data when ``zero_optimization.odc.balancer`` is set."""
    return PlannedLoader(engine, dataset, collate_fn, engine._config.zero_config.odc.balancer)


class PlannedLoader:
    """This rank's microbatches of every planned minibatch, one epoch per ``iter()`` (see the module docstring).

    Attributes:
        sampler: the :class:`~ds_odc.balancer.sampler.BalancedBatchSampler` that plans (``state_dict`` for resuming).
        steps_per_epoch: optimizer steps (minibatches) in one epoch.
        last_step: the gathered :class:`~ds_odc.training.metrics.StepRecord` of the last step, when measured,
            else None.
        measure: whether each step is measured and gathered into ``last_step`` (one small all-gather per step). On
            with ``cost: "auto"``, which fits from it; set it for the records with a fixed cost.
        fit_cost: whether the next measured steps refit the automatic cost (default True); turn it off for a step
            whose timing says nothing of the plan's (one run under a profiler), then on again.
    """

    def __init__(self, engine, dataset, collate_fn: Callable | None, config) -> None:
        world, rank = int(engine.dp_world_size), int(engine.global_rank)
        per_rank = config.minibatch_size
        if per_rank is None:
            configured = engine._config.train_batch_size
            if configured % world:
                raise ValueError(f"ds_odc: train_batch_size {configured} is not a multiple of the {world} ranks: set "
                                 "zero_optimization.odc.balancer.minibatch_size (samples per rank per step)")
            per_rank = configured // world
        self.engine, self.dataset, self.config = engine, dataset, config
        self.collate = collate_fn if collate_fn is not None else PackedCollator()
        # Our packed rows also say use_cache=False: only without a cache do transformers' sdpa and eager attention
        # see a packed row's documents (from position_ids) and keep each to itself; with one they attend across.
        self._packed_rows = collate_fn is None
        lengths = _sample_lengths(dataset, config.length_column)
        self.sampler = BalancedBatchSampler(
            lengths, world_size=world, rank=rank, minibatch_size=per_rank, max_tokens=config.max_tokens,
            planner=config.planner, cost=config.cost, model_config=getattr(engine.module, "config", None),
            seed=config.seed, shuffle=config.shuffle, drop_last=True, oversize=config.oversize,
            describe_sample=lambda i: f"sample {i} of the training data ({int(lengths[i])} tokens)")
        self.steps_per_epoch = len(self.sampler)
        self.plan: EnginePlan = attach_plan(engine, per_rank * world, world)
        self.plan.on_step = self._measure_step
        self.last_step: StepRecord | None = None
        self.measure: bool = self.sampler.auto is not None
        self.fit_cost: bool = True
        self._world, self._rank = world, rank
        self._epoch = 0
        self._clock = StepClock()
        self._open: tuple[RankBatch, int] | None = None  # the minibatch being trained, engine.global_steps before it
        self._label_counts: dict[int, int] = {}
        skipped = self.sampler.data_report.skipped.size
        if skipped and rank == 0:
            logger.warning(f"ds_odc balancer: {skipped} samples longer than max_tokens are left out of every epoch "
                           "(zero_optimization.odc.balancer.oversize 'skip')")

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next ``iter()`` trains (by default each ``iter()`` trains the next one)."""
        self._epoch = int(epoch)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.sampler.set_epoch(self._epoch)
        self._epoch += 1
        for batch in self.sampler:
            self._close_step()
            if not batch.microbatches:  # the planners give every rank a microbatch when each has a sample
                raise OdcError(f"ds_odc: rank {self._rank} got no microbatch of minibatch {batch.step}; every "
                               "planner gives each rank at least one when the minibatch holds a sample per rank")
            total = self._normaliser(batch)
            tag_minibatch(self.engine, batch, label_tokens=total if self.config.loss != "sample_mean" else None)
            self._open = (batch, self.engine.global_steps)
            self._clock.start()
            count = len(batch.microbatches)
            for index, ids in enumerate(batch.microbatches):
                row = self._collate(ids, batch)
                weight = self._world * self._share(row, ids, batch) / total
                self.plan.follow(self.engine, PlannedMicrobatch(index, count, len(ids), weight))
                yield row
        self._close_step()
        self.plan.current = None

    # -- one step ------------------------------------------------------------------------------------------------------
    def _close_step(self) -> None:
        """Before the next minibatch: check the loop stepped the last one."""
        if self._open is None:
            return
        batch, steps_before = self._open
        self._open = None
        if self.engine.global_steps == steps_before:
            raise OdcError(f"ds_odc: rank {self._rank}: the loop asked for the next minibatch without engine.step() "
                           f"at the end of minibatch {batch.step} (epoch {batch.epoch}); call engine.step() after "
                           "every engine.backward(), as the stock loop does")

    def _measure_step(self) -> None:
        """Right after the minibatch's optimizer step (every rank is there): gather every rank's busy time and load
        once and refit the cost (``cost: "auto"``), so what the loop does between steps is not counted."""
        if self._open is None or not self.measure:
            return
        batch, _ = self._open
        busy, step_time = self._clock.finish(wait_seconds(self.engine))
        tokens, sq_tokens = self.sampler.load(batch.microbatches)
        record = gather_step(self.plan.loss_share(), busy, step_time, len(batch.microbatches), tokens,
                             batch.num_samples, sq_tokens=sq_tokens, device_wait_s=lockstep_waits(self.engine) or 0.0)
        if self.fit_cost:  # the same gathered record on every rank: the same refit
            update = self.sampler.observe(record)
            record.cost = update.as_dict() if update else None
        self.last_step = record

    # -- the loss weights ----------------------------------------------------------------------------------------------
    def _normaliser(self, batch: RankBatch) -> int:
        """What the minibatch's global mean divides by: its samples, or its label tokens (counted from the samples,
        as every rank can without communicating)."""
        if self.config.loss == "sample_mean":
            return batch.num_samples
        order = self.sampler.epoch_order(batch.epoch)
        g = self.sampler.global_minibatch_size
        ids = order[batch.step * g:(batch.step + 1) * g].tolist()
        total = sum(self._label_count(i, batch) for i in ids)
        if total == 0:
            raise DataError(f"ds_odc: minibatch {batch.step} (epoch {batch.epoch}) has no label tokens (every label "
                            f"is {IGNORE_INDEX}): its mean loss is undefined. Check the dataset's labels")
        return total

    def _share(self, row: dict, ids: Sequence[int], batch: RankBatch) -> float:
        """This microbatch's part of the normaliser: what its loss averaged over (``sum``: 1, the loss is a sum)."""
        if self.config.loss == "sample_mean":
            return float(len(ids))
        expected = sum(self._label_count(i, batch) for i in ids)
        counted = count_loss_tokens(row)
        if counted != expected:
            raise DataError(f"ds_odc: rank {self._rank}: the collated microbatch of samples {list(ids)} holds "
                            f"{counted} label tokens, its samples {expected} (labels after the causal shift, "
                            f"{IGNORE_INDEX} not counted): the loss weights need the collate_fn to keep each sample's "
                            "labels and to mask each sample's first position where it packs several in a row (as "
                            "ds_odc.training.collate.PackedCollator and transformers' DataCollatorWithFlattening do)")
        return 1.0 if self.config.loss == "sum" else float(counted)

    def _label_count(self, index: int, batch: RankBatch) -> int:
        """Label tokens sample ``index`` adds to a causal-LM loss (after the shift; truncated at the token limit)."""
        key = (index, index in batch.truncated)
        if key not in self._label_counts:
            sample = self.dataset[index]
            labels = sample.get("labels") if hasattr(sample, "get") else None
            labels = torch.as_tensor(sample["input_ids"] if labels is None else labels).reshape(-1)
            if index in batch.truncated:
                labels = labels[:self.sampler.token_limit]
            self._label_counts[key] = int((labels[1:] != IGNORE_INDEX).sum())
        return self._label_counts[key]

    def _collate(self, ids: Sequence[int], batch: RankBatch) -> dict[str, Any]:
        samples = [self.dataset[i] for i in ids]
        if batch.truncated:
            samples = [_truncated(s, self.sampler.token_limit) if i in batch.truncated else s
                       for i, s in zip(ids, samples)]
        row = on_device(self.collate(samples), self.engine.device)
        if self._packed_rows:
            row["use_cache"] = False
        return row


def _truncated(sample: dict, limit: int) -> dict:
    return {k: v[:limit] if isinstance(v, (list, tuple, torch.Tensor, np.ndarray)) and len(v) > limit else v
            for k, v in sample.items()}


def _sample_lengths(dataset, column: str) -> np.ndarray:
    """Every sample's token count: the ``column`` of a Hugging Face dataset (read as Arrow), else row by row."""
    if hasattr(dataset, "column_names"):
        return lengths_from_dataset(dataset, column)
    lengths = []
    for i in range(len(dataset)):
        value = dataset[i][column]
        lengths.append(int(value) if isinstance(value, (int, np.integer)) else len(value))
    return np.asarray(lengths, dtype=np.int64)
