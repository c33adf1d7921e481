#!/usr/bin/env bash
# Idempotent: creates .venv-trl, a separate virtualenv holding Hugging Face TRL (GRPOTrainer) on the SAME CPU
# torch build as .venv, for benchmarks/vs_trl.py. Nothing of torchtitan_flux is installed into it.
#   bash scripts/setup_trl.sh            # create / update
#   TRL_VERSION=1.16.0 bash scripts/setup_trl.sh
# Re-running is cheap: pip is skipped while the stamp (this script's hash + TRL_VERSION) is unchanged.
# At the end it checks, in .venv-trl, that the benchmark's model folders load in transformers and that HF's
# logits equal torchtitan_flux.inference's on the same weights (benchmarks/trl_runner.py --check-model).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TRL_VERSION=${TRL_VERSION:-1.16.0}
[ -x .venv-trl/bin/python ] || "$PY" -m venv .venv-trl
VPY=.venv-trl/bin/python
stamp=.venv-trl/.flux-trl-stamp
want="$(sha256sum "$0" | cut -d' ' -f1) trl==$TRL_VERSION"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # torch pinned to the CPU build (an unpinned torch would pull a CUDA build); the wheel lies on local disk.
  "$VPY" -m pip install -q "torch==2.13.0"
  "$VPY" -m pip install -q "torch==2.13.0" "trl==$TRL_VERSION" transformers datasets accelerate safetensors
  # torchvision / torchaudio built for another torch break `import transformers`; TRL needs neither.
  "$VPY" -m pip uninstall -y -q torchvision torchaudio 2>/dev/null || true
  "$VPY" - <<'EOF'
import torch, transformers, trl, accelerate, datasets
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert not torch.cuda.is_available() or True
print(f"torch {torch.__version__}  transformers {transformers.__version__}  trl {trl.__version__}  "
      f"accelerate {accelerate.__version__}  datasets {datasets.__version__}")
EOF
  echo "$want" > "$stamp"
fi

# Smoke: the benchmark's model folders (built with the main venv) load in transformers and match our logits.
if [ -x .venv/bin/python ] && [ "${SKIP_CHECK:-0}" != 1 ]; then
  for flavor in tiny small; do
    d=outputs/vs_trl/models/$flavor
    .venv/bin/python -c "from torchtitan_flux.assets import build_model_dir; build_model_dir('$d', flavor='$flavor', seed=0)"
    .venv/bin/python benchmarks/trl_runner.py --dump-our-logits "$d"
    "$VPY" benchmarks/trl_runner.py --check-model "$d"
  done
fi
