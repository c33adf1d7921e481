#!/usr/bin/env bash
# Run the engine-side receiver's tests (tests/integration/test_transport.py, tests/unit/test_compat.py) under an OLD
# torch.
#
# The receiver (torchtitan_flux/wire/transport.py, compat.py, models/inference.py, engine/embedded.py) runs inside
# inference engines that pin their own torch, so it must work on torch >= 2.3 without torchtitan. This script builds
# a throwaway venv with only an old torch + numpy<2 + pytest (NOT our package's dependencies: no torchtitan, no
# pytest-xdist), puts the repository on PYTHONPATH and runs those two test files there. pyproject.toml's pytest
# addopts name pytest-xdist's options, so every pytest here runs with them cleared (-o addopts=).
#
#   scripts/check_old_torch.sh                       # torch 2.3.1 (default)
#   FLUX_OLD_TORCH=2.4.1 scripts/check_old_torch.sh  # another version
#   scripts/check_old_torch.sh --clean               # delete the venv afterwards (it is reused otherwise)
#   scripts/check_old_torch.sh -- -k swap            # extra pytest arguments after --
#   scripts/check_old_torch.sh --collect-only        # seconds, no venv (CI): the same pytest invocations, on
#       FLUX_NEW_PYTHON without pytest-xdist and with torchtitan unimportable, must collect the test files whole
#       (as many tests as a plain pytest run of them) and step 2's peer tests
#
# Environment: FLUX_OLD_TORCH (torch version, default 2.3.1), FLUX_OLD_TORCH_VENV (default
# ${TMPDIR:-/tmp}/flux_old_torch), PYTHON (interpreter that creates the venv, default python3; torch 2.3 ships
# wheels for CPython 3.8-3.12), FLUX_NEW_PYTHON (default: the repository's .venv/bin/python): step 2 runs the
# 2-process push tests with the sender (and the TCPStore) on that interpreter's torch and the receiver on the old
# torch, i.e. the two versions talk over one store + gloo group, as a trainer and a pinned engine do.
#
# PyPI's Linux x86_64 wheels of torch 2.3.1 are CUDA 12.1 builds: pip also pulls the nvidia-* runtime wheels
# (5.0 GB installed in all, about 1.5 min here). ``import torch`` needs them even on a CPU-only machine, because
# it loads libtorch_cuda.so and its CUDA libraries (it then finds no GPU and runs on CPU).
# Exit status: pytest's (non-zero on failure), or 3 if torchtitan is importable in the venv; --collect-only: 0 when
# the collections match, else 1 (2: bad usage).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_VERSION="${FLUX_OLD_TORCH:-2.3.1}"
VENV="${FLUX_OLD_TORCH_VENV:-${TMPDIR:-/tmp}/flux_old_torch}"
PY="${PYTHON:-python3}"
NEW="${FLUX_NEW_PYTHON:-$ROOT/.venv/bin/python}"
CLEAN=0
COLLECT=0
PYTEST_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --clean) CLEAN=1; shift ;;
    --collect-only) COLLECT=1; shift ;;
    --) shift; PYTEST_ARGS=("$@"); break ;;
    *) echo "check_old_torch.sh: error: unknown argument '$1'; allowed: --clean, --collect-only, -- PYTEST_ARGS" >&2
       exit 2 ;;
  esac
done
FILES=(tests/integration/test_transport.py tests/unit/test_compat.py)
# -p no:cacheprovider: no .pytest_cache from the old interpreter in the tree; -o addopts=: see above
PYTEST=(-m pytest -q -p no:cacheprovider -o addopts=)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1 OMP_NUM_THREADS=1
cd "$ROOT"

if [[ $COLLECT == 1 ]]; then
  # the old venv as far as collection sees it: no pytest-xdist, no torchtitan; a peer interpreter named (never run)
  blocked=$(mktemp -d)
  trap 'rm -rf "$blocked"' EXIT
  mkdir "$blocked/torchtitan"
  echo 'raise ImportError("torchtitan is not installed in the old-torch venv")' > "$blocked/torchtitan/__init__.py"
  export FLUX_PEER_PYTHON=/old-torch/bin/python
  count() { sed -nE 's|^([0-9]+) tests? collected.*|\1|p' <<< "$1"; }
  plain=$("$NEW" -m pytest -q -p no:cacheprovider --collect-only "${FILES[@]}" 2>&1) || true
  ours=$(PYTHONPATH="$blocked:$PYTHONPATH" "$NEW" "${PYTEST[@]}" -p no:xdist --collect-only "${FILES[@]}" 2>&1) || true
  want=$(count "$plain") got=$(count "$ours") peer=$(grep -c '\[peer-python\]' <<< "$ours" || true)
  echo "old_torch_collected=${got:-0} (a plain pytest run: ${want:-0}; step 2's peer tests among them: $peer)"
  if [[ -n $got && $got == "$want" && $peer -gt 0 ]]; then exit 0; fi
  echo "check_old_torch.sh: error: step 1 would run ${got:-none} of the ${want:-?} tests (step 2: $peer); its" \
    "collection said: $(grep -m1 -i 'error' <<< "$ours" || tail -1 <<< "$ours")" >&2
  exit 1
fi

t0=$(date +%s)
have="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
if [[ "${have%%+*}" != "$TORCH_VERSION" ]]; then
  echo "== creating $VENV with torch==$TORCH_VERSION (was: ${have:-none})"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --no-cache-dir --upgrade pip
  # --no-cache-dir: do not keep a second copy of the multi-GB wheels in ~/.cache/pip
  "$VENV/bin/python" -m pip install --quiet --no-cache-dir "torch==$TORCH_VERSION" "numpy<2" "pytest>=8"
else
  echo "== reusing $VENV (torch $have)"
fi
t1=$(date +%s)

if "$VENV/bin/python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torchtitan") is None)'; then
  echo "error: torchtitan is importable in $VENV; this check must run without it" >&2
  exit 3
fi

echo "== torch: $("$VENV/bin/python" -c 'import torch, sys; print(torch.__version__, "python", sys.version.split()[0], "cuda available:", torch.cuda.is_available())')"
echo "== venv size: $(du -sh "$VENV" | cut -f1)   setup: $((t1 - t0))s"

rc=0
# 1. everything under the old torch
echo "== 1/2: ${FILES[*]} on torch $TORCH_VERSION"
FLUX_PEER_PYTHON= "$VENV/bin/python" "${PYTEST[@]}" "${FILES[@]}" "${PYTEST_ARGS[@]}" || rc=$?

# 2. the deployment direction: the trainer's torch sends (and hosts the store), the receiver runs on the old torch
if [[ -x "$NEW" ]]; then
  echo "== 2/2: sender on $NEW (torch $("$NEW" -c 'import torch; print(torch.__version__)')), receiver on torch $TORCH_VERSION"
  FLUX_PEER_PYTHON="$VENV/bin/python" "$NEW" "${PYTEST[@]}" "${FILES[0]}" -k peer-python || rc=$?
else
  echo "== 2/2: skipped (no $NEW; set FLUX_NEW_PYTHON to the trainer's interpreter)"
fi
t2=$(date +%s)
echo "== tests: $((t2 - t1))s   total: $((t2 - t0))s   rc=$rc"

if [[ $CLEAN == 1 ]]; then
  rm -rf "$VENV"
  echo "== removed $VENV"
fi
exit $rc
