#!/usr/bin/env bash
# Runs the same short GRPO config with blocking and with async weight push, asserts that after the final sync
# every engine's weights are bitwise equal to the trainer's (sha256 over the pushed buckets), and prints a
# table of steps/s, sync time and the async speedup. Exit code non-zero on any mismatch or failed run.
#   scripts/verify_grpo_2gpu.sh          # 2 GPUs: trainer on GPU 0, embedded engine on GPU 1, NCCL
#   scripts/verify_grpo_2gpu.sh --cpu    # the same checks on CPU with gloo (what CI runs)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
exec "$PY" scripts/verify_grpo.py "$@"
