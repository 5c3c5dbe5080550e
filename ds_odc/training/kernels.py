"""A model's kernels: eager, compiled blocks, Liger's fused kernels, or both; one choice for every engine.

``--kernels`` (``ds_odc.recipes.sft``) and the trainers' ``torch_compile`` / ``use_liger_kernel`` come here:

* ``"eager"``: the model as written.
* ``"compiled"``: every transformer block compiled (:mod:`ds_odc.training.compile`); inductor fuses each block's
  norms, SwiGLU and rotary embedding itself.
* ``"fused"``: Liger's kernels (RMSNorm, SwiGLU, RoPE, and its fused linear cross-entropy, which computes the loss
  and its gradients chunk by chunk without ever holding the logits).
* ``"compiled+fused"``: compiled blocks, plus Liger's fused linear cross-entropy on the head, outside the blocks.
  Liger's layer kernels are left out: inside a compiled block inductor generates the same fusions, and dynamo
  cannot trace Liger's patched layers.

Liger's fused loss, like the chunked loss, reads ``lm_head.weight`` inside the causal LM's own forward rather than
through the ``lm_head`` module; under ZeRO-3 the weight is shared with it the same way (:func:`share_head_with_loss`,
see [Note: the LM head under ZeRO-3] in :mod:`ds_odc.training.loss`).

Liger needs Triton (CUDA); on a machine without it ``"fused"`` raises an error that says so, and the chunked loss
(:func:`ds_odc.training.loss.use_chunked_loss`) stays the loss that never holds the full logits. Liger's layer
kernels also replace transformers' layer classes for models built later in the same process (Liger's own way); dynamo
cannot trace them, so blocks compiled after ``"fused"`` fall back to eager with a warning that names them.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from ds_odc.training.compile import CompiledBlocks, CompileOptions, compile_blocks
from ds_odc.training.loss import share_head_with_loss

__all__ = ["Kernels", "apply_liger"]

KERNEL_CHOICES = ("eager", "compiled", "fused", "compiled+fused")
LIGER_LAYER_KERNELS = ("rope", "rms_norm", "swiglu")  # the kernels inside the blocks, which compiled blocks replace


@dataclass(frozen=True)
class Kernels:
    """``compile``: how blocks are compiled (``None``: eager blocks); ``liger``: Liger's fused kernels (with compiled
    blocks, only its fused linear cross-entropy)."""

    compile: CompileOptions | None = None
    liger: bool = False

    @classmethod
    def from_name(cls, name: str, backend: str = "inductor", mode: str | None = None) -> Kernels:
        if name not in KERNEL_CHOICES:
            raise ValueError(f"kernels {name!r}: choose one of {', '.join(KERNEL_CHOICES)}")
        compiled = name.startswith("compiled")
        return cls(compile=CompileOptions(backend=backend, mode=mode) if compiled else None,
                   liger=name.endswith("fused"))

    @property
    def name(self) -> str:
        return {(False, False): "eager", (True, False): "compiled", (False, True): "fused",
                (True, True): "compiled+fused"}[(self.compile is not None, self.liger)]

    def liger_config(self) -> dict[str, bool]:
        """The keyword arguments of Liger's ``apply_liger_kernel_to_<model>`` (transformers' ``liger_kernel_config``)
        for this choice."""
        layers = self.compile is None
        return {"rope": layers, "rms_norm": layers, "swiglu": layers, "cross_entropy": False,
                "fused_linear_cross_entropy": True}


def apply_liger(model: torch.nn.Module, **config: bool) -> None:
    """Liger's kernels on ``model`` (in place), through Liger's function for the model's type; ``config``: that
    function's flags (``rope``, ``rms_norm``, ``swiglu``, ``fused_linear_cross_entropy``, ...). When the fused
    linear cross-entropy is on, the LM head's weight is made present for it under ZeRO-3
    (:func:`share_head_with_loss`)."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as err:
        raise ImportError("ds_odc: fused kernels need the liger-kernel package, which needs Triton (a CUDA GPU): "
                          "pip install 'ds_odc[liger]', or choose kernels 'eager' or 'compiled'") from err
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        raise ValueError(f"ds_odc: Liger has no kernels for model type {model_type!r}; choose kernels 'eager' or "
                         "'compiled'")
    accepted = inspect.signature(apply).parameters
    apply(model=model, **{k: v for k, v in config.items() if k in accepted})
    if config.get("fused_linear_cross_entropy", True):
        share_head_with_loss(model)


def apply_kernels(model: torch.nn.Module, kernels: Kernels, *, liger: bool = True) -> CompiledBlocks | None:
    """``kernels`` on ``model``, in place, before or after ``deepspeed.initialize`` / ``fully_shard``. ``liger=False``:
    leave Liger to the caller (transformers' Trainer applies it when training starts) and only make the LM head
    present for its fused loss. Returns the compiled blocks (``None`` when not compiling)."""
    if kernels.liger:
        if liger:
            apply_liger(model, **kernels.liger_config())
        else:
            share_head_with_loss(model)
    return compile_blocks(model, kernels.compile) if kernels.compile is not None else None


def kernels_from_training_args(args: Any) -> Kernels:
    """The kernels a ``TrainingArguments`` (or TRL config) asks for: ``torch_compile`` (with its
    ``torch_compile_backend`` and ``torch_compile_mode``) compiles the blocks, ``use_liger_kernel`` fuses."""
    compiled = bool(getattr(args, "torch_compile", False))
    options = None
    if compiled:
        options = CompileOptions(backend=getattr(args, "torch_compile_backend", None) or "inductor",
                                 mode=getattr(args, "torch_compile_mode", None))
    return Kernels(compile=options, liger=bool(getattr(args, "use_liger_kernel", False)))


def training_args_for_kernels(args: Any) -> Any:
    """The ``TrainingArguments`` a Trainer should run with for the kernels they ask for: with both
    ``torch_compile`` and ``use_liger_kernel``, a copy whose ``liger_kernel_config`` turns Liger's layer kernels
    off (the compiled blocks fuse those, and dynamo cannot trace Liger's patched layers; a key the user set stays as
    set); otherwise ``args`` itself. Compilation itself goes through the engine
    (:func:`ds_odc.training.compile.compile_blocks_on_engine_compile`)."""
    kernels = kernels_from_training_args(args)
    if kernels.compile is None or not kernels.liger:
        return args
    out = copy.copy(args)
    given = dict(getattr(args, "liger_kernel_config", None) or {})
    out.liger_kernel_config = {**{k: False for k in LIGER_LAYER_KERNELS}, **given}
    return out
