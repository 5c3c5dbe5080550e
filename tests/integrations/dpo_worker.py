"""OdcDPOTrainer vs stock DPOTrainer + stock ZeRO-3, launched by test_trl_dpo.py through ``_support.launch.launch``.

Every run trains the same tiny Llama (and a reference model, a copy of it) on the same preference pairs, whose lengths
vary from a few tokens to a hundred, in the same global minibatches: ODC re-plans each minibatch's pairs across ranks
with LB-Mini (uneven microbatch counts), in padded microbatches or padding-free rows. The yardstick is stock TRL run
in float64 under DDP (the same minibatches, the same microbatches): every fp32 run is compared with it, and ODC must
be as close to it as stock ZeRO-3 is, within a small factor (test_trl_dpo.py). fp32, SGD, nothing downloaded.

Usage: dpo_worker.py equivalence [--cases a,b] [--runs a,b] [--planted] [--refusals] | gpu; rank 0 prints one
ODC_RESULT line. With ODC_TEST_CUDA=1 (tests/gpu/test_dpo_gpu.py) the ranks train on CUDA: one GPU each, or all on
GPU 0 over gloo (DS_ODC_SHARED_GPU=1).
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import sys
from dataclasses import replace

import ds_odc  # noqa: F401  (the `odc` key must parse before DPOConfig / zero.Init)
from _support.launch import emit
from ds_odc.training.distributed import shutdown_and_exit

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "zero"))
from _hf_workload import ON_CPU, ds_config, shared_tmpdir, tiny_llama  # noqa: E402
from _rl_workload import char_tokenizer  # noqa: E402
from _workload import flat, full_params, max_rel_diff, rel_diff  # noqa: E402
from worker import init_ranks  # noqa: E402

from ds_odc.balancer.sampler import BalancedBatchSampler  # noqa: E402

# Runs of a case: stock TRL in float64 under DDP (the yardstick), stock DPOTrainer + ZeRO-3 (padded, and with
# padding_free=True, which TRL 1.16 trains padded), OdcDPOTrainer padded and padding-free, and OdcDPOTrainer with
# ODC off (stock ZeRO-3: it must be stock DPOTrainer exactly).
RUNS = ("fp64", "stock", "stock_padding_free", "odc_padded", "odc_packed", "odc_off")
CASES = {
    # TRL's default loss.
    "sigmoid": dict(loss_type=["sigmoid"], learning_rate=0.05, budget=300),
    # Every per-pair loss type at once (TRL sums them, weighted), sequences truncated at 64 tokens, activations
    # recomputed in the backward (packed rows attend per sequence there too).
    "losses": dict(loss_type=["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
                              "apo_zero", "apo_down", "discopop", "sigmoid_norm"],
                   loss_weights=[1.0, 0.5, 0.01, 1.0, 1.0, 1.0, 1.0, 0.001, 1.0, 1.0, 0.5, 1.0],
                   label_smoothing=0.1, max_length=64, activation_checkpointing=True, learning_rate=0.05, budget=128),
    # The reference log-probs computed by TRL before training, by a reference model other than the initial policy (so
    # that no margin starts at rounding level), 3 pairs per microbatch, length-weighted (ld_alpha) and WPO-weighted
    # pairs, an f-divergence. One pair per precompute batch: every fp32 run gets the same reference log-probs.
    "precomputed": dict(loss_type=["sigmoid"], precompute_ref_log_probs=True, per_device_train_batch_size=3,
                        precompute_ref_batch_size=1, ld_alpha=0.5, use_weighting=True,
                        f_divergence_type="js_divergence", learning_rate=0.2, budget=300, reference="other"),
    # ... by the initial policy itself (no reference model kept: TRL wraps the policy in an inference engine for it).
    "precomputed_self": dict(loss_type=["sigmoid"], precompute_ref_log_probs=True, precompute_ref_batch_size=1,
                             learning_rate=0.2, budget=300, reference="none"),
}
WORDS = ["alpha", "beta", "gamma", "delta", "odc", "zero", "rank", "step"]


def preference_dataset(n: int, seed: int = 0):
    """Prompt / chosen / rejected texts; completions from one word to twenty (long-tailed), independently drawn."""
    from datasets import Dataset
    rng = random.Random(seed)

    def completion():
        return " " + " ".join(rng.choices(WORDS, k=rng.choice([1, 1, 2, 3, 5, 20])))
    rows = [{"prompt": "Q: " + " ".join(rng.choices(WORDS, k=rng.randint(1, 4))) + "\nA:",
             "chosen": completion(), "rejected": completion()} for _ in range(n)]
    return Dataset.from_list(rows)


def on_disk(data, folder: str):
    """``data`` saved by rank 0 and loaded on every rank: TRL caches precomputed reference log-probs next to the
    dataset's files, where every rank finds them (an in-memory dataset caches in each process's own temporary
    folder)."""
    import torch.distributed as dist
    from datasets import load_from_disk
    if dist.get_rank() == 0:
        data.save_to_disk(folder)
    dist.barrier()
    return load_from_disk(folder)


def dpo_config(output_dir: str, deepspeed: dict | None, **overrides):
    from trl import DPOConfig

    from ds_odc.integrations import activation_checkpointing
    kwargs = dict(output_dir=output_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
                  optim="sgd", lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
                  logging_steps=1, save_strategy="no", report_to=[], use_cpu=ON_CPU, seed=0,
                  disable_tqdm=True, bf16=False, beta=0.1, deepspeed=deepspeed,
                  dataloader_num_workers=0, dataloader_pin_memory=False, max_length=None)
    kwargs.update(activation_checkpointing(overrides.pop("activation_checkpointing", False)))
    kwargs.update(overrides)
    return DPOConfig(**kwargs)


def train(run: str, tmp: str, data, base, case: dict, drop_pair: bool = False) -> dict:
    """One run of a case; returns its parameters, logs and microbatch counts (ODC)."""
    import torch
    from trl import DPOTrainer

    from ds_odc.integrations import match_accelerate_backend
    from ds_odc.integrations.trl_dpo import OdcDPOTrainer
    from ds_odc.balancer.cost import QuadraticCost
    case = dict(case)
    case_budget, reference = case.pop("budget"), case.pop("reference", "policy")
    odc = run in ("odc_padded", "odc_packed")
    deepspeed = None if run == "fp64" else ds_config(odc)
    if case.get("bf16"):  # DeepSpeed's bf16 engine (fp32 master weights), not only autocast
        deepspeed["bf16"] = {"enabled": True}
    if deepspeed is None:  # an earlier DeepSpeed run left Accelerate's switch on, and transformers' ZeRO-3 flag
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
        os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
        unset_hf_deepspeed_config()
    if not odc:  # stock trains the minibatches in the plan's order (the data comes in that order)
        case["train_sampling_strategy"] = "sequential"
    config = dpo_config(f"{tmp}/{run}", deepspeed, padding_free=run in ("odc_packed", "stock_padding_free"), **case)
    model = copy.deepcopy(base)
    other = tiny_llama(seed=1, vocab=base.config.vocab_size)
    if run == "fp64":
        model = model.double()
    ref_model = {"policy": lambda: copy.deepcopy(model), "none": lambda: None,
                 "other": lambda: other.double() if run == "fp64" else other}[reference]()
    kwargs = dict(ref_model=ref_model, args=config, train_dataset=data, processing_class=char_tokenizer())
    if run.startswith("odc"):
        cls = PlantedDrop if drop_pair else OdcDPOTrainer
        # A cost dominated by squared lengths (attention) gives ranks different microbatch counts more often than
        # tokens do: a rank with a long pair gets fewer pairs.
        trainer = cls(model, max_tokens_per_microbatch=case_budget, balancer_cost=QuadraticCost(a=1.0, b=0.1, c=0.0),
                      **kwargs)
    else:
        trainer = DPOTrainer(model, **kwargs)
        match_accelerate_backend(trainer.args)
    trainer.train()
    history = [e for e in trainer.state.log_history if "loss" in e]
    counts = [[e[f"odc/microbatches_rank{r}"] for r in range(trainer.args.world_size)] for e in history
              if "odc/bubble" in e]
    return {"params": full_params(trainer.model_wrapped, dtype=torch.float64),
            "logs": [{k: v for k, v in e.items() if not k.startswith("odc/")} for e in history],
            "microbatches": counts, "optimizer": type(getattr(trainer.model_wrapped, "optimizer", None)).__name__,
            "attention": trainer.model.config._attn_implementation}


def _planted_drop():
    from ds_odc.integrations._pairs import PAIRS_KEY
    from ds_odc.integrations.trl_dpo import OdcDPOTrainer

    class Dropping:
        """The microbatch collator, losing the last pair of the second microbatch of two pairs or more on rank 0."""

        def __init__(self, collate):
            self.collate, self.seen = collate, 0

        def __call__(self, samples):
            import torch.distributed as dist
            if len(samples) > 1 and dist.get_rank() == 0:
                self.seen += 1
                if self.seen == 2:
                    samples = samples[:-1]
            return self.collate(samples)

    class Planted(OdcDPOTrainer):
        def odc_collator(self):
            return Dropping(super().odc_collator())

        def odc_prepare_step(self, model, microbatches):
            kept = [replace(mb, sample_ids=mb.sample_ids[:mb.inputs[PAIRS_KEY].pairs],
                            slots=mb.slots[:mb.inputs[PAIRS_KEY].pairs]) for mb in microbatches]
            return super().odc_prepare_step(model, kept)
    return Planted


PlantedDrop = None  # built on first use (needs TRL imported)


def scenario_equivalence(args):
    import torch.distributed as dist
    global PlantedDrop
    PlantedDrop = _planted_drop()
    tok = char_tokenizer()
    base = tiny_llama(vocab=len(tok))
    base.config.pad_token_id, base.config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    initial = full_params(base)
    out = {"world": dist.get_world_size(), "cases": {}}
    with shared_tmpdir("odc_dpo_") as tmp:
        for name in args.cases.split(","):
            case = CASES[name]
            data = preference_dataset(16 * dist.get_world_size() * case.get("per_device_train_batch_size", 2) // 2)
            if case.get("precompute_ref_log_probs"):
                data = on_disk(data, f"{tmp}/{name}-data")
            # The plan's epoch order (the sampler's permutation of the dataset): stock trains it sequentially.
            order = BalancedBatchSampler([1] * len(data), world_size=1, rank=0, minibatch_size=len(data),
                                         max_tokens=None, cost="tokens", seed=0).epoch_order(0).tolist()
            runs = {}
            for run in args.runs.split(","):
                runs[run] = train(run, tmp, data if run in ("odc_padded", "odc_packed") else data.select(order), base,
                                  case)
            if name == "sigmoid" and args.planted:
                runs["odc_dropped"] = train("odc_packed", tmp, data, base, case, drop_pair=True)
            reference = runs["fp64"]
            out["cases"][name] = {
                "params": {r: max_rel_diff(v["params"], reference["params"]) for r, v in runs.items()},
                "params_vs_stock": {r: max_rel_diff(v["params"], runs["stock"]["params"]) for r, v in runs.items()},
                "moved": rel_diff(flat(reference["params"].values()), flat(initial.values())),
                "logs": {r: v["logs"] for r, v in runs.items()},
                "microbatches": {r: v["microbatches"] for r, v in runs.items() if v["microbatches"]},
                "optimizers": {r: v["optimizer"] for r, v in runs.items()},
                "attention": {r: v["attention"] for r, v in runs.items()},
            }
        if args.refusals:
            out["refusals"] = refusals(tmp, base)
    if dist.get_rank() == 0:
        emit(out)


def scenario_gpu(args):
    """bf16 on CUDA (tests/gpu/test_dpo_gpu.py), 2 steps of the default loss with a reference model: stock DPOTrainer
    + ZeRO-3 in fp32 (the reference) and in bf16, OdcDPOTrainer padded and padding-free in bf16 (``ds_odc_varlen`` on
    the GPU's kernels: heads 32 wide)."""
    import torch.distributed as dist

    from _rl_workload import tiny_qwen2
    tok = char_tokenizer()
    base = tiny_qwen2(vocab=len(tok), hidden_size=128)
    base.config.pad_token_id, base.config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    initial = full_params(base)
    case = dict(loss_type=["sigmoid"], max_steps=2, learning_rate=args.gpu_lr, budget=300)
    with shared_tmpdir("odc_dpo_gpu_") as tmp:
        data = preference_dataset(8 * dist.get_world_size())
        order = BalancedBatchSampler([1] * len(data), world_size=1, rank=0, minibatch_size=len(data),
                                     max_tokens=None, cost="tokens", seed=0).epoch_order(0).tolist()
        runs = {"fp32": train("stock", tmp, data.select(order), base, case),
                "stock": train("stock", tmp, data.select(order), base, {**case, "bf16": True}),
                "padded": train("odc_padded", tmp, data, base, {**case, "bf16": True}),
                "packed": train("odc_packed", tmp, data, base, {**case, "bf16": True})}
    reference, stock = runs["fp32"]["params"], runs["stock"]["params"]
    out = {"world": dist.get_world_size(), "optimizers": {v: r["optimizer"] for v, r in runs.items()},
           "moved": rel_diff(flat(initial.values()), flat(reference.values())),
           "stock_vs_fp32": max_rel_diff(stock, reference),
           "loss": {v: [e["loss"] for e in r["logs"]] for v, r in runs.items()},
           "microbatches": {v: runs[v]["microbatches"] for v in ("padded", "packed")},
           "attention": runs["packed"]["attention"]}
    for variant in ("padded", "packed"):
        out[f"{variant}_vs_stock"] = max_rel_diff(runs[variant]["params"], stock)
        out[f"{variant}_vs_fp32"] = max_rel_diff(runs[variant]["params"], reference)
    if dist.get_rank() == 0:
        emit(out)


REFUSED = {
    "loss_type": dict(loss_type=["sigmoid", "sft"]),
    "aot": dict(loss_type=["aot"]),
    "sync_ref_model": dict(sync_ref_model=True),
    "balancer_planner": dict(odc_kwargs=dict(balancer_planner="lb-mini-sp")),
    "oversize": dict(odc_kwargs=dict(oversize="truncate")),
}


def refusals(tmp: str, base) -> dict:
    """Options ODC cannot make equal to stock: each fails at construction, naming the option."""
    from ds_odc.integrations.trl_dpo import OdcDPOTrainer
    out = {}
    for name, overrides in REFUSED.items():
        overrides = dict(overrides)
        odc_kwargs = overrides.pop("odc_kwargs", {})
        try:
            OdcDPOTrainer(copy.deepcopy(base), ref_model=copy.deepcopy(base),
                          args=dpo_config(f"{tmp}/refused", ds_config(True), **overrides),
                          train_dataset=preference_dataset(8), processing_class=char_tokenizer(), **odc_kwargs)
            out[name] = "accepted"
        except ValueError as err:
            out[name] = str(err)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--planted", action="store_true", help="also an ODC run that loses one pair (must fail)")
    parser.add_argument("--refusals", action="store_true")
    parser.add_argument("--gpu-lr", type=float, default=0.1, help="gpu: the learning rate (SGD)")
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args()
    init_ranks(timeout_s=120)
    globals()[f"scenario_{args.scenario}"](args)


if __name__ == "__main__":
    main()
    shutdown_and_exit()
