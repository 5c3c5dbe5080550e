"""Plain PyTorch on the same samples as examples/sft.py: FSDP2 (what users would otherwise switch to) or, on one
GPU, unsharded training (the bound no sharded engine can beat).

``--engine fsdp2`` (default): ``fully_shard`` per decoder layer and the root, bf16 parameters with fp32 gradient
reduction, a reduce-scatter per microbatch, fused AdamW. ``--engine plain``: one rank, the model's parameters in
bf16 on the GPU (fp32 on CPU), fused AdamW, no sharding and no communication. Both use the same sampler (collective
planners only for FSDP2), attention, loss and metrics as sft.py, so their ``--metrics-json`` files compare directly.

    torchrun --standalone --nproc_per_node 2 benchmarks/fsdp2_sft.py --model qwen2.5-1.5b \\
        --lengths-file lengths.txt --no-shuffle --balancer local-sort --steps 5 --warmup-steps 1
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ds_odc.training.collate import PackedCollator
from ds_odc.training.distributed import shutdown_and_exit
from ds_odc.balancer.planners import get_planner
from ds_odc.balancer.sampler import BalancedBatchSampler
from ds_odc.training.loss import global_mean_weight
from ds_odc.training.metrics import StepClock, gather_step, summarize
from ds_odc.training.profiling import decoder_layers, describe, profile_step
from ds_odc.recipes.sft import (cost_from_args, on_device, plan_attention, prepare_model, samples_from_args,
                            sft_argument_parser)
from ds_odc.recipes.workloads import SampleSet, model_config


def main():
    parser = sft_argument_parser(__doc__, deepspeed_config=False)
    parser.add_argument("--engine", default="fsdp2", choices=["fsdp2", "plain"])
    args = parser.parse_args()
    if get_planner(args.balancer).runtime != "collective" and args.engine == "fsdp2":
        raise SystemExit("FSDP2 runs collectives every microbatch: use --balancer local-sort or lb-micro")
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.engine == "plain" and world != 1:
        raise SystemExit("--engine plain trains unsharded on one rank (no gradient communication): run it with "
                         "--nproc_per_node 1")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    config = model_config(args.model, num_layers=args.num_layers)
    torch.manual_seed(args.seed)
    # FSDP2: fp32 master weights (as ZeRO keeps), bf16 compute; plain: bf16 weights. Built on the device (fast init).
    dtype = torch.bfloat16 if cuda and args.engine == "plain" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=args.attn_implementation)
    prepare_model(model, args)  # LoRA adapters (--lora) go into model's own layers: no need for the PeftModel
    if args.engine == "fsdp2":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cuda else torch.float32,
                                      reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), fused=cuda)
    lengths, token_ids = samples_from_args(args)
    dataset = SampleSet(lengths, token_ids, config.vocab_size, args.seed)  # the samples examples/sft.py trains
    if cuda:
        plan_attention(model, args, lengths, device, torch.bfloat16)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # as sft.py: the peak of training, not of building

    cost = cost_from_args(args, config)
    sampler = BalancedBatchSampler(lengths.tolist(), world_size=world, rank=rank, minibatch_size=args.minibatch_size,
                                   max_tokens=args.max_tokens, planner=args.balancer, seed=args.seed,
                                   shuffle=not args.no_shuffle, cost=cost, model_config=config)
    collate = PackedCollator()
    clock, records, profile = StepClock(), [], None
    for step, batch in zip(range(min(args.steps, len(sampler))), sampler):
        weight = global_mean_weight(batch.num_label_tokens, world)
        profiling = (profile_step(args.profile_dir, rank, decoder_layers(model),
                                   python_stacks=args.profile_python)
                     if step == args.profile_step else contextlib.nullcontext())
        clock.start()
        # summed on the device: reading a microbatch's loss on the host would wait for its backward, every microbatch
        loss_share = torch.zeros((), dtype=torch.float64, device=device)
        with profiling as profiled:
            for mb in batch.microbatches:
                samples = [dataset[j] for j in mb]
                row = on_device(collate(samples), device)
                loss = model(**row, num_items_in_batch=1 / weight).loss
                loss.backward()  # FSDP2 averages gradients over ranks, as ZeRO does: the W in `weight` cancels it
                loss_share += loss.detach().double() / world
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if profiled is not None:
            profile = profiled
        busy, step_time = clock.finish(0.0)
        tokens, sq_tokens = sampler.load(batch.microbatches)
        record = gather_step(loss_share, busy, step_time, len(batch.microbatches), tokens, batch.num_samples,
                             sq_tokens=sq_tokens)
        if step != args.profile_step:
            update = sampler.observe(record)  # lb-micro plans with the automatic cost, as in sft.py
            record.cost = update.as_dict() if update else None
        records.append(record)
    if rank == 0:
        summary = summarize(records, args.warmup_steps, world, untimed=[args.profile_step])
        total = summary["time_s"]
        if args.metrics_json:
            Path(args.metrics_json).write_text(json.dumps({"config": {**vars(args), "world_size": world},
                                                           "steps": [r.as_dict() for r in records],
                                                           "summary": summary, "profile_rank0": profile}, indent=1))
        if profile:
            print(f"profile of step {args.profile_step} (rank 0): {describe(profile)}; files in "
                  f"{args.profile_dir}/", flush=True)
        print(f"summary: loss {summary['final_loss']:.5f}  samples/s {summary['samples_per_s']:.3f}  "
              f"time {total:.2f}s", flush=True)
    # every rank leaves together and exits at once: gloo's threads sometimes abort a finished run at exit
    shutdown_and_exit()


if __name__ == "__main__":
    main()
