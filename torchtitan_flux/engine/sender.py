"""``PipeSender``: the one thread that sends an embedded engine's control messages (``engine/embedded.py``), so that
no caller ever blocks on the engine.

Invariants: ``send`` never blocks, from any thread (``EngineHandler.submit`` from the episodes thread beside the main
thread). Messages are pickled by their caller (a CUDA tensor's IPC handle is made on the calling thread's device,
``cuda_rules`` rule 6, and a message that cannot be pickled raises there) and sent in the order they were queued.
Only the sender thread blocks: in a send to an engine that stopped reading (SIGSTOPped, hung) once the OS pipe
buffer is full, until the process dies, when the send raises (the dead process's end of the pipe closes). Past
``maxsize`` queued messages a message is dropped (logged once), and after a failed send or ``stop`` every message
is. Nothing is lost for the run: the rollouts kill an engine that holds requests with no result for
``rollout.engine_stall_seconds`` and re-dispatch its requests, and a dead engine is replaced, not sent to again.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from multiprocessing.reduction import ForkingPickler
from typing import Callable

logger = logging.getLogger("torchtitan_flux")


class PipeSender:
    """The sender thread of one engine's control pipe (see the module docstring)."""

    def __init__(self, conn, name: str, on_failure: Callable[[str], None], maxsize: int = 4096):
        """``conn``: the trainer's end of the pipe; ``on_failure``: called (sender thread) with why a send failed.
        ``maxsize``: messages queued at most, far more than one engine holds requests."""
        self.conn, self.name, self.on_failure, self.maxsize = conn, name, on_failure, maxsize
        self._queue: queue.Queue = queue.Queue(maxsize)  # pickled messages; None ends the thread
        self._dropping = False  # a send failed or ``stop`` was called: every message is dropped
        self._lock = threading.Lock()  # the full-queue warning, once
        self._warned = False
        self._thread = threading.Thread(target=self._run, name=f"{name}-sender", daemon=True)
        self._thread.start()

    def send(self, msg: tuple) -> None:
        """Queue ``msg`` (see the module docstring for what is dropped); any thread, never blocks."""
        if self._dropping:
            return
        try:
            self._queue.put_nowait(ForkingPickler.dumps(msg))
        except queue.Full:
            with self._lock:
                first, self._warned = not self._warned, True
            if first:
                logger.warning(f"engine {self.name}: {self.maxsize} messages queued that it does not read (stopped or "
                               "hung): its messages are dropped until it is declared stuck and killed "
                               "(rollout.engine_stall_seconds)")

    def _run(self) -> None:
        while (buf := self._queue.get()) is not None:
            if self._dropping:  # stopped: what was queued before is dropped too
                return
            try:
                self.conn.send_bytes(buf)
            except (OSError, EOFError) as e:
                self._dropping = True
                self.on_failure(f"control pipe closed: {e}")
                return

    def stop(self, timeout: float = 5.0) -> None:
        """Drop every later message and end the thread; call it once the process is dead (a send in progress then
        raises). Waits ``timeout`` at most."""
        self._dropping = True
        with contextlib.suppress(queue.Full):  # full: the thread is in a send, which raises, and it returns
            self._queue.put_nowait(None)
        self._thread.join(timeout)
