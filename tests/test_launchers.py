"""Every launcher a user may pick trains ODC correctly and leaves nothing behind in /dev/shm.

Also runs under mpirun, whose MPICH keeps a segment in /dev/shm until MPI is finalized: the rank scripts end with
``ds_odc.training.distributed.shutdown_and_exit``, which must finalize MPI before its hard exit.
"""

import os
import shutil
import sys
from pathlib import Path

import pytest

from _support.launch import launch
from _support.tolerance import assert_within, compare

WORKER = Path(__file__).resolve().parent / "zero" / "worker.py"
SHM = Path("/dev/shm")
pytestmark = pytest.mark.slow


def _mpirun_missing() -> str | None:
    if not (Path(sys.executable).with_name("mpirun").exists() or shutil.which("mpirun")):
        return "no mpirun (pip install mpich)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "no mpi4py (pip install mpi4py)"
    return None


def _shm_entries() -> set[str]:
    return set(os.listdir(SHM))


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this host")
@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed", "mpirun", "plain"])
def test_launcher_trains_and_leaves_no_shared_memory(launcher):
    """Uneven counts (2,1) for 2 steps against the single-process reference, then /dev/shm as it was before.

    Run alone on the host: a job started by someone else during the run would show up as new entries too."""
    if launcher == "mpirun" and _mpirun_missing():
        pytest.skip(_mpirun_missing())
    before = _shm_entries()
    r = launch(WORKER, 2, ["uneven", "--counts", "2,1", "--steps", "2"], launcher=launcher).check().result
    left = sorted(_shm_entries() - before)
    assert_within(compare("odc vs one process: parameters (max over tensors, relative)", r["max_rel_diff"],
                          r["ref_rounding"]))  # the bound of tests/_support/tolerance.py
    assert not left, f"{launcher} left {left} in /dev/shm"
