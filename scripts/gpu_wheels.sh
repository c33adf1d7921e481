#!/usr/bin/env bash
# Download (never install) the pure-Python wheels scripts/gpu_smoke.sh --wheels installs on a bare GPU machine
# without network: torchtitan and what it needs beyond a CUDA image's packages (torch, numpy, safetensors,
# tokenizers, transformers, pyarrow, pandas, ... are there), at the versions .venv holds.
#   scripts/gpu_wheels.sh [DIR]     # default DIR: .whl (git-ignored); Python 3.12 wheels
# The smoke's parts (scripts/gpu_smoke.py, scripts/gpu_checks/) import only torch (distributed, fsdp, multiprocessing),
# numpy, safetensors and this package: nothing more to carry (nvidia-smi, where present, is optional).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/.whl}"
PY="$ROOT/.venv/bin/python"
PKGS=(torchtitan tomli torchdata tyro datasets dill multiprocess docstring_parser typeguard)
pins=()
for p in "${PKGS[@]}"; do
  pins+=("$p==$("$PY" -c "import importlib.metadata as m; print(m.version('$p'))")")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DIR" "${pins[@]}"
ls "$DIR"
