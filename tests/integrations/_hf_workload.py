"""A tiny HF causal LM, a synthetic variable-length dataset and Trainer settings for the OdcTrainer tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import torch

# Trainer arguments' use_cpu: the ranks run on the CPU unless tests/gpu launched them (ODC_TEST_CUDA=1).
ON_CPU = os.environ.get("ODC_TEST_CUDA") != "1"

VOCAB = 256


def tiny_llama(seed: int = 0, vocab: int = VOCAB):
    """Random-init 2-layer Llama (about 40k params), built outside any zero.Init so copies start identical."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def token_dataset(num_samples: int, min_len: int = 4, max_len: int = 40, seed: int = 0):
    """``datasets.Dataset`` with one ``input_ids`` column of random tokens and random lengths."""
    from datasets import Dataset
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num_samples,), generator=g).tolist()
    return Dataset.from_dict({"input_ids": [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]})


def ds_config(odc: bool) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 3000,
            "stage3_prefetch_bucket_size": 3000, "overlap_comm": False, "contiguous_gradients": True,
            "stage3_gather_16bit_weights_on_model_save": True}
    if odc:
        zero["odc"] = True
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": zero,
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "wall_clock_breakdown": False}


def training_args(output_dir: str, odc: bool, **overrides):
    from transformers import TrainingArguments
    kwargs = dict(output_dir=output_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
                  learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                  max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[],
                  use_cpu=ON_CPU,
                  optim="adamw_torch", deepspeed=ds_config(odc), seed=0, disable_tqdm=True,
                  dataloader_num_workers=0, dataloader_pin_memory=False)
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def steps(result: dict, run: str, keys=("loss", "grad_norm")) -> list[dict]:
    """The values ``run`` logged in a worker's result (``result[key][run]``: one list per key), one dict per step."""
    return [dict(zip(keys, values)) for values in zip(*(result[k][run] for k in keys))]


def equal_to(result: dict, run: str, stock: str = "stock") -> list:
    """The comparisons of ``run`` with ``stock`` in a worker's result (tests/_support/tolerance.py): the loss and
    gradient norm of every step, against the distance of ``stock``'s from those of the float64 run ``fp64``.

    Not the parameters: these runs train with AdamW, whose update does not scale with the gradient, so the rounding
    of a coordinate whose gradient nearly cancels becomes an update of the learning rate's order, one coordinate at a
    time. How far a run's parameters land from float64 is then a heavy-tailed draw, whichever run is the legitimate
    one (measured on one tensor: stock 10x further than ODC with AVX-512 kernels, ODC 8x further than stock with the
    scalar ones). The SGD runs of tests/zero and tests/integrations/test_trl_grpo.py compare parameters."""
    from _support.tolerance import compare_logs
    return compare_logs(run, steps(result, run), steps(result, stock), steps(result, "fp64"))


def logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry and "train_runtime" not in entry]


@contextlib.contextmanager
def without_deepspeed():
    """Build and train a trainer without DeepSpeed in a process whose earlier trainers used it: the float64 reference
    runs (DeepSpeed refuses float64) train through DDP. Accelerate leaves ``ACCELERATE_USE_DEEPSPEED`` set (a new
    Trainer would pick a default DeepSpeed plugin up from it) and transformers may still hold the last ZeRO-3 config
    (models would be built under zero.Init, in fp32): both are cleared while the block runs."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    saved = os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if saved is not None:
            os.environ["ACCELERATE_USE_DEEPSPEED"] = saved


@contextlib.contextmanager
def shared_tmpdir(prefix: str):
    """One temporary folder for all ranks (rank 0 makes it), removed when every rank is done with it."""
    import torch.distributed as dist
    box = [tempfile.mkdtemp(prefix=prefix)] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(box, src=0)
    try:
        yield box[0]
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(box[0], ignore_errors=True)
