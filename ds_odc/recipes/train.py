"""The SFT training loop: DeepSpeed ZeRO-3, with or without ODC, balanced by the sampler's planner.

One loop to read top to bottom: :class:`SftRun` builds the engine and the sampler, then every optimizer step
(:meth:`SftRun.step`) trains the microbatches the planner gave this rank (any number, 0 included), meets the other
ranks at the step, and feeds the step's measured busy times back to the automatic cost; :func:`train` runs it to the
end. ``examples/sft.py`` is its command line (the flags are :func:`ds_odc.recipes.sft.sft_argument_parser`'s); the
benchmarks call :func:`train`, ``examples/compare.py`` steps several runs in turn.

``--loop stock`` trains the same minibatches through DeepSpeed's own loop instead: the flags fill in
``zero_optimization.odc.balancer``, ``deepspeed.initialize(training_data=...)`` returns the loader of this rank's
planned microbatches, and each step is ``engine(**batch)``, ``engine.backward(loss)``, ``engine.step()`` up to the
rank's boundary, with the engine weighting the losses and the loader measuring the step
(:mod:`ds_odc.training.planned_loader`). What the balancer key cannot say (samples split over ranks, a fitted cost)
stays with the recipe's loop.

The logged loss is the global mean token loss of each minibatch, the same quantity in every mode, so stock and ODC
runs can be compared step by step. ``--metrics-json`` writes per-step throughput, bubble rate and per-rank
busy/wait (:mod:`ds_odc.training.metrics`).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

import ds_odc  # noqa: F401  (before the model is built: installs the odc config key)
from ds_odc.balancer.planners import get_planner
from ds_odc.balancer.sampler import BalancedBatchSampler
from ds_odc.config import odc_config_from_ds_config
from ds_odc.recipes.sft import (attention_from_args, cost_from_args, on_device, plan_attention, prepare_model,
                                samples_from_args, sft_argument_parser, split_policy_from_args)
from ds_odc.recipes.workloads import SampleSet, model_config
from ds_odc.training.collate import PackedCollator
from ds_odc.training.distributed import init_distributed, shutdown_and_exit
from ds_odc.training.loss import global_mean_weight
from ds_odc.training.metrics import StepClock, StepRecord, gather_step, summarize
from ds_odc.training.profiling import decoder_layers, describe, profile_step
from ds_odc.training.sequence_parallel import SequenceParallel
from ds_odc.zero.engine import lockstep_waits, odc_requested, tag_minibatch, wait_seconds

__all__ = ["main", "train", "SftRun"]


def main(argv: list[str] | None = None, description: str | None = None) -> None:
    """The command line: parse the flags, start the process group, train, exit."""
    args = sft_argument_parser(description or __doc__).parse_args(argv)
    init_distributed(shared_gpu=args.shared_gpu or None)
    train(args)
    shutdown_and_exit()


def train(args) -> dict | None:
    """One run in an initialised process group (several may follow each other, as in ``benchmarks/offload.py``).
    Returns, on rank 0, the metrics that ``--metrics-json`` writes (None on the other ranks)."""
    run = SftRun(args)
    while run.step() is not None:
        pass
    return run.finish()


class SftRun:
    """One SFT run, a minibatch at a time: the constructor builds the engine and the sampler, each :meth:`step`
    trains the next minibatch on every rank and returns its gathered record (None when the run has trained all its
    steps), :meth:`finish` reports and destroys the engine. :func:`train` steps one run to its end;
    ``examples/compare.py`` keeps several runs alive and steps them in turn, so that each minibatch is timed under
    every mode within moments of each other. Every rank must call the same runs' steps in the same order. With
    ``--loop stock`` the loader that ``deepspeed.initialize`` returns plans and measures the steps (its sampler is
    :attr:`sampler`), and each step runs DeepSpeed's three lines; records, summaries and reports are the same."""

    def __init__(self, args):
        import deepspeed
        import torch.distributed as dist

        self.args = args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                                else torch.device("cpu"))

        # 1. Engine: the model under ZeRO-3 (ODC when the ds_config says "odc": true).
        ds_config, self.odc_on = engine_config(args)
        self.lengths, token_ids = samples_from_args(args)
        self.model = model = build_model(args, ds_config, device)
        self.samples = SampleSet(self.lengths, token_ids, model.config.vocab_size, args.seed)
        params = [p for p in model.parameters() if p.requires_grad]
        self.loader = None  # --loop stock: the loader deepspeed.initialize returns under the balancer key
        if args.loop == "stock":  # the engine plans with the balancer key and hands out this rank's microbatches
            self.engine, _, self.loader, _ = deepspeed.initialize(
                model=model, model_parameters=params, config=with_balancer_key(ds_config, args),
                training_data=self.samples)
        else:
            self.engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config)
        if device.type == "cuda":
            plan_attention(model, args, self.lengths, device, next(model.parameters()).dtype)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()  # peak memory of training, not of building the unpartitioned model

        # 2. Sampler: every optimizer step's minibatch, planned over the ranks (each rank gets its own microbatches).
        self.split = split = split_policy_from_args(args, model.config)  # how samples split over groups (lb-mini-sp)
        self.sp = (None if split is None else
                   SequenceParallel(split, timeout_s=odc_config_from_ds_config(ds_config).timeout_s))
        if self.loader is not None:  # the loader's sampler: the same flags, so the same minibatches in the same order
            self.sampler = self.loader.sampler
            self.loader.measure = True  # every step's gathered record, as this loop's own is
            self._rows = iter(self.loader)
        else:
            self.sampler = BalancedBatchSampler(
                self.lengths.tolist(), world_size=self.world, rank=self.rank, minibatch_size=args.minibatch_size,
                max_tokens=args.max_tokens, planner=args.balancer, seed=args.seed, shuffle=not args.no_shuffle,
                cost=cost_from_args(args, model.config), oversize=args.oversize, model_config=model.config,
                split=split)
            self._batches = iter(self.sampler)
        if self.rank == 0 and self.sampler.data_report.message():
            print(self.sampler.data_report.message(), flush=True)
        self.collate = PackedCollator()
        self.steps = min(args.steps, len(self.sampler))
        self.progress = (_progress_bar(self.steps, f"{'odc' if self.odc_on else 'stock'}+{args.balancer}", args)
                         if self.rank == 0 else None)
        self.clock = StepClock()
        self.records: list[StepRecord] = []
        self.profile = None
        self.split_samples = 0  # split samples this rank trained a slice of

    def _sample(self, j: int, truncated: bool) -> dict:
        ids = self.samples[j]["input_ids"]
        return {"input_ids": ids[:self.sampler.token_limit] if truncated else ids}

    # 3. The loop: one optimizer step per minibatch.
    def step(self) -> StepRecord | None:
        """Train the next minibatch (one optimizer step) and return its record, the same on every rank; None once
        the run's steps are done."""
        step = len(self.records)
        if step >= self.steps:
            return None
        profiled_step = step == self.args.profile_step
        profiling = (profile_step(self.args.profile_dir, self.rank, decoder_layers(self.model),
                                  python_stacks=self.args.profile_python)
                     if profiled_step else contextlib.nullcontext())
        # the profiler's own overhead is no cost of the plan: its step does not refit the automatic cost
        train = self._train_stock_loop if self.loader is not None else self._train_planned
        record = train(profiling, fit_cost=not profiled_step)
        self.records.append(record)
        if self.progress is not None:
            self.progress.set_postfix(loss=f"{record.loss:.4f}", samples_s=f"{record.samples_per_s:.2f}",
                                      bubble=f"{record.bubble_rate:.1%}")
            self.progress.update()
        return record

    def _train_stock_loop(self, profiling, fit_cost: bool) -> StepRecord:
        """DeepSpeed's three lines over the loader's microbatches of the next minibatch, up to this rank's boundary
        (the engine follows the loader's plan: loss weights, boundary, step check); the loader measured the step as
        its ``engine.step()`` returned."""
        engine = self.engine
        self.loader.fit_cost = fit_cost
        with profiling as profiled:
            for batch in self._rows:
                loss = engine(**batch).loss
                engine.backward(loss)
                boundary = engine.is_gradient_accumulation_boundary()
                engine.step()
                if boundary:
                    break
        if profiled is not None:
            self.profile = profiled
        return self.loader.last_step

    def _train_planned(self, profiling, fit_cost: bool) -> StepRecord:
        """The next minibatch of the sampler's plan, this loop marking the boundary and weighting the losses itself,
        then measured."""
        args, engine, device, world, batch = self.args, self.engine, self.device, self.world, next(self._batches)
        self.split_samples += len(batch.splits)
        # Each microbatch's loss sum times W / N is its share of the global mean over the minibatch's N label
        # tokens, however the samples are spread over ranks and microbatches (ds_odc.training.loss).
        tag_minibatch(engine, batch)  # the step checks that every rank trains this same minibatch
        weight = global_mean_weight(batch.num_label_tokens, world)
        self.clock.start()
        # summed on the device: reading a microbatch's loss on the host would wait for its backward, every microbatch
        loss_share = torch.zeros((), dtype=torch.float64, device=device)
        k = len(batch.microbatches)  # differs between ranks under lb-mini
        with profiling as profiled:
            for i, mb in enumerate(batch.microbatches):
                samples = [self._sample(j, j in batch.truncated) for j in mb]
                engine.set_gradient_accumulation_boundary(i == k - 1)
                if mb[0] in batch.splits:  # a sample split over a group of ranks: this rank trains its slice
                    piece = self.sp.slice(samples[0], batch.splits[mb[0]], device=device)
                    with self.sp.run(piece):  # forward and backward over the group
                        # labels switch the model's loss on; shift_labels, shifted over the whole sample, replace them
                        loss = engine(input_ids=piece.input_ids, position_ids=piece.position_ids,
                                      labels=piece.shift_labels, shift_labels=piece.shift_labels,
                                      num_items_in_batch=1 / weight).loss
                        engine.backward(loss, scale_wrt_gas=False)
                else:
                    row = on_device(self.collate(samples), device)
                    loss = engine(**row, num_items_in_batch=1 / weight).loss  # the sum divided by N / W
                    engine.backward(loss, scale_wrt_gas=False)
                engine.step()  # the optimizer steps after the last microbatch only (the boundary)
                loss_share += loss.detach().double() / world
            if k == 0:  # a rank with no microbatch still joins the step
                engine.set_gradient_accumulation_boundary(True)
                engine.step()
        if profiled is not None:
            self.profile = profiled

        # 4. Measure: every rank's busy time and load, gathered once; the automatic cost refits from it.
        busy, step_time = self.clock.finish(wait_seconds(engine))
        tokens, sq_tokens = self.sampler.load(batch.microbatches, batch.splits)  # as the plan counts them
        device_wait = lockstep_waits(engine) or 0.0  # odc.lockstep's meetings on CUDA: waits inside busy
        record = gather_step(loss_share, busy, step_time, k, tokens, batch.num_samples, sq_tokens=sq_tokens,
                             device_wait_s=device_wait)
        if fit_cost:
            update = self.sampler.observe(record)  # the same gathered record on every rank: the same refit
            record.cost = update.as_dict() if update else None
        return record

    # 5. Report (rank 0).
    def finish(self) -> dict | None:
        """Report (rank 0: print, ``--metrics-json``, ``--timeline``) and destroy the engine. Returns, on rank 0, the
        run's metrics (None on the other ranks)."""
        import deepspeed

        args, records = self.args, self.records
        if self.progress is not None:
            self.progress.close()
        out = None
        if self.rank == 0:
            config = {k: v for k, v in vars(args).items() if k != "local_rank"}
            config.update(world_size=self.world, odc=self.odc_on, lockstep=lockstep_waits(self.engine) is not None,
                          device=str(self.device),
                          deepspeed_version=deepspeed.__version__)
            out = {"config": config, "data": self.sampler.data_report.as_dict(),
                   "steps": [r.as_dict() for r in records],
                   "summary": summarize(records, args.warmup_steps, self.world, untimed=[args.profile_step]),
                   "split_samples_rank0": self.split_samples}
            if self.profile:
                out["profile_rank0"] = self.profile
                print(f"profile of step {args.profile_step} (rank 0): {describe(self.profile)}; files in "
                      f"{args.profile_dir}/", flush=True)
            if args.metrics_json:
                Path(args.metrics_json).write_text(json.dumps(out, indent=1))
            if not args.quiet:
                _print_summary(out["summary"], records)
            if args.timeline:
                draw_timeline(records[-min(len(records), 4):], args.timeline)
        self.engine.destroy()
        return out


