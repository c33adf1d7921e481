"""How a run ends when it cannot go on, through the real command (torchrun -m torchtitan_flux.train):

* bad input: one ``error: <field> = <value> ...; allowed: ...`` line first on stderr, the trainer's exit code 2
  (torchrun shows it, and the line, in its failure summary), no traceback from our code, nothing started;
* an engine that fails the same way every time: restarted at most ``rollout.max_engine_restarts`` times, then
  the run stops with ``stopped: ...`` (it used to restart it thousands of times);
* a loss that is not finite: ``stopped: loss is not finite at step k``, the weights of step k-1 kept (and
  checkpointed), no crash in the progress line.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from _procs import Run, complete_ckpts

from conftest import ROOT, TESTS, read_metrics, torchrun_cmd


_reward_calls = itertools.count()
SANE_CALLS = 1 + 2 * 32  # the start-up probe, then two steps of the debug config (4 prompts x group 8)



_USER_FRAME = re.compile(r" \((\w+\.py):\d+\)$")


def error_lines(text: str) -> list[str]:
    """The ``error: `` lines of ``text``, the user's frame they end with (``my_env.py:74``) without its line number."""
    return [_USER_FRAME.sub(r" (\1)", x) for x in text.splitlines() if x.startswith("error: ")]

def huge_reward_after_two_steps(completions, **_):
    """Ordinary rewards for the first two steps, then finite but absurd ones: without std normalisation the loss
    overflows fp32 at a step > 1, so there is a good step before it to keep (and checkpoint)."""
    return [float(len(c) % 2) if next(_reward_calls) < SANE_CALLS else 1e38 if len(c) % 2 else -1e38
            for c in completions]


def exit_on_a_completion(completions, **_):
    """Passes the start-up probe (an empty completion), then calls sys.exit() mid-run."""
    if any(completions):
        sys.exit(3)
    return [0.0] * len(completions)


_CALLS = []


def never_returns_mid_run(completions, **_):
    """Scores the start-up check (an empty completion) and the batches of steps 1 and 2, then never returns
    (issue 27's hang)."""
    if any(completions):
        _CALLS.append(1)
        if len(_CALLS) > 2 and os.environ.get("FLUX_TEST_REWARD_MARKER"):
            open(os.environ["FLUX_TEST_REWARD_MARKER"], "w").close()
        while len(_CALLS) > 2:
            time.sleep(1)
    return [0.0] * len(completions)


def never_returns(completions, **_):
    """Hangs in the start-up check already."""
    while True:
        time.sleep(1)


def finished_raises_at_step_2(job_config, tokenizer, *_):
    """The digits task whose ``finished`` (user code, rank 0) raises once step 2 is scored."""
    from torchtitan_flux.data.tasks import DigitsTask

    class Task(DigitsTask):
        def finished(self, step):
            if step == 2:
                raise RuntimeError("no idea")
            return False

    return Task()


def finished_exits_0_at_step_1(job_config, tokenizer, *_):
    """The digits task whose ``finished`` calls ``sys.exit(0)`` once step 1 is scored."""
    from torchtitan_flux.data.tasks import DigitsTask

    class Task(DigitsTask):
        def finished(self, step):
            sys.exit(0)

    return Task()


def prompts_returns_text_at_step_2(job_config, tokenizer, *_):
    """The digits task whose ``prompts`` returns a string instead of a list from step 2 on."""
    from torchtitan_flux.data.tasks import DigitsTask

    class Task(DigitsTask):
        def prompts(self, seed, step, n):
            return "oops" if step >= 2 else super().prompts(seed, step, n)

    return Task()


def chdir_on_a_completion(completions, **_):
    """Scores like ``digits`` and moves the process's working directory (to ``FLUX_TEST_CHDIR``) on each call."""
    os.chdir(os.environ["FLUX_TEST_CHDIR"])
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def hangs_building_the_task(*_):
    """A task factory that never returns (``rollout.task = 'test_stops:hangs_building_the_task'``)."""
    open(os.environ["FLUX_TEST_TASK_MARKER"], "w").close()
    while True:
        time.sleep(1)


