#!/usr/bin/env bash
# Every benchmark's cheapest mode (--quick), so that a change which breaks one fails CI instead of rotting
# unnoticed. Each must exit 0 and print at least one key=value headline line; the figures are not measurements,
# so two run at a time (BENCH_JOBS, default 2: one per core of this machine kind; vs_trl's runs alone), each into
# its own log, and the results are printed in order.
# Needs .venv (scripts/setup.sh), .venv-vllm (scripts/setup_vllm.sh) and .venv-trl (scripts/setup_trl.sh):
# a missing one is an error, not a skip.
#   bash scripts/bench_quick.sh            # all of them (~8 min on 2 cores)
#   bash scripts/bench_quick.sh weight_sync controller   # some of them
set -euo pipefail
cd "$(dirname "$0")/.."
all=(weight_sync controller sync_memory train_step startup vs_trl vllm_async streaming environments engine)
names=("${@:-${all[@]}}")
need() { [ -x "$1/bin/python" ] || { echo "bench_quick: $1 is missing: run $2" >&2; exit 1; }; }
need .venv scripts/setup.sh
for b in "${names[@]}"; do
  [ -f "benchmarks/$b.py" ] || { echo "bench_quick: no benchmarks/$b.py; known: ${all[*]}" >&2; exit 2; }
  case $b in vllm_async) need .venv-vllm scripts/setup_vllm.sh ;; vs_trl) need .venv-trl scripts/setup_trl.sh ;; esac
done
jobs_max=${BENCH_JOBS:-2}
logs=$(mktemp -d)
runs=()  # "bench mode" pairs, in order; each with its own key=value lines
for b in "${names[@]}"; do
  modes=("")
  [ "$b" = weight_sync ] && modes=("" "--colocated" "--sparse")
  [ "$b" = vs_trl ] && modes=("" "--workloads real")  # real: needs assets/smollm2-135m-instruct (get_real_model.sh)
  [ "$b" = controller ] && modes=("" "--suite")  # every workload, curricula included (Task.finished ends them)
  [ "$b" = streaming ] && modes=("--carry-over off")  # async and streaming without carry-over (the slow test:
  # test_streaming_bench.py runs async and streaming with it)
  for mode in "${modes[@]}"; do runs+=("$b $mode"); done
done
one() {  # one RUN_INDEX: run it into its log, its pid, exit code and seconds beside
  local b mode t0=$SECONDS
  read -r b mode <<< "${runs[$1]}"
  set +e
  .venv/bin/python "benchmarks/$b.py" --quick $mode > "$logs/$1.out" 2>&1 &
  echo $! > "$logs/$1.pid"
  wait $!
  echo $? > "$logs/$1.rc"
  rm -f "$logs/$1.pid"
  echo $((SECONDS - t0)) > "$logs/$1.s"
}
stop() {  # stop EXIT_STATUS: on a signal, SIGTERM to the running benchmarks (each stops its own runs), then wait
  trap - INT TERM HUP
  local pids
  pids=$(cat "$logs"/*.pid 2>/dev/null || true)
  [ -z "$pids" ] || kill -TERM $pids 2>/dev/null || true
  wait
  echo "bench_quick: stopped by a signal; the benchmarks that were running were stopped" >&2
  exit "$1"
}
trap 'stop 130' INT
trap 'stop 143' TERM
trap 'stop 129' HUP
# vs_trl's runs go alone: TRL's 2-thread process beside another job ran 2-3x slower (measured 2026-11-27: its two
# quick runs took ~410 s side by side with the others, 96 + 162 s alone)
solo() { [[ "${runs[$1]}" == vs_trl* ]]; }
for i in "${!runs[@]}"; do
  if solo "$i"; then
    wait
    one "$i" &
    wait $!  # a background job, waited for: a signal's trap runs at once (not after a foreground command)
    continue
  fi
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
  one "$i" &
done
wait
failed=0
for i in "${!runs[@]}"; do
  read -r b mode <<< "${runs[$i]}"
  echo "=== benchmarks/$b.py --quick $mode"
  lines=$(grep -E '^[a-z_0-9]+=' "$logs/$i.out" || true)
  if [ "$(cat "$logs/$i.rc")" != 0 ]; then
    tail -40 "$logs/$i.out"; echo "bench_quick: $b $mode failed" >&2; failed=1
  elif [ -z "$lines" ]; then
    tail -40 "$logs/$i.out"; echo "bench_quick: $b $mode printed no key=value line" >&2; failed=1
  else
    echo "$lines"
  fi
  echo "--- $b $mode: $(cat "$logs/$i.s") s"
done
exit $failed
