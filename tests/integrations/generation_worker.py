"""Lockstep-free generation under ZeRO-3 + ODC, launched by test_generation.py through ``_support.launch.launch``.

Every rank generates for its own prompts (its own batch size, prompt lengths, padding, new-token budget and EOS;
the last rank of a 3-rank run has no prompts and runs no forward), greedy and sampled, with the KV cache, in both
residencies, and compares every token with the unsharded model in this process. Between rounds the ranks train
one uneven optimizer step, compared with a single-process SGD reference. Rank 0 prints one ODC_RESULT line.
"""

from __future__ import annotations

import copy
import os
import sys

import torch

import ds_odc  # noqa: F401  (installs the odc config key before any engine is built)
from _support.launch import emit, expect_error
from ds_odc.training.distributed import shutdown_and_exit

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "zero"))
import _workload  # noqa: E402
import worker as zero_worker  # noqa: E402
from _rl_workload import prompt_batch, tiny_qwen2  # noqa: E402
from _workload import ds_config, flat, full_params, max_rel_diff, reference_and_rounding, rel_diff  # noqa: E402

RESIDENCIES = ("block", "full")


def rank_plan(rank: int, world: int) -> dict:
    """What this rank generates: the last rank of a 3-rank run has nothing to do."""
    if world > 2 and rank == world - 1:
        return {"lengths": [], "new_tokens": 0}
    lengths = [[5, 9, 3], [4, 11]][rank % 2]
    return {"lengths": lengths, "new_tokens": 6 + 5 * rank, "seed": 100 + rank}


def count_forwards(module) -> list[int]:
    calls = [0]
    module.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def generate_round(engine, reference, plan, rank, residency):
    """Greedy then sampled generation on this rank, ODC vs the unsharded reference; returns mismatches and counts."""
    from ds_odc.integrations.generation import lockstep_free
    out = {"mismatch": [], "forwards": 0, "new_tokens": []}
    if not plan["lengths"]:
        return out
    batch = {k: v.to(_workload.DEVICE) for k, v in prompt_batch(plan["lengths"], plan["seed"]).items()}
    greedy = dict(max_new_tokens=plan["new_tokens"], do_sample=False, pad_token_id=0)
    with torch.no_grad():
        probe = reference.generate(**batch, **greedy)
    # EOS = a token the first sequence produces early: it stops there, the others run on (uneven lengths in a batch).
    eos = int(probe[0, batch["input_ids"].shape[1] + 1])
    runs = {"greedy": (batch, dict(greedy, eos_token_id=eos)),
            "sampled": (batch, dict(greedy, do_sample=True, top_k=0, temperature=1.0, eos_token_id=eos)),
            # the first prompt alone: every sequence of the rank ends at its EOS, long before max_new_tokens
            "early_stop": ({k: v[:1] for k, v in batch.items()}, dict(greedy, eos_token_id=eos))}
    forwards = engine.odc_test_forwards
    for name, (batch, kwargs) in runs.items():
        torch.manual_seed(1234 + rank)
        with torch.no_grad():
            expected = reference.generate(**batch, **kwargs)
        torch.manual_seed(1234 + rank)
        before = forwards[0]
        zero_worker.CALLS["on"] = True
        with torch.no_grad(), lockstep_free(engine, residency=residency) as model:
            got = model.generate(**batch, **kwargs)
            logits = model(**batch).logits  # an evaluation forward inside the block too
        zero_worker.CALLS["on"] = False
        out["forwards"] += forwards[0] - before
        out["new_tokens"].append(int(got.shape[1] - batch["input_ids"].shape[1]))
        with torch.no_grad():
            expected_logits = reference(**batch).logits
        if not torch.equal(got, expected):
            out["mismatch"].append(f"{name}: {got.tolist()} != {expected.tolist()}")
        if not torch.allclose(logits, expected_logits, rtol=1e-5, atol=1e-6):
            out["mismatch"].append(f"{name} eval logits differ by {float((logits - expected_logits).abs().max())}")
    return out


def error_checks(engine, stock_engine) -> dict:
    import deepspeed
    import torch.distributed as dist
    from ds_odc.integrations.generation import lockstep_free

    def all_reduce():
        with lockstep_free(engine, residency="block"):
            dist.all_reduce(torch.ones(1))

    def synced():
        with lockstep_free(engine, residency="block") as model:
            batch = {k: v.to(_workload.DEVICE) for k, v in prompt_batch([3], 0).items()}
            model.generate(**batch, max_new_tokens=1, synced_gpus=True)

    def stock():
        with lockstep_free(stock_engine):
            pass

    def modifier_rank():  # last: the raise leaves the parameter gathered
        param = next(engine.module.parameters())
        with lockstep_free(engine, residency="block"):
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                pass

    return {"all_reduce": expect_error(all_reduce), "synced_gpus": expect_error(synced),
            "stock_engine": expect_error(stock), "modifier_rank": expect_error(modifier_rank)}


def main():
    zero_worker.count_collectives()
    zero_worker.init_ranks(timeout_s=60)
    import torch.distributed as dist
    from ds_odc.integrations.generation import residency_for

    rank, world = dist.get_rank(), dist.get_world_size()
    counts = [3, 1] if world == 2 else [2, 0, 1]  # training microbatches per rank (one sample each)
    model = tiny_qwen2()
    initial = copy.deepcopy(model).to(_workload.DEVICE).eval()
    after_one, _, one_rounding = reference_and_rounding(model, 1, sum(counts))
    after_two, _, two_rounding = reference_and_rounding(model, 2, sum(counts))
    after_one.eval()
    engine = zero_worker.build(model, ds_config(True, managed=False, optimizer="sgd"))
    stock_engine = zero_worker.build(tiny_qwen2(), ds_config(None, optimizer="sgd"))
    engine.odc_test_forwards = count_forwards(engine.module)
    plan = rank_plan(rank, world)

    report = {"rank": rank, "rounds": {}, "param_diff": [], "ref_rounding": [one_rounding, two_rounding],  # rank 0
              "reference_moved": rel_diff(flat(full_params(after_one).values()), flat(full_params(initial).values()))}
    zero_worker.CALLS["by_name"] = {}
    for phase, reference in (("initial", initial), ("after_step", after_one)):
        engine.module.eval()
        for residency in RESIDENCIES:
            report["rounds"][f"{phase}/{residency}"] = generate_round(engine, reference, plan, rank, residency)
        engine.module.train()
        zero_worker.train_uneven(engine, counts, 1, step_offset=0 if phase == "initial" else 1)
        target = after_one if phase == "initial" else after_two
        report["param_diff"].append(max_rel_diff(full_params(engine), full_params(target)))
    report["collectives_during_generation"] = dict(zero_worker.CALLS["by_name"])
    report["auto"] = {"tiny_budget": residency_for(engine, "auto", max_resident_bytes=1),
                      "large_budget": residency_for(engine, "auto", max_resident_bytes=1 << 40)}
    report["errors"] = error_checks(engine, stock_engine)
    reports = [None] * world
    dist.all_gather_object(reports, report)
    if rank == 0:
        emit({"world": world, "ranks": reports})


if __name__ == "__main__":
    main()
    shutdown_and_exit()