def _run(dump, *overrides, timeout=180, env=None):
    p = subprocess.run(torchrun_cmd(dump, *overrides), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    return p


def _our_traceback_frames(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if re.match(r'\s*File ".*torchtitan_flux/', line)]


def test_bad_input_is_one_line_exit_2_and_nothing_starts(tmp_path):
    p = _run(tmp_path / "run", "--grpo.group_size", "1")
    first = p.stderr.strip().splitlines()[0]
    assert first == "error: grpo.group_size = 1 is out of range; allowed: an integer in [2, 4096]", p.stderr[-3000:]
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
    # every engine start fails the same way (the old code restarted it without end); this used a seed beyond int64,
    # which validation now refuses
    run = Run(tmp_path / "run", tmp_path / "run.log", "--training.steps", "5", "--rollout.max_engine_restarts", "2",
              faults={"FLUX_FAULT_ENGINE_FAIL": "injected: this engine cannot generate"})
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
    p = _run(dump, "--rollout.reward_funcs", "test_stops:huge_reward_after_two_steps",
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
    # and it holds step `kept`'s weights and optimizer state, not the bad step's: every tensor equals a clean run's
    # to step `kept` (runs are deterministic), and Adam counted `kept` steps (a mutation that applied the bad step
    # passed the checks above: all 156 tensors differed)
    clean = tmp_path / "clean"
    p = _run(clean, "--rollout.reward_funcs", "test_stops:huge_reward_after_two_steps",
             "--grpo.advantage_std_normalize", "false", "--checkpoint.enable", "true", "--training.steps", str(kept))
    assert p.returncode == 0, p.stderr[-3000:]
    got = _checkpoint_tensors(dump, kept, tmp_path / "got.pt")
    want = _checkpoint_tensors(clean, kept, tmp_path / "want.pt")
    assert got.keys() == want.keys() and len(got) > 10
    # the one exception is torch's RNG state (``CheckpointState``'s "rng"): the bad step ran, and drew from it,
    # before its loss was found non-finite
    assert [k for k in got if not torch.equal(got[k], want[k])] == ["train_state.rng"]
    steps = {float(v) for k, v in got.items() if k.startswith("optimizer.state.") and k.endswith(".step")}
    assert steps == {float(kept)}, steps


def _checkpoint_tensors(dump, step: int, out) -> dict:
    """Every tensor of ``dump``'s DCP checkpoint of ``step``, by flattened name (model, optimizer, ...)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(dump / "checkpoint" / f"step-{step}"), str(out))
    flat = {}

    def walk(prefix, obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(obj, torch.Tensor):
            flat[prefix] = obj

    walk("", torch.load(out, weights_only=False))
    return flat


def test_sys_exit_in_a_reward_mid_run_ends_the_run_with_one_error_line(tmp_path, monkeypatch):
    """Before: the SystemExit crossed the reward thread pool into the main loop and ended the run silently with
    exit code 3."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.dirname(__file__), str(TESTS),  # test_stops, _procs
                                                      os.environ.get("PYTHONPATH", "")]))
    p = _run(tmp_path / "run", "--rollout.reward_funcs", "test_stops:exit_on_a_completion", "--training.steps", "3")
    lines = error_lines(p.stderr)
    assert lines == ["error: reward function 'exit_on_a_completion' raised SystemExit: 3 (test_stops.py)"], \
        p.stderr[-3000:]
    assert "exitcode  : 2" in p.stderr and not _our_traceback_frames(p.stderr)
    assert "Training starts" in p.stdout + p.stderr  # it failed mid-run, not at the start-up probe


