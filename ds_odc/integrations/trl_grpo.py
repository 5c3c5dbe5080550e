"""``OdcGRPOTrainer``: TRL's ``GRPOTrainer`` with lockstep-free generation and LB-Mini over the rollout batch.

With ``"zero_optimization": {"stage": 3, "odc": true}`` in the DeepSpeed config (``GRPOConfig(deepspeed=...)`` or the
``deepspeed_config_file`` of an ``accelerate launch`` config), each optimizer step:

1. generates on every rank for its own prompts, lockstep-free (:mod:`ds_odc.integrations.generation`): each rank
   decodes at its own pace and stops at its own EOS, with no collective and without TRL's full-model all-gather;
2. scores the completions and computes advantages (and old / reference log-probs where TRL needs them) exactly as
   TRL does, the log-probs from padding-free rows;
3. re-plans the step's samples across ranks with LB-Mini (lengths gathered once, tensors moved once per generation
   batch, see :mod:`ds_odc.integrations._rollout`), balancing a cost learned from the measured step times; each rank
   trains its share in as many microbatches as its work needs (padding-free rows, or padded microbatches), then all
   ranks meet once, at the optimizer step.

The loss equals TRL's for every ``loss_type``: TRL's own loss code runs on each group of samples that shared a stock
microbatch (their log-probs taken from the microbatch's one forward), weighted by what TRL's normalisation gives that
group in its stock microbatch (its share of the rows, or of the loss tokens for ``bnpo``: :data:`LOSS_WEIGHTS`); the
sum over all ranks is TRL's loss whatever rank trains which sample. TRL's per-token metrics (``kl``, ``entropy``,
``clip_ratio/*``, ...) are reconstructed for the stock microbatches too (:mod:`ds_odc.integrations._stock_metrics`),
so the logs show the curves stock TRL shows. A MoE model's router auxiliary loss, a mean over each microbatch, is
added once per microbatch, weighted by the microbatch's share of the step's samples (see [Note: per-microbatch
means] in :mod:`ds_odc.integrations._router_loss`). LoRA adapters (``peft_config`` or a ``PeftModel``) train as in TRL,
whose reference model is then the base model with the adapters disabled. Without ``odc`` in the config every method
defers to ``GRPOTrainer``. See docs/RL.md.

The step, the meeting and the logs are every ds_odc trainer's (:meth:`~ds_odc.integrations._runner.OdcRunner.run`):
the trainer picks its runner once, in ``__init__`` (:class:`RolloutRunner` with ODC, TRL's own methods without), and
adds what is GRPO's: lockstep-free generation, the rollout plans and TRL's loss per stock microbatch. The TRL privates this
relies on (``_generate_single_turn``, ``_generate_and_score_completions``, ``_get_per_token_logps_and_entropies``,
``_compute_loss``, ``_metrics``, ``_step``) and the Accelerate ones are listed, each with its reason, in
:mod:`ds_odc.integrations._hf_privates`, and checked when this module is imported (tested with trl 1.16).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence
from trl import GRPOTrainer
from trl.trainer.utils import shuffle_sequence_dict

import ds_odc
from ds_odc.balancer.autocost import AutoCost
from ds_odc.balancer.options import BalancerOptions
from ds_odc.integrations import _rollout as rollout
from ds_odc.integrations._completions import pack_completions, packed_attention, score_completions
from ds_odc.integrations._hf_privates import (TRL_GRPO_PRIVATES, advance_trl_microstep, check_trl, check_trl_instance,
                                              generate_and_score, grpo_per_token_logps, is_vision_language,
                                              match_accelerate_backend, rank_local_collectives,
                                              redirected_trl_metrics, router_loss_enabled, router_loss_left_out,
                                              trl_loss, trl_microstep, trl_pad_token_id, trl_train_metrics)
from ds_odc.integrations._router_loss import router_term
from ds_odc.integrations._runner import (Microbatch, OdcRunner, RunsOdcSteps, StepRunner, load_balancer_state,
                                         save_balancer_state)
from ds_odc.integrations._setup import balancer_options, odc_enabled, warn_of_unread_balancer_block
from ds_odc.integrations._stock_metrics import SlotMetrics
from ds_odc.integrations.generation import RESIDENCIES, lockstep_free
from ds_odc.training.kernels import training_args_for_kernels
from ds_odc.zero.engine import is_odc
from ds_odc.zero.minibatch import MinibatchTag

__all__ = ["OdcGRPOTrainer"]

check_trl(GRPOTrainer, TRL_GRPO_PRIVATES)

# How TRL normalises a group of samples inside its microbatch of B rows: "rows" = divides by the rows of the
# microbatch (a mean over sequences), "tokens" = by the microbatch's loss tokens, "global" = by a count that does not
# depend on the microbatch (num_items_in_batch). TRL's loss of the group alone is rescaled accordingly.
LOSS_WEIGHTS = {"grpo": "rows", "sapo": "rows", "dr_grpo": "rows", "luspo": "rows", "bnpo": "tokens",
                "dapo": "global", "cispo": "global", "vespo": "global"}
PACKED_ATTENTIONS = ("sdpa", "eager", "ds_odc_varlen", "flash_attention_2", "flash_attention_3")


def _refusals(args, trainer_kwargs: dict, options: BalancerOptions) -> list[str]:
    """Options OdcGRPOTrainer cannot run with ODC, each with what to change."""
    out = []
    if args.loss_type not in LOSS_WEIGHTS:
        out.append(f"loss_type={args.loss_type!r} (supported: {sorted(LOSS_WEIGHTS)})")
    if args.use_vllm:
        out.append("use_vllm=True (ODC generates in the trainer, lockstep-free: set use_vllm=False)")
    if getattr(args, "use_transformers_continuous_batching", False):
        out.append("use_transformers_continuous_batching=True (untested with ODC: set it to False)")
    if args.top_entropy_quantile < 1.0:
        out.append("top_entropy_quantile < 1 (its threshold is a cross-rank quantile over each stock microbatch, "
                   "which LB-Mini does not keep together: set top_entropy_quantile=1.0)")
    if args.entropy_coef != 0.0 or args.use_adaptive_entropy:
        out.append("entropy_coef / use_adaptive_entropy (the entropy bonus is a per-microbatch mean, not yet "
                   "reweighted per sample: set entropy_coef=0.0 and use_adaptive_entropy=False)")
    if trainer_kwargs.get("tools") or trainer_kwargs.get("environment_factory") is not None:
        out.append("tools / environment_factory (multi-turn tool calls are not tested with ODC yet)")
    if args.steps_per_generation % args.gradient_accumulation_steps:
        out.append(f"steps_per_generation={args.steps_per_generation} (ODC plans whole optimizer steps: use a "
                   f"multiple of gradient_accumulation_steps={args.gradient_accumulation_steps})")
    if options.spec.splits:
        out.append(f"balancer_planner={options.planner!r} (rollouts are not split over ranks: use 'lb-mini')")
    unused = [f"{name}={getattr(options, name)!r}" for name in ("oversize", "split", "length_column")
              if getattr(options, name) != getattr(BalancerOptions(), name)]
    if unused:
        out.append(f"BalancerOptions({', '.join(unused)}) (a rollout sample larger than the budget gets a microbatch of "
                   "its own, and lengths come from the completions: leave these at their defaults)")
    return out


class OdcGRPOTrainer(RunsOdcSteps, GRPOTrainer):
    """``trl.GRPOTrainer`` that generates lockstep-free and trains with ODC + LB-Mini when the config turns ODC on.

    Extra keyword arguments (all optional):
        padding_free: train on padding-free rows (every forward the loss needs: policy, old policy, reference model;
            attention ``ds_odc_varlen``) instead of padded microbatches. Default (``None``): padding-free when the
            model's attention is ``sdpa``, ``eager``, ``ds_odc_varlen`` or flash attention.
        balancer_planner: ``"lb-mini"`` (default: any microbatch count per rank), or ``"lb-micro"`` /
            ``"local-sort"`` for comparisons.
        max_tokens_per_microbatch: budget of one microbatch: tokens of a padding-free row, or rows x padded width of
            a padded microbatch. Default: the size of the largest microbatch the stock trainer runs on the same
            generation batch. A sample larger than the budget gets a microbatch of its own.
        balancer_cost: what LB-Mini balances: ``"auto"`` (default: starts from the model's shape and is refitted
            every step from the measured busy times of all ranks; logged as ``odc/cost_*``; an ``AutoCost`` for
            other fit settings), ``"tokens"``, ``"quadratic"`` or a ``CostModel``.
        balancer: the three above as one :class:`~ds_odc.balancer.options.BalancerOptions`, instead of the keywords.
        generation_residency: ``"auto"`` / ``"full"`` / ``"block"`` (see ``lockstep_free``). Default: ``"auto"``, or
            ``"block"`` when ``ds3_gather_for_generation=False``.
        max_resident_bytes: the memory budget of ``"auto"``.
    """

    odc_padding_free: bool  # ODC trains (and scores old / reference log-probs) on padding-free rows

    def __init__(self, model, reward_funcs=None, args=None, *trainer_args, padding_free: bool | None = None,
                 balancer_planner: str = "lb-mini", max_tokens_per_microbatch: int | None = None,
                 balancer_cost: Any = "auto", generation_residency: str | None = None,
                 max_resident_bytes: int | None = None, balancer: BalancerOptions | None = None, **trainer_kwargs):
        ds_odc.patch()
        options = balancer_options(balancer, balancer_planner=balancer_planner,
                                   max_tokens_per_microbatch=max_tokens_per_microbatch, balancer_cost=balancer_cost)
        warn_of_unread_balancer_block(args, type(self).__name__)
        odc = args is not None and odc_enabled(args)
        if odc:
            _refuse_options(args, trainer_kwargs, options)
        if generation_residency is not None and generation_residency not in RESIDENCIES:
            raise ValueError(f"ds_odc: generation_residency must be one of {RESIDENCIES}, got {generation_residency!r}")
        args = training_args_for_kernels(args)  # torch_compile + use_liger_kernel: Liger's layer kernels off
        super().__init__(model, reward_funcs, args, *trainer_args, **trainer_kwargs)
        match_accelerate_backend(self.args)
        if odc:
            _refuse_built(self)
        attention = getattr(getattr(self.model, "config", None), "_attn_implementation", None)
        if padding_free is None:
            padding_free = attention in PACKED_ATTENTIONS
        self.odc_padding_free = bool(odc and padding_free)
        if generation_residency is None:
            generation_residency = "auto" if self.args.ds3_gather_for_generation else "block"
        self.odc_runner = (RolloutRunner(self, options, padding_free=self.odc_padding_free,
                                         residency=generation_residency, max_resident_bytes=max_resident_bytes)
                           if odc else StepRunner())

    @property
    def odc_microbatch_history(self) -> deque:
        """Microbatches per rank of the recent optimizer steps (ODC)."""
        return getattr(self.odc_runner, "microbatch_history", deque())

    @property
    def odc_plan_history(self) -> deque:
        """(global step, this rank's microbatches of global sample ids) of the recent optimizer steps (ODC)."""
        return getattr(self.odc_runner, "plan_history", deque())

    # -- the Trainer's and TRL's per-step methods, handed to the runner ----------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        return self.odc_runner.training_step(model, inputs, num_items_in_batch, super().training_step)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        stock = functools.partial(super()._generate_single_turn, prompt_ids, images, multimodal_fields,
                                  num_generations, has_tool_images)
        return self.odc_runner.generate(stock)

    # -- the loss -----------------------------------------------------------------------------------------------------
    def odc_loss(self, model, mb: Microbatch) -> torch.Tensor:
        """One forward for the microbatch; then TRL's loss of each group of its samples that shared a stock
        microbatch, weighted as that group counts in its stock microbatch."""
        share: RolloutShare = mb.inputs
        plan, members = share.plan, share.samples
        logps, entropies, router_loss = self._odc_completion_logps(model, members)
        kind = LOSS_WEIGHTS[self.loss_type]
        rows = self.args.per_device_train_batch_size
        groups: dict[tuple[int, int], list[int]] = {}
        for i, sample in enumerate(members):
            groups.setdefault(plan.stock_microbatch(sample.gid), []).append(i)
        loss = logps[0].new_zeros(())
        with router_loss_left_out(self):  # a group's loss leaves the router loss out: the microbatch's is added below
            for (_, slot), index in groups.items():
                group = [members[i] for i in index]
                inputs = rollout.collate(group, trl_pad_token_id(self))
                if mb.num_items_in_batch is not None:
                    inputs["num_items_in_batch"] = mb.num_items_in_batch
                width = inputs["completion_ids"].shape[1]
                mb.metrics.slot = slot
                # TRL's loss hands its `model` argument to _get_per_token_logps_and_entropies only: the group's
                # log-probs of the microbatch's forward travel there in its place.
                served = ServedLogps(_rows([logps[i] for i in index], width),
                                     _rows([entropies[i] for i in index], width))
                term = trl_loss(self, served, inputs)
                if kind == "rows":
                    weight = len(group) / rows
                elif kind == "tokens":
                    weight = (max(int(sum(plan.loss_tokens[s.gid] for s in group)), 1)
                              / max(plan.stock_microbatch_loss_tokens(group[0].gid), 1))
                else:
                    weight = 1.0
                loss = loss + term * weight
        if router_loss is not None:
            # A MoE model's router loss over the microbatch, weighted once (see _router_loss), and logged as that
            # weighted mean per stock microbatch
            loss = loss + router_term(self, mb, router_loss)
            value = float(router_loss.detach())
            for (_, slot), index in groups.items():
                mb.metrics.add_mean("aux_loss", slot, value * len(index), len(index))
        return loss

    def _odc_completion_logps(self, model, members: list[rollout.Sample]):
        """Each sample's completion log-probs and entropies (1-D, its completion length), from one forward, and a MoE
        model's router loss over the microbatch when TRL would add it (else ``None``)."""
        if self.odc_padding_free:
            row = pack_completions([s.prompt_ids for s in members], [s.completion["completion_ids"] for s in members])
            return score_completions(model, row, compute_entropy=True, autocast=self.accelerator.autocast,
                                     router_loss=router_loss_enabled(self))
        inputs = rollout.collate(members, trl_pad_token_id(self), self.pad_to_multiple_of)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logps, entropies, router_loss = grpo_per_token_logps(
            self, model, ids, mask, inputs["completion_ids"].shape[1], compute_entropy=True,
            compute_aux_loss=router_loss_enabled(self))
        lengths = [len(s.completion["completion_mask"]) for s in members]
        return ([logps[r, :n] for r, n in enumerate(lengths)], [entropies[r, :n] for r, n in enumerate(lengths)],
                router_loss)

    def odc_step_metrics(self, minibatch: Sequence[int], metrics: dict[str, list[float]]) -> None:
        """TRL's metrics of the step, one value per stock microbatch, as TRL appends them."""
        logged = trl_train_metrics(self)
        for name, values in metrics.items():
            logged[name].extend(values)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, *args, **kwargs):
        if isinstance(model, ServedLogps):  # the microbatch forward's log-probs of the samples TRL scores now
            return model.serve(input_ids.shape[0], logits_to_keep, compute_entropy)
        if self.odc_padding_free and not args and not any(v not in (None, False) for v in kwargs.values()):
            return self._odc_packed_logps(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                          compute_entropy)
        return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                          batch_size, compute_entropy, *args, **kwargs)

    def _odc_packed_logps(self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy):
        """TRL's padded scoring (old and reference log-probs of a generation batch, evaluation) from packed rows:
        ``batch_size`` samples per row, so a rank runs as many forwards as TRL (the reference model's engine is
        stock ZeRO-3, whose forwards must stay in step across ranks). Zero past each completion's end."""
        rows = input_ids.shape[0]
        batch_size = batch_size or rows
        prompt_width = input_ids.shape[1] - logits_to_keep
        real = attention_mask.bool()
        present = torch.arange(1, logits_to_keep + 1, device=input_ids.device) * real[:, prompt_width:]
        completion_len = present.max(1).values.tolist()  # TRL's masks end at the EOS; padding after it
        logps = entropies = None
        for start in range(0, rows, batch_size):
            chunk = range(start, min(start + batch_size, rows))
            packed = pack_completions([input_ids[r, :prompt_width][real[r, :prompt_width]] for r in chunk],
                                      [input_ids[r, prompt_width:prompt_width + completion_len[r]] for r in chunk])
            chunk_logps, chunk_entropies, _ = score_completions(model, packed, compute_entropy=compute_entropy,
                                                             autocast=self.accelerator.autocast)
            if logps is None:
                logps = chunk_logps[0].new_zeros((rows, logits_to_keep))
                entropies = logps.new_zeros((rows, logits_to_keep)) if compute_entropy else None
            for k, r in enumerate(chunk):
                logps[r, :completion_len[r]] = chunk_logps[k]
                if compute_entropy:
                    entropies[r, :completion_len[r]] = chunk_entropies[k]
        return logps, entropies, None


