"""The CUDA/NCCL rules of weight sync, in one place. Torch-only (no torchtitan): engines import it too.

Each rule is a function or constant here, used by both sides (``sync/`` on the trainer, ``transport.py`` in
engines); CPU tests: ``tests/integration/test_cuda_rules.py``; what CPU cannot test (streams): ``docs/gpu.md``.

1. One thread, one stream per group: every collective of a weight-sync group is issued by one thread (trainer:
   the push thread; engine: the receiver) inside ``on_stream`` with the group's own stream (``group_stream``).
   NCCL's stream waits on the *current* stream at enqueue, and ``Work.wait()`` makes the current stream wait on
   it: from the default stream a push would queue behind training kernels or block generation. The trainer
   gives each NCCL engine its own stream and staging ring (``pusher.DeviceRing``): nothing issued for one engine
   is ever ordered after another engine's work, so a stalled engine stalls only itself (a shared stream or ring
   made every engine wait for the slowest earlier one and cut them all at its deadline: review 4, finding 1).
   A library that sends for us runs under ``on_stream`` too: vLLM's ``trainer_init`` enqueues a warm-up
   all_reduce on the current stream and its ``send_weights`` ends with ``current_stream().synchronize()``, which
   on the default stream would wait for the training step's kernels (``engine/vllm_nccl.py``; finding 4).
2. The header lives on the group's device (``header_device``): NCCL rejects CPU tensors; gloo wants CPU.
3. Host-side completion is decided by polling ``Work.is_completed()`` against OUR deadline (``wait_works``),
   one deadline per push, never by ``Work.wait(timeout)`` (counted from enqueue, and under
   ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` a timed-out Work tears the whole process down). A push that misses
   its deadline has its NCCL group aborted (``abort_group``; a gloo group is dropped) and the engine rejoins on a
   fresh one. The abort runs on a helper thread bounded by ``ABORT_S``; one that hangs gets its engine killed
   (fifth review, finding 24).
4. Groups get a long timeout (``GROUP_TIMEOUT``) so the NCCL watchdog never fires before our deadline does.
5. The receiver acks only after the bytes landed: ``landed(works, stream)`` waits on the Works on the receiver's
   stream and synchronizes an event recorded after them (on CPU: ``Work.wait()``, which blocks the host). The event
   is a blocking one, so an idle engine waiting for the next push sleeps instead of spinning a core.
6. The receiver thread calls ``bind_thread(device)`` first, so its CUDA context is the engine's GPU.
7. NCCL versions are compared at join (``check_nccl_version``), or at start where the server reports its own
   (vLLM's NCCL engine: ``require_same_nccl``): a mismatch is one error line, not a rejoin loop.
8. The trainer joins eagerly in the joiner thread, never inside a broadcast holding the claim, wherever the engine
   connects eagerly too (``EngineHandler.eager_connect``; SGLang does not, see docs/gpu.md).
9. Colocated engines map the trainer's device staging by CUDA IPC. Memory from the allocator's expandable
   segments is exported as a file descriptor the importer takes with ``pidfd_getfd`` (ptrace rights, which some
   containers refuse), legacy segments as ``cudaIpcMemHandle``: validation warns when the allocator config enables
   them for a colocated GPU run (``expandable_segments_setting``; torchtitan's ``run_train.sh`` exports it).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from datetime import timedelta
from typing import Any, Iterable

import torch

from torchtitan_flux import compat
from torchtitan_flux.errors import NcclVersionMismatch

GROUP_TIMEOUT = timedelta(days=7)  # rule 4: far beyond any push deadline; our polling decides
# rule 3: ``wait_works`` yields for the first SPIN_S, then sleeps POLL_S[0], doubling up to POLL_S[1]
SPIN_S = 0.003
POLL_S = (0.0001, 0.002)
ABORT_S = 10.0  # rule 3: an abort not returned by then hangs; its engine is killed (``abort_group``)


def expandable_segments_setting(env: dict[str, str] | None = None) -> str | None:
    """Rule 9: the allocator-config variable that enables expandable segments (``NAME=value``), else None."""
    env = os.environ if env is None else env
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        value = env.get(name, "")
        if re.search(r"expandable_segments\s*:\s*true", value, re.IGNORECASE):
            return f"{name}={value}"
    return None


def header_device(backend: str, device: torch.device | str) -> torch.device:
    """Rule 2: where a push header (and every tensor a group carries) must live for ``backend``."""
    return torch.device(device) if backend == "nccl" else torch.device("cpu")


def group_stream(device: torch.device | str) -> Any:
    """Rule 1: a fresh side stream on ``device`` for one weight-sync group, or None on CPU."""
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return None
    mod = compat.device_module(device)
    return mod.Stream(device=device) if mod is not None and hasattr(mod, "Stream") else None


@contextlib.contextmanager
def on_stream(stream: Any):
    """Rule 1: issue collectives (and their ``Work.wait()``) with ``stream`` current; a no-op for None."""
    if stream is None:
        yield
        return
    mod = compat.device_module(stream.device)
    with mod.stream(stream):
        yield


def bind_thread(device: torch.device | str) -> None:
    """Rule 6: the calling thread's current device is ``device`` (a no-op on CPU)."""
    device = torch.device(device)
    if device.type != "cpu" and device.index is not None:
        mod = compat.device_module(device)
        if mod is not None and hasattr(mod, "set_device"):
            mod.set_device(device)