def test_a_reward_that_never_returns_stops_the_run_at_its_deadline_and_checkpoints(tmp_path, monkeypatch):
    """Before 2026-11-25 the run froze with no note; one SIGTERM could not stop it and torchrun SIGKILLed it without
    a checkpoint (issue 27). Now: one line naming the function, exit 2, the last completed step checkpointed."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.dirname(__file__), str(TESTS),
                                                      os.environ.get("PYTHONPATH", "")]))
    dump = tmp_path / "run"
    t0 = time.monotonic()
    p = _run(dump, "--rollout.reward_funcs", "test_stops:never_returns_mid_run", "--rollout.reward_timeout_seconds",
             "3", "--checkpoint.enable", "true", "--checkpoint.interval", "100", "--training.steps", "5", timeout=120)
    took = time.monotonic() - t0
    lines = [x for x in p.stderr.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith(
        "error: reward function 'never_returns_mid_run' did not return within "
        "rollout.reward_timeout_seconds = 3 ("), p.stderr[-3000:]
    assert "exitcode  : 2" in p.stderr and not _our_traceback_frames(p.stderr)
    assert took < 90, took
    assert "checkpoint of step 2 written" in p.stdout + p.stderr, p.stderr[-3000:]
    assert complete_ckpts(dump) == [2] and [r["step"] for r in read_metrics(dump)] == [1, 2]


def test_sigterm_while_a_reward_hangs_stops_at_once_and_checkpoints_the_last_step(tmp_path, monkeypatch):
    """The reward of step 3 never returns (deadline 300 s, far past torchrun's 30 s grace period); SIGTERM stops
    the run at once: step 2 checkpointed, exit non-zero, nothing left running. Before 2026-11-25 one SIGTERM could
    not stop it, and torchrun's SIGKILL left no checkpoint."""
    marker = tmp_path / "reward_hangs"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.dirname(__file__), str(TESTS),
                                                      os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FLUX_TEST_REWARD_MARKER", str(marker))
    dump = tmp_path / "run"
    run = Run(dump, tmp_path / "run.log", "--rollout.reward_funcs", "test_stops:never_returns_mid_run",
              "--checkpoint.enable", "true", "--checkpoint.interval", "1000", "--training.steps", "40")
    run.wait_for(marker.exists, 120, "the reward of step 3 to hang")
    log = run.sigterm_stops_within(25.0)
    assert "interrupted while waiting for the rewards of step 3" in log and "checkpoint of step 2 written" in log, \
        log[-3000:]
    assert complete_ckpts(dump) == [2]


@pytest.mark.slow
def test_sigterm_while_the_trainer_is_set_up_stops_at_once(tmp_path, monkeypatch):
    """A task factory that never returns; one SIGTERM stops the run at once with one line, nothing left running.
    Before 2026-11-26 (issue 27's second sweep): the signal only asked to stop "after the current step", the set-up
    went on hanging, and torchrun SIGKILLed the trainer 30 s later without a word."""
    marker = tmp_path / "task_hangs"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.dirname(__file__), str(TESTS),
                                                      os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FLUX_TEST_TASK_MARKER", str(marker))
    run = Run(tmp_path / "run", tmp_path / "run.log", "--rollout.task", "test_stops:hangs_building_the_task")
    run.wait_for(marker.exists, 120, "the task factory to hang")
    log = run.sigterm_stops_within(15.0)
    assert [x for x in log.splitlines() if x.startswith(("stopped: ", "error: "))] == [
        "stopped: received SIGTERM while starting (nothing trained yet)"], log[-3000:]


def test_a_reward_that_hangs_in_the_start_up_check_is_refused_before_engines_start(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.dirname(__file__), str(TESTS),
                                                      os.environ.get("PYTHONPATH", "")]))
    p = _run(tmp_path / "run", "--rollout.reward_funcs", "test_stops:never_returns", "--rollout.reward_timeout_seconds",
             "2", "--training.steps", "3", timeout=120)
    lines = [x for x in p.stderr.splitlines() if x.startswith("error: ")]
    assert lines == ["error: reward function 'never_returns' did not return within "
                     "rollout.reward_timeout_seconds = 2 (2 s); the run stops (the function's thread cannot be "
                     "interrupted)"], p.stderr[-3000:]
    assert "exitcode  : 2" in p.stderr and "Training starts" not in p.stdout + p.stderr


