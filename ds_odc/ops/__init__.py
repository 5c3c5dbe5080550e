"""Transports: how ODC moves parameter shards and gradient slices between ranks (see ``transport.py``)."""

from __future__ import annotations

import torch

from ds_odc.ops.transport import (FenceTimeout, GatherPlan, OdcError, ScatterPlan, Segment, SymmetricBuffer,
                                  Transport)

__all__: list[str] = []


def make_transport(config, device: torch.device, process_group=None, control=None, job_control=None) -> Transport:
    """Build the transport named by ``config.transport`` (an ``OdcConfig``) for ranks whose tensors live on
    ``device``, over ``process_group`` (default: the world). When that group is part of the job: ``control``, a gloo
    group over the same ranks (meetings), and ``job_control``, a gloo group over every rank (NVSHMEM's collective
    calls span the whole job); None where the group itself is gloo, or the default group."""
    kind, timeout_s = config.transport, config.timeout_s
    if kind == "auto":
        kind = "nvshmem" if device.type == "cuda" else "shm"
    if kind == "shm":
        if device.type != "cpu":
            raise ValueError(f"ds_odc: transport 'shm' works on CPU tensors only, but training runs on {device}. "
                             "Set zero_optimization.odc.transport to 'nvshmem' or 'auto'.")
        from ds_odc.ops.shm import ShmTransport
        return ShmTransport(process_group, timeout_s, control=control, lockstep=config.lockstep)
    if kind == "nvshmem":
        if device.type != "cuda":
            raise ValueError(f"ds_odc: transport 'nvshmem' needs CUDA tensors, but training runs on {device}. "
                             "Set zero_optimization.odc.transport to 'shm' or 'auto'.")
        from ds_odc.ops.nvshmem import NvshmemTransport
        return NvshmemTransport(process_group, timeout_s, force_remote_path=config.force_remote_path,
                                scatter_method="staging" if config.deterministic else "atomic",
                                bootstrap=config.bootstrap, control=control, job_control=job_control,
                                lockstep=config.lockstep)
    raise ValueError(f"ds_odc: unknown transport {kind!r}; use 'auto', 'shm' or 'nvshmem'.")
