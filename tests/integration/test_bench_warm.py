"""The benchmarks' warm starts (``benchmarks/common.WarmStarter``): a run forked from the process that imported the
trainer once trains bit-identically to a fresh ``python -m torchtitan_flux.train``, reports a failed run's exit code
and error line, and a signal to the benchmark leaves none of the run's processes behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
from _procs import gone
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import common  # noqa: E402

PY = sys.executable
# async (background pushes, generation a step ahead, the engine process): deterministic whatever the timing (every
# request pinned to the version staged at dispatch), unlike in-flight updates, which land where the timing puts them
STEPS = ["--training.steps", "4", "--weight_sync.async_weight_update", "true", "--off_policy.max_version_gap", "2"]


def test_a_warm_start_trains_as_a_fresh_process_does(tmp_path):
    fresh_rows, fresh = common.run_training(str(tmp_path / "fresh"), *STEPS)
    runs, servers = [], []
    for i in range(2):  # the second from the same server
        runs.append(common.run_training(str(tmp_path / f"warm{i}"), *STEPS, warm=True))
        servers.append(common.WARM.server.pid)
    assert common.WARM.usable and common.WARM.server.poll() is None and servers[0] == servers[1]
    for rows, summary in runs:
        assert summary["trainer_checksum"] == fresh["trainer_checksum"]
        assert [r["loss"] for r in rows] == [r["loss"] for r in fresh_rows]
        assert summary["checksums_match"]


def test_a_failed_warm_run_reports_its_exit_code_and_error_line(tmp_path):
    starter = common.WarmStarter()
    bad = starter.run(["--job.config_file", common.DEBUG_CONFIG, "--job.dump_folder", str(tmp_path),
                       "--off_policy.max_version_gap", "-1"], {**common.os.environ, "RANK": "0", "WORLD_SIZE": "1"})
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert bad.stderr.strip().splitlines()[-1].startswith("error: off_policy.max_version_gap")
    assert "RuntimeWarning" not in bad.stderr  # runpy's, had the entry module been imported before it ran
    starter.server.stdin.close()  # EOF: the server exits
    assert starter.server.wait(10) == 0


def test_sigterm_to_a_benchmark_stops_its_warm_run_and_engine(tmp_path):
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import common; "
            f"common.run_training({str(tmp_path)!r}, '--training.steps', '100000', warm=True)")
    bench = subprocess.Popen([PY, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "metrics.jsonl").exists():  # training: the engine runs
            assert bench.poll() is None, bench.communicate()
            assert time.monotonic() < deadline, "no step within 120 s"
            time.sleep(0.1)
        for p in psutil.Process(bench.pid).children(recursive=True):  # server, run, fork server, engine
            seen[p.pid] = p
        assert any(p.name().startswith("flux-") for p in seen.values()), [p.name() for p in seen.values()]
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=60)
        assert bench.returncode == 128 + signal.SIGTERM, err[-3000:]
        deadline = time.monotonic() + 10
        while (alive := [p for p in seen.values() if not gone(p.pid, p.create_time())]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive, f"outlived the benchmark: {alive}"
    finally:
        if bench.poll() is None:
            bench.kill()