def _refuse_options(args, trainer_kwargs: dict, options: BalancerOptions) -> None:
    refused = _refusals(args, trainer_kwargs, options)
    if refused:
        raise ValueError("ds_odc: OdcGRPOTrainer with zero_optimization.odc does not support "
                         + "; ".join(refused) + ". Change these options or turn ODC off.")


def _refuse_built(trainer: OdcGRPOTrainer) -> None:
    """What only the built trainer tells: TRL's instance attributes, a vision-language model."""
    check_trl_instance(trainer, TRL_GRPO_PRIVATES)
    if is_vision_language(trainer):
        raise ValueError("ds_odc: OdcGRPOTrainer with zero_optimization.odc does not support vision-language models "
                         "(their image inputs are not moved between ranks yet). Turn ODC off for it.")
    if trainer.ref_model is not None and trainer.args.sync_ref_model:
        raise ValueError("ds_odc: sync_ref_model=True is not tested with ODC yet; set sync_ref_model=False")


@dataclass(frozen=True)
class ServedLogps:
    """Per-token log-probs (and entropies) of a group of samples, rows x completion width, already computed by the
    microbatch's forward: handed to TRL's loss in place of the model."""

    logps: torch.Tensor
    entropies: torch.Tensor

    def serve(self, rows: int, logits_to_keep: int, compute_entropy: bool):
        if self.logps.shape != (rows, logits_to_keep):
            raise RuntimeError(f"ds_odc: served log-probs of shape {tuple(self.logps.shape)} for a batch of "
                               f"{rows} x {logits_to_keep} completion tokens")
        return self.logps, (self.entropies if compute_entropy else None), None


