#!/usr/bin/env bash
# Start an SGLang (0.5.23) server on 127.0.0.1 (or $FLUX_HOST), ready for torchtitan_flux weight sync
# (rollout.engine = "sglang", rollout.urls = ["http://127.0.0.1:PORT"]).
#
#   scripts/launch_sglang.sh MODEL_DIR [PORT] [extra sglang.launch_server args...]
#   TORCHTITAN_FLUX_TOKEN=... FLUX_HOST=10.0.0.5 scripts/launch_sglang.sh MODEL_DIR [PORT]   # off loopback
#
# Security: the weight-update endpoints let anyone who can reach the server replace the model. FLUX_HOST (default
# 127.0.0.1) is the address the server listens on; anything but a loopback address is refused unless
# TORCHTITAN_FLUX_TOKEN holds the shared token. With the token set (any host) it is passed as SGLang's --api-key,
# which answers 401 to every request without "Authorization: Bearer <token>" except /health* and /metrics* (set the
# trainer's variable named by weight_sync.auth_token_env to the same token). --api-key shows the token on the
# server's command line (ps): keep the machine's other users out, or start sglang.launch_server yourself.
#
# Needs a CUDA GPU: SGLang has no CPU build on PyPI (its CPU kernels exist only in source builds). Install with
# `pip install -e ".[sglang]"` into the interpreter given by $SGLANG_PYTHON (default: python3 on PATH).
# MODEL_DIR must hold the same HF Llama the trainer starts from (model.hf_assets_path). PORT defaults to 30000.
# SGLang's weight-update endpoints (/init_weights_update_group, /update_weights_from_distributed, /begin_ and
# /end_weight_update, /pause_generation, /continue_generation) need no flag; weight sync needs tensor and data
# parallel size 1 (one trainer rank per group). Returned log-probs are log_softmax(logits / temperature), what the
# trainer recomputes, as long as SGLANG_RETURN_ORIGINAL_LOGPROB is unset.
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 MODEL_DIR [PORT] [extra sglang.launch_server args...]" >&2
  exit 2
fi
MODEL_DIR=$1
PORT=${2:-30000}
shift $(( $# >= 2 ? 2 : 1 ))
. "$(dirname "$0")/flux_host.sh"  # HOST; refuses a non-loopback one without the token
PY=${SGLANG_PYTHON:-python3}
if ! (command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1); then
  echo "SGLang needs a CUDA GPU; none found on this machine (use scripts/launch_vllm.sh for a CPU server)" >&2
  exit 2
fi
if ! "$PY" -c "import sglang" 2>/dev/null; then
  echo "$PY cannot import sglang: pip install -e \".[sglang]\" (or set SGLANG_PYTHON)" >&2
  exit 2
fi
if [ ! -f "$MODEL_DIR/config.json" ]; then
  echo "$MODEL_DIR has no config.json: pass a HF model folder (python scripts/build_tiny_model.py builds one)" >&2
  exit 2
fi
unset SGLANG_RETURN_ORIGINAL_LOGPROB
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # the model comes from MODEL_DIR only
args=()
if [ -n "${TORCHTITAN_FLUX_TOKEN:-}" ]; then
  args+=(--api-key "$TORCHTITAN_FLUX_TOKEN")
fi
exec "$PY" -m sglang.launch_server --model-path "$MODEL_DIR" --host "$HOST" --port "$PORT" \
  --tp-size 1 --dp-size 1 --random-seed 0 --skip-server-warmup ${args[@]+"${args[@]}"} "$@"
