"""Distributed scenarios for the ZeRO-3 + ODC tests. Launched by tests through ``_support.launch.launch``.

Usage: worker.py SCENARIO [options]; rank 0 prints one ODC_RESULT line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

import ds_odc  # installs the odc config key before any engine is built
from ds_odc.training.loss import global_mean_weight, token_loss_sum
from _support.launch import emit, init_test_ranks
from _support.tolerance import plant_wrong_weight
from ds_odc.training.distributed import shutdown_and_exit

sys.path.insert(0, os.path.dirname(__file__))
import _workload  # noqa: E402
from _workload import (client_optimizer, ds_config, full_params, max_rel_diff, minibatch,  # noqa: E402
                       reference_and_rounding, reference_run, rel_diff, tiny_llama)


def rank_world():
    import torch.distributed as dist
    return dist.get_rank(), dist.get_world_size()


def build(model, config):
    import deepspeed
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = None if "optimizer" in config else client_optimizer(params)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, optimizer=optimizer, config=config)
    return engine


def train_uneven(engine, counts, steps, managed=False, step_offset=0, stall=None, before_microbatch=None, tag=False,
                 skip_step=None, progress=None):
    """Rank r runs counts[r] microbatches (one sample each) of every global minibatch; loss = global token mean.
    ``before_microbatch(step, i)`` runs before each of this rank's microbatches (to delay it). ``tag``: tag every
    minibatch (``ds_odc.tag_minibatch``); ``skip_step(step)``: True where this rank forgets ``engine.step()`` (a bug
    to be caught); ``progress``: a dict told the step under way and when it started."""
    rank, world = rank_world()
    total = sum(counts)
    first = sum(counts[:rank])
    losses = []
    for step in range(step_offset, step_offset + steps):
        if progress is not None:
            progress.update(step=step, started=time.monotonic())
        samples = minibatch(step, total)
        n_tokens = sum(s.numel() - 1 for s in samples)
        weight = global_mean_weight(n_tokens, world)
        if tag:
            ds_odc.tag_minibatch(engine, epoch=0, step=step, label_tokens=n_tokens)
        mine = samples[first:first + counts[rank]]
        local = 0.0
        for i, s in enumerate(mine):
            if before_microbatch is not None:
                before_microbatch(step, i)
            if managed:
                engine.set_gradient_accumulation_boundary(i == len(mine) - 1)
            loss = token_loss_sum(engine(input_ids=s).logits, s) * weight
            engine.backward(loss, scale_wrt_gas=False)
            local += loss.item() / world
            if managed:
                engine.step()
        forgets = skip_step is not None and skip_step(step)
        if managed and not mine and not forgets:
            engine.set_gradient_accumulation_boundary(True)
            engine.step()
        if stall is not None:
            stall(step)
        if not managed and not forgets:
            engine.step()
        losses.append(local)
    return losses


def stock_rounding() -> dict[str, float]:
    """How far fp32 rounding moves stock ZeRO-3's gradients, parameters, logits and losses of the tiny model on this
    machine's kernels: one drop-in step (GAS 2, SGD, every rank) against one process computing the same minibatch in
    float64 (relative distances of whole flat vectors; for the losses, the largest over this rank's microbatches).
    The reference distances (tests/_support/tolerance.py) of API sequences that have no float64 counterpart
    (dropin_worker.py, deepspeed_apis_worker.py), by kind of quantity; on the first rank, which reports them (None on
    the others)."""
    from deepspeed.utils import safe_get_full_grad
    rank, world = rank_world()
    gas = 2
    samples = minibatch(0, gas * world)
    prompt = minibatch(7, world)[rank][:, :6]
    engine = build(tiny_llama(), ds_config(None, gas=gas, optimizer="sgd"))
    exact = tiny_llama().to(_workload.DEVICE, torch.float64)
    with torch.no_grad():
        logits = [engine(input_ids=prompt).logits, exact(input_ids=prompt).logits if rank == 0 else None]
    losses = []
    for k in range(gas):
        s = samples[k * world + rank]
        loss = engine(input_ids=s, labels=s).loss
        engine.backward(loss)
        losses.append(loss.item())
        if k == gas - 1:
            grads = torch.cat([safe_get_full_grad(p).reshape(-1) for p in engine.module.parameters()])
        engine.step()
    trained = full_params(engine, torch.float64)  # collective
    if rank != 0:
        return None
    exact_losses = []
    for i, s in enumerate(samples):  # stock's weight: the mean over samples of each sample's token mean
        loss = torch.nn.functional.cross_entropy(exact(input_ids=s).logits[0, :-1], s[0, 1:])
        (loss / len(samples)).backward()
        if i % world == rank:
            exact_losses.append(loss.item())
    exact_grads = torch.cat([p.grad.reshape(-1) for p in exact.parameters()])
    client_optimizer(list(exact.parameters())).step()
    params = [torch.cat([t.reshape(-1) for t in p.values()]) for p in (trained, full_params(exact, torch.float64))]
    return {"grads": rel_diff(grads, exact_grads), "params": rel_diff(*params), "logits": rel_diff(*logits),
            "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, exact_losses))}


def scenario_equal(args):
    """Drop-in semantics: every rank runs the configured GAS; ODC must equal stock ZeRO-3 up to fp32 rounding.
    Both are also compared, parameter by parameter, with a single-process reference of the same minibatches in
    ``--reference-dtype`` (float64: the exact answer both runs approximate; float32 for the bf16 runs)."""
    rank, world = rank_world()
    gas, steps = 2, 3
    results = {}
    extra = {} if args.linear is None else {"memory_efficient_linear": args.linear == "deepspeed"}
    for name, odc in (("stock", None), ("odc", {"enabled": True, "fetch_unit": args.fetch_unit})):
        config = ds_config(odc, gas=gas, clip=args.clip, bf16=args.bf16, optimizer=args.optimizer, extra_zero=extra)
        engine = build(tiny_llama(), config)
        losses = []
        for step in range(steps):
            samples = minibatch(step, gas * world)
            for k in range(gas):
                s = samples[k * world + rank]
                loss = engine(input_ids=s, labels=s).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        results[name] = (full_params(engine), losses, type(engine.optimizer).__name__,
                         engine.optimizer.offload_optimizer)
    stock, odc = results["stock"][0], results["odc"][0]
    # Sample order of the reference: step s's samples in index order, which is how ranks x GAS slots cover them.
    dtype = getattr(torch, args.reference_dtype)
    sample_losses = []
    ref, _ = reference_run(tiny_llama(), steps, gas * world, clip=args.clip, per_sample_mean=True, dtype=dtype,
                           optimizer=args.optimizer, sample_losses=sample_losses)
    ref = full_params(ref, dtype)
    per_param = {n: [rel_diff(stock[n], ref[n]), rel_diff(odc[n], ref[n]), rel_diff(odc[n], stock[n])] for n in ref}
    out = {"max_rel_diff": max(v[2] for v in per_param.values()),
           "stock_vs_ref": max(v[0] for v in per_param.values()), "odc_vs_ref": max(v[1] for v in per_param.values()),
           "per_param": per_param, "loss_stock": results["stock"][1], "loss_odc": results["odc"][1],
           # the reference's loss of each sample this rank trained, in the order of loss_stock
           "loss_ref": [sample_losses[step * gas * world + k * world + rank] for step in range(steps)
                        for k in range(gas)],
           "optimizers": [results["stock"][2], results["odc"][2]],
           "offloaded": [results["stock"][3], results["odc"][3]]}
    if rank == 0:
        emit(out)


def scenario_uneven(args):
    """Variable microbatch counts vs a single-process reference on the same global minibatches."""
    rank, world = rank_world()
    counts = [int(c) for c in args.counts.split(",")]
    assert len(counts) == world, f"--counts needs {world} entries"
    model = tiny_llama(frozen_embeddings=args.frozen)
    initial = full_params(model)
    ref_model, ref_losses, ref_rounding = reference_and_rounding(model, args.steps, sum(counts), clip=args.clip)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    extra = {"stage3_param_persistence_threshold": args.persist} if args.persist else {}
    if args.linear is not None:
        extra["memory_efficient_linear"] = args.linear == "deepspeed"
    odc = {"enabled": True, "fetch_unit": args.fetch_unit, "force_remote_path": args.remote}
    engine = build(model, ds_config(odc, clip=args.clip, managed=args.managed, optimizer="sgd", extra_zero=extra))
    persistent = len(engine.optimizer.persistent_parameters)
    transport, reads = engine.optimizer.odc.transport, []
    gather = transport.gather
    transport.gather = lambda plan, out: reads.append(len(plan.segments)) or gather(plan, out)
    coordinator, fetches, in_flight = engine.optimizer.parameter_offload.get_param_coordinator(), [], []
    fetch = coordinator.fetch_sub_module
    registry = coordinator._PartitionedParameterCoordinator__inflight_param_registry

    def counted_fetch(module, **kwargs):
        fetches.append(module)
        fetch(module, **kwargs)
        in_flight.append(len(registry))  # prefetches stock would leave for a per-parameter wait later

    coordinator.fetch_sub_module = counted_fetch
    if args.plant:  # the planted error of tests/_support/tolerance.py: rank 0's second microbatch dropped or reweighted
        plant_wrong_weight(engine, {"drop": 0.0, "weight": 1.5}[args.plant], call=1)
    train_uneven(engine, counts, args.steps, managed=args.managed, tag=args.tag)
    odc = full_params(engine)
    if rank == 0:
        emit({"max_rel_diff": max_rel_diff(odc, full_params(ref_model)), "ref_losses": ref_losses,
              "ref_rounding": ref_rounding,
              "moved": max_rel_diff(odc, initial),
              "persistent_params": persistent, "reads": len(reads), "params_read": sum(reads), "module_fetches": len(fetches),
              "prefetches_waiting": max(in_flight, default=0),
              "gradient_buckets_allocated": sum(b.buffer is not None for b in engine.optimizer.ipg_buckets.values()),
              "optimizer": type(engine.optimizer).__name__, "grad_norm": float(engine.get_global_grad_norm()),
              "offloaded": engine.optimizer.offload_optimizer, "host_step_s": host_step_seconds(engine)})


def host_step_seconds(engine) -> dict | None:
    """ODC's host step times of the last step (copy out, CPU optimizer, copy back) when the optimizer is offloaded."""
    import dataclasses
    times = engine.optimizer.odc_host_step_times
    return None if times is None else dataclasses.asdict(times)


def scenario_repeatable(args):
    """"deterministic": true, trained twice on the same minibatches with the ranks delayed differently each time (so
    gradient pushes land in other orders): the two runs must end bit for bit equal."""
    rank, world = rank_world()
    counts = [int(c) for c in args.counts.split(",")]
    torch.use_deterministic_algorithms(True, warn_only=True)  # the model's own kernels must not add noise
    initial = full_params(tiny_llama())
    finals = []
    for run in range(2):
        engine = build(tiny_llama(), ds_config({"enabled": True, "deterministic": True}, managed=False,
                                               optimizer="sgd"))
        slow = (rank + run) % world  # another rank is slow in each run

        def delay(step, i, slow=slow):
            if rank == slow:
                time.sleep(0.05)

        train_uneven(engine, counts, args.steps, before_microbatch=delay)
        finals.append(full_params(engine))
    bits = sum(int((a.view(torch.int32) != b.view(torch.int32)).sum()) for a, b in
               zip(finals[0].values(), finals[1].values()))
    if rank == 0:
        emit({"runs_differ_bits": bits, "moved": max_rel_diff(finals[0], initial),
              "optimizer": type(engine.optimizer).__name__})


def scenario_checkpoint(args):
    """Save after 2 steps (into --dir, the test's own temporary folder), continue 2 steps; a fresh engine loading the
    checkpoint must reproduce those 2 steps."""
    rank, world = rank_world()
    counts = [int(c) for c in args.counts.split(",")]
    engine = build(tiny_llama(), ds_config(True, clip=args.clip, managed=False))
    train_uneven(engine, counts, 2)
    engine.save_checkpoint(args.dir, tag="step2")
    train_uneven(engine, counts, 2, step_offset=2)
    uninterrupted = full_params(engine)
    resumed_engine = build(tiny_llama(seed=123), ds_config(True, clip=args.clip, managed=False))
    resumed_engine.load_checkpoint(args.dir, tag="step2")
    train_uneven(resumed_engine, counts, 2, step_offset=2)
    resumed = full_params(resumed_engine)
    if rank == 0:
        emit({"max_rel_diff": max_rel_diff(resumed, uninterrupted)})


COUNTED = ["all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast", "barrier", "all_gather",
           "reduce_scatter", "send", "recv", "isend", "irecv", "all_to_all_single", "gather", "scatter",
           "all_gather_object", "broadcast_object_list", "monitored_barrier", "all_gather_coalesced", "reduce",
           "batch_isend_irecv", "all_reduce_coalesced", "reduce_scatter_tensor_coalesced",
           "all_gather_into_tensor_coalesced"]
CALLS = {"on": False, "by_name": {}}


def count_collectives():
    """Wrap torch.distributed's communication functions; must run before DeepSpeed's backend caches them."""
    import torch.distributed as dist

    def wrap(name, original):
        def counted(*a, **k):
            if CALLS["on"]:
                CALLS["by_name"][name] = CALLS["by_name"].get(name, 0) + 1
            return original(*a, **k)
        return counted

    for name in COUNTED:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))


