"""Shared by the benchmarks: run one training job as a user would (torchrun) and read what it wrote."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import socket
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_CONFIG = os.path.join(ROOT, "train_configs", "debug_cpu.toml")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_training(out: str, *overrides: str, config: str = DEBUG_CONFIG, nproc: int = 1,
                 env: dict[str, str] | None = None) -> tuple[list[dict], dict]:
    """Train with ``--job.dump_folder out`` plus overrides (and extra environment ``env``); returns
    (metrics.jsonl rows, summary.json)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "torchtitan_flux.train", "--job.config_file", config,
        "--job.dump_folder", out, *overrides,
    ]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-6000:])
        raise SystemExit(f"benchmark run failed: {' '.join(cmd)}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f]
    with open(os.path.join(out, "summary.json")) as f:
        return rows, json.load(f)


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


# A torchtitan_flux log line: "[titan] 2026-11-23 17:41:14,495 - torchtitan_flux - INFO - <message>".
_FLUX_LOG = re.compile(r"^\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) - torchtitan_flux - INFO - (.*)$")


def flux_log_times(log: str, message: re.Pattern) -> list[tuple[float, re.Match]]:
    """(epoch seconds, match) of every torchtitan_flux INFO line of ``log`` whose message matches ``message``
    (``re.match`` on the message); the stamps are local time, as the trainer logged them."""
    out = []
    for line in log.splitlines():
        m = _FLUX_LOG.match(line)
        if m and (mm := message.match(m.group(2))):
            out.append((dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), mm))
    return out
