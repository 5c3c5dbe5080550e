"""Rank script of tests/training/test_planned_loop.py (CPU) and tests/gpu/test_planned_loop_gpu.py: the stock DeepSpeed loop
with ``zero_optimization.odc.balancer``.

Usage: planned_loop_worker.py SCENARIO [options]; every rank prints one ODC_RESULT line.
"""

from __future__ import annotations

import argparse
import warnings
import os
import sys
import time

import torch

import ds_odc  # noqa: F401 - the odc key, before any engine is built
import ds_odc.training.attention  # noqa: F401 - "ds_odc_varlen": each document of a packed row attends to itself
from _support.launch import emit, init_test_ranks
from _support.tolerance import plant_wrong_weight
from ds_odc.training.distributed import shutdown_and_exit

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "zero"))
import _workload  # noqa: E402
from _workload import VOCAB, client_optimizer, ds_config, full_params, max_rel_diff, tiny_llama  # noqa: E402

IGNORE = -100


# The microbatch budget, the shortest of the long samples and the data's seed (--max-tokens, --long-min, --seed): at 2
# and 3 ranks with the default 32, 24 and 5 or 6, LB-Mini plans different counts per rank in 2 of the 3 minibatches.
MAX_TOKENS, LONG_MIN, SEED = 32, 24, 5


