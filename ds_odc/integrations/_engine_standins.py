"""STAND-INS for ODC engine APIs that do not exist yet. Everything here touches DeepSpeed privates; it moves into the
engine (``ds_odc/zero``) once the engine offers the API named in each docstring, and this module then goes away.

Requested engine API (what the lockstep-free generation path needs from the ODC optimizer):

``OdcOptimizer.odc_resident() -> ContextManager``
    Read every parameter this rank needs (one-sidedly, no collective) and keep it resident until the context exits,
    with DeepSpeed's per-module fetch/release hooks bypassed inside it, so that forwards run at the speed of the
    unsharded model; on exit drop the full copies and restore the hooks. Called by
    ``ds_odc.integrations.generation.lockstep_free(residency="full")`` around ``generate`` and evaluation forwards.
    Semantics wanted beyond this stand-in: lazily (keep what the forwards read, block by block, rather than reading
    the whole model up front), and with a byte budget after which further blocks are read and released per forward.
"""

from __future__ import annotations

import contextlib

import deepspeed
import torch


def zero_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The module's ZeRO-3-partitioned parameters (trainable and frozen)."""
    return [p for p in module.parameters() if hasattr(p, "ds_id")]


@contextlib.contextmanager
def resident_parameters(engine):
    """STAND-IN for ``OdcOptimizer.odc_resident()``: the whole model read up front and kept for the context.

    Under ODC, ``GatheredParameters`` without a modifier rank reads the shards one-sidedly and releases them locally
    on exit (no collective either way). Inside it DeepSpeed's module hooks would release each block after its
    forward, so they are detached for the duration and registered again afterwards; re-registering invalidates the
    coordinator's recorded module trace, which re-records on the next training forward. TRL's
    ``unwrap_model_for_generation`` does the same with stock ZeRO-3 (where the gather is a collective)."""
    offload = engine.optimizer.parameter_offload
    module = offload.module
    with deepspeed.zero.GatheredParameters(zero_params(module)):
        for param in zero_params(module):
            param.ds_active_sub_modules.clear()
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield module
        finally:
            offload._register_deepspeed_module(module)
