"""``python -m ds_odc`` where users start it: from any folder (one that holds a folder named ``ds_odc`` included),
and in a Python that lacks what ds_odc needs (it says what is missing and how to install it, no traceback)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# What an editable install does (setuptools' finder): ds_odc is found after the path entries, so an empty folder
# named ds_odc in the current folder shadows it as a namespace package.
EDITABLE_LIKE = """
import importlib.machinery, importlib.util, os, runpy, sys
ROOT = {root!r}
class Editable:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "ds_odc" and not name.startswith("ds_odc."):
            return None
        base = os.path.join(ROOT, *name.split("."))
        if os.path.isdir(base):
            return importlib.util.spec_from_file_location(name, os.path.join(base, "__init__.py"),
                                                          submodule_search_locations=[base])
        return importlib.util.spec_from_file_location(name, base + ".py") if os.path.isfile(base + ".py") else None
after = next(i for i, f in enumerate(sys.meta_path) if f is importlib.machinery.PathFinder) + 1
sys.meta_path.insert(after, Editable)
sys.argv = ["ds_odc", "check", {config!r}]
runpy.run_module("ds_odc", run_name="__main__", alter_sys=True)
"""


def test_check_works_from_a_folder_that_holds_a_folder_named_ds_odc(tmp_path):
    (tmp_path / "ds_odc").mkdir()  # e.g. the parent of a clone called ds_odc
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3, "odc": True}}))
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    script = EDITABLE_LIKE.format(root=str(REPO), config=str(config))
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "valid; ODC on" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_a_python_without_torch_or_deepspeed_says_what_is_missing_and_how_to_install(tmp_path):
    """``python -S``: no site-packages, so no torch, DeepSpeed or pydantic; ds_odc itself is found in the checkout (and
    writes no bytecode there: without site, the environment's setting of that is not read)."""
    for argv in ([], ["check", str(tmp_path / "any.json")]):
        proc = subprocess.run([sys.executable, "-S", "-m", "ds_odc", *argv], cwd=REPO, capture_output=True,
                              text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"})
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        assert "has no torch, deepspeed, pydantic, which ds_odc needs" in proc.stderr, proc.stderr
        assert "pip install torch" in proc.stderr and ("install.sh" in proc.stderr or ".venv" in proc.stderr)
