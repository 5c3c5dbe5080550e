"""Generation and evaluation forwards under ZeRO-3 + ODC without lockstep.

Under stock ZeRO-3 every forward all-gathers each layer's parameters, so all ranks must run the same number of
forwards: ``generate(synced_gpus=True)`` keeps ranks that reached their EOS decoding dummy tokens until the slowest
rank is done. With ODC a rank reads the shards it needs from their owners one-sidedly, so each rank decodes at its
own pace, stops at its own EOS, and may run no forward at all::

    from ds_odc.integrations.generation import lockstep_free

    with lockstep_free(engine) as model:            # engine: the DeepSpeedEngine, zero_optimization.odc on
        out = model.generate(**batch, max_new_tokens=256)

Inside the block:

* ``model.generate`` runs with ``synced_gpus=False``;
* any ``torch.distributed`` or ``deepspeed.comm`` collective raises :class:`LockstepError` naming it, instead of
  hanging until the process-group timeout (other ranks are not there to join it);
* parameters are either read once and kept for the whole block (``residency="full"``: the speed of the unsharded
  model, at the memory of one full model copy per rank) or read per transformer block at every forward
  (``residency="block"``: the memory of ZeRO-3). ``"auto"`` (default) keeps them when one full copy fits in half of
  the free device memory, or in ``max_resident_bytes`` when given.

The block must not contain an optimizer step (that is where ranks meet). Ranks need not enter it together and need
not call ``generate`` the same number of times; the next optimizer step after it is exact as usual.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch

from ds_odc.ops.transport import OdcError

__all__ = ["lockstep_free", "LockstepError"]

RESIDENCIES = ("auto", "full", "block")

# Collective entry points: torch.distributed (Accelerate, Transformers, user code) and deepspeed.comm (DeepSpeed
# itself, which caches some torch.distributed functions at init and so is caught only at its own layer).
_TORCH_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
    "barrier", "monitored_barrier", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv",
    "isend", "irecv", "batch_isend_irecv", "all_gather_object", "broadcast_object_list", "gather_object",
    "scatter_object_list", "all_reduce_coalesced", "all_gather_coalesced",
)
_DEEPSPEED_COLLECTIVES = _TORCH_COLLECTIVES + (
    "allgather_fn", "reduce_scatter_fn", "inference_all_reduce",
)


def _zero_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The module's ZeRO-3-partitioned parameters (trainable and frozen)."""
    return [p for p in module.parameters() if hasattr(p, "ds_id")]


class LockstepError(OdcError):
    """A collective was called where ranks run at their own pace (it would hang: the other ranks never join it)."""


def _forbidden(namespace: str, name: str, what: str):
    def call(*args, **kwargs):
        raise LockstepError(
            f"ds_odc: {namespace}.{name} was called during {what}, where ranks run different numbers of forward "
            "passes, so the other ranks would never join it. Move it out of the lockstep-free block (to the "
            "optimizer step, where every rank meets), or, inside the block, use one-sided reads only: "
            "deepspeed.zero.GatheredParameters without modifier_rank, generate(synced_gpus=False).")
    return call


@contextlib.contextmanager
def collectives_forbidden(what: str = "lockstep-free generation") -> Iterator[None]:
    """Make every collective in the block raise :class:`LockstepError` (process-wide; restored on exit)."""
    import deepspeed.comm as ds_comm
    import torch.distributed as dist

    ds_comm_module = __import__("deepspeed.comm.comm", fromlist=["comm"])  # where DeepSpeed's own calls resolve
    saved = []
    for owner, label, names in ((dist, "torch.distributed", _TORCH_COLLECTIVES),
                                (ds_comm, "deepspeed.comm", _DEEPSPEED_COLLECTIVES),
                                (ds_comm_module, "deepspeed.comm", _DEEPSPEED_COLLECTIVES)):
        for name in names:
            if hasattr(owner, name):
                saved.append((owner, name, getattr(owner, name)))
                setattr(owner, name, _forbidden(label, name, what))
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def _require_odc(engine) -> None:
    from ds_odc.zero.engine import is_odc
    if not is_odc(engine):
        optimizer = getattr(engine, "optimizer", None)
        raise ValueError(
            "ds_odc: lockstep-free generation needs the DeepSpeedEngine of a model trained with "
            "zero_optimization.odc on (got "
            f"{type(engine).__name__} with optimizer {type(optimizer).__name__}). Stock ZeRO-3, and engines built "
            "without an optimizer, gather parameters with collectives: generate with synced_gpus=True there.")


def full_model_bytes(module: torch.nn.Module) -> int:
    """Bytes of one full copy of the module's ZeRO-3 parameters."""
    return sum(p.ds_numel * p.ds_tensor.element_size() for p in _zero_params(module))


def _free_device_bytes(device: torch.device) -> int:
    """Free device memory, counting what PyTorch's caching allocator holds but does not use."""
    if device.type == "cuda":
        cached_unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0] + cached_unused)
    import psutil
    return int(psutil.virtual_memory().available)


def residency_for(engine, residency: str = "auto", max_resident_bytes: int | None = None) -> str:
    """``"full"`` or ``"block"``: what :func:`lockstep_free` does for ``residency`` on this rank."""
    if residency not in RESIDENCIES:
        raise ValueError(f"ds_odc: residency must be one of {RESIDENCIES}, got {residency!r}")
    if residency != "auto":
        return residency
    module = engine.module
    need = full_model_bytes(module)
    if max_resident_bytes is None:
        device = next((p.ds_tensor.device for p in _zero_params(module)), torch.device("cpu"))
        max_resident_bytes = _free_device_bytes(device) // 2
    return "full" if need <= max_resident_bytes else "block"


@contextlib.contextmanager
def _generate_unsynced(module: torch.nn.Module) -> Iterator[None]:
    """``module.generate`` with ``synced_gpus=False`` for the block (an instance attribute, removed on exit)."""
    own = module.__dict__.get("generate")
    original = module.generate

    @functools.wraps(original)
    def generate(*args, synced_gpus=None, **kwargs):
        if synced_gpus:
            raise ValueError("ds_odc: synced_gpus=True makes every rank decode until the slowest is done, with a "
                             "collective per step; inside lockstep_free each rank decodes at its own pace. Drop it.")
        return original(*args, synced_gpus=False, **kwargs)

    module.generate = generate
    try:
        yield
    finally:
        if own is None:
            del module.generate
        else:
            module.generate = own


@contextlib.contextmanager
def lockstep_free(engine, residency: str = "auto", max_resident_bytes: int | None = None) -> Iterator[torch.nn.Module]:
    """Run generation / evaluation forwards of an ODC engine without collectives; yields the model to call.

    Args:
        engine: the ``DeepSpeedEngine`` (what ``deepspeed.initialize`` returned, or a Trainer's ``model_wrapped``).
        residency: ``"full"`` (read every parameter once, keep it for the block), ``"block"`` (read per block at
            every forward), or ``"auto"`` (see :func:`residency_for`).
        max_resident_bytes: the budget ``"auto"`` compares one full model copy with (default: half the free
            device memory).
    """
    _require_odc(engine)
    mode = residency_for(engine, residency, max_resident_bytes)
    module = engine.module
    with contextlib.ExitStack() as stack:
        stack.enter_context(collectives_forbidden("lockstep-free generation"))
        if mode == "full":
            from ds_odc.zero.engine import resident_parameters
            stack.enter_context(resident_parameters(engine))
        stack.enter_context(_generate_unsynced(module))
        yield module
