"""A tiny causal LM, its data, ds_configs and a single-process reference, shared by the ZeRO worker scenarios."""

from __future__ import annotations

import copy

import torch

VOCAB = 256


def tiny_llama(seed: int = 0, frozen_embeddings: bool = False, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
                         tie_word_embeddings=False, attn_implementation="eager")
    model = LlamaForCausalLM(config).to(dtype)
    if frozen_embeddings:
        model.model.embed_tokens.weight.requires_grad_(False)
    return model


DEVICE = torch.device("cpu")  # worker.py sets cuda:N when the scenarios run on GPUs (tests/gpu)
# ``--offload`` of the workers: "odc" puts the optimizer of every ODC engine on the host (stock engines stay the
# reference without offload), "both" every engine's; ds_config's ``offload`` argument overrides it.
OFFLOAD = ""


def minibatch(step: int, num_samples: int, min_len: int = 4, max_len: int = 24) -> list[torch.Tensor]:
    """The global minibatch of ``step``: the same on every rank, variable lengths, on ``DEVICE``."""
    g = torch.Generator().manual_seed(1000 + step)
    lengths = torch.randint(min_len, max_len + 1, (num_samples,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (1, n), generator=g).to(DEVICE) for n in lengths]


def ds_config(odc, *, gas: int = 1, clip: float = 0.0, managed: bool = True, lr: float = 1e-2, bf16: bool = False,
              bucket: int = 3000, extra_zero: dict | None = None, optimizer: str = "adamw",
              offload: bool | None = None) -> dict:
    """``optimizer="sgd"`` leaves the optimizer to the caller (see ``client_optimizer``). ``offload``: the optimizer on
    the host (``offload_optimizer`` to the CPU, pinned), stepped by the torch optimizer (config ``torch_adam`` or the
    client's: DeepSpeed's CPU Adam JIT-compiles for over a minute); None: as ``OFFLOAD`` says."""
    if offload is None:
        offload = OFFLOAD == "both" or (OFFLOAD == "odc" and odc is not None)
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "reduce_bucket_size": bucket,
        "stage3_prefetch_bucket_size": bucket,
        "overlap_comm": False,
        "contiguous_gradients": True,
    }
    if odc is not None:
        zero["odc"] = odc
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    zero.update(extra_zero or {})
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
    }
    if optimizer == "adamw":
        config["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.99], "eps": 1e-8,
                                                           "weight_decay": 0.01, "torch_adam": True}}
    if offload:
        config["zero_force_ds_cpu_optimizer"] = False  # a torch optimizer on the host, knowingly
    if not managed:
        config["managed_gradient_accumulation"] = False
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


SGD_LR, SGD_MOMENTUM = 0.2, 0.9
ADAMW = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)  # ds_config's "AdamW" with torch_adam


def client_optimizer(params):
    """The optimizer of reference comparisons. SGD, not Adam: Adam's update does not scale with the gradient, so the
    fp32 rounding noise of a coordinate whose gradient nearly cancels (attention scores at random init) becomes an
    update difference of the learning rate's order; under SGD it stays as small as the gradient."""
    return torch.optim.SGD(params, lr=SGD_LR, momentum=SGD_MOMENTUM)