def scenario_collectives(args):
    """Count torch.distributed calls during forward and backward, stock vs ODC (uneven counts for ODC); the last
    minibatch runs under the torch profiler, whose ranges named ``ds_odc::...`` are reported."""
    import torch.profiler
    rank, world = rank_world()
    out = {}
    for label, odc in (("stock", None), ("odc", True)):
        engine = build(tiny_llama(), ds_config(odc, managed=odc is None, gas=2 if odc is None else 1))
        CALLS["by_name"] = {}
        for step in range(2):
            samples = minibatch(step, 3 * world)
            mine = 2 if odc is None else (3 if rank == 0 else 1)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if step == 1 \
                    else contextlib.nullcontext() as profiled:
                for k in range(mine):
                    s = samples[k * world + rank]
                    CALLS["on"] = True
                    loss = engine(input_ids=s, labels=s).loss
                    engine.backward(loss, scale_wrt_gas=odc is None)
                    CALLS["on"] = False
                    if odc is None:
                        engine.step()
                if odc is not None:
                    engine.step()
        out[label] = {"calls": sum(CALLS["by_name"].values()), "by_name": dict(CALLS["by_name"]),
                      "ranges": sorted({e.name for e in profiled.events() if e.name.startswith("ds_odc::")})}
    if rank == 0:
        emit(out)


