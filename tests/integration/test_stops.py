"""How a run ends when it cannot go on, through the real command (torchrun -m torchtitan_flux.train):

* bad input: one ``error: <field> = <value> ...; allowed: ...`` line first on stderr, the trainer's exit code 2
  (torchrun shows it, and the line, in its failure summary), no traceback from our code, nothing started;
* an engine that fails the same way every time: restarted at most ``rollout.max_engine_restarts`` times, then
  the run stops with ``stopped: ...`` (it used to restart it thousands of times);
* a loss that is not finite: ``stopped: loss is not finite at step k``, the weights of step k-1 kept (and
  checkpointed), no crash in the progress line.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys

import pytest
from _procs import Run

from conftest import ROOT, TESTS, torchrun_cmd


_reward_calls = itertools.count()
SANE_CALLS = 1 + 2 * 32  # the start-up probe, then two steps of the debug config (4 prompts x group 8)


def huge_reward_after_two_steps(prompt, completion, answer):
    """Ordinary rewards for the first two steps, then finite but absurd ones: without std normalisation the loss
    overflows fp32 at a step > 1, so there is a good step before it to keep (and checkpoint)."""
    if next(_reward_calls) < SANE_CALLS:
        return float(len(completion) % 2)
    return 1e38 if len(completion) % 2 else -1e38


def exit_on_a_completion(prompt, completion, answer):
    """Passes the start-up probe (an empty completion), then calls sys.exit() mid-run."""
    if completion:
        sys.exit(3)
    return 0.0


def _run(dump, *overrides, timeout=180, env=None):
    p = subprocess.run(torchrun_cmd(dump, *overrides), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    return p


def _our_traceback_frames(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if re.match(r'\s*File ".*torchtitan_flux/', line)]


def test_bad_input_is_one_line_exit_2_and_nothing_starts(tmp_path):
    p = _run(tmp_path / "run", "--grpo.group_size", "1")
    first = p.stderr.strip().splitlines()[0]
    assert first == "error: grpo.group_size = 1 is out of range; allowed: an integer >= 2", p.stderr[-3000:]
    assert "exitcode  : 2" in p.stderr  # the trainer's own exit code, in torchrun's summary
    assert "traceback : error: grpo.group_size = 1" in p.stderr  # the line, not a pointer to torch's docs
    assert not _our_traceback_frames(p.stderr)
    assert "Training starts" not in p.stdout + p.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_two_config_files_are_refused(tmp_path):
    p = _run(tmp_path / "run", "--job.config_file", str(ROOT / "train_configs" / "debug_cpu.toml"))
    assert p.stderr.strip().splitlines()[0] == "error: --job.config_file is given 2 times; allowed: once"
    assert "exitcode  : 2" in p.stderr


def test_debug_switch_keeps_the_traceback(tmp_path):
    p = _run(tmp_path / "run", "--grpo.group_size", "1", env={"TORCHTITAN_FLUX_DEBUG": "1"})
    assert _our_traceback_frames(p.stderr) and "error: grpo.group_size = 1" in p.stderr


@pytest.mark.faults
def test_engine_failing_every_time_is_restarted_a_bounded_number_of_times(tmp_path):
    # a seed beyond int64 makes every engine start fail the same way (the old code restarted it without end)
    run = Run(tmp_path / "run", tmp_path / "run.log", "--rollout.seed", str(2**64 + 1), "--training.steps", "5",
              "--rollout.max_engine_restarts", "2")
    rc = run.proc.wait(120)
    log = run.log.read_text()
    assert rc != 0
    assert len(re.findall(r"rollout engine engine0 died", log)) == 3, log[-3000:]  # the first start + 2 restarts
    assert "not restarted again" in log and "rollout.max_engine_restarts = 2" in log
    assert "stopped: every rollout engine died" in log


def test_non_finite_loss_stops_cleanly_and_keeps_the_last_good_step(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.dirname(__file__), str(TESTS),  # test_stops, _procs
                                                      os.environ.get("PYTHONPATH", "")]))
    dump = tmp_path / "run"
    p = _run(dump, "--rollout.reward_fn", "test_stops:huge_reward_after_two_steps",
             "--grpo.advantage_std_normalize", "false", "--checkpoint.enable", "true", "--training.steps", "6")
    assert p.returncode != 0
    m = re.search(r"stopped: loss is not finite at step (\d+) .* the weights of step (\d+) are kept", p.stderr)
    assert m, p.stderr[-3000:]
    bad, kept = int(m.group(1)), int(m.group(2))
    assert bad >= 2 and kept == bad - 1, (bad, kept)  # a good step came first: there is something to keep
    assert "TypeError" not in p.stdout + p.stderr and not _our_traceback_frames(p.stderr)
    rows = [json.loads(x) for x in open(dump / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, bad))  # the bad step was never logged as trained
    assert (dump / "checkpoint" / f"step-{kept}" / ".metadata").exists()  # the kept step is checkpointed
    assert f"checkpoint of step {kept} written" in p.stdout + p.stderr


def test_sys_exit_in_a_reward_mid_run_ends_the_run_with_one_error_line(tmp_path, monkeypatch):
    """Before: the SystemExit crossed the reward thread pool into the main loop and ended the run silently with
    exit code 3."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.dirname(__file__), str(TESTS),  # test_stops, _procs
                                                      os.environ.get("PYTHONPATH", "")]))
    p = _run(tmp_path / "run", "--rollout.reward_fn", "test_stops:exit_on_a_completion", "--training.steps", "3")
    lines = [x for x in p.stderr.splitlines() if x.startswith("error: ")]
    assert lines == ["error: reward function 'test_stops:exit_on_a_completion': sample 0: SystemExit: 3"], \
        p.stderr[-3000:]
    assert "exitcode  : 2" in p.stderr and not _our_traceback_frames(p.stderr)
    assert "Training starts" in p.stdout + p.stderr  # it failed mid-run, not at the start-up probe


