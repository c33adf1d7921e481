"""Thread utilities of the HTTP engine handlers (``engine/http.py``): the gate over a server's weights and the
worker pool. Simplification: plain ``threading`` (no asyncio): a handler makes a few blocking HTTP calls at a
time, so one thread per in-flight call is the simplest correct design.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from typing import Callable

logger = logging.getLogger("torchtitan_flux")


class Gate:
    """Reader/writer gate over a server's weights, and the ``version`` they are at (-1: loaded from disk).
    Generations share it (``shared`` yields the version); an update holds it alone and publishes its version on
    ``release``. Writers go first. After ``fail`` every ``shared`` / ``acquire`` raises ``RuntimeError``.
    Concurrency: state changes happen under one condition variable; ``held`` and ``version`` are read without it
    where a stale value is harmless."""

    def __init__(self):
        self._cv = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        self._failed: str | None = None
        self.version = -1

    def wait_version(self, min_version: int, timeout: float) -> None:
        """Wait until the weights are at ``min_version`` or newer, the gate failed, or ``timeout`` passed."""
        with self._cv:
            self._cv.wait_for(lambda: self.version >= min_version or self._failed is not None, timeout=timeout)

    @contextlib.contextmanager
    def shared(self):
        with self._cv:
            while (self._writer or self._writers_waiting) and self._failed is None:
                self._cv.wait()
            if self._failed is not None:
                raise RuntimeError(self._failed)
            self._readers += 1
        try:
            yield self.version
        finally:
            with self._cv:
                self._readers -= 1
                self._cv.notify_all()

    def acquire(self) -> None:
        with self._cv:
            self._writers_waiting += 1
            try:
                while (self._writer or self._readers) and self._failed is None:
                    self._cv.wait()
            finally:
                self._writers_waiting -= 1
            if self._failed is not None:
                raise RuntimeError(self._failed)
            self._writer = True

    def release(self, version: int | None = None) -> None:
        """End an update; ``version``: the weights it left (None: unchanged, the update did not happen)."""
        with self._cv:
            if version is not None:
                self.version = version
            self._writer = False
            self._cv.notify_all()

    @property
    def held(self) -> bool:
        return self._writer

    def fail(self, why: str) -> None:
        with self._cv:
            self._failed = why
            self._cv.notify_all()


class Workers:
    """A fixed set of daemon threads draining a task queue (a call stuck on a dead server never keeps the trainer
    from exiting). Tasks report through the handler's events; one that raises is logged and the thread goes on."""

    def __init__(self, n: int, name: str):
        self._q: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable, *args) -> None:
        self._q.put((fn, args))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - tasks report through events; never lose the thread
                logger.exception("HTTP engine task failed")

    def stop(self) -> None:
        """Drop the queued tasks and end every thread once its running task returns."""
        with self._q.mutex:
            self._q.queue.clear()
        for _ in self._threads:
            self._q.put(None)
