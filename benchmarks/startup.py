#!/usr/bin/env python
"""Start-up time of a run: engines from the fork server (the default) vs spawned, side by side in one run.

    .venv/bin/python benchmarks/startup.py [--reps 5] [--config train_configs/debug_cpu.toml]

Launches the config as the README does (``torchrun --nproc_per_node=1 --standalone -m torchtitan_flux.train``,
3 steps) ``--reps`` times per start method, interleaved, with ``TORCHTITAN_FLUX_ENGINE_START`` = ``forkserver``
or ``spawn`` (``torchtitan_flux/engine/forkserver.py``), and reads the trainer's log timestamps:

* ``to_train_start``: launch -> "Training starts" (torchrun, imports, trainer construction);
* ``to_step1``: launch -> the end of step 1 (adds waiting for the engine to be up, the first weight push and
  step 1 itself): what a user waits before the first step is done.

Reports medians; the last lines are ``key=value``: ``to_step1_forkserver_s``, ``to_step1_spawn_s``,
``startup_saved_s`` (spawn - fork server), ``startup_ratio`` (spawn / fork server) and ``pair_efficiency``
(``benchmarks/common.py``: the fork server's gain is imports overlapped on another core, which needs two cores that
run in parallel; a WARNING line below 0.8).
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (DEBUG_CONFIG, ROOT, ArgumentParser, count, existing_file, flux_log_times,  # noqa: E402
                    pair_efficiency, pair_lines, run_child)

METHODS = ("forkserver", "spawn")
_TRAIN_START = re.compile(r"Training starts at step")
_STEP1 = re.compile(r"step\s+1/")


def _stamp(log: str, message: re.Pattern) -> float:
    found = flux_log_times(log, message)
    if not found:
        raise SystemExit(f"no log line matching {message.pattern!r} in the run's log:\n{log[-3000:]}")
    return found[0][0]


def launch(method: str, config: str, dump: str) -> dict:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = [torchrun, "--nproc_per_node=1", "--standalone", "-m", "torchtitan_flux.train", "--job.config_file", config,
           "--job.dump_folder", dump, "--training.steps", "3", "--checkpoint.enable", "false"]
    env = {**os.environ, "TORCHTITAN_FLUX_ENGINE_START": method}
    t0 = time.time()
    try:
        p = run_child(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as e:
        raise SystemExit(f"run timed out after {e.timeout:.0f} s (stopped): {' '.join(cmd)}\n"
                         f"{(e.stderr or '')[-4000:]}") from None
    wall = time.time() - t0
    log = p.stdout + p.stderr
    if p.returncode != 0:
        raise SystemExit(f"run failed ({p.returncode}): {' '.join(cmd)}\n{log[-4000:]}")
    return {"to_train_start": _stamp(log, _TRAIN_START) - t0, "to_step1": _stamp(log, _STEP1) - t0, "wall": wall}


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=count(), default=5, help="launches per start method (default 5)")
    ap.add_argument("--config", type=existing_file, default=DEBUG_CONFIG)
    ap.add_argument("--quick", action="store_true", help="smoke run for CI (the cheapest that exercises every code path; its figures are no measurement)")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps = 1
    pair = pair_efficiency()  # the fork server overlaps its imports with the trainer's on another core
    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    tmp = tempfile.mkdtemp(prefix="flux_startup_")
    try:
        launch("forkserver", args.config, os.path.join(tmp, "warmup"))  # page cache, .pyc files
        for i in range(args.reps):
            for m in (METHODS if i % 2 == 0 else METHODS[::-1]):
                runs[m].append(launch(m, args.config, os.path.join(tmp, f"{m}{i}")))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    med = {m: {k: statistics.median(r[k] for r in runs[m]) for k in runs[m][0]} for m in METHODS}
    print(f"start-up, {args.reps} launches per method, interleaved; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, {dt.date.today()}")
    print(f"{'engine start':<12} {'to train start s':>17} {'to end of step 1 s':>19} {'process wall s':>15}   per launch (to step 1)")
    for m in METHODS:
        per = " ".join(f"{r['to_step1']:.2f}" for r in runs[m])
        print(f"{m:<12} {med[m]['to_train_start']:>17.2f} {med[m]['to_step1']:>19.2f} {med[m]['wall']:>15.2f}   {per}")
    fs, sp = med["forkserver"]["to_step1"], med["spawn"]["to_step1"]
    print(f"to_step1_forkserver_s={fs:.2f}")
    print(f"to_step1_spawn_s={sp:.2f}")
    print(f"startup_saved_s={sp - fs:.2f}")
    print(f"startup_ratio={sp / fs:.2f}")
    print("\n".join(pair_lines(pair)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