def scenario_fence_timeout(args):
    """Rank ``--victim`` arrives at the fence late (or dies): rank 0 must raise an error naming it within the timeout
    (with ``--shard-size``, also when the victim is in another shard group)."""
    rank, world = rank_world()
    odc = {"enabled": True, "timeout_s": args.timeout}
    if args.shard_size:
        odc["shard_size"] = args.shard_size
    engine = build(tiny_llama(), ds_config(odc, managed=False))
    if rank == 0:  # the shm transport's file prefix (the GPU transport has none)
        emit({"tag": getattr(engine.optimizer.odc.transport, "tag", None)})

    def stall(step):
        if rank == args.victim and step == 1:
            if args.kill:
                os.kill(os.getpid(), 9)
            time.sleep(args.timeout + 4)
        if rank == args.late and step == 1:
            time.sleep(args.timeout / 3)  # late, but well within the timeout: must not be named

    started = time.monotonic()
    try:
        train_uneven(engine, [1] * world, 3, stall=stall)
    except Exception as err:  # noqa: BLE001 - the point is to report it
        if rank == 0:
            emit({"error_type": type(err).__name__, "error": str(err), "after_s": time.monotonic() - started,
                  "missing": getattr(err, "missing_ranks", None)})
        os._exit(3)
    if rank == 0:
        emit({"error_type": None})


