#!/usr/bin/env bash
# Idempotent setup: creates .venv (if missing), installs torchtitan_flux with its dev and tasks extras, and builds the
# tiny local model the debug configs use (and its chat variant, for train_configs/debug_multiturn_cpu.toml). On a
# machine without CUDA it installs the CPU torch build.
# Re-running is cheap: the install step is skipped while pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
stamp=.venv/.flux-install-stamp
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "$VPY" -m pip install -q "torch>=2.10"
  else
    "$VPY" -m pip install -q "torch==2.13.0"   # CPU build; an unpinned torch would pull a CUDA build
  fi
  # one editable install at a time on this machine: setuptools writes torchtitan_flux.egg-info into the tree, and CI
  # runs scripts/setup_vllm.sh (which installs this package too) beside this script
  flock "${TMPDIR:-/tmp}/flux-editable-install.lock" "$VPY" -m pip install -q -e ".[dev,tasks]"
  echo "$want" > "$stamp"
fi
"$VPY" scripts/build_tiny_model.py --out assets/tiny-llama --flavor tiny --chat-out assets/tiny-chat