def test_a_second_run_in_the_same_dump_folder_is_refused(tmp_path):
    dump = tmp_path / "run"
    first = Run(dump, tmp_path / "first.log", "--training.steps", "400")
    try:
        first.wait_for(lambda: "Training starts" in first.log.read_text(), 120, "the first run to start training")
        p = _run(dump, "--training.steps", "2")
        line = p.stderr.strip().splitlines()[0]
        assert line.startswith(f"error: job.dump_folder = '{dump}' is in use by another run (pid "), p.stderr[-2000:]
        assert "exitcode  : 2" in p.stderr
        assert first.proc.poll() is None  # the first run goes on, its files untouched by the second
    finally:
        first.proc.terminate()
        first.proc.wait(60)
    p = _run(dump, "--training.steps", "2")  # the lock goes with the process that held it
    assert p.returncode == 0, p.stderr[-3000:]


@pytest.mark.faults
def test_the_only_engine_killed_while_idle_is_restarted_and_the_run_finishes(tmp_path):
    """A long training step (a large local batch of many micro-batches) leaves the engine idle; SIGKILLed then,
    it is restarted at the next dispatch (it used to end the run with NoEngineLeft)."""
    import signal

    dump = tmp_path / "run"
    run = Run(dump, tmp_path / "run.log", "--training.steps", "30", "--training.local_batch_size", "1",
              "--weight_sync.async_weight_update", "true")  # async: nothing pumps engine events between steps
    try:
        run.wait_for(lambda: run.engines and (dump / "metrics.jsonl").exists()
                     and len((dump / "metrics.jsonl").read_text().splitlines()) >= 3, 180, "three steps")
        killed = run.engines[0]
        os.kill(killed, signal.SIGKILL)
        # the restart comes at the next dispatch, within seconds (a step here takes well under one), not after a
        # timeout: a new engine process is up while the run goes on
        run.wait_for(lambda: any(p != killed for p in run.engines), 60, "the engine's restart")
        rc = run.proc.wait(300)  # the run then finishes (TimeoutExpired fails the test)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    log = run.log.read_text()
    assert rc == 0, log[-3000:]
    rows = [json.loads(x) for x in open(dump / "metrics.jsonl")]
    assert rows[-1]["step"] == 30 and rows[-1]["engine_restarts"] >= 1, log[-3000:]
    assert json.loads((dump / "summary.json").read_text())["checksums_match"]
