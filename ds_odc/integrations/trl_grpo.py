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
so the logs show the curves stock TRL shows. Without ``odc`` in the config every method defers to ``GRPOTrainer``.
See docs/RL.md.

The step loop and the logs are shared with ``OdcTrainer`` (:mod:`ds_odc.integrations._step`). The TRL privates this
relies on (``_generate_single_turn``, ``_generate_and_score_completions``, ``_get_per_token_logps_and_entropies``,
``_compute_loss``, ``_metrics``, ``_step``) and the Accelerate ones are listed, each with its reason, in
:mod:`ds_odc.integrations._hf_privates`, and checked when this module is imported (tested with trl 1.16).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence
from trl import GRPOTrainer
from trl.trainer.utils import shuffle_sequence_dict

import ds_odc
from ds_odc.balancer.autocost import AutoCost, rank_rows
from ds_odc.balancer.cost import get_cost_model
from ds_odc.balancer.sampler import auto_cost_prior
from ds_odc.integrations import _rollout as rollout
from ds_odc.integrations._completions import pack_completions, packed_attention, score_completions
from ds_odc.integrations._hf_privates import (TRL_GRPO_PRIVATES, check_trl, check_trl_instance, match_accelerate_backend,
                                              rank_local_collectives)
from ds_odc.integrations._metrics import BalanceMeter
from ds_odc.integrations._step import OdcStep, load_balancer_state, resolve_checkpoint, save_balancer_state
from ds_odc.integrations._stock_metrics import SlotMetrics, combine
from ds_odc.integrations.generation import RESIDENCIES, is_odc_engine, lockstep_free
from ds_odc.integrations.transformers import odc_enabled

__all__ = ["OdcGRPOTrainer", "LOSS_WEIGHTS"]

check_trl(GRPOTrainer, TRL_GRPO_PRIVATES)

# How TRL normalises a group of samples inside its microbatch of B rows: "rows" = divides by the rows of the
# microbatch (a mean over sequences), "tokens" = by the microbatch's loss tokens, "global" = by a count that does not
# depend on the microbatch (num_items_in_batch). TRL's loss of the group alone is rescaled accordingly.
LOSS_WEIGHTS = {"grpo": "rows", "sapo": "rows", "dr_grpo": "rows", "luspo": "rows", "bnpo": "tokens",
                "dapo": "global", "cispo": "global", "vespo": "global"}
PACKED_ATTENTIONS = ("sdpa", "eager", "ds_odc_varlen", "flash_attention_2", "flash_attention_3")


def _refusals(args, trainer_kwargs: dict) -> list[str]:
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
    if trainer_kwargs.get("peft_config") is not None:
        out.append("peft_config (PEFT/LoRA adapters are not tested with ODC yet: train without ODC, or merge the "
                   "adapter into a full fine-tune)")
    if trainer_kwargs.get("tools") or trainer_kwargs.get("environment_factory") is not None:
        out.append("tools / environment_factory (multi-turn tool calls are not tested with ODC yet)")
    if args.steps_per_generation % args.gradient_accumulation_steps:
        out.append(f"steps_per_generation={args.steps_per_generation} (ODC plans whole optimizer steps: use a "
                   f"multiple of gradient_accumulation_steps={args.gradient_accumulation_steps})")
    return out