@pytest.mark.parametrize("factory,line,kept", [
    ("finished_exits_0_at_step_1", "error: task 'digits': finished(1) raised SystemExit: 0 (test_stops.py)", []),  # asked before
    ("prompts_returns_text_at_step_2", "error: task 'digits': prompts(seed=0, step=2, n=4) returned str 'oops'; "
                                       "allowed: a list of 4 Prompt objects", [1]),
])
def test_a_task_failing_mid_run_stops_the_run_in_one_line_naming_it(tmp_path, monkeypatch, factory, line, kept):
    """Before 2026-11-27 ``sys.exit(0)`` in ``finished`` ended the run with exit code 0 after step 1, no message,
    no summary; ``prompts`` returning a string was a traceback."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.dirname(__file__), str(TESTS),
                                                      os.environ.get("PYTHONPATH", "")]))
    p = _run(tmp_path / "run", "--rollout.task", f"test_stops:{factory}", "--training.steps", "5",
             "--checkpoint.enable", "true", "--checkpoint.interval", "100")
    lines = error_lines(p.stderr)
    assert lines == [line], p.stderr[-3000:]
    assert "exitcode  : 2" in p.stderr and not _our_traceback_frames(p.stderr)
    assert complete_ckpts(tmp_path / "run") == kept  # the steps trained before it (finished(k) is asked before k is)


def test_the_dump_folder_is_resolved_once_home_expanded_and_a_chdir_moves_no_output(tmp_path, monkeypatch):
    """Before 2026-11-27 ``--job.dump_folder ~/x`` wrote into ``./~/x``, and a reward that called ``os.chdir`` sent
    checkpoints, ``hf_final`` and ``summary.json`` into another, unlocked folder (exit 0). Every path field is
    resolved once, at the start (the relative model folder of the debug config too: the reward moves the working
    directory at the start-up check already)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.dirname(__file__), str(TESTS),
                                                      os.environ.get("PYTHONPATH", "")]))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    p = _run("~/run", "--rollout.reward_funcs", "test_stops:chdir_on_a_completion", "--training.steps", "2",
             "--checkpoint.enable", "true", "--checkpoint.interval", "1",
             env={"HOME": str(tmp_path), "FLUX_TEST_CHDIR": str(elsewhere)})
    assert p.returncode == 0, p.stderr[-3000:]
    dump = tmp_path / "run"
    assert (dump / "summary.json").is_file() and (dump / "hf_final" / "config.json").is_file()
    assert complete_ckpts(dump) == [1, 2] and [r["step"] for r in read_metrics(dump)] == [1, 2]
    assert not any(elsewhere.iterdir()) and not (ROOT / "~").exists()


def test_sys_exit_in_a_step_callback_stops_the_run_with_its_reason_and_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    dump = tmp_path / "run"
    p = _run(dump, "--metrics.step_callbacks", "_step_callbacks:exits_at_step_2", "--checkpoint.enable", "true",
             "--checkpoint.interval", "100", "--training.steps", "5", timeout=120)
    lines = error_lines(p.stderr)
    assert lines == ["error: step callback '_step_callbacks:exits_at_step_2' raised SystemExit: enough for today "
                     "(_step_callbacks.py)"], \
        p.stderr[-3000:]
    assert "exitcode  : 2" in p.stderr and not _our_traceback_frames(p.stderr)
    assert complete_ckpts(dump) == [2] and [r["step"] for r in read_metrics(dump)] == [1, 2]


@pytest.mark.parametrize("fails", [pytest.param("step_callback", marks=pytest.mark.slow), "reward",
                                   pytest.param("task_finished", marks=pytest.mark.slow)])  # slow: time
