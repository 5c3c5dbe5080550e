"""DeepSpeed op builder for the NVSHMEM kernels in ``csrc/``.

NVSHMEM device code must be compiled relocatable (``-rdc=true``) and device-linked against
``libnvshmem_device.a``, a step torch's JIT ``load()`` (which DeepSpeed's ``jit_load`` wraps) does not have. So the
builder does it itself: ``nvcc -rdc`` + ``nvcc -dlink`` produce an object pair under ``TORCH_EXTENSIONS_DIR``, in a
folder named by a hash of everything that goes into it, and torch then links that pair into a pybind module built
from the C++-only binding. A changed kernel changes the hash, hence the link flags, hence torch's own build hash:
nothing stale is ever reused.

Concurrent ranks build once: a file lock serialises the object step and the result appears by atomic rename; torch
locks its own step.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from deepspeed.ops.op_builder.builder import CUDAOpBuilder

from ds_odc.ops.transport import OdcError

__all__ = ["OdcNvshmemBuilder", "load_op"]

# Shipped inside the package (ds_odc/csrc, a link to the checkout's csrc/), so an installed ds_odc finds them too.
CSRC = Path(__file__).resolve().parents[1] / "csrc"
KERNEL_SOURCES = [CSRC / "odc_kernels.cu"]
BINDING_SOURCES = [CSRC / "odc_binding.cpp"]
NVSHMEM_MAJOR = 3
NVSHMEM_PIN = "nvidia-nvshmem-cu13==3.4.5"


def nvshmem_home() -> Path | None:
    """Where NVSHMEM's ``include/`` and ``lib/`` are: ``$NVSHMEM_HOME``, else the ``nvidia-nvshmem`` wheel that torch
    pins (whose host library torch itself has already loaded, so ours is the same instance)."""
    env = os.environ.get("NVSHMEM_HOME")
    if env:
        return Path(env)
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def nvshmem_version(home: Path) -> tuple[int, int, int] | None:
    header = home / "include" / "non_abi" / "nvshmem_version.h"
    if not header.exists():
        return None
    text = header.read_text()
    parts = [re.search(rf"#define NVSHMEM_VENDOR_{k}_VERSION (\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    return tuple(int(p.group(1)) for p in parts) if all(parts) else None


def cuda_home() -> Path | None:
    """The CUDA toolkit torch builds with (its CUDA_HOME), else $CUDA_HOME, else the nvcc on PATH."""
    from torch.utils.cpp_extension import CUDA_HOME
    for candidate in (CUDA_HOME, os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if candidate and (Path(candidate) / "bin" / "nvcc").exists():
            return Path(candidate)
    nvcc = shutil.which("nvcc")
    return Path(nvcc).resolve().parents[1] if nvcc else None


def parse_arch_list(text: str) -> list[str]:
    """``TORCH_CUDA_ARCH_LIST`` entries as nvcc arch names: "9.0a" -> "90a", "8.0+PTX" -> "80"."""
    archs = []
    for entry in re.split(r"[;\s]+", text.strip()):
        found = re.fullmatch(r"(\d+)\.(\d+)([a-z]?)(\+PTX)?", entry, flags=re.IGNORECASE)
        if not found:
            if entry:
                raise OdcError(f"ds_odc: cannot read TORCH_CUDA_ARCH_LIST entry {entry!r} (expected e.g. 9.0 or 9.0a)")
            continue
        name = f"{found.group(1)}{found.group(2)}{found.group(3).lower()}"
        if name not in archs:
            archs.append(name)
    return archs


def strip_arch_suffixes(text: str) -> str:
    """DeepSpeed 0.19's arch parser reads "9.0a" as minor version "0a" and fails: hand it "9.0" instead."""
    return re.sub(r"(\d+\.\d+)[a-zA-Z]", r"\1", text)


