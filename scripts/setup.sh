#!/usr/bin/env bash
# Idempotent setup: creates .venv (if missing) with torch 2.15.0 and torchtitan 0.3.0, installs torchtitan_flux with
# its dev and tasks extras, and builds the tiny local model the debug configs use (and its chat variant, for
# train_configs/debug_multiturn_cpu.toml). Re-running is cheap: the install step is skipped while pyproject.toml and
# this script are unchanged. About 5 GB and 2-3 minutes on a first run here.
#
# torch: PyPI has no CPU build of torch 2.15.0 (the PyTorch index, which has one, is not reachable from every
# machine). Its Linux x86_64 wheel is the CUDA 13.2 build (539 MB), which needs the CUDA libraries even to import on a
# machine without a GPU (libtorch_cuda.so links cudnn, cublas, nccl, ...: `--no-deps` alone fails with
# "libcudnn.so.9: cannot open shared object file"), so they are installed too (about 4 GB). triton, the one other
# dependency, is left out without CUDA (uninstalled after the installs that pull it back): the CPU build has none, and
# the triton_stub patch (patches/) is what lets torchtitan import without it. Where there is a GPU, torch comes with
# all its dependencies. Some machines' pip configuration caps torch at the releases on their disk
# (PIP_CONSTRAINT): the installs here lift that cap.
#
# datasets: torchtitan 0.3.0 requires datasets<4.8, under which a JSONL file with a null, list or dict prompt cannot
# be read at all ("KeyError: 'level'"; 8 tests of tests/unit/test_data.py), where 5.2.0 reads it and our check names
# the record. So datasets 5.2.0 is installed over it (pip reports the conflict); torchtitan's own hf_datasets still
# import under it, and the trainer does not use them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=torch==2.15.0
export PIP_CONSTRAINT=/dev/null
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
stamp=.venv/.flux-install-stamp
want=$(cat pyproject.toml "$0" | sha256sum | cut -d' ' -f1)  # re-run when either changes
gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; }
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  if gpu; then
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
  # one editable install at a time on this machine: setuptools writes torchtitan_flux.egg-info into the tree, and CI
  # runs scripts/setup_vllm.sh (which installs this package too) beside this script
  flock "${TMPDIR:-/tmp}/flux-editable-install.lock" "$VPY" -m pip install -q -e ".[dev,tasks]"
  "$VPY" -m pip install -q datasets==5.2.0  # over torchtitan's datasets<4.8: see above
  echo "setup.sh: datasets 5.2.0 over torchtitan 0.3.0's datasets<4.8 is deliberate (pip's conflict line above; see this script's header)"
  gpu || "$VPY" -m pip uninstall -q -y triton  # pulled back by the resolver as torch's requirement
  echo "$want" > "$stamp"
fi
"$VPY" scripts/build_tiny_model.py --out assets/tiny-llama --flavor tiny --chat-out assets/tiny-chat
