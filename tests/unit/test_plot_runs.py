"""scripts/plot_runs.py: synthetic runs of both kinds -> a non-empty PNG; a bad path -> exit 2 with a message."""

import json
import subprocess
import sys
from pathlib import Path


SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "plot_runs.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def _write(path: Path, rows: list[dict], extra: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + extra)


def test_plots_ours_and_trl(tmp_path):
    ours = tmp_path / "sync"
    _write(ours / "metrics.jsonl",
           [{"step": s, "reward_mean": 0.04 + 0.03 * s, "step_time_s": 0.07} for s in range(1, 21)],
           extra='{"step": 21, "rew')  # half-written last line is skipped
    trl = tmp_path / "trl.jsonl"
    _write(trl, [{"event": "start", "startup_s": 9.0}]
           + [{"step": s, "reward_mean": 0.04 + 0.02 * s, "time_s": 0.11 * s, "step_time_s": 0.11} for s in range(1, 21)])
    out = tmp_path / "plots" / "curves.png"
    p = _run(f"{ours}:ours sync", f"{trl}:TRL", str(ours), "-o", out, "--target", "0.8", "--smooth", "3")
    assert p.returncode == 0, p.stderr
    assert out.is_file() and out.stat().st_size > 1000
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_path_exit_2(tmp_path):
    out = tmp_path / "x.png"
    p = _run(tmp_path / "missing_run", "-o", out)
    assert p.returncode == 2
    assert "missing_run" in p.stderr and "not found" in p.stderr
    assert not out.exists()


def test_no_records_exit_2(tmp_path):
    empty = tmp_path / "empty"
    _write(empty / "metrics.jsonl", [{"event": "start"}])
    p = _run(empty, "-o", tmp_path / "x.png")
    assert p.returncode == 2
    assert "no records" in p.stderr
