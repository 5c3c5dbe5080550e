"""Lock-step meetings (``odc.lockstep``): several checks in one launch (tests/zero/test_lockstep.py on CPU ranks,
tests/gpu/test_lockstep_gpu.py on CUDA ranks).

Usage: lockstep_worker.py [--delay S] [--fewer R --timeout T]. Rank 0 prints one ODC_RESULT line with the numbers of
the first two checks; with ``--fewer`` every rank then prints one line more, with the error it raised.

* equal (always): stock ZeRO-3 and lockstep ODC train the same minibatches in the drop-in loop (GAS 2, SGD), both
  with the chunked loss (the head applied ``CHUNK`` positions at a time, so as many times as a rank's row needs), and
  one process trains them in float64 (the bound's reference). Every microbatch's lock-step meetings are counted (by
  wrapping the transport's), beside the model's fetch units (blocks, and modules with parameters of their own
  outside blocks), each step's ``odc_lockstep``, and whether the ranks' head calls differed in some microbatch;
* delay (``--delay S``): the last rank sleeps S seconds before each microbatch, for 2 steps of the lockstep engine
  and 2 of a plain ODC engine (which must hold no lock-step meeting); per step, rank 0's waits;
* fewer (``--fewer R``): a lockstep engine with ``timeout_s`` T and managed accumulation off, where rank R runs one
  microbatch fewer than the others in its first step: every rank reports the error it raised, and when.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

import ds_odc  # noqa: F401  (installs the odc config key before any engine is built)
from _support.launch import emit
from ds_odc.training.distributed import shutdown_and_exit
from ds_odc.training.loss import use_chunked_loss

sys.path.insert(0, os.path.dirname(__file__))
from _workload import ds_config, full_params, max_rel_diff, minibatch, reference_run, rel_diff, tiny_llama  # noqa: E402
from worker import build, init_ranks, rank_world, train_uneven  # noqa: E402

GAS, STEPS, DELAY_STEPS = 2, 3, 2
CHUNK = 8  # positions per head call of the chunked loss: samples of 4 to 24 tokens take 1 to 3 calls


class Counted:
    """Counts an ODC engine's parameter fetches and lock-step meetings (by wrapping its state's and transport's
    methods), and how many of each every microbatch had."""

    def __init__(self, engine):
        state = engine.optimizer.odc
        self.totals = {"fetches": 0, "meetings": 0}
        self.per_microbatch: list[dict] = []
        self._mark = dict(self.totals)
        for owner, name, key in ((state, "fetch", "fetches"), (state.transport, "lockstep_barrier", "meetings")):
            setattr(owner, name, self._counting(getattr(owner, name), key))

    def _counting(self, method, key):
        def counted(*args, **kwargs):
            self.totals[key] += 1
            return method(*args, **kwargs)
        return counted

    def microbatch_done(self) -> None:
        self.per_microbatch.append({k: self.totals[k] - self._mark[k] for k in self.totals})
        self._mark = dict(self.totals)


def fetch_units(model) -> int:
    """The modules the coordinator fetches for: blocks (ZeRO-3 leaf modules) and, outside them, the modules with
    parameters of their own."""
    from deepspeed.utils import z3_leaf_module
    inside = {id(m) for block in model.modules() if z3_leaf_module(block) for m in block.modules() if m is not block}
    return sum(1 for m in model.modules() if id(m) not in inside
               and (z3_leaf_module(m) or next(m.parameters(recurse=False), None) is not None))


def drop_in(engine, steps: int, offset: int = 0, delay: float = 0.0, counted: Counted | None = None):
    """The drop-in loop (``GAS`` microbatches of one sample on every rank, ``engine.step()`` after each); the last
    rank sleeps ``delay`` seconds before each. Returns this rank's losses and, per step, its waits."""
    rank, world = rank_world()
    losses, steps_seen = [], []
    for step in range(offset, offset + steps):
        samples = minibatch(step, GAS * world)
        for k in range(GAS):
            if delay and rank == world - 1:
                time.sleep(delay)
            s = samples[k * world + rank]
            loss = engine(input_ids=s, labels=s).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if counted is not None:
                counted.microbatch_done()
        lockstep = getattr(engine.optimizer, "odc_lockstep", None)
        steps_seen.append({"wait_s": getattr(engine.optimizer, "odc_wait_s", 0.0),
                           "lockstep": None if lockstep is None else dataclasses.asdict(lockstep)})
    return losses, steps_seen


