"""Launching local vLLM servers for ``rollout.launch = true`` (the handler that talks to them is ``engine/vllm.py``).

``launch_command`` builds a server's command as ``scripts/launch_vllm.sh`` does (keep the two in step);
``launch_servers`` starts them, each in its own process group and dying with the trainer. A launched server whose
handler dies is stopped and launched again (``rollout.engines.EngineFleet``, off the main thread). The server runs in another Python environment
(``rollout.launch_python``) with this package's parent directory on its ``PYTHONPATH``.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from torchtitan_flux.auth import MIDDLEWARE, TOKEN_ENV
from torchtitan_flux.engine.forkserver import die_with_parent
from torchtitan_flux.engine.group_watchdog import GroupWatchdog
from torchtitan_flux.errors import EngineStartError

logger = logging.getLogger("torchtitan_flux")

EXTENSION = "torchtitan_flux.engine.vllm_ext.FluxWorkerExtension"
PACKAGE_PARENT = Path(__file__).resolve().parents[2]  # where ``import torchtitan_flux`` finds this package


def _has_gpu() -> bool:
    """What ``scripts/launch_vllm.sh`` tests: ``nvidia-smi`` exists and succeeds."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return subprocess.run(["nvidia-smi"], capture_output=True, timeout=30, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# vLLM 0.32's CPU attention (``CPUAttentionBackend.get_supported_head_sizes``); a launched CPU server with another
# head size exits during start-up after ~1 min of loading. Checked before launching (``unservable_reason``).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def unservable_reason(model_dir: str | os.PathLike, gpu: bool | None = None) -> str | None:
    """Why a server launched here could not serve ``model_dir`` (CPU: the head sizes above), else None; called
    at config validation. ``gpu``: as ``launch_command`` decides it."""
    from torchtitan_flux.models import hf

    if _has_gpu() if gpu is None else gpu:
        return None
    head_dim = hf.architecture(hf.read_config(model_dir), str(Path(model_dir) / "config.json"))["head_dim"]
    if head_dim in VLLM_CPU_HEAD_SIZES:
        return None
    return (f"the model's head_dim is {head_dim}, and vLLM's CPU attention serves head sizes "
            f"{', '.join(map(str, VLLM_CPU_HEAD_SIZES))} only")


