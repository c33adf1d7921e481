#!/usr/bin/env bash
# Record the debug config's losses for tests/integration/test_train_e2e.py::test_with_every_streaming_field_off_the_
# losses_are_the_recorded_runs: run this on the commit to record from (a worktree with .venv and assets/tiny-llama),
# then copy the JSON it writes into tests/fixtures/recorded_losses.json of the code under test.
#   scripts/record_losses.sh OUT.json
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/record_losses.sh OUT.json}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
declare -A ARGS=([sync]="" [async]="--weight_sync.async_weight_update true")
for mode in sync async; do
  # shellcheck disable=SC2086
  .venv/bin/torchrun --standalone --nproc_per_node 1 -m torchtitan_flux.train \
    --job.config_file train_configs/debug_cpu.toml --job.dump_folder "$tmp/$mode" --training.steps 6 \
    ${ARGS[$mode]} > "$tmp/$mode.log" 2>&1 || { tail -20 "$tmp/$mode.log" >&2; exit 1; }
done
.venv/bin/python - "$tmp" "$out" <<'PY'
import json, subprocess, sys
tmp, out = sys.argv[1], sys.argv[2]
args = {"sync": [], "async": ["--weight_sync.async_weight_update", "true"]}
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
doc = {"commit": commit}
for mode in ("sync", "async"):
    rows = [json.loads(x) for x in open(f"{tmp}/{mode}/metrics.jsonl")]
    doc[mode] = {"args": args[mode], **{k: [r[k] for r in rows] for k in
                                        ("loss", "reward_mean", "behaviour_kl", "version_gap_mean")}}
json.dump(doc, open(out, "w"), indent=1)
print(f"recorded {out} on {commit}")
PY