def test_with_two_trainer_processes_a_failure_on_rank_0_stops_every_rank_at_once(tmp_path, monkeypatch, fails):
    """A step callback, a reward function and a task's ``finished`` run on rank 0 only. Before 2026-11-25 (issue 27) their failure stopped
    rank 0 alone: rank 1 went on into the next step's batch broadcast, which rank 0 never joined, and died with a
    traceback from inside it when rank 0's exit closed the connection (or waited for a timeout while rank 0 was
    still closing). Now the error travels with the batch broadcast (or a step-end agreement): every rank stops on
    it with the same one line."""
    from _procs import wait_gone

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.dirname(__file__), str(TESTS),
                                                      os.environ.get("PYTHONPATH", "")]))
    args = {"step_callback": ("--metrics.step_callbacks", "_step_callbacks:exits_at_step_2"),
            "reward": ("--rollout.reward_funcs", "test_stops:exit_on_a_completion"),
            "task_finished": ("--rollout.task", "test_stops:finished_raises_at_step_2")}[fails]
    expected = {"step_callback": "error: step callback '_step_callbacks:exits_at_step_2' raised SystemExit: enough "
                                 "for today (_step_callbacks.py)",
                "reward": "error: reward function 'exit_on_a_completion' raised SystemExit: 3 (test_stops.py)",
                "task_finished": "error: task 'digits': finished(2) raised RuntimeError: no idea (test_stops.py)"}[fails]
    run = Run(tmp_path / "run", tmp_path / "run.log", *args, "--training.steps", "6", nproc=2)
    deadline = time.monotonic() + 90
    while run.proc.poll() is None and time.monotonic() < deadline:
        run.scan()
        time.sleep(0.05)
    if run.proc.poll() is None:
        os.killpg(run.proc.pid, 9)
        pytest.fail(f"the run did not stop within 90 s: {run.log.read_text()[-3000:]}")
    log = run.log.read_text()
    assert run.proc.returncode != 0
    lines = set(error_lines(log))
    assert lines == {expected}, log[-3000:]  # one line, the same on both ranks
    assert "exitcode  : 2" in log and not _our_traceback_frames(log), log[-3000:]
    assert not wait_gone(run.seen, 10.0), "processes outlived the run"


@pytest.mark.slow
def test_a_new_run_in_a_used_dump_folder_sets_the_old_outputs_aside(tmp_path):
    """Before 2026-11-25 (issue 27): a second run with checkpoints off appended steps 1..N again to metrics.jsonl
    and overwrote hf_final. Now the old outputs move to previous_runs/<time>/, whole; a resume still appends."""
    dump = tmp_path / "run"
    for _ in range(2):
        p = _run(dump, "--training.steps", "2", timeout=120)
        assert p.returncode == 0, p.stderr[-3000:]
    assert [r["step"] for r in read_metrics(dump)] == [1, 2] and len((dump / "metrics.jsonl").read_text().splitlines()) == 2
    (old,) = (dump / "previous_runs").iterdir()
    assert len((old / "metrics.jsonl").read_text().splitlines()) == 2
    assert (old / "hf_final" / "model.safetensors").exists() and (old / "summary.json").exists()
    # torchtitan 0.3.0's init_logger writes log lines to stdout (0.2.2's went to stderr)
    assert f"held a previous run's outputs (metrics.jsonl, summary.json, hf_final): moved to {old}" in p.stdout


@pytest.mark.slow
@pytest.mark.faults
def test_a_stopped_engine_is_declared_stuck_killed_restarted_and_the_run_finishes(tmp_path):
    """Before 2026-11-25 (issue 27) a SIGSTOPped engine was waited on forever ("waiting" logged every 30 s). Now,
    holding requests with no result for rollout.engine_stall_seconds, it is killed (SIGKILL ends a stopped
    process), restarted, its requests re-dispatched; the run finishes and nothing outlives it."""
    import signal

    from _procs import wait_gone

    dump, marker = tmp_path / "run", tmp_path / "stalled"
    run = Run(dump, tmp_path / "run.log", "--rollout.engine_stall_seconds", "8", "--weight_sync.timeout_seconds", "5",
              "--training.steps", "12", faults={"FLUX_FAULT_GENERATE_STALL": f"6:2:{marker}"})
    run.wait_for(marker.exists, 120, "step 6's generation to start")
    (pid,) = run.engines
    os.kill(pid, signal.SIGSTOP)
    assert run.proc.wait(120) == 0, run.log.read_text()[-3000:]
    log = run.log.read_text()
    assert "declared stuck and stopped" in log and "rollout.engine_stall_seconds = 8" in log, log[-3000:]
    rows = read_metrics(dump)
    assert [r["step"] for r in rows] == list(range(1, 13)) and rows[-1]["engine_restarts"] >= 1
    assert json.loads((dump / "summary.json").read_text())["checksums_match"]
    assert not wait_gone(run.seen, 10.0), "processes outlived the run"


