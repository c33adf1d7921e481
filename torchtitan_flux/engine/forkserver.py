"""How embedded engine processes start: forked from a fork server where the platform has one, else spawned
(``TORCHTITAN_FLUX_ENGINE_START=spawn`` forces spawn). The server imports torch and the engine code once
(``ENGINE_PRELOAD``), so an engine skips those imports; ``prestart_engine_server`` starts it at the top of the
entry point, so they overlap the trainer's. This module imports no torch.

Invariants: the server only imports and forks (no threads, CUDA context or process group), so forking it is
safe. It exits with its starter (its liveness pipe closes) and engines die with it (``die_with_parent``); each
engine closes its inherited copy of that pipe first thing (``release_server_liveness``), else a stopped or stuck
engine would keep the server, itself and the resource tracker alive. Its socket is in a private (0700) folder.
Engines inherit the environment of the top of the entry point, not torchtitan's later changes (``TORCH_NCCL_*``,
``CUBLAS_WORKSPACE_CONFIG``, ``PYTHONHASHSEED``): set a variable for engines before ``prestart_engine_server``.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal

START_METHOD_ENV = "TORCHTITAN_FLUX_ENGINE_START"

# Everything an engine runs. Not the entry module itself (re-run as ``__mp_main__``: runpy warns when preloaded).
ENGINE_PRELOAD = ("torchtitan_flux.patches", "torchtitan_flux.engine.embedded", "torchtitan_flux.models.inference",
                  "torchtitan_flux.wire.transport", "torchtitan_flux.compat")


def start_method() -> str:
    """``forkserver`` where the platform has it, else ``spawn``; ``$TORCHTITAN_FLUX_ENGINE_START`` overrides it."""
    want = os.environ.get(START_METHOD_ENV, "").strip().lower()
    if want and want not in ("forkserver", "spawn"):
        raise ValueError(f"{START_METHOD_ENV}={want!r}: allowed values are 'forkserver' and 'spawn'")
    if want == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    return "forkserver"


def engine_context():
    """The ``multiprocessing`` context engines start from (``start_method``)."""
    if start_method() == "spawn":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(ENGINE_PRELOAD))  # no effect once the server runs
    return ctx


def prestart_engine_server() -> bool:
    """Start the fork server without waiting for its imports; False where engines are spawned. Idempotent."""
    if engine_context().get_start_method() != "forkserver":
        return False
    from multiprocessing import forkserver

    forkserver.ensure_running()
    return True


def release_server_liveness() -> None:
    """In an engine forked by the server: close the inherited write end of the server's liveness pipe (a no-op in a
    spawned engine; never call it in the server's starter). Reads CPython's private ``_forkserver_alive_fd``
    (3.9-3.13): ``test_faults.py::test_engine_does_not_outlive_a_killed_parent`` catches a rename."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is None:
        return
    server._forkserver_alive_fd = None
    with contextlib.suppress(OSError):
        os.close(fd)


def prctl(option: int, arg) -> bool:
    """Linux ``prctl(option, arg)``; False where there is no libc.so.6 (not Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg, 0, 0, 0)
    except OSError:
        return False
    return True


def die_with_parent() -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies (``PR_SET_PDEATHSIG``); False off Linux
    (engines still end when their control pipe closes)."""
    return prctl(1, signal.SIGKILL)


def name_process(name: str) -> None:
    """``PR_SET_NAME``: the name ``ps -o comm``, ``top`` and psutil's ``name()`` show (15 bytes kept)."""
    prctl(15, name.encode()[:15])
