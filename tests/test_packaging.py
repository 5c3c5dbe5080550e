"""The wheel is complete: installed (not editable) into a fresh venv, ds_odc's op builder finds every kernel source
inside the installed package, and the pydantic plugin that names the fix for a forgotten ``import ds_odc`` is
registered. Nothing is compiled (no nvcc needed) and nothing is downloaded."""

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

CHECK = """
import json, ds_odc
from ds_odc.ops import builder
b = builder.OdcNvshmemBuilder()
sources = [str(p) for p in builder.KERNEL_SOURCES] + b.sources()
print(json.dumps({"package": ds_odc.__file__, "sources": sources,
                  "missing": [s for s in sources if not __import__("os").path.isfile(s)],
                  "problems": b.problems()}))
"""

# DeepSpeed alone, ds_odc installed but not imported: the odc key is rejected with the hint, nothing else changes.
FORGOTTEN_IMPORT = """
import json, sys, traceback
from deepspeed.runtime.zero.config import get_zero_config
shown = {}
for name, zero in [("odc", {"stage": 3, "odc": True}), ("typo", {"stage": 3, "stagee": 1})]:
    try:
        get_zero_config({"zero_optimization": zero})
    except Exception as err:
        shown[name] = {"type": type(err).__name__, "str": str(err), "traceback": "".join(traceback.format_exception(err))}
shown["ds_odc_imported"] = any(m == "ds_odc" or m.startswith("ds_odc.") for m in sys.modules)
print(json.dumps(shown))
"""


def _run(cmd, **kwargs):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kwargs)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_installed_wheel_finds_its_kernel_sources(tmp_path):
    # Build from a copy, so the checkout gets no build/ or egg-info.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in [*ROOT.glob("ds_odc*/"), ROOT / "csrc"]:
        shutil.copytree(package, src / package.name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist",
          src])
    wheel, = (tmp_path / "dist").glob("ds_odc-*.whl")

    # A fresh venv that sees this interpreter's packages (torch, DeepSpeed) through a .pth line, but not their
    # .pth files, so an editable ds_odc installed there stays invisible.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    venv_site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    (venv_site / "parent_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel])

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["DS_ACCELERATOR"] = "cpu"
    report = json.loads(_run([python, "-c", CHECK], cwd=tmp_path, env=env).stdout.strip().splitlines()[-1])
    assert Path(report["package"]).is_relative_to(venv_site), report["package"]
    assert report["sources"] and not report["missing"], report
    assert all(Path(s).is_relative_to(venv_site / "ds_odc" / "csrc") for s in report["sources"]), report["sources"]
    assert not [p for p in report["problems"] if "kernel sources" in p], report["problems"]

    shown = json.loads(_run([python, "-c", FORGOTTEN_IMPORT], cwd=tmp_path, env=env).stdout.strip().splitlines()[-1])
    assert not shown["ds_odc_imported"]
    odc, typo = shown["odc"], shown["typo"]
    assert odc["type"] == typo["type"] == "ValidationError"
    assert "Extra inputs are not permitted" in odc["str"] and "import ds_odc" not in odc["str"]  # message unchanged
    assert "add `import ds_odc`" in odc["traceback"], odc["traceback"]
    assert "import ds_odc" not in typo["traceback"], typo["traceback"]