@pytest.mark.parametrize("case", ["a file", "empty", "read-only", "checkpoint folder a file"])
def test_unusable_output_folders_are_one_line_naming_the_path(tmp_path, case):
    """Before 2026-11-25 (issue 27): FileExistsError / FileNotFoundError tracebacks, and a checkpoint folder that is
    a file was found only at the final save, so the finished run exported nothing."""
    if case == "read-only" and os.geteuid() == 0:
        pytest.skip("root writes into read-only folders: the check cannot be exercised as root")
    dump, extra = tmp_path / "run", []
    if case == "a file":
        dump.write_text("")
    elif case == "empty":
        dump = ""
    elif case == "read-only":
        dump.mkdir()
        dump.chmod(0o500)
    else:
        dump.mkdir()
        (dump / "checkpoint").write_text("")
        extra = ["--checkpoint.enable", "true"]
    p = _run(dump, *extra, "--training.steps", "2", timeout=120)
    lines = [x for x in p.stderr.splitlines() if x.startswith("error: ")]
    line = lines[0] if lines else ""
    expected = {
        "a file": f"error: job.dump_folder = '{dump}' cannot be used (it is a file, not a folder); allowed: a folder "
                  "this user can write (created if missing)",
        "empty": "error: job.dump_folder = '' is empty; allowed: a folder this user can write (created if missing)",
        "read-only": f"error: job.dump_folder = '{dump}' is not writable; allowed: a folder this user can write",
        "checkpoint folder a file": "error: checkpoint.folder = 'checkpoint' (that is "
                                    f"'{dump}/checkpoint') cannot be used (it is a file, not a folder)",
    }[case]
    assert line.startswith(expected), p.stderr[-2000:]
    assert "exitcode  : 2" in p.stderr and not _our_traceback_frames(p.stderr)


@pytest.mark.parametrize("mode, code, fix", [
    ("disabled", "ENOSPC", "free space on its disk"),
    ("async", "EROFS", "remount the file system of {step} read-write"),
])
def test_a_failed_checkpoint_write_stops_the_run_in_one_line_keeping_the_previous_checkpoint(tmp_path, mode, code,
                                                                                               fix):
    """Before 2026-11-25 (issue 27): a traceback from inside DCP. Now one ``stopped:`` line naming the step folder,
    the cause and the fix for that cause, exit 1; the previous complete checkpoint stays the one a resume loads;
    nothing outlives it. Async (``checkpoint.async_mode``), before 2026-11-26: the background write's failure
    surfaced at the next save, named as that step's, and every error was told to free space."""
    dump = tmp_path / "run"
    step, n = dump / "checkpoint" / "step-4", getattr(errno, code)
    _stops_in_one_line(dump, f"stopped: checkpoint of step 4 could not be written to {step} (OSError: [Errno {n}] "
                             f"{os.strerror(n)}: '{step}/__0_0.distcp'); a resume loads the previous complete one: "
                             f"{fix.format(step=step)}, or set checkpoint.folder elsewhere",
                       {"FLUX_FAULT_CKPT_OSERROR": f"4:{code}"}, "--checkpoint.interval", "2",
                       "--checkpoint.async_mode", mode)
    assert complete_ckpts(dump) == [2]


def test_a_full_disk_under_the_metrics_stops_the_run_and_checkpoints_the_step(tmp_path):
    """Before 2026-11-25 (issue 27) an OSError writing metrics.jsonl ended the run with a traceback, and the steps
    since the last periodic checkpoint were lost; now the run stops with one line naming the file and the step,
    after checkpointing the step it just trained."""
    dump = tmp_path / "run"
    _stops_in_one_line(dump, f"stopped: cannot write {dump}/metrics.jsonl at step 5: No space left on device; free "
                             "space on its disk, then resume",
                       {"FLUX_FAULT_METRICS_ENOSPC": "5"}, "--checkpoint.interval", "1000")
    assert complete_ckpts(dump) == [5] and len(read_metrics(dump)) == 4


