"""The controller's deterministic figure, in the default suite (its throughput is a timing: test_controller_e2e.py,
run alone). Requests are pinned to the versions staged at dispatch and the debug config keeps the fixed CPU thread
split, so a seed's run trains on the same samples on every machine and the controller sees the same staleness: its
tracking is a deterministic number, and any change to the controller's law, inputs or target changes it. A mutation
audit found the goal-only check (in band >= 0.80 over 5 seeds) passing a PID without its integral term (0.844) and
a controller aiming 0.03 above its target (0.808)."""

from __future__ import annotations

import statistics

from conftest import read_metrics, run_train

WARMUP = 10
ADAPTIVE = ["--weight_sync.async_weight_update", "true", "--adaptive_async.enabled", "true",
            "--adaptive_async.controller", "pid", "--off_policy.max_version_gap", "4",
            "--adaptive_async.target_staleness", "0.15",
            "--adaptive_async.phase_schedule.warmup.steps", str(WARMUP)]


def test_the_controller_tracks_its_target_exactly_as_recorded(tiny_model_dir, tmp_path):
    run_train(tmp_path, "--training.steps", "60", "--rollout.seed", "0", *ADAPTIVE)
    post = [r for r in read_metrics(tmp_path) if r["step"] > WARMUP]
    errors = [abs(r["staleness"] - r["target_staleness"]) for r in post]
    in_band = sum(e <= 0.05 for e in errors)
    # recorded 2026-11-27 (seed 0 of the five the benchmark and test_controller_e2e.py use; 0.864 over all five)
    assert (len(post), in_band) == (50, 43), in_band
    assert abs(statistics.mean(errors) - 0.028691276050899755) < 1e-6, statistics.mean(errors)
