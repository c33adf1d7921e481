#!/usr/bin/env bash
# Idempotent: creates .venv-030 (gitignored) with torch 2.15.0, torchtitan 0.3.0 and this package with its dev and
# tasks extras: the venv of the torchtitan 0.3.0 port (issue 50, docs/port_torchtitan_030.md). At the switch it
# becomes scripts/setup.sh. About 5 GB and 2 minutes on first run; a no-op afterwards while pyproject.toml and this
# script are unchanged.
#
# torch: PyPI has no CPU build of torch 2.15.0. Its Linux x86_64 wheel is the CUDA 13.2 build (539 MB) and needs
# the CUDA libraries even to import on a CPU-only machine (libtorch_cuda.so links cudnn, cublas, nccl, ...:
# `--no-deps` alone fails with "libcudnn.so.9: cannot open shared object file"), so they are installed too (about
# 4 GB). triton, the one other dependency, is left out without CUDA (removed after the installs that pull it back):
# a CPU torch from the PyTorch index has none, and the triton_stub patch is what lets torchtitan import without it.
# This machine's pip configuration caps torch at the releases on its disk (constraints torch<=2.14.1):
# PIP_CONSTRAINT=/dev/null lifts that cap for these installs only.
#
# datasets: torchtitan 0.3.0 requires datasets<4.8 and pip resolves 4.7.0, under which 8 tests of
# tests/unit/test_data.py fail (a JSONL file with a null, list or dict prompt cannot be read at all: "KeyError:
# 'level'", where 5.2.0 reads it and our check names the record). So datasets 5.2.0 is installed over it, the
# release the project used with torchtitan 0.2.2; pip reports the conflict and torchtitan's own hf_datasets still
# import (the trainer does not use them).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=${FLUX_030_VENV:-.venv-030}
TORCH=torch==2.15.0
export PIP_CONSTRAINT=/dev/null
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
stamp="$VENV/.flux-install-stamp"
want=$(cat pyproject.toml "$0" | sha256sum | cut -d" " -f1)  # re-run when either changes
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "$VPY" -m pip install -q "$TORCH"
  else
    # torch 2.15.0's own requirements (its wheel's METADATA) less triton
    "$VPY" -m pip install -q --no-deps "$TORCH"
    "$VPY" -m pip install -q filelock "typing-extensions>=4.13.0" "setuptools>=77.0.3" "sympy>=1.13.3" \
      "networkx>=2.5.1" jinja2 "fsspec>=0.8.5" \
      "cuda-toolkit[cublas,cudart,cufft,cufile,cupti,cusolver,cusparse,nvjitlink,nvrtc,nvtx]==13.2.2" \
      "cuda-bindings<14,>=13.0.3" nvidia-cudnn-cu13==9.26.0.51 nvidia-cusparselt-cu13==0.8.1 \
      nvidia-nccl-cu13==2.30.7 nvidia-nvshmem-cu13==3.7.2
  fi
  # one editable install at a time on this machine (see scripts/setup.sh)
  flock "${TMPDIR:-/tmp}/flux-editable-install.lock" "$VPY" -m pip install -q -e ".[dev,tasks]"
  "$VPY" -m pip install -q datasets==5.2.0  # over torchtitan's datasets<4.8: see above
  if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; }; then
    "$VPY" -m pip uninstall -q -y triton  # pulled back by the resolver as torch's requirement
  fi
  echo "$want" > "$stamp"
fi
"$VPY" -c "import torch, torchtitan, importlib.metadata as m; print('torch', torch.__version__, 'torchtitan', \
m.version('torchtitan'), 'datasets', m.version('datasets'))"