def check_equal_and_delay(args) -> dict:
    rank, world = rank_world()
    lockstep = {"enabled": True, "lockstep": True, "timeout_s": 120}
    stock = build(use_chunked_loss(tiny_llama(), CHUNK), ds_config(None, gas=GAS, optimizer="sgd"))
    stock_losses, _ = drop_in(stock, STEPS)
    stock_params = full_params(stock)
    engine = build(use_chunked_loss(tiny_llama(), CHUNK), ds_config(lockstep, gas=GAS, optimizer="sgd"))
    counted = Counted(engine)
    losses, steps = drop_in(engine, STEPS, counted=counted)
    params = full_params(engine)
    sample_losses = []
    ref, _ = reference_run(tiny_llama(), STEPS, GAS * world, per_sample_mean=True, dtype=torch.float64,
                           sample_losses=sample_losses)
    ref = full_params(ref, torch.float64)
    out = {"max_rel_diff": max_rel_diff(params, stock_params), "stock_vs_ref": max_rel_diff(stock_params, ref),
           "moved": max_rel_diff(stock_params, full_params(tiny_llama())),
           "loss_stock": stock_losses, "loss_lockstep": losses,
           "loss_ref": [sample_losses[step * GAS * world + k * world + rank] for step in range(STEPS)
                        for k in range(GAS)],
           "per_microbatch": counted.per_microbatch, "steps": steps, "fetch_units": fetch_units(engine.module),
           "head_calls_differ": any(len({-(-minibatch(step, GAS * world)[k * world + r].shape[1] // CHUNK)
                                         for r in range(world)}) > 1 for step in range(STEPS) for k in range(GAS)),
           "transport": engine.optimizer.odc.transport.name, "optimizer": type(engine.optimizer).__name__}
    if args.delay:
        _, out["delayed_lockstep"] = drop_in(engine, DELAY_STEPS, offset=STEPS, delay=args.delay)
        plain = build(tiny_llama(), ds_config({"enabled": True}, gas=GAS, optimizer="sgd"))
        plain_counted = Counted(plain)
        _, out["delayed_odc"] = drop_in(plain, DELAY_STEPS, delay=args.delay, counted=plain_counted)
        out["odc_meetings"] = plain_counted.totals["meetings"]
    return out


def check_fewer(args) -> dict:
    """Rank ``args.fewer`` runs one microbatch fewer than the others: every rank must raise, naming it."""
    rank, world = rank_world()
    engine = build(tiny_llama(), ds_config({"enabled": True, "lockstep": True, "timeout_s": args.timeout},
                                           managed=False, optimizer="sgd"))
    counts = [2] * world
    counts[args.fewer] = 1
    progress = {}
    try:
        train_uneven(engine, counts, 2, progress=progress)
    except Exception as err:  # noqa: BLE001 - the point is to report it
        return {"rank": rank, "error_type": type(err).__name__, "error": str(err)[:1500],
                "missing": getattr(err, "missing_ranks", None), "step": progress["step"],
                "after_s": time.monotonic() - progress["started"]}
    return {"rank": rank, "error_type": None}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--delay", type=float, default=0.0, help="seconds the last rank sleeps before each microbatch")
    parser.add_argument("--fewer", type=int, default=-1, help="the rank that runs a microbatch fewer (-1: no check)")
    parser.add_argument("--timeout", type=float, default=20.0, help="odc.timeout_s of the --fewer check")
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args()
    init_ranks(timeout_s=max(60.0, 2 * args.timeout))
    out = check_equal_and_delay(args)
    if rank_world()[0] == 0:
        emit(out)
    if args.fewer >= 0:
        failed = check_fewer(args)
        emit(failed)
        if failed["error_type"] is not None:
            os._exit(3)  # peers may be gone or stuck: no orderly shutdown
    shutdown_and_exit()


if __name__ == "__main__":
    main()
