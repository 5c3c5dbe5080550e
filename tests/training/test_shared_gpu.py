"""The shared-GPU switch on a machine without a GPU: what it refuses, what it sets, and what the trainers check.
(Running several ranks on one GPU is tested in tests/gpu, where every multi-rank test uses it on a one-GPU host.)"""

import os
import types

import pytest
import torch

from ds_odc.training import distributed


@pytest.fixture
def clean_env(monkeypatch):
    """The switch writes os.environ directly (LOCAL_RANK, DS_ODC_SHARED_GPU) for the rest of the process, which
    monkeypatch does not see: the whole environment is put back after each test, or every later test's ranks would
    inherit shared-GPU mode."""
    saved = dict(os.environ)
    for key in (distributed.SHARED_GPU_ENV, "DS_ODC_LAUNCHER_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
                "DS_ACCELERATOR"):
        monkeypatch.delenv(key, raising=False)
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


def test_refused_without_a_gpu(clean_env):
    clean_env.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU.*drop the option"):
        distributed.init_distributed(shared_gpu=True)
    clean_env.setenv(distributed.SHARED_GPU_ENV, "1")  # the environment switch asks for the same
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        distributed.init_distributed()


def test_refused_under_mpirun(clean_env):
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="not supported under mpirun.*torchrun"):
        distributed.init_distributed(shared_gpu=True)


def test_every_rank_names_gpu_0(clean_env):
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    clean_env.setenv("LOCAL_RANK", "2")
    distributed._share_one_gpu()
    assert os.environ["LOCAL_RANK"] == "0" and os.environ["DS_ODC_LAUNCHER_LOCAL_RANK"] == "2"
    assert distributed.shared_gpu_mode() and distributed.training_device() == torch.device("cuda", 0)


def test_accelerate_is_told_the_backend_is_gloo(clean_env):
    """Under DeepSpeed, TrainingArguments leaves Accelerate assuming nccl on CUDA; its gathers then take a path gloo
    rejects for 2-D tensors. The trainers correct the state's backend when the process group is gloo."""
    from ds_odc.integrations import match_accelerate_backend
    args = types.SimpleNamespace(distributed_state=types.SimpleNamespace(backend="nccl"))
    clean_env.setattr(torch.distributed, "is_initialized", lambda: True)
    clean_env.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    match_accelerate_backend(args)
    assert args.distributed_state.backend == "nccl"  # a real nccl group is left alone
    clean_env.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    match_accelerate_backend(args)
    assert args.distributed_state.backend == "gloo"
    match_accelerate_backend(types.SimpleNamespace())  # arguments not yet set up: nothing to correct