"""Fault tests of the real trainer under torchrun: a checkpoint write interrupted, SIGTERM during a checkpoint
save, SIGTERM during a weight push. Faults are injected from outside the code under test
(``tests/fault_inject/sitecustomize.py``). For each: the run stops as documented (docs/reliability.md), no trained
step is lost (the resume starts right after the newest complete checkpoint), no process outlives the trainer, and
after the resume the engines' weights equal the trainer's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
from _procs import Run, complete_ckpts, count_steps_lost, wait_gone
from conftest import FIGURES, read_metrics, run_train

pytestmark = pytest.mark.faults


def _resume(dump, log: str, graceful: bool, *overrides):
    """Resume after the interrupted run that wrote ``log``; counts the trained steps lost (``count_steps_lost``:
    a graceful stop must keep every step it trained, a kill every step it had checkpointed)."""
    trained = read_metrics(dump)[-1]["step"]
    proc = run_train(dump, *overrides)
    out = proc.stdout + proc.stderr
    start = int(re.search(r"Training starts at step (\d+)", out).group(1))
    assert count_steps_lost(log, trained, start, graceful) == 0, (trained, start)
    summary = json.loads((dump / "summary.json").read_text())
    FIGURES["checksums_compared"] += 1
    assert summary["checksums_match"], summary
    return out


@pytest.mark.slow  # moved out of the default suite (its time): CI's slow stage runs it
def test_checkpoint_write_interrupted_resumes_from_the_last_complete_one(tiny_model_dir, tmp_path):
    """SIGKILL of the whole job while step 6's checkpoint is being written (shards on disk, no ``.metadata``):
    that checkpoint is never loaded; the resume starts at step 4 from step 3's, and steps 4..8 are bit-identical
    to an uninterrupted run's."""
    args = ("--checkpoint.enable", "true", "--checkpoint.interval", "3", "--training.steps", "8")
    run_train(tmp_path / "full", *args)
    full = read_metrics(tmp_path / "full")

    dump, marker = tmp_path / "run", tmp_path / "ckpt6_writing"
    run = Run(dump, tmp_path / "run.log", *args, faults={"FLUX_FAULT_CKPT_STALL": f"6:60:{marker}"})
    run.wait_for(marker.exists, 120, "the checkpoint of step 6 to be mid-write")
    os.killpg(run.proc.pid, signal.SIGKILL)
    run.proc.wait(30)
    assert not wait_gone(run.seen, 10.0), "processes outlived the killed job"
    assert (dump / "checkpoint" / "step-6").is_dir() and complete_ckpts(dump) == [3]

    assert "checkpoint of step 3 saved" in run.log.read_text()  # what the kill must not lose
    out = _resume(dump, run.log.read_text(), False, *args)
    assert "Training starts at step 4" in out
    resumed = read_metrics(dump)
    for step in range(4, 9):
        assert resumed[step - 1]["loss"] == full[step - 1]["loss"], step
    assert complete_ckpts(dump)[-1] == 8


def _sigterm_inside(tmp_path, args, fault: str, what: str) -> tuple:
    """Run 40 steps with ``fault`` ("VAR=KEY:SECONDS", see fault_inject), SIGTERM torchrun once the fault has
    started: the run must exit non-zero with nothing left behind. Returns (dump folder, the run's log)."""
    dump, marker = tmp_path / "run", tmp_path / "fault_started"
    var, _, spec = fault.partition("=")
    run = Run(dump, tmp_path / "run.log", *args, "--training.steps", "40", faults={var: f"{spec}:{marker}"})
    run.wait_for(marker.exists, 120, what)
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.proc.wait(60) != 0
    assert not wait_gone(run.seen, 10.0), "processes outlived the SIGTERMed trainer"
    return dump, run.log.read_text()


@pytest.mark.slow  # moved out of the default suite (its time): CI's slow stage runs it
def test_sigterm_during_a_checkpoint_save_completes_it_and_stops(tiny_model_dir, tmp_path):
    """SIGTERM while step 4's checkpoint is mid-write: the save completes (the signal only sets a flag), the run
    stops at that step boundary with a non-zero exit, nothing outlives it, and the resume starts at step 5."""
    args = ("--checkpoint.enable", "true", "--checkpoint.interval", "4", "--weight_sync.async_weight_update", "true",
            "--off_policy.async_ratio", "1")
    dump, log = _sigterm_inside(tmp_path, args, "FLUX_FAULT_CKPT_STALL=4:3", "the checkpoint of step 4 to be mid-write")
    assert "interrupted after step 4" in log, log[-3000:]
    assert complete_ckpts(dump) == [4] and read_metrics(dump)[-1]["step"] == 4

    out = _resume(dump, log, True, *args, "--training.steps", "6")
    assert "Training starts at step 5" in out
    assert [r["step"] for r in read_metrics(dump)] == list(range(1, 7))