def engine_config(args) -> tuple[dict, bool]:
    """The ds_config of ``--deepspeed`` for a loop that marks step boundaries itself (one microbatch per forward,
    any count per rank), and whether it turns ODC on. A planner that gives ranks different microbatch counts
    without ODC is refused."""
    ds_config = json.loads(Path(args.deepspeed).read_text())
    odc_on = odc_requested(ds_config)
    if get_planner(args.balancer).runtime == "odc" and not odc_on:
        raise SystemExit(f"--balancer {args.balancer} gives ranks different numbers of microbatches, which only ODC "
                         'can run: add "odc": true to zero_optimization in the ds_config, or use --balancer lb-micro')
    if args.loop == "stock":
        refuse_for_the_stock_loop(args, ds_config)
    ds_config["train_micro_batch_size_per_gpu"] = 1
    ds_config["gradient_accumulation_steps"] = 1  # boundaries are set explicitly: any count per rank
    ds_config.pop("train_batch_size", None)
    return ds_config, odc_on


def refuse_for_the_stock_loop(args, ds_config: dict) -> None:
    """``--loop stock`` trains what ``zero_optimization.odc.balancer`` can say; the rest of the recipe's options
    stay with its own loop (``--loop recipe``), refused here by name."""
    odc = odc_config_from_ds_config(ds_config)
    reason = None
    if get_planner(args.balancer).splits:
        reason = (f"--balancer {args.balancer} splits samples over groups of ranks (sequence parallel), which only "
                  "the recipe's loop trains")
    elif args.cost == "fitted":
        reason = "the balancer key's costs are auto, tokens and quadratic: --cost fitted (--cost-coeffs) is not one"
    elif odc.balancer is not None:
        reason = ("the flags fill in zero_optimization.odc.balancer: remove it from the ds_config of --deepspeed "
                  "and give --balancer, --max-tokens, --cost ... instead")
    if reason:
        raise SystemExit(f"--loop stock: {reason}; or use --loop recipe")


