"""What the trainer benchmarks (grpo.py, dpo.py, generation.py) share: the random-init model every mode loads, and
each mode run in a ``torchrun`` process of its own, so that one mode's memory and compiled state never reach the next.

Imported by those scripts from their own folder (``python benchmarks/X.py`` puts ``benchmarks/`` on ``sys.path``)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ds_odc.training.launch import run_launch  # noqa: E402

__all__ = ["ROOT", "model_folder", "save_random_model", "run_modes", "run_modes_on_random_model", "finish_worker",
           "adapters_in_model_dtype"]


def model_folder(out: str | Path, model: str) -> Path:
    """Where :func:`run_modes_on_random_model` keeps the model of ``--model`` while the modes run."""
    return Path(out) / f"model-{model}"


def save_random_model(shape: str, folder: Path, *, max_positions: int, seed: int) -> None:
    """A Qwen2 model of ``shape`` (a name of ``ds_odc.balancer.presets.MODEL_SHAPES``) with random weights and the
    character tokenizer, saved once in ``folder`` (bf16 when a GPU will train it)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from ds_odc.balancer.presets import MODEL_SHAPES
    from ds_odc.recipes.toy_text import char_tokenizer
    tokenizer = char_tokenizer()
    config = Qwen2Config(**MODEL_SHAPES[shape], max_position_embeddings=max_positions,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    on_gpu = torch.cuda.is_available()
    with torch.device("cuda" if on_gpu else "cpu"):  # random init of 1.5B weights on the host took 95 s
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if on_gpu else None)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    if on_gpu:
        torch.cuda.empty_cache()  # the modes run in their own processes


def adapters_in_model_dtype(model) -> None:
    """Cast a PEFT model's trainable parameters (its adapters) to the dtype of its frozen ones. TRL's ``peft_config``
    makes the adapters float32 in a bf16 model except under ZeRO-3, where it makes them in the model's dtype: the
    unsharded mode calls this before training so that every mode of a call trains the same adapters alike (the
    same initial values; TRL's path draws them identically in every mode)."""
    frozen = next(p.dtype for p in model.parameters() if not p.requires_grad)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(frozen)


def run_modes(script: str, modes: Sequence[str], worker_args: Sequence[str], *, ranks: int, out: Path,
              timeout: float, result_file: Callable[[str], str] = lambda mode: f"{mode}.json",
              tail_chars: int = 4000) -> dict[str, dict]:
    """Run ``script --worker MODE *worker_args`` under ``torchrun`` on ``ranks`` processes for every mode, one after
    another; each worker writes its result as JSON to ``out / result_file(mode)``. Returns every mode's result, or
    ``{"mode": ..., "failed": <the output's tail>}`` for a mode that failed or ran past ``timeout`` seconds."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    results = {}
    for mode in modes:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", script,
               "--worker", mode, *worker_args]
        started = time.perf_counter()
        result = out / result_file(mode)
        with tempfile.TemporaryDirectory(prefix="ds_odc_bench_") as scratch:  # torchrun's logs, datasets' caches
            finished = run_launch(cmd, timeout=timeout, env={**env, "TMPDIR": scratch})
        ok = finished.returncode == 0 and result.exists()
        tail = finished.output[-tail_chars:] + ("" if ok else f"\nthe launch {finished.describe(timeout)}")
        results[mode] = json.loads(result.read_text()) if ok else {"mode": mode, "failed": tail}
        if not ok:
            print(f"{mode}: FAILED\n{tail}", flush=True)
        print(f"{mode}: done in {time.perf_counter() - started:.0f} s", flush=True)
    return results


def run_modes_on_random_model(script: str, modes: Sequence[str], worker_args: Sequence[str], *, shape: str,
                              folder: Path, max_positions: int, seed: int, **run) -> dict[str, dict]:
    """:func:`save_random_model` into ``folder``, :func:`run_modes` (``run``: its keyword arguments), then the folder
    removed (a 1.5B shape's weights are 3 GB)."""
    started = time.perf_counter()
    save_random_model(shape, folder, max_positions=max_positions, seed=seed)
    print(f"model: saved in {time.perf_counter() - started:.0f} s", flush=True)
    try:
        return run_modes(script, modes, worker_args, **run)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def finish_worker(path: Path, result: dict) -> None:
    """The end of a mode's worker: its result written to ``path`` (by rank 0), then every rank leaves together and
    the process exits at once (``shutdown_and_exit``: gloo's threads sometimes abort a finished run at exit)."""
    import torch.distributed as dist

    from ds_odc.training.distributed import shutdown_and_exit
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(path).write_text(json.dumps(result))
    shutdown_and_exit(0)