def test_a_disk_full_for_metrics_and_checkpoint_alike_is_one_line_with_both_causes(tmp_path):
    """Before 2026-11-27 the metrics write failed, then the stop's checkpoint, then ``close()``: a chained traceback
    and no ``stopped:`` line. The previous complete checkpoint (step 4) is what a resume loads."""
    dump = tmp_path / "run"
    _stops_in_one_line(dump, f"stopped: cannot write {dump}/metrics.jsonl at step 5: No space left on device; free "
                             f"space on its disk, then resume; then checkpoint of step 5 could not be written to "
                             f"{dump}/checkpoint/step-5 (OSError: [Errno 28] No space left on device: "
                             f"'{dump}/checkpoint/step-5/__0_0.distcp'); a resume loads "
                             "the previous complete one: free space on its disk, or set checkpoint.folder elsewhere",
                       {"FLUX_FAULT_METRICS_ENOSPC": "5", "FLUX_FAULT_CKPT_OSERROR": "5:ENOSPC"},
                       "--checkpoint.interval", "4")
    assert complete_ckpts(dump) == [4]


def _stops_in_one_line(dump, expected: str, faults: dict[str, str], *args: str) -> None:
    """An 8-step run with checkpoints and ``faults`` exits 1 with exactly the ``stopped:`` line ``expected``, no
    traceback of ours, and nothing left running."""
    from _procs import wait_gone

    run = Run(dump, dump.parent / "run.log", "--checkpoint.enable", "true", *args, "--training.steps", "8",
              faults=faults)
    assert run.proc.wait(120) == 1
    assert not wait_gone(run.seen, 10.0), "processes outlived the run"
    log = run.log.read_text()
    assert [x for x in log.splitlines() if x.startswith("stopped: ")] == [expected], log[-3000:]
    assert not _our_traceback_frames(log)


@pytest.mark.slow  # moved out of the default suite (its time): CI's slow stage runs it
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


@pytest.mark.slow
def test_a_second_run_in_the_same_checkpoint_folder_is_refused(tmp_path):
    """Two runs with different dump folders and one absolute ``checkpoint.folder``. Before 2026-11-25 the lock
    covered the dump folder only: the second run resumed from the first's live checkpoint (another run's step) and
    the first crashed inside its own save (issue 27's data-loss case)."""
    shared = tmp_path / "shared_ckpt"
    ckpt = ("--checkpoint.enable", "true", "--checkpoint.folder", str(shared), "--checkpoint.interval", "5")
    first = Run(tmp_path / "a", tmp_path / "first.log", *ckpt, "--training.steps", "400")
    try:
        first.wait_for(lambda: "Training starts" in first.log.read_text(), 120, "the first run to start training")
        p = _run(tmp_path / "b", *ckpt, "--training.steps", "2")
        lines = p.stderr.strip().splitlines()
        owner = (shared / ".flux.lock").read_text()  # the first run's trainer pid, in the checkpoint folder
        assert lines[0] == (f"error: checkpoint.folder = '{shared}' is in use by another run (pid {owner}); "
                            "allowed: a folder no running job uses (each run needs its own)"), p.stderr[-2000:]
        assert "exitcode  : 2" in p.stderr and not (tmp_path / "b" / "metrics.jsonl").exists()
        assert first.proc.poll() is None  # the first run goes on
    finally:
        first.proc.terminate()
        first.proc.wait(60)


@pytest.mark.slow  # moved out of the default suite (its time): CI's slow stage runs it
@pytest.mark.faults
def test_the_only_engine_killed_while_idle_is_restarted_and_the_run_finishes(tmp_path):
    """A long training step (a large local batch of many micro-batches) leaves the engine idle; SIGKILLed then,
    it is restarted at the next dispatch (it used to end the run with NoEngineLeft)."""
    import signal

    dump = tmp_path / "run"
    run = Run(dump, tmp_path / "run.log", "--training.steps", "30", "--training.local_batch_size", "1",
              "--weight_sync.async_weight_update", "true", "--off_policy.async_ratio", "1")  # async: nothing pumps engine events between steps
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
