"""Scripts of ``examples/`` and ``benchmarks/`` as modules, for tests of their functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def load_script(script: Path):
    """``script`` as a module (its ``main`` does not run), its own folder importable while it loads, as when it runs
    (benchmarks import their helpers, e.g. ``_modes``, from beside them)."""
    folder = str(Path(script).parent)
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(Path(script).stem, script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module
