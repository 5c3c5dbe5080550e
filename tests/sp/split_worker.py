"""Split samples under ZeRO-3 + ODC on CPU ranks. Launched by test_split_training.py through ``_support.launch``.

Usage: split_worker.py SCENARIO [options]; rank 0 prints one ODC_RESULT line.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

import ds_odc  # noqa: F401  (installs the odc config key before any engine is built)
import ds_odc.training.sequence_parallel  # noqa: F401  (registers attn_implementation="ds_odc_sp")
from _support.launch import emit, init_test_ranks
from ds_odc.training.collate import PackedCollator
from ds_odc.balancer.planners import plan_minibatch
from ds_odc.balancer.sp import SplitPolicy
from ds_odc.training.distributed import shutdown_and_exit
from ds_odc.training.loss import global_mean_weight, token_loss_sum, use_chunked_loss
from ds_odc.training.sequence_parallel import SequenceParallel, slice_loss_sum

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "zero"))
from _workload import client_optimizer, ds_config, full_params, max_rel_diff  # noqa: E402

VOCAB = 256
DEVICE = torch.device("cpu")  # cuda:N when ODC_TEST_CUDA=1 (tests/gpu/test_split_gpu.py)
MAX_TOKENS = 24  # a microbatch's budget: a 40-token sample must split over 2 ranks, an 80-token one over 4


def tiny_model(kind: str, attn: str, seed: int = 0):
    """Tiny Llama with one KV head (Ulysses replicates it at g=2) or tiny Qwen2 with two (replicated at g=4)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=False, use_cache=False,
                 attn_implementation=attn)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(num_key_value_heads=1, **shape)).to(DEVICE)
    return Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, **shape)).to(DEVICE)


def minibatch(step: int, world: int) -> list[torch.Tensor]:
    """The global minibatch of ``step`` (same on every rank): one 40-token sample (split over 2 ranks), at 4 ranks
    in the last step also an 80-token one (split over all 4), and 3 short samples per rank."""
    g = torch.Generator().manual_seed(500 + step)
    giants = [80, 40] if world == 4 and step == 2 else [40]
    lengths = giants + torch.randint(10, 25, (3 * world,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=g).to(DEVICE) for n in lengths]


def policy(model) -> SplitPolicy:
    """Head limits from the model; no exchange cost, so the plan is a function of the token counts alone."""
    return SplitPolicy.from_hf_config(model.config, ranks_per_node=4, flops_per_byte=0.0)


def reference(model, steps: int, world: int):
    """One process, plain eager attention, each sample alone: SGD on the global token mean of every minibatch."""
    model = copy.deepcopy(model)
    opt = client_optimizer([p for p in model.parameters() if p.requires_grad])
    losses = []
    for step in range(steps):
        samples = minibatch(step, world)
        n = sum(s.numel() - 1 for s in samples)
        opt.zero_grad()
        total = 0.0
        for s in samples:
            loss = token_loss_sum(model(input_ids=s[None]).logits, s[None]) / n
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return model, losses


def train(engine, sp: SequenceParallel, steps: int, world: int, rank: int, before_split=None, chunked=False):
    """``chunked``: the model computes its loss (use_chunked_loss) from ``shift_labels`` / ``labels`` and
    ``num_items_in_batch``, as docs/SEQUENCE_PARALLEL.md shows; else the loss comes from the logits here."""
    collate = PackedCollator(return_flash_attn_kwargs=False)
    losses, counts, splits = [], [], []
    for step in range(steps):
        samples = minibatch(step, world)
        lengths = [s.numel() for s in samples]
        plan = plan_minibatch(lengths, world, planner="lb-mini-sp", max_tokens=MAX_TOKENS, cost="tokens",
                              split=sp.policy)
        weight = global_mean_weight(plan.num_label_tokens, world)
        groups = plan.groups
        local = 0.0
        for mb in plan.microbatches[rank]:
            if mb[0] in groups:
                if before_split is not None:
                    before_split(step)
                piece = sp.slice(samples[mb[0]], groups[mb[0]], device=DEVICE)
                with sp.run(piece):
                    if chunked:
                        loss = engine(input_ids=piece.input_ids, position_ids=piece.position_ids,
                                      shift_labels=piece.shift_labels, num_items_in_batch=1 / weight).loss
                    else:
                        logits = engine(input_ids=piece.input_ids, position_ids=piece.position_ids).logits
                        loss = slice_loss_sum(logits, piece) * weight
                    engine.backward(loss, scale_wrt_gas=False)
            else:
                row = {k: v.to(DEVICE) for k, v in collate([{"input_ids": samples[i].cpu()} for i in mb]).items()}
                if chunked:
                    loss = engine(input_ids=row["input_ids"], position_ids=row["position_ids"], labels=row["labels"],
                                  num_items_in_batch=1 / weight).loss
                else:
                    logits = engine(input_ids=row["input_ids"], position_ids=row["position_ids"]).logits
                    loss = token_loss_sum(logits, row["labels"]) * weight
                engine.backward(loss, scale_wrt_gas=False)
            local += loss.item() / world
        engine.step()
        losses.append(local)
        counts.append(len(plan.microbatches[rank]))
        splits.append([[s.index, list(s.ranks)] for s in plan.splits])
    return losses, counts, splits


