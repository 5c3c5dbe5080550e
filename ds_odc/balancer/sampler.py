"""Batch sampler: this rank's microbatches for every minibatch, with epochs, seeds and exact resume.

Every rank builds the same :class:`BalancedBatchSampler` (same lengths, seed, world size) and only ``rank``
differs, so all ranks draw the same global minibatches and compute the same plan without communicating.

The cost it balances is learned by default (``cost="auto"``, :mod:`ds_odc.balancer.autocost`): after every
optimizer step, pass every rank's measured numbers to :meth:`BalancedBatchSampler.observe` (the same gathered
numbers on every rank, e.g. the ``StepRecord`` of :func:`ds_odc.training.metrics.gather_step`), and the next plans use
the refitted cost. The samples are checked when the sampler is built (:mod:`ds_odc.balancer.checks`).

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
            sampler.observe(gather_step(...))      # every rank's busy time, tokens and microbatches
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from .autocost import AutoCost, CostUpdate, rank_rows
from .checks import DataError, DataReport, check_lengths
from .cost import CostModel
from .options import auto_cost_prior, choose_cost
from .plan import check_max_tokens, check_oversize, effective_lengths
from .planners import DEFAULT_PLANNER, get_planner, plan_minibatch
from .sp import SplitPolicy

__all__ = ["BalancedBatchSampler"]

logger = logging.getLogger("ds_odc.balancer")


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
        skipped: dataset indices (whole minibatch) that were left out (always empty from the sampler, which
            leaves ``oversize="skip"`` samples out of every epoch up front).
        splits: ``planner="lb-mini-sp"``: ``{dataset index: ranks}`` of the split samples among this rank's
            microbatches (each alone in its microbatch); train this rank's slice of them with
            :class:`ds_odc.training.sequence_parallel.SequenceParallel`.
    """

    microbatches: list[list[int]]
    num_samples: int
    num_tokens: int
    step: int
    epoch: int = 0
    truncated: tuple[int, ...] = ()
    skipped: tuple[int, ...] = ()
    splits: dict[int, tuple[int, ...]] = field(default_factory=dict)

    @property
    def num_label_tokens(self) -> int:
        return self.num_tokens - self.num_samples


_last_drawn: RankBatch | None = None


def last_drawn() -> RankBatch | None:
    """The :class:`RankBatch` that a :class:`BalancedBatchSampler` of this process yielded last, iterating. ODC's
    optimizer step takes it as the minibatch's identity when the loop did not tag the step itself
    (``ds_odc.tag_minibatch``): a rank with no microbatch in a minibatch that skips ``engine.step()`` then steps the
    next one's identity while the others step this one's, and every rank is told at that step, naming it."""
    return _last_drawn