def scenario_skipped_step(args):
    """Rank ``--victim`` has no microbatch in any minibatch (``--counts``) and forgets ``engine.step()`` at step
    ``--skip-at`` (-1: never); with ``--tag``, rank ``--untagged`` does not tag. Every rank reports the error it
    raised, the step it was in and how long into that step."""
    rank, world = rank_world()
    counts = [int(c) for c in args.counts.split(",")]
    odc = {"enabled": True, "timeout_s": args.timeout}
    if args.shard_size:
        odc["shard_size"] = args.shard_size
    engine = build(tiny_llama(), ds_config(odc, managed=args.managed, optimizer="sgd"))
    progress = {}
    try:
        train_uneven(engine, counts, args.steps, managed=args.managed, tag=args.tag and rank != args.untagged,
                     progress=progress, skip_step=lambda step: rank == args.victim and step == args.skip_at)
    except Exception as err:  # noqa: BLE001 - the point is to report it
        emit({"rank": rank, "error_type": type(err).__name__, "error": str(err), "step": progress["step"],
              "after_s": time.monotonic() - progress["started"],
              "ranks": getattr(err, "ranks", getattr(err, "missing_ranks", None))})
        os._exit(3)
    emit({"rank": rank, "error_type": None, "steps": progress["step"] + 1})
    if args.destroy:  # the loop's end as a trainer has it (then shutdown, as every script ends)
        engine.destroy()