def build(model, timeout_s: float):
    import deepspeed
    params = [p for p in model.parameters() if p.requires_grad]
    config = ds_config({"enabled": True, "timeout_s": timeout_s}, managed=False, optimizer="sgd")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, optimizer=client_optimizer(params),
                                      config=config)
    return engine


def scenario_train(args):
    """Split samples and short ones, different microbatch counts per rank: loss and parameters after 3 SGD steps
    against one process training the same minibatches (eager attention, every sample whole)."""
    import torch.distributed as dist
    import deepspeed.comm as ds_comm
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_model(args.model, "ds_odc_sp")
    ref_model, ref_losses = reference(tiny_model(args.model, "eager"), args.steps, world)
    if args.checkpointing:  # attention is recomputed in the backward, which must still run over the group
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.chunked_loss:
        use_chunked_loss(model, chunk_tokens=7)  # several chunks per slice
    sp = SequenceParallel(policy(model), timeout_s=60)
    refused = refusal_of_a_model_without_ds_odc_sp(sp, world) if world == 2 else None
    engine = build(model, timeout_s=60)
    losses, counts, splits = train(engine, sp, args.steps, world, rank, chunked=args.chunked_loss)
    totals = torch.tensor(losses, dtype=torch.float64, device=DEVICE)
    ds_comm.all_reduce(totals)  # each rank's share of the loss: the sum is the minibatch's mean loss
    all_counts = [None] * world
    dist.all_gather_object(all_counts, counts)
    params = full_params(engine)
    if rank == 0:
        emit({"max_rel_diff": max_rel_diff(params, full_params(ref_model)), "losses": totals.tolist(),
              "ref_losses": ref_losses, "counts": all_counts, "splits": splits,
              "moved": _moved(params, full_params(tiny_model(args.model, "eager"))), "refused": refused})


def refusal_of_a_model_without_ds_odc_sp(sp: SequenceParallel, world: int) -> str | None:
    """A split sample through a model whose attention is not ds_odc_sp would attend within each slice only."""
    eager = tiny_model("llama", "eager")
    piece = sp.slice(minibatch(0, world)[0], (0, 1), device=DEVICE)
    try:
        with sp.run(piece):
            eager(input_ids=piece.input_ids, position_ids=piece.position_ids)
    except ValueError as err:
        return str(err)
    return None


def _moved(after: dict, before: dict) -> float:
    """How far training moved the parameters, relative to their norm (a test that moves nothing cannot fail)."""
    num = sum(float((after[n] - before[n]).double().norm() ** 2) for n in after)
    den = sum(float(before[n].double().norm() ** 2) for n in after)
    return (num / den) ** 0.5


def scenario_member_fails(args):
    """Rank 1 never reaches the split sample of step 1 (it sleeps, or dies): rank 0, its partner, must raise
    SplitSampleError naming it within the timeout."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_model("llama", "ds_odc_sp")
    sp = SequenceParallel(policy(model), timeout_s=args.timeout)
    engine = build(model, timeout_s=args.timeout)

    def before_split(step):
        if rank == 1 and step == 1:
            if args.kill:
                os.kill(os.getpid(), 9)
            time.sleep(args.timeout + 6)

    started = time.monotonic()
    try:
        train(engine, sp, 3, world, rank, before_split=before_split)
    except Exception as err:  # noqa: BLE001 - the point is to report it
        if rank == 0:
            emit({"error_type": type(err).__name__, "error": str(err), "after_s": time.monotonic() - started,
                  "missing": getattr(err, "missing_ranks", None), "group": getattr(err, "group", None)})
        os._exit(3)
    if rank == 0:
        emit({"error_type": None})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario")
    parser.add_argument("--model", choices=["llama", "qwen2"], default="llama")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=6.0)
    parser.add_argument("--kill", action="store_true")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing (non-reentrant)")
    parser.add_argument("--chunked-loss", action="store_true", help="the model's chunked loss (use_chunked_loss)")
    args = parser.parse_args()
    if os.environ.get("ODC_TEST_CUDA") == "1":  # the same scenarios on GPUs (tests/gpu/test_split_gpu.py)
        import datetime

        import deepspeed
        global DEVICE
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        DEVICE = torch.device("cuda", local_rank)
        deepspeed.init_distributed(dist_backend="nccl", timeout=datetime.timedelta(seconds=120))
    else:
        init_test_ranks(timeout_s=60 if args.scenario == "train" else args.timeout * 2)
    globals()[f"scenario_{args.scenario}"](args)
    shutdown_and_exit()


if __name__ == "__main__":
    main()
