"""ZeRO-3-shaped parameters without DeepSpeed's engine, for driving :class:`ds_odc.zero.state.OdcState` directly.

Each parameter is partitioned the way ``deepspeed.zero.Init`` does it (padded to a multiple of the world size, rank
``r`` owns slice ``r``) and its shard lives in one flat buffer, like the optimizer's ``lp_param_buffer``.
"""

from __future__ import annotations

import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

SHAPES = [(5, 3), (7,), (1,), (4, 4, 2), (33,)]


def full_values(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in SHAPES]


def zero3_params(rank: int, world: int, seed: int = 0):
    """(params, flat): fake ZeRO-3 parameters whose ``ds_tensor`` are views of ``flat``."""
    values = full_values(seed)
    shard_sizes = [-(-v.numel() // world) for v in values]
    flat = torch.zeros(sum(shard_sizes))
    params, offset = [], 0
    for i, (value, n) in enumerate(zip(values, shard_sizes)):
        padded = torch.zeros(n * world)
        padded[:value.numel()] = value.reshape(-1)
        flat[offset:offset + n] = padded[rank * n:(rank + 1) * n]
        param = torch.nn.Parameter(torch.empty(0), requires_grad=True)
        param.ds_id, param.ds_numel, param.ds_shape = i, value.numel(), value.shape
        param.ds_tensor = flat.narrow(0, offset, n)
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE
        param.partition_numel = lambda n=n: n
        param.ds_summary = lambda i=i: f"param {i}"
        params.append(param)
        offset += n
    return params, flat


def release(params) -> None:
    for param in params:
        param.data = torch.empty(0)
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE


def push_grads(state, groups, grads) -> None:
    """Push ``grads`` (one per parameter, by ds_id) bucket by bucket, with the parameters fetched, as in backward."""
    for group in groups:
        state.fetch(group).wait()
        for param in group:
            param.grad = grads[param.ds_id]
        state.push(group)
        for param in group:
            param.grad = None
        release(group)
