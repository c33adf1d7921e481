#!/usr/bin/env bash
# Every benchmark's cheapest mode (--quick), so that a change which breaks one fails CI instead of rotting
# unnoticed. Each must exit 0 and print at least one key=value headline line; the figures are not measurements.
# Needs .venv (scripts/setup.sh), .venv-vllm (scripts/setup_vllm.sh) and .venv-trl (scripts/setup_trl.sh):
# a missing one is an error, not a skip.
#   bash scripts/bench_quick.sh            # all of them (~6 min on 2 cores)
#   bash scripts/bench_quick.sh weight_sync controller   # some of them
set -euo pipefail
cd "$(dirname "$0")/.."
all=(weight_sync controller sync_memory train_step startup vs_trl vllm_async)
names=("${@:-${all[@]}}")
need() { [ -x "$1/bin/python" ] || { echo "bench_quick: $1 is missing: run $2" >&2; exit 1; }; }
need .venv scripts/setup.sh
for b in "${names[@]}"; do
  case $b in vllm_async) need .venv-vllm scripts/setup_vllm.sh ;; vs_trl) need .venv-trl scripts/setup_trl.sh ;; esac
done
for b in "${names[@]}"; do
  [ -f "benchmarks/$b.py" ] || { echo "bench_quick: no benchmarks/$b.py; known: ${all[*]}" >&2; exit 2; }
  modes=("")
  [ "$b" = weight_sync ] && modes=("" "--colocated" "--sparse")  # each mode with its own key=value lines
  for mode in "${modes[@]}"; do
    echo "=== benchmarks/$b.py --quick $mode"
    t0=$SECONDS
    out=$(.venv/bin/python "benchmarks/$b.py" --quick $mode 2>&1) || { echo "$out" | tail -40; echo "bench_quick: $b $mode failed" >&2; exit 1; }
    lines=$(echo "$out" | grep -E '^[a-z_0-9]+=' || true)
    [ -n "$lines" ] || { echo "$out" | tail -40; echo "bench_quick: $b $mode printed no key=value line" >&2; exit 1; }
    echo "$lines"
    echo "--- $b $mode: $((SECONDS - t0)) s"
  done
done