def reference_run(model, steps: int, num_samples: int, clip: float = 0.0, per_sample_mean: bool = False,
                  dtype: torch.dtype = torch.float32, optimizer: str = "sgd", sample_losses: list | None = None):
    """Plain PyTorch, one process: the gradient of the global token-mean loss of every minibatch (or, with
    ``per_sample_mean``, of the mean over samples of each sample's token mean: stock DeepSpeed's GAS semantics).
    ``dtype=torch.float64`` gives the exact answer both distributed runs are rounding approximations of.
    ``sample_losses``: a list that gets each sample's token-mean loss, step by step, in sample order."""
    model = copy.deepcopy(model).to(DEVICE, dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = client_optimizer(params) if optimizer == "sgd" else torch.optim.AdamW(params, **ADAMW)
    losses = []
    for step in range(steps):
        samples = minibatch(step, num_samples)
        n_tokens = sum(s.numel() - 1 for s in samples)
        opt.zero_grad()
        total = 0.0
        for s in samples:
            norm = len(samples) * (s.numel() - 1) if per_sample_mean else n_tokens
            logits = model(input_ids=s).logits
            loss = torch.nn.functional.cross_entropy(logits[0, :-1].to(max(dtype, torch.float32, key=_width)),
                                                     s[0, 1:], reduction="sum") / norm
            loss.backward()
            total += loss.item()
            if sample_losses is not None:
                sample_losses.append(loss.item() * norm / (s.numel() - 1))
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        losses.append(total)
    return model, losses


def reference_and_rounding(model, steps: int, num_samples: int, **kwargs):
    """:func:`reference_run` in fp32, and how far fp32 rounding moved it: its distance from the same run in float64
    (max over tensors, relative), the reference distance of tests/_support/tolerance.py for a comparison with it.
    Returns (fp32 model, fp32 losses, that distance); the distance on the first rank only, which reports it (None on
    the others: the float64 run is not repeated on every rank)."""
    import torch.distributed as dist
    ref, losses = reference_run(model, steps, num_samples, **kwargs)
    if dist.is_initialized() and dist.get_rank() != 0:
        return ref, losses, None
    exact, _ = reference_run(model, steps, num_samples, **{**kwargs, "dtype": torch.float64})
    return ref, losses, max_rel_diff(full_params(ref, torch.float64), full_params(exact, torch.float64))


def _width(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits


def full_params(engine_or_model, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Full (unpartitioned) parameters by name; collective for ZeRO-3 engines."""
    import deepspeed
    module = getattr(engine_or_model, "module", engine_or_model)
    params = list(module.named_parameters())
    if params and hasattr(params[0][1], "ds_id"):
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {n: p.detach().to(dtype).clone() for n, p in params}
    return {n: p.detach().to(dtype).clone() for n, p in params}


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (``b`` is the reference; it may live on another device)."""
    a, b = a.double(), b.to(a.device).double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def max_rel_diff(a: dict, b: dict) -> float:
    return max(rel_diff(a[name], b[name]) for name in a)


def flat(tensors) -> torch.Tensor:
    """Tensors as one flat fp32 CPU vector (to compare whole parameter or gradient sets)."""
    return torch.cat([t.detach().float().reshape(-1).cpu() for t in tensors])


def api_comparisons(diffs: dict[str, float], rounding: dict[str, float], what: str = "") -> list:
    """The comparisons (tests/_support/tolerance.py) of :func:`odc_vs_stock`'s distances, each against stock's own
    rounding of its kind of quantity (``worker.stock_rounding``): gradients, parameters (and the 16-bit save of
    them), logits, losses; the greedy tokens must agree exactly."""
    from _support.tolerance import SCALAR_ULPS, compare

    def kind(key: str) -> tuple[str | None, float]:
        if key.startswith("tokens"):
            return None, 1.0
        if key.startswith(("loss", "grad_norm")):
            return ("loss" if key.startswith("loss") else "grads"), SCALAR_ULPS
        for name, prefixes in (("grads", ("full_grads", "local_grads", "averaged", "slow_", "grad_partitions")),
                               ("params", ("params_after", "saved_16bit")), ("logits", ("logits",))):
            if key.startswith(prefixes):
                return name, 1.0
        raise KeyError(f"{key}: which kind of quantity (gradients, parameters, logits, losses) is it?")

    out = []
    for key, measured in diffs.items():
        name, ulps = kind(key)
        out.append(compare(f"{what}{key}: odc vs stock", measured, rounding[name] if name else 0.0, ulps=ulps))
    return out


def odc_vs_stock(sections, initial: torch.Tensor) -> dict:
    """Run every section (a function of ``odc``, returning named tensors) with ODC off and on: per name, ODC's
    distance from stock, and under ``stock_moved`` how far each ``params_after*`` result of stock moved from
    ``initial`` (a section that trains nothing would prove nothing)."""
    out, moved = {}, {}
    for section in sections:
        stock, odc = section(None), section(True)
        for key in stock:
            out[key] = rel_diff(odc[key], stock[key])
            if key.startswith("params_after"):
                moved[key] = rel_diff(stock[key], initial)
    out["stock_moved"] = moved
    return out
