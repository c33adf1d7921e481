#!/usr/bin/env bash
# The first thing to run on a GPU machine, in under 10 minutes on one bare GPU with a CUDA torch and no
# network; `--cpu` runs the same parts on CPU (CI runs it). What each part checks and prints: scripts/gpu_smoke.py.
#
#   scripts/gpu_smoke.sh                       # on a GPU machine where the package is installed (scripts/setup.sh)
#   scripts/gpu_smoke.sh --wheels .whl         # a bare GPU machine: install the carried pure-Python wheels first
#   scripts/gpu_smoke.sh --cpu                 # the CPU twin
#   scripts/gpu_smoke.sh --out DIR             # keep the logs (part_<name>.log), the trace and the run folders
#   scripts/gpu_smoke.sh --only seqlock,fsdp   # some parts; --budget S: all parts within S seconds (default 470)
#
# Every part runs in its own process under its own time limit; a part the budget leaves no time for prints
# part_<name>=not_run. What each part checks and prints: docs/gpu.md, "Run this first".
#
# --wheels DIR: wheels made here by scripts/gpu_wheels.sh (torchtitan and the pure-Python packages it needs that a
# CUDA image lacks) are installed into /tmp/flux_wheels, and this checkout is installed in editable mode into the
# interpreter's environment if it is not importable yet (offline: --no-index --no-build-isolation).
# Environment: PYTHON (default: .venv/bin/python if present, else python3).
# Exit status: 0 when every check held (the last line is smoke_ok=1), 1 if one failed, 2 on bad usage.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS=""
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS="${2:?--wheels needs a folder}"; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
if [ -n "$WHEELS" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/flux_wheels \
    "$WHEELS"/*.whl
  export PYTHONPATH="/tmp/flux_wheels${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! (cd /tmp && "$PY" -c "import torchtitan_flux.patches" 2>/dev/null); then
  "$PY" -m pip install -q --no-deps --no-index --no-build-isolation -e "$ROOT"
fi
cd "$ROOT"
exec "$PY" "$ROOT/scripts/gpu_smoke.py" ${ARGS[@]+"${ARGS[@]}"}
