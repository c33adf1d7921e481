"""Shared by the benchmarks (and ``scripts/verify_grpo.py``, ``scripts/gpu_smoke.py``): run one training job (one
process as torchrun starts a worker, or torchrun for several) and read what it wrote; child processes that stop
with their starter (``run_child``); argument types whose errors are one line (``ArgumentParser``, ``count``,
``number``, ``numbers``); what the machine allows (``busy_cores``, ``pair_efficiency``)."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_CONFIG = os.path.join(ROOT, "train_configs", "debug_cpu.toml")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------ child processes

STOP_GRACE_S = 30.0  # how long a stopped child may take to end after SIGTERM (a trainer: its step, its engines)


class Interrupted(SystemExit):
    """SIGINT, SIGTERM or SIGHUP reached this process (``stop_children_on_signals``): it unwinds to ``run_child``,
    which stops its child, and ends the process with exit status 128 + the signal."""


def _on_signal(signum, frame) -> None:
    name = signal.Signals(signum).name
    # os.write: the signal may land inside a print, and a buffered stream is not reentrant
    os.write(2, f"{os.path.basename(sys.argv[0])}: received {name}: stopping its child processes\n".encode())
    raise Interrupted(128 + signum)


def stop_children_on_signals() -> None:
    """From now on SIGINT, SIGTERM and SIGHUP (each unless ignored, as under nohup) raise ``Interrupted`` in the
    main thread. ``run_child`` calls it; call it first where a signal must also unwind in-process work."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) not in (signal.SIG_IGN, _on_signal):
            signal.signal(sig, _on_signal)


