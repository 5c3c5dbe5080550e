"""One launch of a distributed job (``torchrun`` and its ranks) that cannot outlive the script that started it.

``subprocess.run(cmd, timeout=...)`` kills only the process it started: a ``torchrun`` launch killed that way leaves
its ranks running, holding the GPU's memory, the rendezvous port and (under ``--partition-gpu``) clients of the MPS
server while the next launch starts, or blocked in a collective until their own timeout. :func:`run_launch` starts
the launch in a process group of its own and, when it runs past its time or the caller is interrupted (Ctrl-C, a
``timeout`` around the script), ends the whole group: SIGTERM, then SIGKILL to what is left after a grace period.

Used by the main job (``examples/compare.py``) and the benchmarks, which run one launch per mode.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Mapping, Sequence

__all__ = ["Finished", "run_launch"]


@dataclasses.dataclass(frozen=True)
class Finished:
    """How a launch ended."""

    returncode: int | None
    """The launch's exit status; None when it ran past its time and was ended."""
    output: str
    """What it printed (stdout and stderr together); empty when it was written to a log file instead."""

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def describe(self, timeout: float | None, option: str = "") -> str:
        """How a launch that failed ended, for a message; ``option``: the setting that holds the time limit."""
        if self.timed_out:
            return (f"ran past its time limit of {timeout:g} s{f' ({option})' if option else ''} and was stopped "
                    "with all its ranks; raise the limit if it was still making progress")
        if self.returncode == 0:
            return "exited with status 0 but wrote no result"
        return f"exited with status {self.returncode}"


def _end_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """End ``proc``'s process group (the launch and every rank it started): SIGTERM, then SIGKILL to whatever is
    still there after ``grace_s`` seconds."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if not _signal_group(proc.pid, sig):
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the launcher, or it stays in the group as a zombie
            if not _signal_group(proc.pid, 0):
                return
            time.sleep(0.1)


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to the group; False when nothing is left in it."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def run_launch(cmd: Sequence[str], *, timeout: float | None, env: Mapping[str, str] | None = None,
               log: str | Path | None = None, grace_s: float = 10.0) -> Finished:
    """Run ``cmd`` in a process group of its own and wait for it, at most ``timeout`` seconds (None: no limit).
    Its output goes to ``log`` when given, else it is returned. Past the limit, or when this process is interrupted
    (KeyboardInterrupt, re-raised), the whole group is ended (``_end_group``)."""
    sink = open(log, "w") if log is not None else None
    try:
        proc = subprocess.Popen(list(cmd), stdout=sink or subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=None if env is None else dict(env), start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            _end_group(proc, grace_s)
            try:  # what it printed before; a process that left the group could hold the pipe open
                out, _ = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                out = ""
            returncode = None
        except BaseException:
            _end_group(proc, grace_s)
            raise
        if returncode is not None:  # a rank that outlived its launcher (one that crashed) is an orphan now
            _signal_group(proc.pid, signal.SIGKILL)
    finally:
        if sink is not None:
            sink.close()
    return Finished(returncode, out or "")
