#!/usr/bin/env bash
# Runs the same short GRPO config with blocking and with async weight push (and an FSDP + activation
# checkpointing variant), each child under a timeout, asserts that after the final sync every engine's weights
# are bitwise equal to the trainer's (sha256 over the pushed buckets, where the engine can hash them), and prints
# checksums, the sync time split (main-thread pause vs push transfer) and the async speedup as key=value lines.
# Exit code non-zero on any mismatch, failed or timed-out run.
#   scripts/verify_grpo_2gpu.sh                     # 2 GPUs: trainer on GPU 0, a vLLM server launched on GPU 1
#   scripts/verify_grpo_2gpu.sh --engine embedded   # 2 GPUs: trainer on GPU 0, embedded engine on GPU 1
#                                                   # (>= 3 GPUs: + FSDP/AC/bf16 on GPUs 0-1, engine on GPU 2)
#   scripts/verify_grpo_2gpu.sh --cpu               # the same steps on CPU with gloo (what CI runs)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
exec "$PY" scripts/verify_grpo.py "$@"