def stop_group(p: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to ``p`` (a trainer stops its engines on it; torchrun forwards it to its ranks), up to ``grace_s``
    for it to exit, then SIGKILL to its whole process group: whatever of it lingers."""
    try:
        if p.poll() is None:
            p.terminate()
            p.wait(grace_s)
    except (subprocess.TimeoutExpired, Interrupted):  # Interrupted: a second signal, no more waiting
        pass
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def run_child(cmd: list[str], *, timeout: float | None = None, check: bool = False, capture_output: bool = False,
              text: bool = False, grace_s: float = STOP_GRACE_S, **popen_kw) -> subprocess.CompletedProcess:
    """``subprocess.run`` with the child in a session (and process group) of its own, stopped with its whole group
    (``stop_group``) when the timeout passes (then ``TimeoutExpired``, as subprocess.run) or a signal reaches this
    process (then this process exits 128 + the signal). Captured output goes through temporary files, never a
    pipe that a descendant could hold open or fill."""
    stop_children_on_signals()
    with contextlib.ExitStack() as files:
        if capture_output:
            popen_kw["stdout"], popen_kw["stderr"] = (files.enter_context(tempfile.TemporaryFile()) for _ in "12")

        def captured() -> tuple:
            if not capture_output:
                return None, None
            out = []
            for f in (popen_kw["stdout"], popen_kw["stderr"]):
                f.seek(0)
                out.append(f.read().decode(errors="replace") if text else f.read())
            return tuple(out)

        p = subprocess.Popen(cmd, start_new_session=True, **popen_kw)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            stop_group(p, grace_s)
            raise subprocess.TimeoutExpired(cmd, timeout, *captured()) from None
        except BaseException:
            stop_group(p, grace_s)
            raise
        done = subprocess.CompletedProcess(cmd, p.returncode, *captured())
    if check:
        done.check_returncode()
    return done


# -------------------------------------------------------------------------------------------- training runs


def run_training(out: str, *overrides: str, config: str = DEBUG_CONFIG, nproc: int = 1,
                 env: dict[str, str] | None = None, warm: bool = False) -> tuple[list[dict], dict]:
    """Train with ``--job.dump_folder out`` plus overrides (and extra environment ``env``); returns
    (metrics.jsonl rows, summary.json). One process is launched as the single worker torchrun would start (its
    rendezvous variables set here): the same trainer, without the agent's 2-3 s of start and exit per run, which
    were more than half of a short run's wall time (the controller suite's 360 runs); several go through torchrun.
    ``warm``: the one process is forked from ``WARM`` (the imports done once; one process only, and ``env`` must
    not change what torch reads when it is imported; started fresh where CUDA would not survive the fork)."""
    train = ["--job.config_file", config, "--job.dump_folder", out, *overrides]
    port = str(free_port())
    if nproc == 1:
        cmd = [sys.executable, "-m", "torchtitan_flux.train", *train]
        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **(env or {})}
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}", "-m", "torchtitan_flux.train", *train]
    p = WARM.run(train, {**os.environ, **env}) if warm and nproc == 1 else None
    if p is None:
        p = run_child(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-6000:])
        raise SystemExit(f"benchmark run failed: {' '.join(cmd)}" + (" (warm start)" if warm else ""))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f]
    with open(os.path.join(out, "summary.json")) as f:
        return rows, json.load(f)


# A training run forked from a process that has imported the trainer (``warm_server``): the imports (3.5 s of a
# one-process run's 6 s of start and exit on 2 cores, beside the engines' fork server's 2.5 s on the other core)
# are done once, not once a run: the controller suite's 400 runs. The run itself is the trainer ``python -m
# torchtitan_flux.train`` starts (``runpy``, its own session, stdin /dev/null, ``sys.path`` as ``-m`` sets it);
# ``tests/integration/test_bench_warm.py`` checks it trains bit-identically. Invariants: the server runs no torch op
# and initialises no CUDA before it forks (the threads ``import torch`` and the allocator start hold no lock a run
# needs: the engines' fork server forks after the same imports); where CUDA was initialised by the imports the
# server says so and every run starts fresh; the server dies with its starter, a run in progress with it (SIGTERM:
# the trainer stops its engines).
_WARM_IMPORTS = ("torchtitan_flux.run.trainer", "torchtitan_flux.run.config_file", "torchtitan_flux.run.validation",
                 "torchtitan_flux.run.resume", "torchtitan_flux.run.leftovers", "torchtitan.tools.logging")
_PDEATHSIG = 1  # prctl's PR_SET_PDEATHSIG


def _forked_run(request: dict, server: int) -> None:
    """In the forked child: become the run ``python -m torchtitan_flux.train ARGV`` would start; never returns."""
    import runpy
    import traceback

    from torchtitan_flux.engine.forkserver import prctl

    try:
        os.setsid()
        prctl(_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != server:  # the server died before the line above
            os._exit(1)
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_TRUNC),
                                (2, request["stderr"], os.O_WRONLY | os.O_TRUNC)):
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(ROOT)
        sys.path[:] = [ROOT, *(p for p in sys.path if p not in ("", os.path.dirname(os.path.abspath(__file__))))]
        sys.argv = ["torchtitan_flux.train", *request["argv"]]
        runpy.run_module("torchtitan_flux.train", run_name="__main__", alter_sys=True)  # ends with os._exit
    except BaseException:  # noqa: BLE001 - this child must never return into the server's loop
        traceback.print_exc()
        sys.stderr.flush()
    os._exit(1)


def warm_server() -> None:
    """The process behind ``WarmStarter``: imports once and answers ``{"ready": bool}``, then per request line on
    stdin (JSON: argv, env, stdout, stderr) forks a run and answers ``{"pid": P}``, then ``{"rc": R}`` when it
    ends; exits at EOF."""
    import gc
    import importlib

    from torchtitan_flux.engine.forkserver import prctl

    prctl(_PDEATHSIG, signal.SIGKILL)  # with the benchmark; its run then gets SIGTERM (``_forked_run``)
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # torch.cuda.is_available() without a CUDA context
    from torchtitan_flux.patches import apply_patches

    apply_patches()
    for name in _WARM_IMPORTS:
        importlib.import_module(name)
    import torch

    ready = not torch.cuda.is_initialized()  # a forked child could not use CUDA
    print(json.dumps({"ready": ready}), flush=True)
    if not ready:
        return
    gc.freeze()  # the imports' objects: never scanned again, so a run's collections write none of their pages
    me = os.getpid()
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _forked_run(request, me)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


def _stop_session(pgid: int, grace_s: float = STOP_GRACE_S) -> None:
    """``stop_group`` for a process group that is not our child: SIGTERM, up to ``grace_s`` for every member to end
    (a second signal ends the wait), then SIGKILL to what lingers."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        with contextlib.suppress(Interrupted):
            while time.monotonic() < deadline:
                os.killpg(pgid, 0)  # ProcessLookupError once none is left
                time.sleep(0.05)
        os.killpg(pgid, signal.SIGKILL)


