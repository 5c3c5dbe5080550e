"""The gradient norms of stock ZeRO-3's step (``_get_norm_groups``), taken over ODC's flat fp32 accumulator.

Stock takes one norm per parameter (several tensor ops each, hundreds per step) over views of what under ODC is one
flat accumulator, where each group's gradients are one contiguous range; so :func:`gradient_norms` takes one norm
per group, summed over the same process group, with stock's -1 for a non-finite norm. The squares add up in stock's
norm dtype (float64 where the device has it; :func:`sum_of_squares`), so the norm rounds as stock's does.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from deepspeed import comm as dist
from deepspeed.runtime.zero.utils import get_norm_dtype

from ds_odc.zero.state import OdcState

__all__: list[str] = []


def gradient_norms(groups: Sequence[Sequence[torch.nn.Parameter]], odc: OdcState, views: dict[int, torch.Tensor],
                   partition_group_of: Callable[[torch.nn.Parameter], object],
                   on_host: bool) -> list[torch.Tensor] | None:
    """Each of ``groups``' gradient norm (the optimizer's ``fp16_groups``; ``views``: each parameter's gradient
    partition by ``ds_id``; ``partition_group_of``: the process group a parameter is partitioned over), or None to
    leave it to stock. ``on_host`` (``offload_optimizer``): the norms go to the host, where clipping scales the
    gradients."""
    flats = [odc.accumulated(group) if all(p.requires_grad for p in group) else None for group in groups]
    if any(flat is None for flat in flats) and not on_host:
        return None  # a frozen parameter in a trainable group: stock counts it as zeros
    # (with offload_optimizer stock's norms come from gradient copies ODC does not make: such a group is normed over
    # its trainable parameters' partitions here)
    norms = []
    for group, flat in zip(groups, flats):
        if flat is not None:
            total = sum_of_squares(flat).reshape(1)
        else:
            total = torch.zeros(1, dtype=get_norm_dtype(), device=odc.accumulator.local.device)
            for param in group:
                if param.requires_grad:
                    total += sum_of_squares(views[param.ds_id])
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=partition_group_of(group[0]))
        norm = total.sqrt().squeeze(0)
        norm = torch.where(norm.isfinite(), norm, torch.full_like(norm, -1.0))
        norms.append(norm.cpu() if on_host else norm)
    return norms


_ROW = 256  # elements whose squares add up in fp32 before the sum goes on in the norm dtype


def sum_of_squares(grad: torch.Tensor) -> torch.Tensor:
    """``sum(grad ** 2)`` as a 0-dim tensor of stock ZeRO-3's norm dtype (``get_norm_dtype()``: float64 where the
    device has it), without a full-size copy in that dtype: fp32 sums over rows of 256 elements (a few roundings
    each), then the rows' sums in the norm dtype. An fp32 sum over a whole accumulator rounds once per element on a
    CPU's vector lanes: hundreds of ulps on a large one, and more on one CPU's kernels than on another's."""
    dtype, flat = get_norm_dtype(), grad.reshape(-1)
    whole = flat.numel() - flat.numel() % _ROW
    rows = torch.linalg.vector_norm(flat[:whole].view(-1, _ROW), 2, dim=1, dtype=torch.float32)
    return rows.to(dtype).square().sum() + flat[whole:].to(dtype).square().sum()
