"""``train_configs/debug_multiturn_cpu.toml`` through the real command (the tiny model's chat variant, as
``scripts/setup.sh`` builds it, the calculator environment): it trains and reports its episodes; a list the TOML
sets and the command line clears (``--rollout.environment_args ""``) is empty in the trainer's config too; an
opening longer than ``training.seq_len`` stops the run in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
from model_assets import build_chat_model_dir

from conftest import ROOT, TESTS, read_metrics, torchrun_cmd

CONFIG = ROOT / "train_configs" / "debug_multiturn_cpu.toml"


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    return build_chat_model_dir(ROOT / "assets" / "tiny-llama", tmp_path_factory.mktemp("assets") / "tiny-chat")


def _run(dump, model, *overrides, env_extra=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]),
           **(env_extra or {})}
    return subprocess.run(torchrun_cmd(dump, "--model.hf_assets_path", str(model), "--training.steps", "2",
                                       *overrides, config=CONFIG),
                          cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)


@pytest.mark.parametrize("cleared", [  # a list of strings, another, a list of numbers; ~20 s each: one by default
    "environment_args", pytest.param("reward_funcs", marks=pytest.mark.slow),
    pytest.param("reward_weights", marks=pytest.mark.slow)])
def test_the_multi_turn_debug_config_trains_with_a_list_cleared_on_the_command_line(tmp_path, tiny_chat, cleared):
    """Lists cleared with ``""`` passed validation, then torchtitan's main parsed sys.argv again and the trainer got
    [""] (environment_args: refused after the model was built; reward_funcs: an import of ''); a list of numbers
    given ``""`` was refused by tyro's parser. Mutations: the trainer given a re-parsed config; "" passed to tyro."""
    dump = tmp_path / "run"
    p = _run(dump, tiny_chat, f"--rollout.{cleared}", "", "--metrics.log_completions_every", "1")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = read_metrics(dump)
    assert [r["step"] for r in rows] == [1, 2]
    assert ("rewards/digits/mean" in rows[0]) == (cleared != "reward_funcs")
    for r in rows:
        assert 1 <= r["episode/turns_mean"] <= 3 and r["episode/env_steps_mean"] > 0
        ends = sum(r[f"episode/end_{e}_frac"] for e in ("done", "max_turns", "max_tokens", "opening_too_long"))
        assert abs(ends - 1.0) < 1e-9
    assert "turns " in p.stdout + p.stderr and "env steps " in p.stdout + p.stderr  # the step line
    assert "left running" not in p.stderr  # our own processes are no leftovers
    done = [json.loads(line) for line in (dump / "completions.jsonl").read_text().splitlines()]
    assert done[0]["prompt"].startswith("[system] You solve arithmetic problems with a calculator.")  # the opening


def test_an_opening_longer_than_seq_len_stops_the_run_in_one_line(tmp_path, tiny_chat):
    """The fifth sweep's item 2: the shipped config with --training.seq_len 128 failed its first forward with a bare
    AssertionError in RoPE."""
    p = _run(tmp_path / "run", tiny_chat, "--training.seq_len", "128")
    errors = [x for x in p.stderr.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1, p.stderr[-3000:]
    assert errors[0].startswith("error: every episode of step 1 opens with more tokens than training.seq_len = 128 "
                                "(the shortest opening: ")
    assert "AssertionError" not in p.stderr and "exitcode  : 2" in p.stderr


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_processes_an_environment_leaves_running_are_stopped_at_exit_in_one_line(tmp_path, tiny_chat):
    """The fifth sweep's item 7: a process an environment started per step (and one it orphaned) outlived the run,
    which exited 0 saying nothing. Mutations: no subreaper (the orphan is missed), nothing stopped at exit."""
    pids = tmp_path / "pids"
    p = _run(tmp_path / "run", tiny_chat, "--rollout.environment", "fakes.environments:SpawningEnv",
             "--rollout.environment_args", "", env_extra={"FLUX_TEST_PIDS": str(pids)})
    started = [int(x) for x in pids.read_text().split()]
    try:
        assert p.returncode == 0, p.stderr[-3000:]
        lines = [x for x in p.stderr.splitlines() if "the run's user code left running" in x]
        assert len(lines) == 1 and lines[0].startswith(f"stopped {len(started)} process(es) "), p.stderr[-3000:]
        assert "(sleep 300)" in lines[0]
        assert [pid for pid in started if _alive(pid)] == []
    finally:
        for pid in started:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_reward_that_closes_stdout_stops_the_run_with_our_line_and_no_logging_traceback(tmp_path, tiny_chat):
    """The fifth sweep's item 8: a traceback came with our line (here: the exit's flush of the closed stdout raised
    ValueError after it). Mutation: the exit's flush unguarded."""
    p = _run(tmp_path / "run", tiny_chat, "--rollout.reward_funcs", "fakes.rewards:closes_stdout")
    assert "error: reward function 'closes_stdout' closed sys.stdout" in p.stderr, p.stderr[-3000:]
    assert "Logging error" not in p.stderr and "I/O operation on closed file" not in p.stderr, p.stderr[-3000:]
    assert 'torchtitan_flux/train.py", line' not in p.stderr  # no traceback of ours (torchrun's own follows)