class OdcNvshmemBuilder(CUDAOpBuilder):
    BUILD_VAR = "DS_BUILD_ODC_NVSHMEM"
    NAME = "ds_odc_nvshmem"

    def __init__(self, name=None):
        super().__init__(name=self.NAME if name is None else name)
        self._objects: list[str] | None = None

    def absolute_name(self):
        return f"ds_odc.ops.{self.NAME}_op"

    def sources(self):
        return [str(p) for p in BINDING_SOURCES]

    def include_paths(self):
        return []

    # -- compatibility ---------------------------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """Why the op cannot be built here, each with what to change (empty when it can)."""
        found = []
        missing = [str(p) for p in KERNEL_SOURCES + BINDING_SOURCES if not p.is_file()]
        if missing:
            found.append(f"ds_odc's kernel sources are missing ({', '.join(missing)}): reinstall ds_odc")
        if torch.version.cuda is None:
            found.append(f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch")
        if cuda_home() is None:
            found.append("nvcc not found: install the CUDA toolkit and set CUDA_HOME")
        home = nvshmem_home()
        if home is None:
            found.append(f"NVSHMEM not found: pip install {NVSHMEM_PIN} (the version torch pins) or set NVSHMEM_HOME")
        else:
            version = nvshmem_version(home)
            libs = [home / "lib" / "libnvshmem_device.a", home / "lib" / "libnvshmem_host.so.3"]
            if version is None:
                found.append(f"NVSHMEM headers missing under {home}/include: set NVSHMEM_HOME to an NVSHMEM 3.x install")
            elif version[0] != NVSHMEM_MAJOR:
                found.append(f"NVSHMEM {'.'.join(map(str, version))} at {home}: ds_odc needs {NVSHMEM_MAJOR}.x "
                             f"({NVSHMEM_PIN}, the version torch pins)")
            for lib in libs:
                if not lib.exists():
                    found.append(f"{lib} missing: set NVSHMEM_HOME to a complete NVSHMEM install")
        return found

    def is_compatible(self, verbose=False):
        found = self.problems()
        if found:
            self.error_log = "; ".join(found)
            if verbose:
                self.warning(f"{self.NAME} is not compatible: {self.error_log}")
            return False
        return super().is_compatible(verbose)

    # -- architecture flags --------------------------------------------------------------------------------------
    def compute_capability_args(self, cross_compile_archs=None):
        # jit_load restores TORCH_CUDA_ARCH_LIST afterwards; only DeepSpeed's parser needs the stripped form.
        if getattr(self, "_jit_arch_list", None):
            self._jit_arch_list = strip_arch_suffixes(self._jit_arch_list)
        if os.environ.get("TORCH_CUDA_ARCH_LIST"):
            os.environ["TORCH_CUDA_ARCH_LIST"] = strip_arch_suffixes(os.environ["TORCH_CUDA_ARCH_LIST"])
        return super().compute_capability_args(cross_compile_archs)

    def kernel_archs(self) -> list[str]:
        """Targets for the kernels: TORCH_CUDA_ARCH_LIST as written (suffixes such as 9.0a kept), else the GPUs here.
        NVSHMEM's device library needs sm_70 or newer."""
        text = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
        if text:
            archs = parse_arch_list(text)
        elif torch.cuda.is_available():
            archs = sorted({"%d%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        else:
            raise OdcError("ds_odc: no GPU visible to choose kernel targets from; set TORCH_CUDA_ARCH_LIST (e.g. 9.0a)")
        archs = [a for a in archs if int(re.match(r"\d+", a).group()) >= 70]
        if not archs:
            raise OdcError(f"ds_odc: TORCH_CUDA_ARCH_LIST={text!r} has no target >= 7.0, which NVSHMEM needs")
        return archs

    # -- the rdc + device-link step ----------------------------------------------------------------------------------
    def _nvcc(self) -> list[str]:
        # Same host compiler as torch's own nvcc steps (CUDAHOSTCXX), in case the default one is unsupported.
        host = os.environ.get("CUDAHOSTCXX")
        return [str(cuda_home() / "bin" / "nvcc"), *(["-ccbin", host] if host else [])]

    def build_objects(self, verbose: bool = False) -> list[str]:
        """Compile the kernels with -rdc and device-link them against libnvshmem_device.a, once per content hash."""
        home = nvshmem_home()
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in self.kernel_archs()]
        compile_cmd = [*self._nvcc(), "-std=c++17", "-O3", "-rdc=true", "-Xcompiler", "-fPIC", "--use_fast_math",
                       "-diag-suppress", "3012,3013", *gencode, f"-I{home / 'include'}", "-c"]
        dlink_cmd = [*self._nvcc(), "-dlink", "-Xcompiler", "-fPIC", *gencode, f"-L{home / 'lib'}", "-lnvshmem_device"]

        digest = hashlib.sha256()
        for part in (compile_cmd, dlink_cmd):
            digest.update(" ".join(part).encode())
        digest.update(subprocess.run([*self._nvcc(), "--version"], capture_output=True, text=True).stdout.encode())
        for src in KERNEL_SOURCES:
            digest.update(src.read_bytes())
        device_lib = home / "lib" / "libnvshmem_device.a"
        digest.update(f"{device_lib.stat().st_size}:{device_lib.stat().st_mtime_ns}".encode())

        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or _default_extensions_root()) / f"{self.NAME}_objects"
        final = root / digest.hexdigest()[:16]
        objects = [str(final / "kernels.o"), str(final / "kernels_dlink.o")]
        if all(Path(o).exists() for o in objects):
            return objects
        root.mkdir(parents=True, exist_ok=True)
        with open(root / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the process dies, so a crashed build never wedges peers
            if all(Path(o).exists() for o in objects):
                return objects
            tmp = Path(tempfile.mkdtemp(prefix="build-", dir=root))
            try:
                kernel_objs = []
                for src in KERNEL_SOURCES:
                    obj = tmp / (src.stem + ".o")
                    self._run([*compile_cmd, str(src), "-o", str(obj)], verbose)
                    kernel_objs.append(obj)
                # One object holding every kernel keeps the link line fixed; there is one source today.
                shutil.move(str(kernel_objs[0]), tmp / "kernels.o")
                self._run([*dlink_cmd, str(tmp / "kernels.o"), "-o", str(tmp / "kernels_dlink.o")], verbose)
                os.rename(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return objects

    @staticmethod
    def _run(cmd: list[str], verbose: bool) -> None:
        if verbose:
            print("ds_odc build:", " ".join(cmd), flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise OdcError(f"ds_odc: building the NVSHMEM kernels failed ({' '.join(cmd[:1] + cmd[-3:])}):\n"
                           f"{done.stderr[-4000:]}")

    def extra_ldflags(self):
        if self._objects is None:
            return []
        lib = nvshmem_home() / "lib"
        # The kernels call the CUDA runtime; torch adds -lcudart only for CUDA builds of torch.
        cudart = [d for d in ("lib64", "lib", "targets/x86_64-linux/lib") if (cuda_home() / d / "libcudart.so").exists()]
        return [*self._objects, f"-L{lib}", "-l:libnvshmem_device.a", "-l:libnvshmem_host.so.3",
                *([f"-L{cuda_home() / cudart[0]}", "-lcudart"] if cudart else []),
                # our private copy of the device library's host side must not shadow the one torch exports
                "-Wl,--exclude-libs,libnvshmem_device.a", f"-Wl,-rpath,{lib}"]

    def jit_load(self, verbose=True):
        if not self.is_compatible(verbose):
            raise OdcError(f"ds_odc: cannot build the NVSHMEM transport op: {self.error_log}")
        self._objects = self.build_objects(verbose)
        return super().jit_load(verbose)


def _default_extensions_root() -> str:
    from torch.utils.cpp_extension import get_default_build_root
    return get_default_build_root()


_LOADED = None


def load_op(verbose: bool = False):
    """The compiled extension module, building it on first use."""
    global _LOADED
    if _LOADED is None:
        _LOADED = OdcNvshmemBuilder().load(verbose=verbose)
    return _LOADED
