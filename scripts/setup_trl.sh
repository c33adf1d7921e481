#!/usr/bin/env bash
# Idempotent: creates .venv-trl, a separate virtualenv holding Hugging Face TRL (GRPOTrainer) on torch 2.13.0's CPU
# build, for benchmarks/vs_trl.py. Nothing of torchtitan_flux is installed into it. Until the move to torchtitan 0.3.0
# that was .venv's torch too (every vs_trl figure in docs/benchmarks.md); .venv now holds torch 2.15.0, so the two
# sides of a new comparison run different torch versions.
#   bash scripts/setup_trl.sh            # create / update
#   TRL_VERSION=1.16.0 bash scripts/setup_trl.sh
# Re-running is cheap: pip is skipped while the stamp (this script's hash + TRL_VERSION) is unchanged.
# At the end it checks, in .venv-trl, that the benchmark's model folders load in transformers and that HF's
# logits equal torchtitan_flux.models.inference's on the same weights (benchmarks/trl_runner.py --check-model).
set -euo pipefail   # pipefail: a failing pip fails the script even through the grep filter below
SCRIPT="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SCRIPT")/.."
PY=${PYTHON:-python3}
TRL_VERSION=${TRL_VERSION:-1.16.0}
[ -x .venv-trl/bin/python ] || "$PY" -m venv .venv-trl
VPY=.venv-trl/bin/python
stamp=.venv-trl/.flux-trl-stamp
want="$(sha256sum "$SCRIPT" | cut -d' ' -f1) trl==$TRL_VERSION"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # torch pinned to the CPU build (an unpinned torch would pull a CUDA build); the wheel lies on local disk.
  # (grep drops pip's "Location ... is ignored" notes about this machine's local index folders)
  "$VPY" -m pip install -q "torch==2.13.0" 2>&1 | { grep -v "is ignored: it is neither" || true; }
  "$VPY" -m pip install -q "torch==2.13.0" "trl==$TRL_VERSION" transformers datasets accelerate safetensors \
    2>&1 | { grep -v "is ignored: it is neither" || true; }
  # torchvision / torchaudio built for another torch break `import transformers`; TRL needs neither.
  "$VPY" -m pip uninstall -y -q torchvision torchaudio 2>/dev/null || true
  "$VPY" - <<'EOF'
import torch, transformers, trl, accelerate, datasets
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"torch {torch.__version__}  transformers {transformers.__version__}  trl {trl.__version__}  "
      f"accelerate {accelerate.__version__}  datasets {datasets.__version__}")
EOF
  echo "$want" > "$stamp"
fi

# Smoke: the benchmark's model folders (built by the main venv, as vs_trl.py builds them) load in transformers
# as LlamaForCausalLM + PreTrainedTokenizerFast, and HF's logits equal torchtitan_flux.models.inference's (torch-only
# module, loaded by path) on the same weights. Fails (exit 1) on a mismatch above 1e-4. SKIP_CHECK=1 skips it.
if [ "${SKIP_CHECK:-0}" != 1 ]; then
  if [ -x .venv/bin/python ]; then
    for flavor in tiny small; do
      d=outputs/vs_trl/models/$flavor
      PYTHONPATH=scripts .venv/bin/python -c "from model_assets import build_model_dir; build_model_dir('$d', flavor='$flavor', seed=0)"
      TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1 "$VPY" benchmarks/trl_runner.py --check-model "$d"
    done
  else
    echo "setup_trl: .venv missing (run scripts/setup.sh); model check skipped" >&2
  fi
fi
