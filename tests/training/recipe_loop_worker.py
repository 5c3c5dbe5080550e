"""Rank script of tests/training/test_recipe_stock_loop.py: the SFT recipe (``SftRun``) trained through its own loop
and through DeepSpeed's (``--loop stock``) on the same samples, and a one-process float64 run of the same minibatches.

Usage: recipe_loop_worker.py LENGTHS_FILE OUT_DIR; rank 0 prints one ODC_RESULT line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import ds_odc  # noqa: F401 - the odc key, before any engine is built
from _support.launch import emit, init_test_ranks
from _support.tolerance import plant_wrong_weight
from ds_odc.training.distributed import shutdown_and_exit

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "zero"))
from _workload import full_params, rel_diff  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEPS, SEED = 3, 3
# name -> (ds_config, planner, loop): the recipe's loop is the run every other must equal
CASES = {
    "recipe odc lb-mini": ("zero3_odc_fp32_cpu.json", "lb-mini", "recipe"),
    "stock loop odc lb-mini": ("zero3_odc_fp32_cpu.json", "lb-mini", "stock"),
    "stock loop stock-zero3 lb-micro": ("zero3_fp32_cpu.json", "lb-micro", "stock"),
    "stock loop lockstep local-sort": ("lockstep", "local-sort", "stock"),
    "planted: stock loop odc lb-mini, one weight 1.5x": ("zero3_odc_fp32_cpu.json", "lb-mini", "stock"),
}


def run_case(name: str, lengths: str, out: Path):
    """One run of the recipe, STEPS minibatches: (its step records, its full parameters, the run)."""
    from ds_odc.recipes.sft import sft_argument_parser
    from ds_odc.recipes.train import SftRun
    config, planner, loop = CASES[name]
    if config == "lockstep":  # ODC with a meeting at every block: the same count on every rank
        ds_config = json.loads((ROOT / "ds_configs" / "zero3_odc_fp32_cpu.json").read_text())
        ds_config["zero_optimization"]["odc"]["lockstep"] = True
        path = out / "lockstep.json"
        path.write_text(json.dumps(ds_config))
    else:
        path = ROOT / "ds_configs" / config
    argv = ["--deepspeed", str(path), "--balancer", planner, "--loop", loop, "--model", "tiny", "--lengths-file",
            lengths, "--minibatch-size", "2", "--steps", str(STEPS), "--seed", str(SEED), "--cost", "tokens",
            "--quiet"]
    run = SftRun(sft_argument_parser().parse_args(argv))
    if name.startswith("planted"):  # tests/_support/tolerance.py's planted error: rank 0's second microbatch 1.5x
        plant_wrong_weight(run.engine, 1.5, call=1)
    records = [run.step() for _ in range(STEPS)]
    params = full_params(run.engine)
    return records, params, run


def float64_reference(run, initial: dict) -> tuple[dict, list[float]]:
    """One process, float64: the same initial weights, minibatches, loss (the global mean over each minibatch's label
    tokens, each sample alone), gradient clipping and AdamW as the ds_config. Returns the parameters and the losses."""
    from transformers import AutoModelForCausalLM

    from ds_odc.recipes.workloads import model_config
    model = AutoModelForCausalLM.from_config(model_config(run.args.model), attn_implementation="eager")
    model.load_state_dict(initial)
    model = model.double().train()
    ds_config = json.loads(Path(run.args.deepspeed).read_text())
    hyper = {k: v for k, v in ds_config["optimizer"]["params"].items() if k != "torch_adam"}
    opt = torch.optim.AdamW(model.parameters(), **hyper)
    order, per_step = run.sampler.epoch_order(0).tolist(), run.sampler.global_minibatch_size
    losses = []
    for step in range(STEPS):
        samples = [run.samples[j]["input_ids"] for j in order[step * per_step:(step + 1) * per_step]]
        total = sum(len(x) - 1 for x in samples)
        opt.zero_grad()
        loss = 0.0
        for x in samples:
            logits = model(input_ids=x[None]).logits[0, :-1]
            part = torch.nn.functional.cross_entropy(logits, x[1:], reduction="sum") / total
            part.backward()
            loss += part.item()
        losses.append(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), ds_config["gradient_clipping"])
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def whole(params: dict) -> torch.Tensor:
    """Every parameter in one vector (in name order), in float64: distances of whole parameter sets. Per tensor, the
    key projections' biases would decide them, whose gradient is rounding noise (attention scores shift alike over
    every key) that AdamW scales up to full-size steps."""
    return torch.cat([params[name].detach().double().reshape(-1) for name in sorted(params)])


def main():
    lengths, out = sys.argv[1], Path(sys.argv[2])
    init_test_ranks(timeout_s=60.0)
    torch.use_deterministic_algorithms(True)
    import torch.distributed as dist
    results, params, recipe_run = {}, {}, None
    for name in CASES:
        records, params[name], run = run_case(name, lengths, out)
        results[name] = {"losses": [r.loss for r in records],
                         "counts": [[p.microbatches for p in r.per_rank] for r in records],
                         "minibatches": [sorted(run.sampler.epoch_order(0)[s * g:(s + 1) * g].tolist())
                                         for s in range(STEPS) for g in [run.sampler.global_minibatch_size]],
                         "loop": run.args.loop, "optimizer": type(run.engine.optimizer).__name__}
        if name == "recipe odc lb-mini":
            recipe_run = run
        else:
            run.finish()
    if dist.get_rank() == 0:
        from ds_odc.recipes.train import build_model
        initial = build_model(recipe_run.args, {}, torch.device("cpu")).state_dict()  # the recipe's seed
        exact, exact_losses = float64_reference(recipe_run, initial)
        reference = whole(params["recipe odc lb-mini"])
        for name, result in results.items():
            result["params_vs_recipe"] = rel_diff(whole(params[name]), reference)
            result["moved"] = rel_diff(whole(initial), whole(params[name]))
        emit({"cases": results, "recipe_vs_float64": rel_diff(reference, whole(exact)), "float64_losses": exact_losses})
    recipe_run.finish()
    shutdown_and_exit()


if __name__ == "__main__":
    main()