def scenario_fault(args):
    """Rank 1 dies (SIGKILL) right after it issues a gradient push (``--fault kill-push``) or a parameter read
    (``kill-fetch``) of step 1, or stops (SIGSTOP, ``stop``) there. Every other rank must raise at its next meeting an
    error naming rank 1, within ``timeout_s``, and then exit like a script whose exception nobody caught. Each
    survivor prints its own result line first."""
    import signal
    rank, world = rank_world()
    engine = build(tiny_llama(), ds_config({"enabled": True, "timeout_s": args.timeout}, managed=False,
                                           optimizer="sgd"))
    state = engine.optimizer.odc
    clock = {"armed": False, "step1": None}
    if rank == 1:
        hop = "push" if args.fault == "kill-push" or args.fault == "stop" else "fetch"
        original = getattr(state, hop)
        how = signal.SIGSTOP if args.fault == "stop" else signal.SIGKILL

        def faulty(*a, **k):
            out = original(*a, **k)  # the push or read is on the GPU's stream, most likely still running
            if clock["armed"]:
                os.kill(os.getpid(), how)
            return out

        setattr(state, hop, faulty)

    def before(step, i):
        if step == 1 and i == 0:
            clock["armed"], clock["step1"] = True, time.monotonic()

    try:
        train_uneven(engine, [2] * world, 3, before_microbatch=before)
    except Exception as err:
        emit({"rank": rank, "error_type": type(err).__name__, "error": str(err)[:600],
              "missing": getattr(err, "missing_ranks", None), "after_s": time.monotonic() - clock["step1"]})
        raise
    emit({"rank": rank, "error_type": None})


