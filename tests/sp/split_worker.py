"""Split samples under ZeRO-3 + ODC on CPU ranks. Launched by test_split_training.py through ``_support.launch``.

Usage: split_worker.py SCENARIO [options]; rank 0 prints one ODC_RESULT line.

Models (tiny, random, nothing downloaded), chosen so the heads force each shape of a split group:

* ``llama``: 4 query heads, 1 KV head: Ulysses alone for groups of 2 and 4 (the KV head replicated);
* ``qwen2``: 4 query heads, 2 KV heads: Ulysses alone for groups of 2 and 4;
* ``qwen2-ring``: 3 query heads, 1 KV head: Ulysses cannot share 3 heads, so every group is a ring (1 x g);
* ``llama-2x``: 2 query heads, 1 KV head: Ulysses over 2, so a group of 4 is 2 x 2 and one of 8 is 2 x 4.
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
from ds_odc.balancer.planners import plan_minibatch
from ds_odc.balancer.sp import SplitPolicy
from ds_odc.training.collate import PackedCollator
from ds_odc.training.distributed import shutdown_and_exit
from ds_odc.training.loss import global_mean_weight, token_loss_sum, use_chunked_loss
from ds_odc.training.sequence_parallel import SequenceParallel, slice_loss_sum

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "zero"))
from _workload import client_optimizer, ds_config, full_params, max_rel_diff  # noqa: E402

VOCAB = 256
DEVICE = torch.device("cpu")  # cuda when ODC_TEST_CUDA=1 (tests/gpu/test_split_gpu.py)
MAX_TOKENS = 24  # a microbatch's budget: a 40-token sample must split over 2 ranks, 80 over 4, 160 over 8
# Per world size, the long samples of each step (3 short ones per rank come with them).
GIANTS = {2: [[40], [40], [40]], 4: [[40], [40], [80, 40]], 8: [[160, 40], [80, 40, 40], [160, 80]]}
SHORT = {2: (10, 25), 4: (10, 25), 8: (2, 20)}  # lengths of the short samples: packed unevenly, counts differ
SHAPES = {"llama": (4, 1, 32), "qwen2": (4, 2, 32), "qwen2-ring": (3, 1, 24), "llama-2x": (2, 1, 32)}


def tiny_model(kind: str, attn: str, seed: int = 0):
    """The tiny model ``kind`` (see the module docstring) with attention ``attn``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    heads, kv_heads, hidden = SHAPES[kind]
    shape = dict(hidden_size=hidden, intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
                 num_key_value_heads=kv_heads, vocab_size=VOCAB, max_position_embeddings=256,
                 tie_word_embeddings=False, use_cache=False, attn_implementation=attn)
    if kind.startswith("llama"):
        return LlamaForCausalLM(LlamaConfig(**shape)).to(DEVICE)
    return Qwen2ForCausalLM(Qwen2Config(**shape)).to(DEVICE)


def minibatch(step: int, world: int) -> list[torch.Tensor]:
    """The global minibatch of ``step`` (same on every rank): the long samples of :data:`GIANTS`, then 3 short
    samples per rank."""
    g = torch.Generator().manual_seed(500 + step)
    lo, hi = SHORT[world]
    lengths = GIANTS[world][step % 3] + torch.randint(lo, hi, (3 * world,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=g).to(DEVICE) for n in lengths]


def policy(model) -> SplitPolicy:
    """Head limits from the model; no exchange cost, so the plan is a function of the token counts alone."""
    return SplitPolicy.from_hf_config(model.config, ranks_per_node=4, flops_per_byte=0.0)


def reference(model, steps: int, world: int, dtype: torch.dtype = torch.float32):
    """One process, plain eager attention, each sample alone: SGD on the global token mean of every minibatch, in
    ``dtype`` (float64: the exact answer, whose distance from the fp32 run is the reference distance of the bound,
    tests/_support/tolerance.py)."""
    model = copy.deepcopy(model).to(dtype)
    opt = client_optimizer([p for p in model.parameters() if p.requires_grad])
    losses = []
    for step in range(steps):
        samples = minibatch(step, world)
        n = sum(s.numel() - 1 for s in samples)
        opt.zero_grad()
        total = 0.0
        for s in samples:
            logits = model(input_ids=s[None]).logits
            # token_loss_sum computes in fp32 (it upcasts bf16), so in float64 the sum is taken here
            loss = (token_loss_sum(logits, s[None]) if dtype != torch.float64 else
                    torch.nn.functional.cross_entropy(logits[0, :-1], s[1:], reduction="sum")) / n
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
        split_of = {s.index: s for s in plan.splits}
        local = 0.0
        for mb in plan.microbatches[rank]:
            if mb[0] in split_of:
                if before_split is not None:
                    before_split(step)
                piece = sp.slice(samples[mb[0]], split_of[mb[0]], device=DEVICE)
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
        splits.append([[s.index, list(s.ranks), s.shape] for s in plan.splits])
    return losses, counts, splits


