#!/usr/bin/env bash
# Create .venv and install ds_odc with its test tools, CPU build of torch first (DeepSpeed's sdist would otherwise
# pull a CUDA torch). On a host without a local torch wheel, set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# to avoid downloading the CUDA build.
#
# The checkout gets nothing but .venv: pip's build leaves ds_odc.egg-info, which the editable install does not use
# (its metadata is in .venv), and the Python of .venv writes no bytecode caches (__pycache__) next to the sources (a
# .pth line; the installed packages were compiled as pip installed them, ds_odc's own modules compile in 0.15 s).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
DS_BUILD_OPS=0 .venv/bin/python -m pip install -q -c scripts/constraints.txt -e ".[dev]"
rm -rf ds_odc.egg-info
echo "import sys; sys.dont_write_bytecode = True" > \
    "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/ds_odc_no_bytecode.pth"
.venv/bin/python -c "import torch, deepspeed, ds_odc; print('installed: torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'ds_odc', ds_odc.__version__)"
