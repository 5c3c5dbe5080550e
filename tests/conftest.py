"""Every test runs with a temporary folder of its own and must leave it empty.

The suite points ``TMPDIR`` (and ``tempfile``) at a folder of its own, removed when pytest ends, so a run leaves
nothing in the system's temporary folder. Inside it each test gets a fresh ``TMPDIR``, inherited by the processes it
starts; whatever is still there when the test ends fails that test, by name. Write into pytest's ``tmp_path`` (or
remove what the test makes) instead. Two folders torch itself makes there are removed without complaint, as no test
can avoid them: torchrun's log folder (``torchelastic_*``) and torch.compile's precompiled headers
(``torchinductor_*``, written to the temporary folder whatever its cache setting). Ranks started through
``_support.launch`` get a folder of their own, removed when they end.

What later runs reuse (JIT-built ops, the rest of torch.compile's cache, Hypothesis' examples) goes to the suite's
cache folder, never into the checkout: ``var/cache/ds_odc_tests`` inside the virtual environment that runs the suite
(``.venv``, so it goes when the environment goes, and another checkout's environment never shares it), or
``~/.cache/ds_odc_tests`` in a Python of no virtual environment. A ``TORCH_EXTENSIONS_DIR``,
``TORCHINDUCTOR_CACHE_DIR`` or ``HYPOTHESIS_STORAGE_DIRECTORY`` already set wins. Pass ``--basetemp DIR`` to
keep ``tmp_path`` folders for a look after the run. A test that leaves a ``DS_ODC_*`` environment variable changed fails
too (later tests' ranks would inherit it).

Nothing here imports ds_odc: the check of this check (tests/test_temp_dir.py) runs it in a bare pytest.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEMP_VARIABLES = ("TMPDIR", "TMP", "TEMP")
TORCH_OWN = ("torchelastic_", "torchinductor_")  # see the module docstring
OWN_PREFIX = "DS_ODC_"
_suite_dir: Path | None = None


def _point_temp_at(path: Path) -> None:
    for name in TEMP_VARIABLES:
        os.environ[name] = str(path)
    tempfile.tempdir = str(path)


def suite_cache() -> Path:
    """See the module docstring."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "var" / "cache" / "ds_odc_tests"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ds_odc_tests"


def pytest_configure(config):
    global _suite_dir
    if _suite_dir is None:
        cache = suite_cache()
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cache / "torch_extensions"))  # ranks inherit all three
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
        os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", str(cache / "hypothesis"))
        _suite_dir = Path(tempfile.mkdtemp(prefix="ds_odc_tests_"))
        _point_temp_at(_suite_dir)  # before pytest first asks for its basetemp, which then lands in here


def pytest_unconfigure(config):
    if _suite_dir is not None:
        shutil.rmtree(_suite_dir, ignore_errors=True)


@pytest.fixture(autouse=True)
def _ds_odc_settings_left_alone(request):
    """A ``DS_ODC_*`` variable that a test leaves set would reach every rank that later tests start (shared-GPU mode
    left on once failed every multi-rank CPU test after it): such a change fails the test that made it, by name."""
    before = {k: v for k, v in os.environ.items() if k.startswith(OWN_PREFIX)}
    yield
    after = {k: v for k, v in os.environ.items() if k.startswith(OWN_PREFIX)}
    if after != before:
        for key in after.keys() - before.keys():
            del os.environ[key]
        os.environ.update(before)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        pytest.fail(f"{request.node.nodeid} changed {changed} in os.environ and left them so: undo it (monkeypatch, "
                    "or restore the environment when the test ends)", pytrace=False)


@pytest.fixture(autouse=True)
def _temp_dir_left_empty(request, tmp_path_factory):
    tmp_path_factory.getbasetemp()  # made now, so that it is no test's leftover
    saved = {name: os.environ.get(name) for name in TEMP_VARIABLES}
    own = Path(tempfile.mkdtemp(prefix="test_", dir=_suite_dir))
    _point_temp_at(own)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        tempfile.tempdir = saved["TMPDIR"]
        left = sorted(p.name for p in own.iterdir() if not p.name.startswith(TORCH_OWN))
        shutil.rmtree(own, ignore_errors=True)
    if left:
        pytest.fail(f"{request.node.nodeid} left {left} in the temporary folder: write into pytest's tmp_path "
                    "fixture instead, or remove what the test creates", pytrace=False)
