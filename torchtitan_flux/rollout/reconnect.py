"""Replacing a dead server's handler off the main thread: ``Reconnecting`` holds the dead engine's place in the
pump's engines while a thread of its own reconnects to the server (or stops and relaunches a server we launched:
``EngineFleet``), then reports ``Reconnected`` on the engines' events queue; the pump puts the new handler in the
placeholder's place (None: the server is given up) and re-dispatches the requests it held.

Why a thread: a vLLM server wedged by an abandoned NCCL push answers ``/health`` but blocks every call that
reaches its engine core, so a reconnect's start-up checks wait for their read timeout (``engine.http``
``STARTUP_TIMEOUT_S``, never retried), and a relaunch for the server's start-up (``rollout.launch_timeout_s``):
the main thread, which trains and pumps, never waits for either.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable

from torchtitan_flux.engine.base import EngineHandler, GenerationRequest

logger = logging.getLogger("torchtitan_flux")


@dataclass
class Reconnected:
    """Event: the reconnect behind ``placeholder`` ended with ``engine`` started (None: given up)."""

    placeholder: "Reconnecting"
    engine: EngineHandler | None


class Reconnecting:
    """The rollout face (``pump.RolloutEngine``) of a server being reconnected: never alive; a request sent to it
    stays in flight on it until ``Reconnected`` re-dispatches it."""

    reconnects = True

    def __init__(self, dead: EngineHandler, connect: Callable[[], EngineHandler], events: queue.Queue):
        """``connect()``: the started replacement of ``dead`` (raises when the server is not usable), run on a
        thread of its own; its result goes to ``events``."""
        self.name, self.dead = dead.name, dead
        self._lock = threading.Lock()  # ``close`` against the end of the reconnect
        self._closed = False
        threading.Thread(target=self._run, args=(connect, events), name=f"{self.name}-reconnect", daemon=True).start()

    def alive(self) -> bool:
        return False

    def submit(self, request: GenerationRequest) -> None:
        pass  # the pump holds it in flight on this engine; ``Reconnected`` re-dispatches it

    def kill(self, why: str) -> None:
        pass  # nothing runs yet

    def checksum(self, timeout: float = 30.0) -> tuple[int, str | None]:
        return -1, None  # holds no weights (the run's summary asks every engine)

    def close(self) -> None:
        """The run ends: a replacement that connects later is closed at once."""
        with self._lock:
            self._closed = True

    def _run(self, connect: Callable[[], EngineHandler], events: queue.Queue) -> None:
        engine, why = None, None
        try:
            engine = connect()
        except Exception as e:  # noqa: BLE001 - a server that is not back is given up, the run goes on
            why = e
        with self._lock:
            if not self._closed:
                if engine is None:
                    logger.error(f"{self.name}: server gone ({why}); going on without it")
                events.put(Reconnected(self, engine))
                return
        if engine is not None:
            engine.close()
