#!/usr/bin/env bash
# Download (never install) the pure-Python wheels scripts/gpu_smoke.sh --wheels installs on a bare GPU machine
# without network: torchtitan 0.3.0 and what it needs beyond a CUDA image's packages (torch, numpy, safetensors,
# tokenizers, transformers, pyarrow, pandas, tensorboard, pillow, ... are there), at the versions .venv holds.
#   scripts/gpu_wheels.sh [DIR]     # default DIR: .whl (git-ignored); Python 3.12 wheels
# torchtitan 0.3.0's requirements (its METADATA): torchdata, torch_checkpointing, datasets, tokenizers, safetensors,
# tyro, tensorboard, wandb, einops, pillow, spmd_types==0.2.3. Carried: the pure-Python ones an image may lack, with
# tyro's docstring_parser and typeguard and datasets' dill and multiprocess. Not carried: tokenizers, safetensors,
# pillow (binary; in the image), tensorboard (in the image: torchtitan imports it at start, as 0.2.2 did), wandb
# (binary, imported only with metrics.enable_wandb). tomli went with 0.2.2 (Python 3.11's tomllib reads the TOML).
# torch itself cannot be carried (GBs): the image's CUDA torch is what runs, older than the 2.15 torchtitan 0.3.0
# was built against (gpu_smoke.py says in one line what that breaks: torch_has_set_timeout, torchtitan_import).
# The smoke's parts (scripts/gpu_smoke.py, scripts/gpu_checks/) import only torch (distributed, fsdp, multiprocessing),
# numpy, safetensors, torchtitan and this package: nothing more to carry (nvidia-smi, where present, is optional).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/.whl}"
PY="$ROOT/.venv/bin/python"
PKGS=(torchtitan torchdata torch_checkpointing spmd_types tyro docstring_parser typeguard datasets dill multiprocess einops)
pins=()
for p in "${PKGS[@]}"; do
  pins+=("$p==$("$PY" -c "import importlib.metadata as m; print(m.version('$p'))")")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DIR" "${pins[@]}"
ls "$DIR"
