"""GPU partitions (ds_odc.training.partition) where no GPU is needed: the share each rank gets, and the errors that
say what to do when MPS or its environment is missing (the partitions themselves run in tests/gpu under
ODC_TEST_GPU_PARTITIONS=1)."""

import pytest

from ds_odc.training import partition
from ds_odc.training.distributed import partitioned_gpu_mode, shared_gpu_mode


def test_each_rank_gets_its_share_and_the_shares_fit():
    assert [partition.partition_share(n) for n in (1, 2, 3, 4, 8)] == [100, 50, 33, 25, 12]
    assert all(n * partition.partition_share(n) <= 100 for n in range(1, 101))
    with pytest.raises(ValueError):
        partition.partition_share(0)


def test_partition_mode_is_a_shared_gpu_mode(monkeypatch):
    monkeypatch.setenv("DS_ODC_SHARED_GPU", "partition")
    assert shared_gpu_mode() and partitioned_gpu_mode()
    monkeypatch.setenv("DS_ODC_SHARED_GPU", "1")
    assert shared_gpu_mode() and not partitioned_gpu_mode()


def test_a_rank_without_the_mps_environment_is_told_how_to_start_it(monkeypatch):
    for name in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="python -m ds_odc.training.partition --nproc N"):
        partition.check_partition_env()


def test_no_mps_control_program_says_where_it_comes_from(monkeypatch):
    monkeypatch.setattr(partition.shutil, "which", lambda name: None)
    monkeypatch.setattr(partition.Path, "exists", lambda self: False)
    with pytest.raises(RuntimeError, match="nvidia-cuda-mps-control"):
        partition.mps_control()


def test_the_command_line_needs_a_command():
    with pytest.raises(SystemExit):
        partition.main(["--nproc", "2"])