def wait_works(works: Iterable[Any], deadline: float) -> bool:
    """Rule 3: poll every Work until all completed (True) or ``deadline`` passes (False); errors: ``raise_failed``."""
    pending, period, spin_until = list(works), POLL_S[0], time.monotonic() + SPIN_S
    while pending:
        pending = [w for w in pending if not w.is_completed()]
        if not pending:
            break
        now = time.monotonic()
        if now > deadline:
            return False
        if now < spin_until:
            time.sleep(0)  # yield: the backend's threads get the core
            continue
        time.sleep(period)
        period = min(2 * period, POLL_S[1])
    return True


def raise_failed(works: Iterable[Any]) -> None:
    """Raise the error of a completed Work that failed (``Work.wait()`` on a completed Work returns at once)."""
    for w in works:
        w.wait()


def abort_group(pg: Any) -> bool:
    """Rule 3: abandon a group after a missed deadline (NCCL: ``abort`` frees the communicator; gloo: closes), on a
    helper thread joined for at most ``ABORT_S``. False: it has not returned (torch waits for NCCL's
    ``abortComms`` up to the group's own timeout, 7 days by rule 4, and ``ncclCommAbort`` can hang): the caller
    kills the engine, and the helper thread is left to it."""
    fn = next((f for f in (getattr(pg, name, None) for name in ("abort", "shutdown")) if f is not None), None)
    if fn is None:
        return True

    def run() -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - a broken group may refuse; it is dropped either way
            pass

    helper = threading.Thread(target=run, name="flux-abort", daemon=True)
    helper.start()
    helper.join(ABORT_S)
    return not helper.is_alive()


def landed(works: list[Any], stream: Any) -> None:
    """Rule 5 (receiver): return once the data of ``works`` is in memory (GPU: through an event on ``stream``)."""
    with on_stream(stream):
        for w in works:
            w.wait()
    if stream is not None:
        mod = compat.device_module(stream.device)
        try:  # blocking: an idle engine waits for the next header asleep, not spinning a core (review 4, finding 10)
            ev = mod.Event(blocking=True)
        except TypeError:  # a device module whose Event takes no ``blocking``
            ev = mod.Event()
        ev.record(stream)
        ev.synchronize()


def nccl_version() -> str | None:
    """This process's NCCL version ("2.21.5"), or None without CUDA/NCCL."""
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a CPU build has no NCCL
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def check_nccl_version(store: Any, prefix: str, role: str, timeout_s: float, mine: str | None = None) -> None:
    """Rule 7: both sides publish their NCCL version under ``{prefix}/nccl/{role}``; ``NcclVersionMismatch``
    naming both if they differ. NCCL only, right before building the group (``mine``: tests)."""
    mine = mine if mine is not None else (nccl_version() or "none")
    peer = "engine" if role == "trainer" else "trainer"
    store.set(f"{prefix}/nccl/{role}", mine)
    store.wait([f"{prefix}/nccl/{peer}"], timedelta(seconds=timeout_s))
    require_same_nccl(f"on {prefix}", role, mine, peer, store.get(f"{prefix}/nccl/{peer}").decode())


def require_same_nccl(where: str, role: str, mine: str, peer: str, theirs: str) -> None:
    """Rule 7's comparison: ``NcclVersionMismatch`` naming both versions (also where a server reports its version
    at start: ``VllmNcclEngine``)."""
    if theirs != mine:
        raise NcclVersionMismatch(
            f"weight sync {where}: the {role} has NCCL {mine} but the {peer} has NCCL {theirs}; NCCL cannot "
            "connect across versions: install the same torch/NCCL in both environments (see docs/gpu.md)"
        )