class WarmStarter:
    """Starts ``warm_server`` on first use and runs trainings through it, one at a time (``run``)."""

    def __init__(self) -> None:
        self.server: subprocess.Popen | None = None
        self.usable = True  # False once the server said its imports initialised CUDA
        self.log = tempfile.TemporaryFile()  # the server's own stderr: shown if it dies

    def _server(self) -> subprocess.Popen | None:
        if self.usable and (self.server is None or self.server.poll() is not None):
            here = os.path.dirname(os.path.abspath(__file__))
            code = f"import sys; sys.path.insert(0, {here!r}); import common; common.warm_server()"
            self.server = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=self.log, text=True,
                                           start_new_session=True)
            self.usable = self._answer("ready")
        return self.server if self.usable else None

    def _answer(self, key: str):
        line = self.server.stdout.readline()
        if not line:
            self.log.seek(0)
            raise SystemExit("the warm starter (benchmarks/common.warm_server) died:\n"
                             + self.log.read().decode(errors="replace")[-4000:])
        return json.loads(line)[key]

    def run(self, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess | None:
        """Train ``python -m torchtitan_flux.train ARGV`` with ``env``, forked; None where runs cannot be forked
        (CUDA initialised by the imports: start it fresh). A signal to this process stops the run as ``run_child``
        stops a child (``stop_group``'s SIGTERM, grace, SIGKILL) and the server with it."""
        stop_children_on_signals()
        server = self._server()
        if server is None:
            return None
        with tempfile.NamedTemporaryFile() as out, tempfile.NamedTemporaryFile() as err:
            pid = None
            try:
                server.stdin.write(json.dumps({"argv": argv, "env": env, "stdout": out.name, "stderr": err.name})
                                   + "\n")
                server.stdin.flush()
                pid = self._answer("pid")
                rc = self._answer("rc")
            except BaseException:
                if pid is not None:
                    _stop_session(pid)
                server.kill()  # a run it started before its pid was read: SIGTERM by its parent's death
                server.wait()
                raise
            return subprocess.CompletedProcess(argv, rc, out.read().decode(errors="replace"),
                                               err.read().decode(errors="replace"))


WARM = WarmStarter()


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


# ---------------------------------------------------------------------------------------------- arguments


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``<prog>: error: argument --x: <why>; allowed: <what>`` (no usage block)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def count(minimum: int = 1):
    """An argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"got {text!r}; allowed: an integer >= {minimum}")
        return value

    return parse


def number(minimum: float = 0.0, *, above: bool = False):
    """An argparse type: a finite number >= ``minimum`` (> with ``above``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (value > minimum if above else value >= minimum) or value == float("inf"):
            raise argparse.ArgumentTypeError(f"got {text!r}; allowed: a number {'>' if above else '>='} {minimum:g}")
        return value

    return parse


def numbers(minimum: float = 0.0, *, above: bool = False):
    """An argparse type: comma-separated numbers, each as ``number(minimum, above=above)`` allows."""
    one = number(minimum, above=above)

    def parse(text: str) -> list[float]:
        try:
            return [one(x) for x in text.split(",")]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"got {text!r}; allowed: comma-separated numbers {'>' if above else '>='} {minimum:g}, e.g. 1e-6,1e-5"
            ) from None

    return parse


def existing_file(text: str) -> str:
    """An argparse type: a path to an existing file."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"got {text!r}, which is no file; allowed: an existing file")
    return text


# ---------------------------------------------------------------------------------------------- the machine


def busy_cores(seconds: float = 1.0) -> float | None:
    """Cores kept busy by other processes over ``seconds`` (from /proc/stat; none of ours is running then)."""
    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return sum(v) - idle, sum(v)

    try:
        b0, t0 = snap()
        time.sleep(seconds)
        b1, t1 = snap()
    except (OSError, ValueError, IndexError):
        return None
    return (b1 - b0) / max(t1 - t0, 1) * (os.cpu_count() or 1)


# One single-thread process: a fixed matmul loop on request. A line "0" runs the loop for about argv[1] seconds
# and answers "<iterations> <seconds>"; a line "N" times N iterations and answers "N <seconds>". Ends at EOF.
_MATMUL_LOOP = r"""
import sys, time
import numpy as np
a = np.random.default_rng(0).standard_normal((192, 192)).astype(np.float32)
for _ in range(50):
    a @ a
print("ready", flush=True)
for line in sys.stdin:
    n, t0, k = int(line), time.perf_counter(), 0
    while (k < n) if n else (time.perf_counter() - t0 < float(sys.argv[1])):
        for _ in range(10):
            a @ a
        k += 10
    print(k, time.perf_counter() - t0, flush=True)
"""
PAIR_EFFICIENCY_OK = 0.8  # below: two jobs side by side gain well short of 2x here; overlap cannot show
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def pair_efficiency(phase_s: float = 0.25, rounds: int = 3) -> float:
    """The machine's pair efficiency: the time of a fixed single-thread matmul loop alone over the time two
    processes take to run it together (until both are done): 1.0 when two cores run fully in parallel, 0.5 when
    the pair shares one core's worth (hyper-threads of one core, or other load). ``rounds`` of each, interleaved
    (alone: each process in turn), the fastest of each kind: what the machine allows, less its noise. About 2 s."""
    env = {**os.environ, **_ONE_THREAD}
    cmd = [sys.executable, "-c", _MATMUL_LOOP, str(phase_s)]
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) as a, \
            subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) as b:

        def ask(n: int, *procs) -> list[float]:
            for p in procs:
                p.stdin.write(f"{n}\n")
                p.stdin.flush()
            return [float(p.stdout.readline().split()[1]) for p in procs]

        for p in (a, b):
            p.stdout.readline()  # ready
        a.stdin.write("0\n")  # calibrate: the iterations of about phase_s
        a.stdin.flush()
        n = int(a.stdout.readline().split()[0])
        alone, together = [], []
        for r in range(rounds):
            alone += ask(n, (a, b)[r % 2])
            together.append(max(ask(n, a, b)))
        a.stdin.close()
        b.stdin.close()
    return min(alone) / min(together)


def paired(e: float) -> float:
    """The efficiency a schedule can count on: ``e`` within [0.5, 1] (below 0.5 one core at a time is faster)."""
    return min(1.0, max(0.5, e))


def pair_lines(e: float) -> list[str]:
    """A warning when two jobs side by side cannot show overlap here (``e`` below ``PAIR_EFFICIENCY_OK``), then
    the ``pair_efficiency=`` line."""
    warn = [] if e >= PAIR_EFFICIENCY_OK else [
        f"WARNING: pair efficiency {e:.2f}: two single-thread processes run side by side at {e:.0%} of their speed "
        f"alone here (hyper-threads of one core, or other load), so overlapping two equal jobs gains at most "
        f"{2 * paired(e):.2f}x, not 2x: the speedups and limits here cannot show what overlap does; record them "
        "where pair_efficiency is near 1"]
    return warn + [f"pair_efficiency={e:.2f}"]