@dataclass(frozen=True)
class RolloutShare:
    """A GRPO microbatch's inputs (:attr:`Microbatch.inputs <ds_odc.integrations._runner.Microbatch.inputs>`): its
    samples and the plan of their generation batch (TRL's ``num_items_in_batch`` of that batch:
    :attr:`Microbatch.num_items_in_batch <ds_odc.integrations._runner.Microbatch.num_items_in_batch>`)."""

    plan: rollout.RolloutPlan
    samples: list[rollout.Sample]


@dataclass(frozen=True)
class _Rollout:
    """The generation batch being trained: its plan, this rank's samples by global id, TRL's item count."""

    plan: rollout.RolloutPlan
    samples: dict[int, rollout.Sample]
    num_items_in_batch: Any


class RolloutRunner(OdcRunner):
    """ODC on for GRPO: each optimizer step trains this rank's share of a re-planned rollout batch.

    TRL's loop calls ``training_step`` once per accumulation step; the earlier ones only advance TRL's microstep
    counter, and the last one trains the whole optimizer step: a new generation batch when TRL would generate one
    (generated lockstep-free, scored, planned and exchanged, :mod:`ds_odc.integrations._rollout`), then this rank's
    microbatches of it, with TRL's metrics recorded per stock microbatch and combined at the meeting."""

    def __init__(self, trainer: OdcGRPOTrainer, options: BalancerOptions, *, padding_free: bool, residency: str,
                 max_resident_bytes: int | None) -> None:
        super().__init__(trainer, options)
        self.choose_cost()
        self.padding_free = padding_free
        self.residency = residency
        self.max_resident_bytes = max_resident_bytes
        self.rollout: _Rollout | None = None
        self.generation = [0.0, 0]  # seconds and new tokens since the last optimizer step, this rank
        self.microbatch_history: deque = deque(maxlen=1000)  # microbatches per rank, recent optimizer steps
        self.plan_history: deque = deque(maxlen=1000)  # (global step, this rank's microbatches of global ids)

    def generate(self, stock: Callable[[], tuple]) -> tuple:
        """TRL's generation of one batch, lockstep-free on the ODC engine."""
        trainer = self.trainer
        if not is_odc(trainer.model_wrapped):  # e.g. an inference-only engine before training
            return stock()
        gather = trainer.args.ds3_gather_for_generation
        trainer.args.ds3_gather_for_generation = False  # TRL's collective full gather; lockstep_free decides instead
        started = time.perf_counter()
        try:
            with lockstep_free(trainer.model_wrapped, residency=self.residency,
                               max_resident_bytes=self.max_resident_bytes):
                completion_ids, logprobs = stock()
        finally:
            trainer.args.ds3_gather_for_generation = gather
        if trainer.model.training:
            self.generation[0] += time.perf_counter() - started
            self.generation[1] += sum(len(ids) for ids in completion_ids)
        return completion_ids, logprobs

    def training_step(self, model, inputs, num_items_in_batch, stock) -> torch.Tensor:
        trainer = self.trainer
        if not trainer.accelerator.sync_gradients:
            # An earlier accumulation step of the stock loop: the whole optimizer step runs at its last one, where
            # every rank trains its share of the step with its own number of microbatches.
            advance_trl_microstep(trainer)
            return torch.zeros((), device=trainer.args.device)
        model.train()
        gas = trainer.current_gradient_accumulation_steps
        first = trl_microstep(trainer) - (gas - 1)  # TRL's microstep counter at the step's first accumulation step
        generate_every = trainer.args.steps_per_generation * trainer.num_iterations
        if first % generate_every == 0 or self.rollout is None:
            self.rollout = self._new_rollout(inputs, gas)
        step_in_batch = (first % trainer.args.steps_per_generation) // gas
        microbatches = self.rollout.plan.steps[step_in_batch][trainer.args.process_index]
        self.plan_history.append((trainer.state.global_step, microbatches))
        loss = self._train_share(model, microbatches, step_in_batch)
        advance_trl_microstep(trainer)
        return loss

    def _new_rollout(self, inputs, gas: int) -> _Rollout:
        trainer = self.trainer
        batch = generate_and_score(trainer, inputs)
        batch = shuffle_sequence_dict(batch)  # TRL's own shuffle of the generation batch, same random stream
        plan = rollout.plan_rollout(batch, world=trainer.args.world_size,
                                    batch_rows=trainer.args.per_device_train_batch_size, gas=gas,
                                    planner=self.options.planner, cost=self.cost, max_tokens=self.options.max_tokens,
                                    packed=self.padding_free)
        return _Rollout(plan, rollout.exchange(batch, plan, trainer.args.process_index),
                        batch.get("num_items_in_batch"))

    def _train_share(self, model, microbatches: list[list[int]], step_in_batch: int) -> torch.Tensor:
        """One optimizer step: this rank's ``microbatches`` of the rollout, through
        :meth:`~ds_odc.integrations._runner.OdcRunner.run` (which ends with TRL's metrics of the step)."""
        trainer, current = self.trainer, self.rollout
        metrics = SlotMetrics()
        step_samples = (trainer.args.per_device_train_batch_size * trainer.current_gradient_accumulation_steps
                        * trainer.args.world_size)
        share = [Microbatch(RolloutShare(current.plan, [current.samples[g] for g in ids]), tuple(ids),
                            tuple(current.plan.stock_microbatch(g)[1] for g in ids), metrics,
                            step_samples=step_samples, num_items_in_batch=current.num_items_in_batch)
                 for ids in microbatches]
        generation, self.generation = tuple(self.generation), [0.0, 0]
        minibatch = sorted(g for rank in current.plan.steps[step_in_batch] for mb in rank for g in mb)
        times = self.run(model, share, MinibatchTag(None, trainer.state.global_step),
                         load=current.plan.load(microbatches), num_samples=step_samples, minibatch=minibatch,
                         metrics=metrics, generation=generation)
        self.microbatch_history.append([r.microbatches for r in self.meter.records[-1].per_rank])
        trl_train_metrics(trainer)["step_time"].append(times.step_s)
        return times.loss

    def microbatch_context(self, model, mb: Microbatch) -> ContextManager:
        """TRL's loss logs into the step's ``mb.metrics``, rank-locally, by stock microbatch (its collectives return
        this rank's tensors); with padding-free rows, packed attention through the backward too (gradient
        checkpointing runs each layer's forward again there)."""
        stack = contextlib.ExitStack()
        stack.enter_context(redirected_trl_metrics(self.trainer, mb.metrics.sink()))
        stack.enter_context(rank_local_collectives(self.trainer.accelerator, on_reduce=mb.metrics.on_reduce))
        if self.padding_free:
            stack.enter_context(packed_attention(model))
        return stack

    # -- checkpoints ------------------------------------------------------------------------------------------------
    def resume_from(self, checkpoint):
        checkpoint = super().resume_from(checkpoint)
        state = load_balancer_state(checkpoint) if checkpoint else None
        if state is not None and isinstance(self.cost, AutoCost) and "auto_cost" in state:
            self.cost.load_state_dict(state["auto_cost"])  # the resumed run plans as the uninterrupted one
        return checkpoint

    def save(self, folder: str) -> None:
        if isinstance(self.cost, AutoCost) and self.trainer.args.should_save:
            save_balancer_state(folder, {"auto_cost": self.cost.state_dict()})


def _rows(values: list[torch.Tensor], width: int) -> torch.Tensor:
    """1-D per-sample tensors as rows of ``width``, zero after each one's end."""
    out = pad_sequence(values, batch_first=True)
    return torch.nn.functional.pad(out, (0, width - out.shape[1])) if out.shape[1] < width else out[:, :width]
