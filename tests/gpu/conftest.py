"""Shared setup for the GPU tests: build the NVSHMEM op once, in this process, before any rank needs it."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def nvshmem_op():
    """The compiled ds_odc NVSHMEM extension (workers launched afterwards load it from the build cache)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ds_odc.ops.builder import load_op
    return load_op(verbose=True)
