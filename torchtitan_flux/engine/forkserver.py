"""How embedded engine processes start: from a fork server where the platform has one (Linux, macOS), else spawn
(``TORCHTITAN_FLUX_ENGINE_START=spawn`` forces spawn).

The fork server is a helper process that ``multiprocessing`` starts as a fresh interpreter; it imports torch and
the engine code once (``ENGINE_PRELOAD``) and then forks each engine from that state, so an engine, or a restarted
one, is up in ~0.1 s instead of paying the ~1.7 s of imports of a spawned interpreter (measured on 2 CPU cores).
``prestart_engine_server`` starts it at the top of the entry point, before the trainer imports torchtitan, so its
imports run on another core meanwhile.

Invariants: the server only imports modules and forks; it holds no threads, no CUDA context, no process group, so
forking it is safe (CUDA is first touched in the engine). It exits when the process that started it does (its
liveness pipe closes), and engines ask the kernel to kill them when their parent, the server, dies
(``die_with_parent``). ``multiprocessing`` hands every forked child the write end of that pipe
too, so an engine that cannot notice its trainer's death (stopped, or stuck in a collective) would keep the server,
itself and the resource tracker alive forever: an engine closes its copy first thing
(``release_server_liveness``), which makes the chain trainer -> server -> engine -> resource tracker end in order. Its socket is a Unix socket in a private (0700) temporary folder.
An engine inherits the environment the server started with (the top of the entry point), not the trainer's at
the engine's start. After that point only torchtitan's start-up changes the trainer's environment, for the
trainer's own process group and determinism (``TORCH_NCCL_*`` error handling / flight recorder,
``CUBLAS_WORKSPACE_CONFIG``, ``PYTHONHASHSEED``); engines keep the values from before: for an engine's NCCL
weight-sync group (GPU; not run here) torchrun's ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (tear the process down on
an NCCL error) instead of torchtitan's 3 (the same, skipping communicator clean-up). Code that sets a variable
for engines must do it before ``prestart_engine_server``.

This module imports no torch: the entry point calls it first.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal

START_METHOD_ENV = "TORCHTITAN_FLUX_ENGINE_START"

# What the fork server imports before it forks engines: everything an engine runs. The entry module is re-run as
# the child's ``__mp_main__``; what it imports (torch and the torch.distributed modules of the patches) is
# preloaded, not the module itself: runpy warns ("found in sys.modules ... prior to execution") when it is.
ENGINE_PRELOAD = ("torchtitan_flux.patches", "torchtitan_flux.engine.embedded", "torchtitan_flux.models.inference",
                  "torchtitan_flux.sync.transport", "torchtitan_flux.compat")


def start_method() -> str:
    """``forkserver`` where the platform has it, else ``spawn``; the environment variable ``START_METHOD_ENV``
    (``forkserver`` or ``spawn``) overrides it, e.g. to compare the two (``benchmarks/startup.py``)."""
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
    """Start the engines' fork server now and return without waiting for its imports (the first engine start
    waits for them). False where engines are spawned. Idempotent."""
    if engine_context().get_start_method() != "forkserver":
        return False
    from multiprocessing import forkserver

    forkserver.ensure_running()
    return True


def release_server_liveness() -> None:
    """In an engine forked by the server: close the inherited write end of the server's liveness pipe, so the
    server's lifetime is its starter's, not also this engine's (see the module docstring). A no-op in a spawned
    engine. Never call it in the process that started the server: its own copy keeps the server running.
    Reads ``multiprocessing.forkserver``'s private ``_forkserver_alive_fd`` (set by ``_serve_one`` in the child;
    CPython 3.9-3.13); if a future CPython renames it, this does nothing and an engine that cannot exit on its own
    keeps the server alive as before (tests/integration/test_faults.py::test_engine_does_not_outlive_a_killed_parent
    fails)."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is None:
        return
    server._forkserver_alive_fd = None
    try:
        os.close(fd)
    except OSError:
        pass


def _prctl(option: int, arg) -> bool:
    """Linux ``prctl(option, arg)``; False where there is no libc.so.6 (not Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg, 0, 0, 0)
    except OSError:
        return False
    return True


def die_with_parent() -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies (``PR_SET_PDEATHSIG``); False off Linux
    (engines still end when their control pipe closes). Used by engine processes and by trainer workers under
    torchrun (see ``FluxTrainer``)."""
    return _prctl(1, signal.SIGKILL)


def name_process(name: str) -> None:
    """``PR_SET_NAME``: the name ``ps -o comm``, ``top`` and psutil's ``name()`` show (15 bytes kept)."""
    _prctl(15, name.encode()[:15])