def build(model, timeout_s: float):
    import deepspeed
    params = [p for p in model.parameters() if p.requires_grad]
    config = ds_config({"enabled": True, "timeout_s": timeout_s}, managed=False, optimizer="sgd")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, optimizer=client_optimizer(params),
                                      config=config)
    return engine


def check_model(kind: str, args, world: int, rank: int) -> dict:
    """Train ``kind`` for ``args.steps`` steps with split samples; the numbers test_split_training.py asserts."""
    import torch.distributed as dist
    model = tiny_model(kind, "ds_odc_sp")
    ref_model, ref_losses = reference(tiny_model(kind, "eager"), args.steps, world)
    if rank == 0:  # the float64 run, for the reference distance rank 0 reports
        exact_model, exact_losses = reference(tiny_model(kind, "eager"), args.steps, world, torch.float64)
    if args.checkpointing:  # attention is recomputed in the backward, which must still run over the group
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.chunked_loss:
        use_chunked_loss(model, chunk_tokens=7)  # several chunks per slice
    sp = SequenceParallel(policy(model), timeout_s=60)
    refused = refusal_of_a_model_without_ds_odc_sp(sp, world) if world == 2 else None
    engine = build(model, timeout_s=60)
    losses, counts, splits = train(engine, sp, args.steps, world, rank, chunked=args.chunked_loss)
    totals = torch.tensor(losses, dtype=torch.float64, device=DEVICE)
    dist.all_reduce(totals)  # each rank's share of the loss: the sum is the minibatch's mean loss
    all_counts = [None] * world
    dist.all_gather_object(all_counts, counts)
    params = full_params(engine)
    engine.destroy()
    out = {"max_rel_diff": max_rel_diff(params, full_params(ref_model)), "losses": totals.tolist(),
           "ref_losses": ref_losses, "counts": all_counts, "splits": splits,
           "moved": _moved(params, full_params(tiny_model(kind, "eager"))), "refused": refused}
    if rank == 0:  # the fp32 reference's own distance from float64: parameters, and the losses (max, relative)
        out["ref_rounding"] = max_rel_diff(full_params(ref_model, torch.float64), full_params(exact_model,
                                                                                             torch.float64))
        out["ref_loss_rounding"] = max(abs(a - b) / abs(b) for a, b in zip(ref_losses, exact_losses))
    return out


def scenario_train(args):
    """Split samples and short ones, different microbatch counts per rank: loss and parameters after 3 SGD steps
    against one process training the same minibatches (eager attention, every sample whole), for every model of
    ``--model`` (comma-separated) in one launch."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {kind: check_model(kind, args, world, rank) for kind in args.model.split(",")}
    if rank == 0:
        emit(results)


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
    model = tiny_model(args.model, "ds_odc_sp")
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
    parser.add_argument("--model", default="llama", help="one of the module docstring's models (train: a list)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=6.0)
    parser.add_argument("--kill", action="store_true")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing (non-reentrant)")
    parser.add_argument("--chunked-loss", action="store_true", help="the model's chunked loss (use_chunked_loss)")
    args = parser.parse_args()
    cuda = os.environ.get("ODC_TEST_CUDA") == "1"  # the same scenarios on GPUs (tests/gpu/test_split_gpu.py)
    init_test_ranks(timeout_s=120 if cuda else 60 if args.scenario == "train" else args.timeout * 2)
    if cuda:
        from ds_odc.training.distributed import training_device
        global DEVICE
        DEVICE = training_device()
    globals()[f"scenario_{args.scenario}"](args)
    shutdown_and_exit()


if __name__ == "__main__":
    main()