def scenario_rejects(args):
    """Every option ODC refuses raises ValueError naming it at deepspeed.initialize; for each refusal that the ds_config
    alone decides (ds_odc.zero.validate.CONFIG_RULES, each rule's examples planted in turn), also what
    ``python -m ds_odc check`` reports for the same config."""
    from _support.launch import expect_error
    from ds_odc.cli.check import check
    from ds_odc.zero.validate import CONFIG_RULES

    def planted(example: dict) -> dict:
        config = ds_config(True)
        for key, value in example.items():
            config[key] = {**config[key], **value} if isinstance(value, dict) and key in config else value
        return config

    from deepspeed.accelerator import get_accelerator
    out = {"rules": {}, "fp16_supported": bool(get_accelerator().is_fp16_supported())}
    for rule in CONFIG_RULES:
        for example in rule.examples:
            config = planted(example)
            out["rules"][f"{rule.refusal.__name__} {example}"] = {
                "initialize": expect_error(lambda: build(tiny_llama(), config)), "check": check(config).problems}
    # Decided by the job, not the file: 2 does not divide 1 rank.
    out["shard_size"] = expect_error(lambda: build(tiny_llama(), planted({"zero_optimization": {
        "odc": {"enabled": True, "shard_size": 2}}})))
    if rank_world()[0] == 0:
        emit(out)


def init_ranks(timeout_s: float = 60.0) -> None:
    """CPU ranks under the test launcher; with ODC_TEST_CUDA=1 (tests/gpu) CUDA ranks: one GPU each over NCCL, or
    all on one GPU over gloo (DS_ODC_SHARED_GPU=1)."""
    from ds_odc.training.distributed import training_device
    cuda = os.environ.get("ODC_TEST_CUDA") == "1"
    init_test_ranks(timeout_s=max(timeout_s, 120.0) if cuda else timeout_s)
    if cuda:
        _workload.DEVICE = training_device()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario")
    parser.add_argument("--counts", default="1,1")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--managed", action="store_true")
    parser.add_argument("--tag", action="store_true", help="tag every minibatch (ds_odc.tag_minibatch)")
    parser.add_argument("--untagged", type=int, default=-1, help="skipped_step: with --tag, the rank that does not")
    parser.add_argument("--skip-at", type=int, default=1, help="skipped_step: the step the victim forgets (-1: none)")
    parser.add_argument("--destroy", action="store_true", help="skipped_step: destroy the engine after the loop")
    parser.add_argument("--frozen", action="store_true")
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--kill", action="store_true")
    parser.add_argument("--victim", type=int, default=1, help="fence_timeout: the rank that is late or dies")
    parser.add_argument("--late", type=int, default=-1, help="fence_timeout: a rank that arrives late but in time")
    parser.add_argument("--shard-size", type=int, default=0, help="zero_optimization.odc.shard_size (0: unset)")
    parser.add_argument("--fault", choices=["kill-push", "kill-fetch", "stop"], default="kill-push")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--reference-dtype", choices=["float64", "float32"], default="float64")
    parser.add_argument("--fetch-unit", default="block")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing (non-reentrant)")
    parser.add_argument("--linear", choices=["deepspeed", "torch"], help="memory_efficient_linear true / false")
    parser.add_argument("--persist", type=int, default=0, help="stage3_param_persistence_threshold")
    parser.add_argument("--remote", action="store_true", help="odc.force_remote_path (GPU: NVSHMEM get/put only)")
    parser.add_argument("--dir", help="a folder the test owns and removes (checkpoints)")
    parser.add_argument("--plant", choices=["drop", "weight"], help="uneven: a planted error (see scenario_uneven)")
    parser.add_argument("--offload", choices=["odc", "both"], default="",
                        help="offload_optimizer to the CPU for ODC's engines, or for stock's too")
    parser.add_argument("--local_rank", type=int, default=None)  # the deepspeed launcher passes it
    args = parser.parse_args()
    _workload.OFFLOAD = args.offload
    if args.scenario == "collectives":
        count_collectives()
    init_ranks(timeout_s=args.timeout * 2 if args.scenario in ("fence_timeout", "skipped_step") else 60)
    globals()[f"scenario_{args.scenario}"](args)
    shutdown_and_exit()


if __name__ == "__main__":
    main()