class OdcGRPOTrainer(OdcStep, GRPOTrainer):
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
        generation_residency: ``"auto"`` / ``"full"`` / ``"block"`` (see ``lockstep_free``). Default: ``"auto"``, or
            ``"block"`` when ``ds3_gather_for_generation=False``.
        max_resident_bytes: the memory budget of ``"auto"``.
    """

    def __init__(self, model, reward_funcs=None, args=None, *trainer_args, padding_free: bool | None = None,
                 balancer_planner: str = "lb-mini", max_tokens_per_microbatch: int | None = None,
                 balancer_cost: Any = "auto", generation_residency: str | None = None,
                 max_resident_bytes: int | None = None, **trainer_kwargs):
        ds_odc.patch()
        self.odc = args is not None and odc_enabled(args)
        if self.odc:
            refused = _refusals(args, trainer_kwargs)
            if refused:
                raise ValueError("ds_odc: OdcGRPOTrainer with zero_optimization.odc does not support "
                                 + "; ".join(refused) + ". Change these options or turn ODC off.")
        if generation_residency is not None and generation_residency not in RESIDENCIES:
            raise ValueError(f"ds_odc: generation_residency must be one of {RESIDENCIES}, got {generation_residency!r}")
        if self.odc and not isinstance(model, str):
            from accelerate.utils import is_peft_model
            if is_peft_model(model):
                raise ValueError("ds_odc: OdcGRPOTrainer with zero_optimization.odc does not support a PeftModel "
                                 "(PEFT/LoRA adapters are not tested with ODC yet): train without ODC, or merge the "
                                 "adapter into a full fine-tune")
        super().__init__(model, reward_funcs, args, *trainer_args, **trainer_kwargs)
        match_accelerate_backend(self.args)
        if self.odc:
            check_trl_instance(self, TRL_GRPO_PRIVATES)
        if self.odc and (self._is_vlm or self.aux_loss_enabled):
            raise ValueError("ds_odc: OdcGRPOTrainer with zero_optimization.odc does not support "
                             + ("vision-language models (their image inputs are not moved between ranks yet)"
                                if self._is_vlm else "the MoE router auxiliary loss (a per-microbatch term: set "
                                "router_aux_loss_coef=0 or turn output_router_logits off)") + ". Turn ODC off for it.")
        if self.odc and self.ref_model is not None and self.args.sync_ref_model:
            raise ValueError("ds_odc: sync_ref_model=True is not tested with ODC yet; set sync_ref_model=False")
        attention = getattr(getattr(self.model, "config", None), "_attn_implementation", None)
        if padding_free is None:
            padding_free = attention in PACKED_ATTENTIONS
        self.odc_padding_free = bool(self.odc and padding_free)
        self.odc_planner = balancer_planner
        self.odc_max_tokens = max_tokens_per_microbatch
        self.odc_cost = _cost(balancer_cost, getattr(self.model, "config", None)) if self.odc else None
        if generation_residency is None:
            generation_residency = "auto" if self.args.ds3_gather_for_generation else "block"
        self.odc_generation_residency = generation_residency
        self.odc_max_resident_bytes = max_resident_bytes
        self.odc_meter = BalanceMeter(self.args.world_size) if self.odc else None
        self._odc_rollout: tuple[rollout.RolloutPlan, dict[int, rollout.Sample]] | None = None
        self._odc_served: tuple[torch.Tensor, torch.Tensor] | None = None
        self._odc_generation = [0.0, 0]  # seconds and new tokens since the last optimizer step, this rank
        self.odc_microbatch_history = deque(maxlen=1000)  # microbatches per rank, recent optimizer steps
        self.odc_plan_history = deque(maxlen=1000)  # (global step, this rank's microbatches of global ids)

    # -- generation ---------------------------------------------------------------------------------------------------
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if not (self.odc and is_odc_engine(self.model_wrapped)):  # e.g. an inference-only engine before training
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        gather = self.args.ds3_gather_for_generation
        self.args.ds3_gather_for_generation = False  # TRL's collective full gather; lockstep_free decides instead
        started = time.perf_counter()
        try:
            with lockstep_free(self.model_wrapped, residency=self.odc_generation_residency,
                               max_resident_bytes=self.odc_max_resident_bytes):
                completion_ids, logprobs = super()._generate_single_turn(prompt_ids, images, multimodal_fields,
                                                                         num_generations, has_tool_images)
        finally:
            self.args.ds3_gather_for_generation = gather
        if self.model.training:
            self._odc_generation[0] += time.perf_counter() - started
            self._odc_generation[1] += sum(len(ids) for ids in completion_ids)
        return completion_ids, logprobs

    # -- the step -----------------------------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self.odc:
            return super().training_step(model, inputs, num_items_in_batch)
        if not self.accelerator.sync_gradients:
            # An earlier accumulation step of the stock loop: the whole optimizer step runs at its last one, where
            # every rank trains its share of the step with its own number of microbatches.
            self._step += 1
            return torch.zeros((), device=self.args.device)
        model.train()
        gas = self.current_gradient_accumulation_steps
        first = self._step - (gas - 1)  # TRL's microstep counter at the first accumulation step of this step
        generate_every = self.args.steps_per_generation * self.num_iterations
        if first % generate_every == 0 or self._odc_rollout is None:
            self._odc_rollout = self._odc_new_rollout(inputs, gas)
        plan, samples = self._odc_rollout
        step_in_batch = (first % self.args.steps_per_generation) // gas
        microbatches = plan.steps[step_in_batch][self.args.process_index]
        self.odc_plan_history.append((self.state.global_step, microbatches))
        loss = self._odc_train_share(model, plan, samples, microbatches)
        self._step += 1
        return loss

    def _odc_new_rollout(self, inputs, gas: int):
        batch = self._generate_and_score_completions(inputs)
        batch = shuffle_sequence_dict(batch)  # TRL's own shuffle of the generation batch, same random stream
        cost = self.odc_cost.model if isinstance(self.odc_cost, AutoCost) else self.odc_cost
        plan = rollout.plan_rollout(batch, world=self.args.world_size, batch_rows=self.args.per_device_train_batch_size,
                                    gas=gas, planner=self.odc_planner, cost=cost, max_tokens=self.odc_max_tokens,
                                    packed=self.odc_padding_free)
        samples = rollout.exchange(batch, plan, self.args.process_index)
        self._odc_num_items = batch.get("num_items_in_batch")
        return plan, samples

    def _odc_train_share(self, model, plan, samples, microbatches) -> torch.Tensor:
        metrics = SlotMetrics()

        def train_one(ids):
            # Packed attention through the backward too: gradient checkpointing runs each layer's forward again there
            with packed_attention(model) if self.odc_padding_free else contextlib.nullcontext():
                with self.compute_loss_context_manager():
                    loss = self._odc_microbatch_loss(model, plan, [samples[g] for g in ids], metrics)
                self.accelerator.backward(loss, scale_wrt_gas=False)
            return loss.detach()

        logged = self._metrics["train"]
        self._metrics["train"] = metrics.sink()  # TRL's loss logs here, rank-locally, by stock microbatch
        try:
            with rank_local_collectives(self.accelerator, on_reduce=metrics.on_reduce):
                times = self._odc_train_step(microbatches, train_one)
        finally:
            self._metrics["train"] = logged
        generation, self._odc_generation = tuple(self._odc_generation), [0.0, 0]
        tokens, sq_tokens = plan.load(microbatches)
        everyone = self._odc_meet(times, tokens, sq_tokens, self._odc_step_samples(), payload=metrics.records,
                                  generation=generation)
        self.odc_microbatch_history.append([r.microbatches for r in self.odc_meter.records[-1].per_rank])
        for name, values in combine(everyone).items():  # one value per stock microbatch, as TRL appends them
            logged[name].extend(values)
        logged["step_time"].append(times.step_s)
        return times.loss

    def _odc_observe_cost(self, record):
        if not isinstance(self.odc_cost, AutoCost):
            return None
        return self.odc_cost.observe(*rank_rows(record))

    def _odc_microbatch_loss(self, model, plan, members: list[rollout.Sample], metrics: SlotMetrics) -> torch.Tensor:
        """One forward for the microbatch; then TRL's loss of each group of its samples that shared a stock
        microbatch, weighted as that group counts in its stock microbatch."""
        logps, entropies = self._odc_completion_logps(model, members)
        kind = LOSS_WEIGHTS[self.loss_type]
        rows = self.args.per_device_train_batch_size
        groups: dict[tuple[int, int], list[int]] = {}
        for i, sample in enumerate(members):
            groups.setdefault(plan.stock_microbatch(sample.gid), []).append(i)
        loss = logps[0].new_zeros(())
        for (_, slot), index in groups.items():
            group = [members[i] for i in index]
            inputs = rollout.collate(group, self._tokenizer.pad_token_id)
            if self._odc_num_items is not None:
                inputs["num_items_in_batch"] = self._odc_num_items
            width = inputs["completion_ids"].shape[1]
            self._odc_served = (_rows([logps[i] for i in index], width), _rows([entropies[i] for i in index], width))
            metrics.slot = slot
            try:
                term = super()._compute_loss(model, inputs)
            finally:
                self._odc_served = None
            if kind == "rows":
                weight = len(group) / rows
            elif kind == "tokens":
                weight = (max(int(sum(plan.loss_tokens[s.gid] for s in group)), 1)
                          / max(plan.stock_microbatch_loss_tokens(group[0].gid), 1))
            else:
                weight = 1.0
            loss = loss + term * weight
        return loss

    def _odc_completion_logps(self, model, members: list[rollout.Sample]):
        """Each sample's completion log-probs and entropies (1-D, its completion length), from one forward."""
        if self.odc_padding_free:
            row = pack_completions([s.prompt_ids for s in members], [s.completion["completion_ids"] for s in members])
            return score_completions(model, row, compute_entropy=True, autocast=self.accelerator.autocast)
        inputs = rollout.collate(members, self._tokenizer.pad_token_id, self.pad_to_multiple_of)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logps, entropies, _ = super()._get_per_token_logps_and_entropies(model, ids, mask,
                                                                         inputs["completion_ids"].shape[1],
                                                                         compute_entropy=True)
        lengths = [len(s.completion["completion_mask"]) for s in members]
        return [logps[r, :n] for r, n in enumerate(lengths)], [entropies[r, :n] for r, n in enumerate(lengths)]

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, *args, **kwargs):
        if self._odc_served is not None:
            logps, entropies = self._odc_served  # the microbatch forward's log-probs of the samples TRL scores now
            if logps.shape != (input_ids.shape[0], logits_to_keep):
                raise RuntimeError(f"ds_odc: served log-probs of shape {tuple(logps.shape)} for a batch of "
                                   f"{input_ids.shape[0]} x {logits_to_keep} completion tokens")
            return logps, (entropies if compute_entropy else None), None
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
            chunk_logps, chunk_entropies = score_completions(model, packed, compute_entropy=compute_entropy,
                                                             autocast=self.accelerator.autocast)
            if logps is None:
                logps = chunk_logps[0].new_zeros((rows, logits_to_keep))
                entropies = logps.new_zeros((rows, logits_to_keep)) if compute_entropy else None
            for k, r in enumerate(chunk):
                logps[r, :completion_len[r]] = chunk_logps[k]
                if compute_entropy:
                    entropies[r, :completion_len[r]] = chunk_entropies[k]
        return logps, entropies, None

    def _odc_step_samples(self) -> int:
        return self.args.per_device_train_batch_size * self.current_gradient_accumulation_steps * self.args.world_size

    # -- checkpoints --------------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if self.odc:
            resume_from_checkpoint = resolve_checkpoint(self.args.output_dir, resume_from_checkpoint)
            state = load_balancer_state(resume_from_checkpoint) if resume_from_checkpoint else None
            if state is not None and isinstance(self.odc_cost, AutoCost) and "auto_cost" in state:
                self.odc_cost.load_state_dict(state["auto_cost"])  # the resumed run plans as the uninterrupted one
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call=_internal_call)
        if self.odc and _internal_call and isinstance(self.odc_cost, AutoCost) and self.args.should_save:
            save_balancer_state(output_dir, {"auto_cost": self.odc_cost.state_dict()})


def _cost(choice, model_config):
    """The rollout plans' cost: a learned one (``"auto"`` or an ``AutoCost``), or a fixed ``CostModel``."""
    if isinstance(choice, AutoCost):
        return choice
    return AutoCost(auto_cost_prior(model_config)) if choice == "auto" else get_cost_model(choice, model_config)


def _rows(values: list[torch.Tensor], width: int) -> torch.Tensor:
    """1-D per-sample tensors as rows of ``width``, zero after each one's end."""
    out = pad_sequence(values, batch_first=True)
    return torch.nn.functional.pad(out, (0, width - out.shape[1])) if out.shape[1] < width else out[:, :width]