@pytest.mark.slow  # moved out of the default suite (its time): CI's slow stage runs it
def test_sigterm_during_a_weight_push_settles_it_then_checkpoints(tiny_model_dir, tmp_path):
    """Async mode; the engine holds the push of version 5 for 3 s before acking it, and SIGTERM arrives
    meanwhile: the trainer finishes its step, waits for the push in flight to settle (acked: no half-sent
    weights), checkpoints the last step, exits non-zero; nothing outlives it; the resume goes on from the next
    step with engine weights equal to the trainer's."""
    args = ("--checkpoint.enable", "true", "--checkpoint.interval", "1000", "--weight_sync.async_weight_update", "true",
            "--off_policy.async_ratio", "1")
    dump, log = _sigterm_inside(tmp_path, args, "FLUX_FAULT_PUSH_STALL=5:3", "the push of version 5 to be in flight")
    last = read_metrics(dump)[-1]["step"]
    assert last >= 5 and f"checkpoint of step {last} written" in log, log[-3000:]
    assert "weight push did not settle" not in log
    assert complete_ckpts(dump) == [last]

    out = _resume(dump, log, True, *args, "--training.steps", str(last + 2))
    assert f"Training starts at step {last + 1}" in out


@pytest.mark.slow  # moved out of the default suite (its time): CI's slow stage runs it
def test_sigterm_while_a_step_waits_for_its_rollouts_checkpoints_the_last_step_at_once(tiny_model_dir, tmp_path):
    """The engine stalls 300 s before generating step 6's rollouts (far beyond torchrun's 30 s grace period), and
    SIGTERM arrives while the trainer waits for them: the trainer stops at once (step 6 has not started), waits
    at most SIGNAL_STOP_WAIT_S for the rollouts in flight, checkpoints step 5 and exits non-zero well within the
    grace period; the resume trains step 6 on. Before: the wait went on until torchrun's SIGKILL, and no
    checkpoint was written."""
    args = ("--checkpoint.enable", "true", "--checkpoint.interval", "1000")
    dump, marker = tmp_path / "run", tmp_path / "fault_started"
    run = Run(dump, tmp_path / "run.log", *args, "--training.steps", "40",
              faults={"FLUX_FAULT_GENERATE_STALL": f"6:300:{marker}"})
    run.wait_for(marker.exists, 120, "step 6's generation to stall")
    log = run.sigterm_stops_within(25.0)
    # torchrun signals the worker's whole process group, so the engine may die of the same SIGTERM: then the wait
    # ends on the lost engine (not restarted during a stop) instead of the interrupt; either way step 6 never started
    assert ("interrupted while waiting for the rollouts of step 6" in log
            or "engine0: not restarted: the run is stopping (SIGTERM)" in log), log[-3000:]
    assert "interrupted after step 5" in log and "checkpoint of step 5 written" in log, log[-3000:]
    assert "stopped: received SIGTERM" in log
    assert complete_ckpts(dump) == [5] and read_metrics(dump)[-1]["step"] == 5

    out = _resume(dump, log, True, *args, "--training.steps", "7")
    assert "Training starts at step 6" in out
    assert [r["step"] for r in read_metrics(dump)] == list(range(1, 8))