def dataset(num: int, seed: int | None = None) -> list[dict]:
    """Samples of 4-30 tokens, every fifth one LONG_MIN to MAX_TOKENS (so that LB-Mini gives ranks different numbers
    of microbatches), some with their first tokens masked from the loss (a prompt), as an SFT dataset has them."""
    g = torch.Generator().manual_seed(SEED if seed is None else seed)
    rows = []
    for i in range(num):
        n = int(torch.randint(LONG_MIN, MAX_TOKENS + 1, (1,), generator=g)) if i % 5 == 2 else \
            int(torch.randint(4, 31, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        prompt = int(torch.randint(0, n // 2, (1,), generator=g)) if i % 3 == 0 else 0
        rows.append({"input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:]})
    return rows


def reference(model, data, order: list[int], steps: int, per_step: int, dtype, loss_kind: str):
    """One process: per minibatch (consecutive chunks of the epoch's order) the gradient of the global mean over its
    label tokens (``token_mean``) or over its samples' token means (``sample_mean``), each sample alone."""
    import copy
    model = copy.deepcopy(model).to(dtype)
    opt = client_optimizer(list(model.parameters()))
    for step in range(steps):
        ids = order[step * per_step:(step + 1) * per_step]
        labels = [torch.tensor(data[i]["labels"])[1:] for i in ids]
        total = sum(int((y != IGNORE).sum()) for y in labels)
        opt.zero_grad()
        for i, y in zip(ids, labels):
            x = torch.tensor(data[i]["input_ids"])[None]
            logits = model(input_ids=x).logits[0, :-1].to(max(dtype, torch.float32, key=lambda d: torch.finfo(d).bits))
            terms = torch.nn.functional.cross_entropy(logits, y, ignore_index=IGNORE, reduction="sum")
            if loss_kind == "sample_mean":
                loss = terms / max(1, int((y != IGNORE).sum())) / len(ids)
            else:
                loss = terms / total
            loss.backward()
        opt.step()
    return model


def config(args, world: int) -> dict:
    balancer = {"planner": args.planner, "max_tokens": MAX_TOKENS, "cost": args.cost, "loss": args.loss, "seed": 3}
    odc = {"enabled": True, "timeout_s": args.timeout, "balancer": balancer}
    cfg = ds_config(odc, optimizer="sgd")
    cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"] = 1, 4  # minibatch: 4 per rank
    return cfg


def scenario_train(args):
    """The stock three-line loop over the loader deepspeed.initialize returns; parameters against one process."""
    import deepspeed
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    data = dataset(4 * world * args.steps + 3)  # 3 left over: the short final minibatch is dropped
    model = packed_llama()
    initial = full_params(model)
    params = list(model.parameters())
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=params, optimizer=client_optimizer(params),
                                                config=config(args, world), training_data=data)
    if args.plant:  # the planted error of tests/_support/tolerance.py: rank 0's second microbatch weighed 1.5x
        plant_wrong_weight(engine, 1.5, call=1)
    counts, answers, losses = [], [], []
    caught = warnings.catch_warnings(record=True)
    seen = caught.__enter__()
    warnings.simplefilter("always")
    for batch in loader:
        if engine.is_gradient_accumulation_boundary() is None:
            raise AssertionError("no boundary")
        answers.append((engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu(),
                        engine.train_batch_size()))
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        if engine.is_gradient_accumulation_boundary():
            counts.append(engine.gradient_accumulation_steps())
            losses.append(loss.item())
    caught.__exit__(None, None, None)
    trained = full_params(engine)
    order = loader.sampler.epoch_order(0).tolist()
    out = {"rank": rank, "counts": counts, "answers": answers, "steps": engine.global_steps,
           "optimizer": type(engine.optimizer).__name__, "unread_warnings": unread(seen),
           "last_step": None if loader.last_step is None else loader.last_step.as_dict()}
    if rank == 0:
        ref = reference(model_copy(initial), data, order, args.steps, 4 * world, torch.float32, args.loss)
        exact = reference(model_copy(initial), data, order, args.steps, 4 * world, torch.float64, args.loss)
        ref64 = full_params(exact, torch.float64)
        out.update(measured=max_rel_diff({k: v.double() for k, v in trained.items()}, ref64),
                   reference=max_rel_diff(full_params(ref, torch.float64), ref64),
                   moved=max_rel_diff(trained, initial))
    emit(out)


ATTENTION = "eager"


def packed_llama():
    """The tiny Llama with ``--attention``: transformers' eager attention (the loader's packed rows say use_cache=False,
    so it keeps each document to itself) or ds_odc's ``ds_odc_varlen``."""
    model = tiny_llama()
    model.set_attn_implementation(ATTENTION)
    return model


def model_copy(initial: dict):
    model = packed_llama()
    model.load_state_dict(initial)
    return model


def scenario_skip(args):
    """Rank ``--victim`` forgets engine.step() at the end of minibatch 1: the loader names it at once on that rank;
    the others are told at their fence (its timeout)."""
    import deepspeed
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    data = dataset(4 * world * 3)
    model = packed_llama()
    params = list(model.parameters())
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=params, optimizer=client_optimizer(params),
                                                config=config(args, world), training_data=data)
    started, step = time.monotonic(), 0
    try:
        for batch in loader:
            loss = engine(**batch).loss
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            if not (boundary and rank == args.victim and step == 1):
                engine.step()
            if boundary:
                step += 1
                started = time.monotonic()
    except Exception as err:  # noqa: BLE001 - the point is to report it
        emit({"rank": rank, "error_type": type(err).__name__, "error": str(err), "step": step,
              "after_s": time.monotonic() - started,
              "ranks": getattr(err, "ranks", getattr(err, "missing_ranks", None))})
        os._exit(3)
    emit({"rank": rank, "error_type": None})


def unread(seen) -> int:
    """How many of the recorded warnings say that the ds_config's balancer block balances nothing."""
    return sum("nothing is balanced" in str(w.message) for w in seen)


def scenario_sampler_skip(args):
    """The hand-written loop (docs/USAGE.md) over a BalancedBatchSampler, untagged: the final short minibatch gives
    rank ``--victim`` no microbatch and it skips engine.step(). The step's meeting names it at that step. The
    ds_config also carries a balancer block, which this loop never reads: the first step warns of it, once."""
    import deepspeed
    import torch.distributed as dist
    from ds_odc import global_mean_weight, token_loss_sum
    from ds_odc.balancer.sampler import BalancedBatchSampler
    from ds_odc.training.collate import PackedCollator
    rank, world = dist.get_rank(), dist.get_world_size()
    data = dataset(2 * world * 2 + world - 1)  # 2 full minibatches, then one with a sample fewer than ranks
    lengths = [len(d["input_ids"]) for d in data]
    sampler = BalancedBatchSampler(lengths, world_size=world, rank=rank, minibatch_size=2, max_tokens=MAX_TOKENS,
                                   cost="tokens", drop_last=False, shuffle=False)
    model = packed_llama()
    params = list(model.parameters())
    odc = {"enabled": True, "timeout_s": args.timeout, "balancer": {"planner": "lb-mini", "max_tokens": MAX_TOKENS}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, optimizer=client_optimizer(params),
                                      config=ds_config(odc, optimizer="sgd"))
    collate = PackedCollator()
    step, started = 0, time.monotonic()
    caught = warnings.catch_warnings(record=True)
    seen = caught.__enter__()
    warnings.simplefilter("always")
    try:
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for batch in sampler:
                step, started = (epoch, batch.step), time.monotonic()
                weight = global_mean_weight(batch.num_label_tokens, world)
                k = len(batch.microbatches)
                for i, mb in enumerate(batch.microbatches):
                    row = collate([data[j] for j in mb])
                    engine.set_gradient_accumulation_boundary(i == k - 1)
                    loss = token_loss_sum(engine(input_ids=row["input_ids"], position_ids=row["position_ids"]).logits,
                                          row["labels"]) * weight
                    engine.backward(loss, scale_wrt_gas=False)
                    engine.step()
                if k == 0 and rank != args.victim:
                    engine.set_gradient_accumulation_boundary(True)
                    engine.step()
    except Exception as err:  # noqa: BLE001
        emit({"rank": rank, "error_type": type(err).__name__, "error": str(err), "step": list(step),
              "after_s": time.monotonic() - started, "ranks": getattr(err, "ranks", None),
              "unread_warnings": unread(seen)})
        os._exit(3)
    emit({"rank": rank, "error_type": None})


def main():
    global ATTENTION, MAX_TOKENS, LONG_MIN, SEED
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["train", "skip", "sampler_skip"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--planner", default="lb-mini")
    parser.add_argument("--cost", default="tokens")
    parser.add_argument("--loss", default="token_mean")
    parser.add_argument("--victim", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--long-min", type=int, default=LONG_MIN)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--plant", action="store_true")
    parser.add_argument("--local_rank", type=int, default=None)  # the deepspeed launcher passes it
    parser.add_argument("--attention", default="eager", help="eager: transformers' own, on the loader's packed rows")
    args = parser.parse_args()
    ATTENTION, MAX_TOKENS, LONG_MIN, SEED = args.attention, args.max_tokens, args.long_min, args.seed
    cuda = os.environ.get("ODC_TEST_CUDA") == "1"  # tests/gpu: the loader's rows go to the engine's GPU
    init_test_ranks(timeout_s=120.0 if cuda else 60.0)
    if not cuda:  # on CUDA it would need CUBLAS_WORKSPACE_CONFIG, and the pushes' atomic adds are unordered anyway
        torch.use_deterministic_algorithms(True)
    {"train": scenario_train, "skip": scenario_skip, "sampler_skip": scenario_sampler_skip}[args.scenario](args)
    shutdown_and_exit()


if __name__ == "__main__":
    main()