class BalancedBatchSampler:
    """Yields a :class:`RankBatch` per minibatch for one rank.

    Args:
        lengths: token count of every dataset sample.
        world_size, rank: plain ints (no ``torch.distributed`` needed).
        minibatch_size: samples *per rank* per minibatch; a global minibatch holds ``minibatch_size * world_size``.
        max_tokens: token budget per microbatch (``None``: one sample per microbatch).
        planner: ``"lb-mini"`` (ODC), ``"lb-micro"`` or ``"local-sort"`` (collective-compatible), or
            ``"lb-mini-sp"`` (ODC, samples no rank can take alone split over groups of ranks; see ``split``).
        cost: ``"auto"`` (default: learned from :meth:`observe`), ``"tokens"``, ``"quadratic"`` (needs
            ``model_config``), a :class:`~ds_odc.balancer.cost.CostModel`, or an
            :class:`~ds_odc.balancer.autocost.AutoCost` (used as given, with its own lag and settings); see
            :func:`~ds_odc.balancer.options.choose_cost`.
        model_config: the model's (Hugging Face) config: the shape ``"auto"`` starts from and ``"quadratic"`` uses.
        sq_lengths: per sample, the sum of its documents' squared lengths, for rows that already pack several
            documents (attention is per document); ``None``: one document per sample.
        seed, shuffle: epoch permutation.
        drop_last: drop the final incomplete minibatch (default); otherwise plan it with fewer samples.
        oversize: samples longer than ``max_tokens``: ``"error"`` (raise now, naming them), ``"truncate"`` (train
            their first ``max_tokens`` tokens) or ``"skip"`` (leave them out of every epoch); counted in
            :attr:`data_report`.
        cost_lag: with ``cost="auto"``, minibatch ``g`` is planned with the fit after ``g - cost_lag`` observed
            steps; raise it to the number of minibatches a loader draws ahead of training (see
            :mod:`ds_odc.balancer.autocost`).
        describe_sample: ``index -> str``, a few words about a sample for error messages (e.g. its dataset row).
        auto_cost: keyword arguments of :class:`~ds_odc.balancer.autocost.AutoCost` (window, warmup_steps, ...).
        split: with ``planner="lb-mini-sp"``, the :class:`~ds_odc.balancer.sp.SplitPolicy` (e.g.
            ``SplitPolicy.from_hf_config(model.config)``); samples up to ``max_tokens`` times its largest group
            are trained, ``oversize`` applies beyond.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        *,
        world_size: int,
        rank: int,
        minibatch_size: int,
        max_tokens: int | None,
        planner: str = DEFAULT_PLANNER,
        cost: "str | CostModel | AutoCost" = "auto",
        model_config: Any = None,
        sq_lengths: Sequence[float] | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        oversize: str = "error",
        cost_lag: int = 0,
        describe_sample: Callable[[int], str] | None = None,
        auto_cost: dict | None = None,
        split: "SplitPolicy | None" = None,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if minibatch_size < 1:
            raise ValueError(f"minibatch_size must be >= 1, got {minibatch_size}")
        spec = get_planner(planner)
        oversize, max_tokens = check_oversize(oversize), check_max_tokens(max_tokens)
        self.split = (split or SplitPolicy()) if spec.splits else None
        self.token_limit = spec.longest_sample(max_tokens, world_size, self.split)  # the longest sample trained whole
        self.lengths = np.asarray(lengths).reshape(-1)
        self.data_report: DataReport = check_lengths(self.lengths, self.token_limit, oversize, describe_sample)
        self.lengths = self.lengths.astype(np.int64, copy=False)
        self.sq_lengths = None if sq_lengths is None else np.asarray(sq_lengths, dtype=np.float64).reshape(-1)
        if self.sq_lengths is not None and self.sq_lengths.size != self.lengths.size:
            raise ValueError(f"sq_lengths has {self.sq_lengths.size} entries for {self.lengths.size} samples")
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.minibatch_size = int(minibatch_size)
        self.max_tokens = max_tokens
        self.planner = planner
        if isinstance(cost, AutoCost) and (cost_lag or auto_cost):
            raise ValueError("an AutoCost brings its own lag and fit settings: set them on it "
                             "(AutoCost(prior, lag=..., ...)) instead of passing cost_lag / auto_cost")
        chosen = choose_cost(cost, model_config, lag=cost_lag, auto_cost=auto_cost)
        self.auto: AutoCost | None = chosen if isinstance(chosen, AutoCost) else None
        self.cost = chosen.prior if isinstance(chosen, AutoCost) else chosen
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.oversize = oversize
        # The samples every epoch draws from: skipped ones are left out here, so minibatches stay full.
        keep = np.ones(self.lengths.size, dtype=bool)
        keep[self.data_report.skipped] = False
        self._pool = np.flatnonzero(keep)
        self._epoch = 0
        self._step = 0  # next minibatch to yield in the current epoch
        self._warned_unobserved = False
        if len(self) == 0:
            left = f" after skipping {self.data_report.skipped.size} oversize samples" if self.data_report.skipped.size else ""
            raise DataError(f"the dataset has {self._pool.size} samples{left}, fewer than one global minibatch of "
                            f"{self.global_minibatch_size} (minibatch_size {self.minibatch_size} x world size "
                            f"{self.world_size}): nothing to train. Use a smaller minibatch or more data")

    @property
    def global_minibatch_size(self) -> int:
        return self.minibatch_size * self.world_size

    def __len__(self) -> int:
        n, g = self._pool.size, self.global_minibatch_size
        return n // g if self.drop_last else -(-n // g)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's permutation and restart at its first minibatch."""
        self._epoch = int(epoch)
        self._step = 0

    def epoch_order(self, epoch: int | None = None) -> np.ndarray:
        """Dataset indices in the order minibatches are cut from for ``epoch`` (default: current)."""
        e = self._epoch if epoch is None else int(epoch)
        if not self.shuffle:
            return self._pool.copy()
        return self._pool[np.random.default_rng([self.seed, e]).permutation(self._pool.size)]

    def cost_for(self, step: int, epoch: int | None = None) -> CostModel:
        """The cost model that plans minibatch ``step`` of ``epoch``."""
        if self.auto is None:
            return self.cost
        e = self._epoch if epoch is None else int(epoch)
        g = e * len(self) + int(step)
        if g - self.auto.lag > self.auto.observed + 1 and not self._warned_unobserved:
            self._warned_unobserved = True
            logger.warning(f"ds_odc balancer: cost='auto' plans minibatch {g} but has observed {self.auto.observed} "
                           "steps: call sampler.observe(gather_step(...)) after every optimizer step (or pass a fixed "
                           "cost, e.g. cost='tokens'); until then it plans with its prior")
        return self.auto.model_for(g)

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
            cost=self.cost_for(step, e),
            oversize=self.oversize,
            sq_lengths=None if self.sq_lengths is None else self.sq_lengths[ids],
            split=self.split,
        )
        ids_l = ids.tolist()
        groups = plan.groups
        return RankBatch(
            microbatches=[[ids_l[j] for j in mb] for mb in plan.microbatches[self.rank]],
            num_samples=plan.num_samples,
            num_tokens=plan.num_tokens,
            step=step,
            epoch=e,
            truncated=tuple(ids_l[j] for j in plan.truncated),
            skipped=tuple(ids_l[j] for j in plan.skipped),
            splits={ids_l[j]: groups[j] for mb in plan.microbatches[self.rank] for j in mb if j in groups},
        )

    def __iter__(self) -> Iterator[RankBatch]:
        """Yield the remaining minibatches of the current epoch, starting at the resume point.

        The state advances as each batch is yielded, so :meth:`state_dict` taken after consuming batch ``s``
        resumes at ``s + 1``.  (If a DataLoader prefetches ahead of training, save ``batch.step + 1`` yourself.)
        """
        global _last_drawn
        while self._step < len(self):
            batch = self.minibatch(self._step)
            self._step += 1
            _last_drawn = batch
            yield batch
        self._step = 0

    def load(self, microbatches: Sequence[Sequence[int]],
             splits: Mapping[int, Sequence[int]] | None = None) -> tuple[int, float]:
        """(tokens, sum of squared document lengths) that these microbatches of dataset indices train, as the
        planner counts them (truncated samples at ``max_tokens``): what a rank reports to :meth:`observe`. With
        ``lb-mini-sp`` pass ``batch.splits``: a member counts ``1 / (g * efficiency)`` of a split sample, the share
        of its compute it spends."""
        ids = np.asarray([i for mb in microbatches for i in mb], dtype=np.int64)
        if ids.size == 0:
            return 0, 0.0
        lens = self.lengths[ids]
        limit = self.token_limit
        truncated = np.flatnonzero(lens > limit) if limit is not None else ()
        eff, sq = effective_lengths(lens, None if self.sq_lengths is None else self.sq_lengths[ids], truncated, limit)
        if splits:
            share = np.asarray([self.split.compute_share(len(splits[i])) if i in splits else 1.0
                                for i in ids.tolist()])
            return int(round(float((eff * share).sum()))), float((sq * share).sum())
        return int(eff.sum()), float(sq.sum())

    # -- the automatic cost ------------------------------------------------------------------------------------------
    def observe(self, step_record: Any) -> CostUpdate | None:
        """Feed one trained step's per-rank numbers to the automatic cost (a no-op for a fixed cost).

        ``step_record``: a ``StepRecord`` (``ds_odc.training.metrics.gather_step``), its ``per_rank`` list, or dicts with
        ``busy_s``, ``tokens``, ``sq_tokens`` and ``microbatches`` per rank -- the same on every rank, in rank order
        or not. Call it once per optimizer step, in order. Returns the update (coefficients, predicted vs measured
        step time) or ``None``.
        """
        if self.auto is None:
            return None
        tokens, sq, mbs, busy = rank_rows(step_record)
        if len(busy) != self.world_size:
            raise ValueError(f"observe() got numbers of {len(busy)} ranks; this sampler plans for {self.world_size}")
        return self.auto.observe(tokens, sq, mbs, busy)

    # -- checkpoints ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {
            "epoch": self._epoch,
            "step": self._step,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": int(len(self.lengths)),
            "world_size": self.world_size,
            "minibatch_size": self.minibatch_size,
            "planner": self.planner,
        }
        if self.auto is not None:
            state["auto_cost"] = self.auto.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume exactly: the next batch yielded is the one after the last consumed one before saving, planned with
        the same cost (the automatic cost's statistics are part of the state)."""
        for key in ("seed", "shuffle", "num_samples", "world_size", "minibatch_size", "planner"):
            mine = self.state_dict()[key]
            if key in state and state[key] != mine:
                raise ValueError(f"cannot resume: checkpoint has {key}={state[key]!r}, this sampler has {mine!r}")
        if self.auto is not None:
            if "auto_cost" in state:
                self.auto.load_state_dict(state["auto_cost"])
            else:
                logger.warning("ds_odc balancer: the checkpoint has no automatic-cost state (it was saved with a fixed "
                               "cost); the cost is learned again from the prior")
        self._epoch = int(state["epoch"])
        self._step = int(state["step"])
