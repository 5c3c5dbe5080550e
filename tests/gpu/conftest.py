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


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory():
    """Tests in this process (kernel checks) must not keep GPU memory cached while other tests' ranks need it."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
