"""The start of a usual DeepSpeed script on CPU ranks: ``import ds_odc`` (unless ``--without-ds-odc``), then
``deepspeed.init_distributed``. Rank 0 reports whether DeepSpeed asked for its shared-memory op (whose JIT build
takes minutes; here it is never built, only recorded) and what ``inference_all_reduce``, the one user of that op,
returned."""

import sys
import time

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

from _support.launch import emit

requested = []
accelerator = get_accelerator()
create_op_builder = accelerator.create_op_builder


def recording(name):
    builder = create_op_builder(name)
    if name == "ShareMemCommBuilder":
        requested.append(name)
        if builder is not None:
            builder.load = lambda *args, **kwargs: None  # recorded, not compiled
    return builder


accelerator.create_op_builder = recording
if "--without-ds-odc" not in sys.argv:
    import ds_odc  # noqa: F401
started = time.monotonic()
deepspeed.init_distributed(dist_backend="gloo")
elapsed = time.monotonic() - started
rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
total = torch.tensor([rank + 1.0])
deepspeed.comm.inference_all_reduce(total)
if rank == 0:
    emit({"requested": requested, "init_s": elapsed, "sum": total.item(), "expected": world * (world + 1) / 2})
# The launcher's convention (every rank leaves together, no exit-time abort of gloo's threads), imported only now:
# importing ds_odc earlier would change what the --without-ds-odc case measures.
from ds_odc.training.distributed import shutdown_and_exit  # noqa: E402

shutdown_and_exit()
