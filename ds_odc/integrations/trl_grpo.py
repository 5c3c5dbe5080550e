"""``OdcGRPOTrainer``: TRL's ``GRPOTrainer`` with lockstep-free generation and LB-Mini over the rollout batch.

With ``"zero_optimization": {"stage": 3, "odc": true}`` in the DeepSpeed config (``GRPOConfig(deepspeed=...)`` or the
``deepspeed_config_file`` of an ``accelerate launch`` config), each optimizer step:

1. generates on every rank for its own prompts, lockstep-free (:mod:`ds_odc.integrations.generation`): each rank
   decodes at its own pace and stops at its own EOS, with no collective and without TRL's full-model all-gather;
2. scores the completions and computes advantages (and old / reference log-probs where TRL needs them) exactly as
   TRL does;
3. re-plans the step's samples across ranks with LB-Mini (lengths gathered once, tensors moved once per generation
   batch, see :mod:`ds_odc.integrations._rollout`); each rank trains its share in as many padded microbatches as
   its work needs, then all ranks meet once, at the optimizer step.

The loss equals TRL's for every ``loss_type``: TRL's own per-sample loss code runs on each sample (from one batched
forward per microbatch), weighted by what TRL's normalisation gives that sample in the microbatch TRL would have put
it in (its size, or its loss-token count for ``bnpo``); the sum over all ranks is TRL's loss whatever rank trains
which sample. Without ``odc`` in the config every method defers to ``GRPOTrainer``. See docs/RL.md.

TRL internals this relies on (checked at import; tested with trl 1.16): ``_generate_single_turn``,
``_generate_and_score_completions``, ``_get_per_token_logps_and_entropies``, ``_compute_loss``, ``_metrics``,
``_step``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict, deque
from typing import Any

import torch
import torch.distributed as dist
from trl import GRPOTrainer
from trl.trainer.utils import shuffle_sequence_dict

import ds_odc
from ds_odc.integrations import _rollout as rollout
from ds_odc.integrations._metrics import BalanceMeter
from ds_odc.integrations.generation import RESIDENCIES, is_odc_engine, lockstep_free
from ds_odc.integrations.transformers import odc_enabled
from ds_odc.training.metrics import StepClock, record_from_rows

__all__ = ["OdcGRPOTrainer", "LOSS_WEIGHTS"]

_TRL_SEAMS = ("_generate_single_turn", "_generate_and_score_completions", "_get_per_token_logps_and_entropies",
              "_compute_loss")
_missing = [name for name in _TRL_SEAMS if not hasattr(GRPOTrainer, name)]
if _missing:
    import trl
    raise ImportError(f"ds_odc: OdcGRPOTrainer needs GRPOTrainer.{', '.join(_missing)}, which trl {trl.__version__} "
                      "lacks; it is tested with trl 1.16 (pip install 'trl>=1.16,<1.17')")

# How TRL normalises one sample's term inside its microbatch of B rows: "rows" = divides by the rows of the
# microbatch (a mean over sequences), "tokens" = by the microbatch's loss tokens, "global" = by a count that does not
# depend on the microbatch (num_items_in_batch). Each sample's own loss, computed alone, is rescaled accordingly.
LOSS_WEIGHTS = {"grpo": "rows", "sapo": "rows", "dr_grpo": "rows", "luspo": "rows", "bnpo": "tokens",
                "dapo": "global", "cispo": "global", "vespo": "global"}

_STATS = 7  # busy_s, step_s, microbatches, tokens, wait_s, generation_s, generated tokens


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


class OdcGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` that generates lockstep-free and trains with ODC + LB-Mini when the config turns ODC on.

    Extra keyword arguments (all optional):
        balancer_planner: ``"lb-mini"`` (default: any microbatch count per rank), or ``"lb-micro"`` /
            ``"local-sort"`` for comparisons.
        max_tokens_per_microbatch: budget of one padded microbatch (rows x padded width). Default: the size of the
            largest microbatch the stock trainer would have run on the same generation batch.
        balancer_cost: what LB-Mini balances: ``"tokens"``, ``"quadratic"`` or a ``CostModel``.
        generation_residency: ``"auto"`` / ``"full"`` / ``"block"`` (see ``lockstep_free``). Default: ``"auto"``, or
            ``"block"`` when ``ds3_gather_for_generation=False``.
        max_resident_bytes: the memory budget of ``"auto"``.
    """

    def __init__(self, model, reward_funcs=None, args=None, *trainer_args, balancer_planner: str = "lb-mini",
                 max_tokens_per_microbatch: int | None = None, balancer_cost: Any = "tokens",
                 generation_residency: str | None = None, max_resident_bytes: int | None = None, **trainer_kwargs):
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
        if self.odc and (self._is_vlm or self.aux_loss_enabled):
            raise ValueError("ds_odc: OdcGRPOTrainer with zero_optimization.odc does not support "
                             + ("vision-language models (their image inputs are not moved between ranks yet)"
                                if self._is_vlm else "the MoE router auxiliary loss (a per-microbatch term: set "
                                "router_aux_loss_coef=0 or turn output_router_logits off)") + ". Turn ODC off for it.")
        self.odc_balancer = dict(planner=balancer_planner, cost=balancer_cost, max_tokens=max_tokens_per_microbatch)
        if generation_residency is None:
            generation_residency = "auto" if self.args.ds3_gather_for_generation else "block"
        self.odc_generation_residency = generation_residency
        self.odc_max_resident_bytes = max_resident_bytes
        self.odc_meter = BalanceMeter(self.args.world_size) if self.odc else None
        self._odc_rollout: tuple[rollout.RolloutPlan, dict[int, rollout.Sample]] | None = None
        self._odc_served: tuple[torch.Tensor, torch.Tensor] | None = None
        self._odc_generation = [0.0, 0]  # seconds and new tokens since the last optimizer step, this rank
        self._odc_window = {"wait": 0.0, "wait_max": 0.0, "gen_s": 0.0, "gen_tokens": 0, "steps": 0}
        self.odc_microbatch_history = deque(maxlen=1000)  # microbatches per rank, recent optimizer steps
        if self.odc and self.ref_model is not None and self.args.sync_ref_model:
            raise ValueError("ds_odc: sync_ref_model=True is not tested with ODC yet; set sync_ref_model=False")

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
        loss = self._odc_train_share(model, plan, samples, microbatches)
        self._step += 1
        return loss

    def _odc_new_rollout(self, inputs, gas: int):
        batch = self._generate_and_score_completions(inputs)
        batch = shuffle_sequence_dict(batch)  # TRL's own shuffle of the generation batch, same random stream
        plan = rollout.plan_rollout(batch, world=self.args.world_size, batch_rows=self.args.per_device_train_batch_size,
                                    gas=gas, **self.odc_balancer)
        samples = rollout.exchange(batch, plan, self.args.process_index)
        self._odc_num_items = batch.get("num_items_in_batch")
        return plan, samples

    def _odc_train_share(self, model, plan, samples, microbatches) -> torch.Tensor:
        engine = self.model_wrapped
        state = self.accelerator.gradient_state
        model.train()
        clock = StepClock()
        clock.start()
        total = torch.zeros((), device=self.args.device)
        tokens = 0
        scratch = defaultdict(list)
        with self._odc_rank_local_metrics(scratch):
            for ids in microbatches:
                state._set_sync_gradients(False)  # Accelerate marks no boundary and does not step; ODC pushes grads
                inputs = rollout.collate([samples[g] for g in ids], self._tokenizer.pad_token_id,
                                         self.pad_to_multiple_of)
                if self._odc_num_items is not None:
                    inputs["num_items_in_batch"] = self._odc_num_items
                tokens += int(inputs["prompt_ids"].numel() + inputs["completion_ids"].numel())
                with self.compute_loss_context_manager():
                    loss = self._odc_microbatch_loss(model, plan, ids, inputs)
                self.accelerator.backward(loss, scale_wrt_gas=False)
                total = total + loss.detach()
        state._set_sync_gradients(True)
        # The one meeting per step: every rank, whatever its microbatch count (0 too), steps once at a boundary.
        engine.set_gradient_accumulation_boundary(True)
        engine.step()
        # ds_odc.training.metrics' busy time, as every front end counts it: the step's wall time less the wait for peers.
        busy, step_time = clock.finish(float(getattr(engine.optimizer, "odc_wait_s", 0.0)))
        self._odc_end_of_step(scratch, busy, step_time, len(microbatches), tokens,
                              sum(len(ids) for ids in microbatches))
        return total

    def _odc_microbatch_loss(self, model, plan, ids, inputs) -> torch.Tensor:
        """One batched forward; then TRL's loss of each sample alone, weighted as in its stock microbatch."""
        prompt_completion = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        width = inputs["completion_ids"].shape[1]
        logps, entropies, _ = super()._get_per_token_logps_and_entropies(model, prompt_completion, attention, width,
                                                                         compute_entropy=True)
        kind = LOSS_WEIGHTS[self.loss_type]
        rows = self.args.per_device_train_batch_size
        loss = logps.new_zeros(())
        for row, g in enumerate(ids):
            one = {k: (v[row:row + 1] if isinstance(v, torch.Tensor) and v.ndim > 0 else v) for k, v in inputs.items()}
            self._odc_served = (logps[row:row + 1], entropies[row:row + 1])
            try:
                term = super()._compute_loss(model, one)
            finally:
                self._odc_served = None
            if kind == "rows":
                weight = 1.0 / rows
            elif kind == "tokens":
                weight = max(int(plan.loss_tokens[g]), 1) / max(plan.stock_microbatch_loss_tokens(g), 1)
            else:
                weight = 1.0
            loss = loss + term * weight
        return loss

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if self._odc_served is None:
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              *args, **kwargs)
        logps, entropies = self._odc_served  # one row of the microbatch's batched forward
        if logps.shape != (input_ids.shape[0], logits_to_keep):
            raise RuntimeError(f"ds_odc: served log-probs of shape {tuple(logps.shape)} for a batch of "
                               f"{input_ids.shape[0]} x {logits_to_keep} completion tokens")
        return logps, (entropies if kwargs.get("compute_entropy") else None), None

    @contextlib.contextmanager
    def _odc_rank_local_metrics(self, scratch):
        """TRL's loss reduces its metrics across ranks on every microbatch: with uneven counts that would hang.
        Inside, reductions are rank-local and metrics land in ``scratch``; they are combined at the step."""
        accelerator = self.accelerator
        metrics = self._metrics["train"]
        accelerator.reduce = lambda tensor, *args, **kwargs: tensor
        accelerator.gather = lambda tensor, *args, **kwargs: tensor
        self._metrics["train"] = scratch
        try:
            yield
        finally:
            del accelerator.reduce, accelerator.gather
            self._metrics["train"] = metrics

    def _odc_end_of_step(self, scratch, busy, step_time, microbatches, tokens, samples) -> None:
        """At the step, where ranks meet: one all-gather of the balance numbers, one of the metric names, and one
        all-reduce of the metric sums; then per-step metrics as TRL logs them."""
        W = self.args.world_size
        wait = float(getattr(self.model_wrapped.optimizer, "odc_wait_s", 0.0))
        gen_s, gen_tokens = self._odc_generation
        self._odc_generation = [0.0, 0]
        local = torch.tensor([busy, step_time, microbatches, tokens, wait, gen_s, gen_tokens], dtype=torch.float64,
                             device=self.args.device)
        rows = self.accelerator.gather(local).reshape(W, _STATS).cpu()
        self.odc_meter.add(record_from_rows([[0.0, b, s, m, t, 0.0] for b, s, m, t in rows[:, :4].tolist()],
                                            num_samples=int(self._odc_step_samples())))
        self.odc_microbatch_history.append([int(x) for x in rows[:, 2]])
        window = self._odc_window
        window["steps"] += 1
        window["wait"] += float(rows[:, 4].mean())
        window["wait_max"] = max(window["wait_max"], float(rows[:, 4].max()))
        window["gen_s"] += float(rows[:, 5].max())
        window["gen_tokens"] += int(rows[:, 6].sum())
        self._metrics["train"]["step_time"].append(step_time)
        self._odc_reduce_metrics(scratch)

    def _odc_reduce_metrics(self, scratch) -> None:
        """Each metric TRL's loss recorded per sample, combined over all ranks' samples of the step: ``*_min`` and
        ``*_max`` keys by min / max, the rest by mean. Names first (a rank may have trained nothing)."""
        names = [None] * self.args.world_size
        dist.all_gather_object(names, sorted(scratch))
        names = sorted(set().union(*names))
        device = self.args.device
        values = {n: [v for v in scratch.get(n, []) if not math.isnan(v)] for n in names}
        means = [n for n in names if not n.endswith(("_min", "_max"))]
        sums = torch.tensor([[sum(values[n]), len(values[n])] for n in means], dtype=torch.float64,
                            device=device).reshape(-1, 2)
        lows = torch.tensor([min(values[n], default=math.inf) for n in names if n.endswith("_min")],
                            dtype=torch.float64, device=device)
        highs = torch.tensor([max(values[n], default=-math.inf) for n in names if n.endswith("_max")],
                             dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        dist.all_reduce(lows, op=dist.ReduceOp.MIN)
        dist.all_reduce(highs, op=dist.ReduceOp.MAX)
        out = {n: (float(s / c) if c > 0 else math.nan) for n, (s, c) in zip(means, sums.tolist())}
        out.update(zip([n for n in names if n.endswith("_min")], lows.tolist()))
        out.update(zip([n for n in names if n.endswith("_max")], highs.tolist()))
        for name in names:
            self._metrics["train"][name].append(out[name])

    def _odc_step_samples(self) -> int:
        return self.args.per_device_train_batch_size * self.current_gradient_accumulation_steps * self.args.world_size

    # -- logs -------------------------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self.odc and self.odc_meter is not None and "loss" in logs:
            logs.update(self.odc_meter.summary())
            self.odc_meter.reset()
            window = self._odc_window
            if window["steps"]:
                logs["odc/step_wait_seconds"] = window["wait"] / window["steps"]
                logs["odc/step_wait_seconds_max_rank"] = window["wait_max"]
                if window["gen_s"] > 0:
                    logs["odc/generation_tokens_per_second"] = window["gen_tokens"] / window["gen_s"]
                    logs["odc/generation_seconds"] = window["gen_s"] / window["steps"]
            self._odc_window = {"wait": 0.0, "wait_max": 0.0, "gen_s": 0.0, "gen_tokens": 0, "steps": 0}
        super().log(logs, *args, **kwargs)