def with_balancer_key(ds_config: dict, args) -> dict:
    """``ds_config`` with ``zero_optimization.odc.balancer`` filled in from the flags (``--loop stock``): the
    loader's sampler then draws and plans the minibatches that the recipe's own sampler would, in the same order."""
    zero = dict(ds_config["zero_optimization"])
    odc = zero.get("odc")
    odc = dict(odc) if isinstance(odc, dict) else {"enabled": bool(odc)}
    odc["balancer"] = {"planner": args.balancer, "minibatch_size": args.minibatch_size, "max_tokens": args.max_tokens,
                       "cost": args.cost, "oversize": args.oversize, "seed": args.seed, "shuffle": not args.no_shuffle}
    return {**ds_config, "zero_optimization": {**zero, "odc": odc}}


def build_model(args, ds_config: dict, device: torch.device) -> torch.nn.Module:
    """The model of ``--model`` (random weights) or ``--model-path``, with the options of the flags."""
    from transformers import AutoConfig, AutoModelForCausalLM
    attn = attention_from_args(args)
    dtype = torch.bfloat16 if ds_config.get("bf16", {}).get("enabled") else torch.float32
    config = (AutoConfig.from_pretrained(args.model_path) if args.model_path
              else model_config(args.model, num_layers=args.num_layers))
    config.use_cache = False  # packed rows: transformers only detects sample boundaries without a cache
    torch.manual_seed(args.seed)

    def load():
        if args.model_path:
            return AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype, attn_implementation=attn)
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)

    if args.zero_init:  # partitioned from the start, for models that do not fit one device
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig
        build_model.keep_alive = HfDeepSpeedConfig(ds_config)  # HF reads it during from_config
        with deepspeed.zero.Init(config_dict_or_path=ds_config, dtype=dtype):
            model = load()
    else:  # built whole on the device (fast random init), partitioned by deepspeed.initialize
        with torch.device(device):
            model = load()
    return prepare_model(model, args)


