"""``python -m ds_odc``: what ODC can use on this machine, in the style of DeepSpeed's ``ds_report``.

Versions of what ODC builds on, which transports can run here (and, when one cannot, what to change), whether the
GPU op can be built, the GPUs and which pairs can reach each other's memory, and the ``odc`` config keys with
their defaults. Read-only: nothing is built, initialised or allocated.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import inspect
import os
import platform
import subprocess
import sys
import textwrap
from dataclasses import dataclass

__all__: list[str] = []

WIDTH = 34  # name column, dots included


@dataclass
class Check:
    name: str
    ok: bool | None  # None: information, no verdict
    detail: str  # one reason per line where there are several


# -- what is installed -------------------------------------------------------------------------------------------------
def _installed(*names: str) -> str | None:
    """The version of the first of ``names`` (distribution names) that is installed, naming it when there are
    several candidates."""
    for name in names:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return version if len(names) == 1 else f"{version} ({name})"
    return None


def nvcc_release() -> str | None:
    from ds_odc.ops.builder import cuda_home
    home = cuda_home()
    if home is None:
        return None
    try:
        out = subprocess.run([str(home / "bin" / "nvcc"), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    release = [line for line in out.splitlines() if "release" in line]
    return f"{release[-1].split('release')[-1].strip()} ({home})" if release else str(home)


def nvshmem_description() -> str | None:
    from ds_odc.ops.builder import nvshmem_home, nvshmem_version
    home = nvshmem_home()
    if home is None:
        return None
    version = nvshmem_version(home)
    where = "$NVSHMEM_HOME" if os.environ.get("NVSHMEM_HOME") else "pip wheel"
    return f"{'.'.join(map(str, version)) if version else 'unknown version'} ({where}: {home})"


def versions() -> list[Check]:
    import torch

    import ds_odc
    from ds_odc.zero import SUPPORTED_DEEPSPEED as SUPPORTED

    cuda = f", CUDA {torch.version.cuda}" if torch.version.cuda else ", CPU-only build"
    deepspeed = _installed("deepspeed")
    missing = "not installed"
    return [
        Check("ds_odc", None, f"{ds_odc.__version__} ({os.path.dirname(ds_odc.__file__)})"),
        Check("python", None, f"{platform.python_version()} ({sys.executable})"),
        Check("torch", None, f"{torch.__version__}{cuda}"),
        Check("deepspeed", None, f"{deepspeed} (ds_odc supports {SUPPORTED})"),
        Check("transformers", None, _installed("transformers") or missing),
        Check("NVSHMEM", None, nvshmem_description() or "not found"),
        Check("nvshmem4py", None, _installed("nvshmem4py-cu13", "nvshmem4py-cu12") or missing),
        Check("mpi4py", None, _installed("mpi4py") or f"{missing} (needed only for mpirun)"),
        Check("nvcc", None, nvcc_release() or "not found"),
    ]


# -- what can run --------------------------------------------------------------------------------------------------------
def shm_check() -> Check:
    from ds_odc.ops.shm import shm_dir
    where = shm_dir()
    try:
        stats = os.statvfs(where)
    except OSError as err:
        return Check("shm (CPU ranks of one host)", False, f"{where} unusable: {err}")
    free = stats.f_bavail * stats.f_frsize / 2**30
    note = "" if where == "/dev/shm" else " (no writable /dev/shm: files in the temp dir instead)"
    return Check("shm (CPU ranks of one host)", True, f"buffers in {where}, {free:.1f} GiB free{note}")


def nvshmem_problems() -> list[str]:
    """Why the nvshmem transport cannot run here, each with what to change (empty when it can)."""
    import torch

    from ds_odc.ops.builder import OdcNvshmemBuilder

    found = OdcNvshmemBuilder().problems()
    if torch.version.cuda is not None and not torch.cuda.is_available():
        found.append("no CUDA device visible")
    if importlib.util.find_spec("nvshmem") is None:
        found.append("nvshmem4py not installed: pip install --no-deps nvshmem4py-cu13==0.4.1 cuda-core")
    return found


def transports() -> list[Check]:
    problems = nvshmem_problems()
    nvshmem = Check("nvshmem (CUDA ranks)", not problems, "\n".join(problems) or "can be built and run")
    return [shm_check(), nvshmem, shared_gpu_check(problems)]


def shared_gpu_check(nvshmem_problems: list[str]) -> Check:
    """Whether several ranks sharing one GPU is on (DS_ODC_SHARED_GPU) and whether it could run here."""
    import torch

    from ds_odc.training.distributed import SHARED_GPU_ENV, shared_gpu_mode
    name = "shared GPU (ranks on one GPU)"
    if not torch.cuda.is_available():
        state = "ON, but no CUDA device is visible: " if shared_gpu_mode() else "off; "
        return Check(name, False if shared_gpu_mode() else None, f"{state}needs a CUDA GPU (CPU ranks need no such mode)")
    how = ("every rank on GPU 0, torch.distributed over gloo, one NVSHMEM PE per process; checks correctness only, "
           "the ranks share the GPU's SMs")
    if shared_gpu_mode():
        return Check(name, not nvshmem_problems, f"ON ({SHARED_GPU_ENV}=1): {how}" +
                     ("" if not nvshmem_problems else "; ODC's transport cannot run here (see above)"))
    return Check(name, None, f"off; init_distributed(shared_gpu=True), --shared-gpu in the examples or "
                             f"{SHARED_GPU_ENV}=1 puts {how}")


def odc_key_check() -> Check:
    from deepspeed.runtime.zero import config as zero_config

    from ds_odc.config import OdcZeroConfig
    installed = zero_config.DeepSpeedZeroConfig is OdcZeroConfig
    return Check("odc config key", installed, "known to DeepSpeed (import ds_odc did it)" if installed else
                 "not installed: import ds_odc before deepspeed.initialize")


def builder_checks() -> list[Check]:
    from torch.utils.cpp_extension import is_ninja_available

    from ds_odc.ops.builder import BINDING_SOURCES, CSRC, KERNEL_SOURCES, OdcNvshmemBuilder
    sources = KERNEL_SOURCES + BINDING_SOURCES
    present = [p for p in sources if p.is_file()]
    problems = OdcNvshmemBuilder().problems()
    return [
        Check("ninja", is_ninja_available(), "found" if is_ninja_available() else "not found: pip install ninja"),
        Check("kernel sources", len(present) == len(sources), f"{len(present)} of {len(sources)} in {CSRC}"),
        Check(f"{OdcNvshmemBuilder.NAME} op", not problems, "\n".join(problems) or "compatible (JIT-built on first use)"),
    ]


def gpus() -> list[Check]:
    import torch
    if not torch.cuda.is_available():
        return [Check("GPUs", None, "none visible")]
    count = torch.cuda.device_count()
    found = []
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        found.append(Check(f"GPU {i}", None, f"{props.name}, sm_{props.major}{props.minor}, "
                                             f"{props.total_memory / 2**30:.0f} GiB"))
    blocked = [(i, j) for i in range(count) for j in range(count) if i != j and not torch.cuda.can_device_access_peer(i, j)]
    if count > 1:
        found.append(Check("peer access", not blocked, "every pair" if not blocked else
                           "missing for " + ", ".join(f"{i}->{j}" for i, j in blocked) +
                           " (ODC then uses NVSHMEM get/put between them)"))
    return found


# -- the config keys -----------------------------------------------------------------------------------------------------
def field_docs(cls) -> dict[str, str]:
    """The docstring written under each field of a pydantic model class (the ``odc`` keys' documentation)."""
    docs = {}
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    for field, after in zip(body, body[1:]):
        if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[field.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def odc_defaults() -> list[tuple[str, str, str]]:
    """(key, default, meaning) for every key of the ``odc`` block, the keys of its sub-blocks (``balancer``) as
    ``balancer.planner``."""
    import json
    import typing

    from pydantic import BaseModel

    from ds_odc.config import OdcConfig

    def rows_of(model, prefix: str) -> list[tuple[str, str, str]]:
        docs = field_docs(model)
        rows = []
        for name, field in model.model_fields.items():
            default = field.get_default(call_default_factory=True)
            rows.append((prefix + name, json.dumps(default), field.description or docs.get(name, "")))
            nested = [t for t in (field.annotation, *typing.get_args(field.annotation))
                      if isinstance(t, type) and issubclass(t, BaseModel)]
            if nested:
                rows.extend(rows_of(nested[0], f"{prefix}{name}."))
        return rows

    return rows_of(OdcConfig, "")


# -- output --------------------------------------------------------------------------------------------------------------
def _tag(ok: bool | None, color: bool) -> str:
    if ok is None:
        return ""
    text, code = ("[OKAY]", "92") if ok else ("[NO]", "93")
    return (f"\033[{code}m{text}\033[0m " if color else f"{text} ")


def render(color: bool = False) -> str:
    lines = []

    def section(title: str, checks: list[Check]) -> None:
        lines.extend(["-" * 78, title, "-" * 78])
        for c in checks:
            first, *more = c.detail.splitlines() or [""]
            lines.append(f"{c.name} {'.' * max(2, WIDTH - len(c.name) - 1)} {_tag(c.ok, color)}{first}")
            lines.extend(" " * (WIDTH + 1 + len(_tag(c.ok, False))) + line for line in more)

    section("ds_odc environment report", versions())
    section("transports (zero_optimization.odc.transport; \"auto\": nvshmem on CUDA, else shm)",
            [odc_key_check(), *transports()])
    section("GPU op builder (DeepSpeed op builder, JIT)", builder_checks())
    section("GPUs", gpus())
    lines.extend(["-" * 78, 'odc config keys: "zero_optimization": {"stage": 3, "odc": {...}} (or "odc": true)',
                  "-" * 78])
    for key, default, meaning in odc_defaults():
        lines.append(f"{key} = {default}")
        lines.extend(textwrap.wrap(meaning, 100, initial_indent="    ", subsequent_indent="    "))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import ds_odc
    ds_odc.patch()  # imports DeepSpeed with its start-up log on stderr, away from the report
    print(render(color=sys.stdout.isatty()))
    return 0