def launch_command(model_dir: str | os.PathLike, port: int, *, python: str | os.PathLike,
                   extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None, gpu: bool | None = None,
                   auth_token: str | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of a vLLM server for our weight sync on 127.0.0.1:``port``, as ``scripts/launch_vllm.sh``
    builds it (``VLLM_*`` knobs read from ``env``). ``auth_token`` goes into its environment as
    ``$TORCHTITAN_FLUX_TOKEN`` (never its command line), with the ``BearerAuthMiddleware``."""
    env = dict(os.environ if env is None else env)
    env.pop(TOKEN_ENV, None)
    if auth_token:
        env[TOKEN_ENV] = auth_token
        extra_args = ("--middleware", MIDDLEWARE, *extra_args)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    env.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = str(PACKAGE_PARENT) + (f":{env['PYTHONPATH']}" if env.get("PYTHONPATH") else "")
    args: list[str] = []
    if _has_gpu() if gpu is None else gpu:
        backend = "nccl"  # vLLM's own NCCL engine; the trainer drives it (engine/vllm_nccl.py)
        args += ["--dtype", env.get("VLLM_DTYPE") or "auto"]
    else:
        backend = "gloo"
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        args += ["--dtype", env.get("VLLM_DTYPE") or "float32", "--enforce-eager"]
    if env.get("VLLM_MAX_MODEL_LEN"):
        args += ["--max-model-len", env["VLLM_MAX_MODEL_LEN"]]
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1",
        "--port", str(port), "--seed", "0", "--worker-extension-cls", EXTENSION,
        "--weight-transfer-config", json.dumps({"backend": backend}, separators=(",", ":")),
        "--logprobs-mode", "processed_logprobs", *args, *extra_args,
    ]
    return argv, env


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (all bound at once, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _preexec(parent: int, with_thread: bool) -> None:
    """In the forked child, before exec: die with the trainer (exit now if it died before the prctl took effect).
    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child ends, so only a launch from the main thread
    sets it (``with_thread``); a relaunch on a reconnect thread, which ends once the server is up, relies on the
    server's ``GroupWatchdog`` alone (it watches this process, not a thread)."""
    if with_thread and die_with_parent() and os.getppid() != parent:
        os._exit(1)


def last_error_line(log: str) -> str:
    """The line of a server log that says why it failed: the last one naming an error, else the last one."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.search(r"(Error|Exception|error:)", ln):
            return ln[-500:]
    return lines[-1][-500:] if lines else "(empty log)"


class LaunchedServer:
    """A vLLM server this process started (see ``launch_servers``)."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path, log_file):
        self.proc, self.url, self.log_path, self._log = proc, url, log_path, log_file
        # the server's engine core and workers have no parent-death signal: its whole group dies with the trainer
        self._watchdog = GroupWatchdog(proc.pid)
        atexit.register(self.stop)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def healthy(self) -> bool:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy
        try:
            with opener.open(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``grace_s``. Idempotent."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                logger.warning(f"vLLM server {self.url} (pid {self.proc.pid}) ignored SIGTERM; killing it")
        # the group may outlive its leader (engine-core children): kill what is left either way
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.returncode is None:
            self.proc.wait(timeout=30)
        self._watchdog.close()
        if not self._log.closed:
            self._log.close()
        atexit.unregister(self.stop)


def launch_servers(n: int, model_dir: str | os.PathLike, *, python: str | os.PathLike, log_dir: str | os.PathLike,
                   timeout_s: float = 600.0, extra_args: tuple[str, ...] = (), threads: int | None = None,
                   auth_token: str | None = None, envs: list[dict[str, str]] | None = None,
                   log_names: list[str] | None = None) -> list[LaunchedServer]:
    """Start ``n`` local vLLM servers of ``model_dir`` on free ports (logs: ``log_dir/log_names[i]``, default
    ``vllm_server{i}.log``; ``envs[i]`` added to server i's environment) and wait until each answers ``/health``. On failure every server
    started here is stopped and ``EngineStartError`` names the server's log."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    servers: list[LaunchedServer] = []
    main = threading.current_thread() is threading.main_thread()  # _preexec: PDEATHSIG follows the forking thread
    try:
        for i, port in enumerate(_free_ports(n)):
            argv, env = launch_command(os.path.abspath(model_dir), port, python=python, extra_args=extra_args,
                                       auth_token=auth_token)
            if threads is not None:  # CPU: the server's share of the cores (the trainer takes the rest)
                env["OMP_NUM_THREADS"] = str(threads)
            env.update(envs[i] if envs else {})
            log_path = log_dir / (log_names[i] if log_names else f"vllm_server{i}.log")
            log = open(log_path, "w")  # noqa: SIM115 (owned and closed by the LaunchedServer)
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True,
                                    # only a prctl between fork and exec, before any engine thread starts
                                    preexec_fn=functools.partial(_preexec, os.getpid(), main))  # noqa: PLW1509
            servers.append(LaunchedServer(proc, f"http://127.0.0.1:{port}", log_path, log))
            logger.info(f"launched vLLM server {i} (pid {proc.pid}) at {servers[-1].url}; log {log_path}")
        t0 = time.monotonic()
        pending = list(servers)
        while pending:
            for s in list(pending):
                if s.proc.poll() is not None:
                    raise EngineStartError(f"the vLLM server launched at {s.url} exited with code "
                                           f"{s.proc.returncode} before it was healthy: "
                                           f"{last_error_line(s.tail(20000))} (full log: {s.log_path})")
                if s.healthy():
                    pending.remove(s)
            if pending and time.monotonic() - t0 > timeout_s:
                s = pending[0]
                raise EngineStartError(f"the vLLM server launched at {s.url} did not answer /health within "
                                       f"{timeout_s:g} s (rollout.launch_timeout_s); its last log line: "
                                       f"{last_error_line(s.tail(20000))} (full log: {s.log_path})")
            if pending:
                time.sleep(1.0)
        logger.info(f"{n} vLLM server(s) healthy after {time.monotonic() - t0:.1f} s")
        return servers
    except BaseException:
        for s in servers:
            s.stop(grace_s=5.0)
        raise


def resolve_launch_python(path: str) -> str | None:
    """``rollout.launch_python`` as an existing absolute path: as given, else relative to the directory this
    package is imported from (a source checkout's root, where ``.venv-vllm`` is); None when neither exists."""
    for cand in (path, os.path.join(PACKAGE_PARENT, path)):
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return os.path.abspath(cand)
    return None