def _progress_bar(steps: int, desc: str, args):
    from tqdm import tqdm
    return tqdm(total=steps, desc=desc, dynamic_ncols=True, disable=args.quiet)


def _print_summary(summary: dict, records: list[StepRecord]) -> None:
    print(f"summary: loss {summary['final_loss']:.5f}  samples/s {summary['samples_per_s']:.3f}  "
          f"bubble {summary['bubble_rate']:.1%}  time {summary['time_s']:.2f}s", flush=True)
    fitted = next((r.cost for r in reversed(records) if r.cost and r.cost["fitted"]), None)
    if fitted:
        per_mb = "" if fitted["c_measured"] else " (not measured: every rank ran the same count)"
        predicted = ("" if fitted["predicted_step_s"] is None else  # the fit first existed after the last step
                     f"; last step predicted {fitted['predicted_step_s']:.3f} s busy, measured "
                     f"{fitted['measured_step_s']:.3f} s")
        print(f"automatic cost: {fitted['a']:.3g} s/token + {fitted['b']:.3g} s/token^2 + {fitted['c']:.3g} s "
              f"per microbatch{per_mb} + {fitted['d']:.3g} s per step{predicted}", flush=True)


def draw_timeline(records: list[StepRecord], path: str) -> None:
    """Per-rank busy (solid) and waiting (hatched) time, step after step, as a PNG at ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    world = len(records[0].per_rank)
    fig, ax = plt.subplots(figsize=(9, 0.6 * world + 1.5))
    start = 0.0
    for record in records:
        for r, p in enumerate(record.per_rank):
            ax.barh(r, p.busy_s, left=start, color="tab:blue")
            ax.barh(r, p.wait_s, left=start + p.busy_s, color="tab:orange", hatch="//", alpha=0.6)
        start += record.step_time_s
        ax.axvline(start, color="k", lw=0.8)
    ax.set_yticks(range(world), [f"rank {r}" for r in range(world)])
    ax.set_xlabel("seconds (blue: busy, orange: waiting; lines: optimizer steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