@pytest.mark.slow  # moved out of the default suite (its time): CI's slow stage runs it
def test_rollouts_of_a_lagging_engine_beyond_max_version_gap_are_discarded_and_counted(tiny_model_dir, tmp_path):
    """The engine holds the push of version 5 for 5 s while the trainer's push timeout is 1 s: it is marked
    lagging and keeps generating with version 4. Rollouts more than ``max_version_gap`` (1) versions old are
    discarded, counted (``discarded_rollouts``) and regenerated; no step trains on them; the engine resyncs and
    the run ends with its weights equal to the trainer's."""
    dump, marker = tmp_path / "run", tmp_path / "fault_started"
    run = Run(dump, tmp_path / "run.log", "--weight_sync.async_weight_update", "true", "--off_policy.async_ratio", "1",
              "--weight_sync.timeout_seconds",
              "1", "--training.steps", "12", faults={"FLUX_FAULT_PUSH_STALL": f"5:5:{marker}"})
    assert run.proc.wait(240) == 0, run.log.read_text()[-3000:]
    assert marker.exists()
    rows = read_metrics(dump)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["discarded_rollouts"] > 0, [r["discarded_rollouts"] for r in rows]
    assert all(r["version_gap_max"] <= 1 for r in rows)  # nothing staler than the gap was trained on
    assert "exceed max_version_gap; regenerating" in run.log.read_text()
    summary = json.loads((dump / "summary.json").read_text())
    assert summary["checksums_match"] and summary["final_engine_version"] == 12
    FIGURES["checksums_compared"] += 1
    print(f"\nlagging engine: discarded {rows[-1]['discarded_rollouts']} rollouts")


@pytest.mark.slow  # moved out of the default suite (its time): CI's slow stage runs it
def test_a_second_signal_stops_at_once(tiny_model_dir, tmp_path):
    """Step 4's checkpoint save stalls for 120 s. A first SIGTERM to the trainer only asks it to stop after the
    step; a second one 3 s later stops it at once: exit non-zero within seconds (not after the stall), the torn
    step-4 checkpoint is never loaded, nothing outlives the trainer, and the resume starts after step 2's
    complete checkpoint."""
    import psutil

    args = ("--checkpoint.enable", "true", "--checkpoint.interval", "2")
    dump, marker = tmp_path / "run", tmp_path / "fault_started"
    run = Run(dump, tmp_path / "run.log", *args, "--training.steps", "40",
              faults={"FLUX_FAULT_CKPT_STALL": f"4:120:{marker}"})
    run.wait_for(marker.exists, 120, "step 4's checkpoint to be mid-write")
    (worker,) = [c for c in psutil.Process(run.proc.pid).children()
                 if "torchtitan_flux.train" in " ".join(c.cmdline()) and "forkserver" not in " ".join(c.cmdline())]
    worker.send_signal(signal.SIGTERM)
    time.sleep(3)
    assert run.proc.poll() is None  # the first signal waits for the step (and its save) to end
    t0 = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    assert run.proc.wait(60) != 0
    took = time.monotonic() - t0
    log = run.log.read_text()
    assert took < 30 and "received SIGTERM twice" in log, (took, log[-3000:])
    assert not wait_gone(run.seen, 10.0), "processes outlived the trainer"
    assert complete_ckpts(dump) == [2]

    out = _resume(dump, log, False, *args, "--training.steps", "4")  # a second signal keeps only what was saved
    assert "Training starts at step 3" in out


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signal_to_the_whole_process_group_stops_without_restarting_the_engine(tiny_model_dir, tmp_path, sig):
    """A scheduler's SIGTERM, or the SIGHUP of a closed terminal, reaches every process of the group, the engines
    included. Before 2026-11-25 (issue 27) the trainer restarted the engine just to finish the step, and SIGHUP
    killed the run with no checkpoint and no ``stopped:`` line; now a dead engine is not restarted while the run
    stops, the stop names the signal and checkpoints the last step, and nothing outlives the run."""
    dump = tmp_path / "run"
    run = Run(dump, tmp_path / "run.log", "--checkpoint.enable", "true", "--checkpoint.interval", "1000",
              "--training.steps", "400")
    run.wait_for(lambda: (dump / "metrics.jsonl").exists() and len(read_metrics(dump)) >= 5, 120, "5 steps")
    os.killpg(run.proc.pid, sig)
    deadline = time.monotonic() + 60
    while run.proc.poll() is None and time.monotonic() < deadline:  # record every engine process the stop starts
        run.scan()
        time.sleep(0.02)
    assert run.proc.wait(1) != 0
    assert not wait_gone(run.seen, 10.0), "processes outlived the SIGTERMed run"
    log = run.log.read_text()
    assert f"stopped: received {sig.name}" in log, log[-3000:]
    last = max(complete_ckpts(dump))
    assert f"checkpoint of step {last} written" in log
    assert len(run.engines) == 1, run.engines  # no replacement engine was started
    if "rollout engine engine0 died" in log:  # its death was noticed before the stop ended (else a push failed)
        assert f"engine0: not restarted: the run is stopping ({sig.name})" in log, log[-3000:]

