"""``EnginePump``: rank 0's engines, the requests they hold, and the events they report.

It owns the engines list (a dead one is replaced through the ``replace`` function it is built with), every request
in flight (``InFlight``: which engine holds it since when), stall kills (an engine alive but holding requests with
no result for ``rollout.engine_stall_seconds``), deaths and re-dispatch (a dead engine's requests go to the fastest
engine alive: no prompt is lost), and the route of every event: ``pump`` hands each event of the main queue to the
handler registered for its type at construction (results with their ``InFlight``).

Threads, and who waits for whom:

* engine threads and processes only put events on ``raw`` (the queue every handler was given);
* with multi-turn episodes, the router thread ("flux-router") moves them to the main queue in order, but for a
  turn's result, which it hands straight to the episode waiting for it (``TurnRequest.resolve``), so episodes go on
  while nobody pumps (a step training, a checkpoint); single-turn runs have no router (the main queue is ``raw``);
* the episodes' thread ("flux-episodes") sends turns (``send_turn``): never blocks, never waits for an engine
  (a turn while no engine is alive is parked: ``pump``'s once-a-second check sends it once one is, or raises
  ``NoEngineLeft`` after ``DEATH_NOTICE_S`` with none);
* the main thread sends single-turn and evaluation requests (``send``) and runs ``pump``: the handlers, stall
  kills, deaths and re-dispatch run there only. The registry of requests in flight is shared with the first two
  threads under ``_lock``, held only for bookkeeping (engine submits never block: ``EngineHandler.submit``).
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

from torchtitan_flux.engine.base import EngineError, GenerationRequest, GenerationResult
from torchtitan_flux.errors import NoEngineLeft
from torchtitan_flux.rollout.reconnect import Reconnected, Reconnecting
from torchtitan_flux.rollout.split import SpeedSplit

logger = logging.getLogger("torchtitan_flux")

DEATH_NOTICE_S = 10.0  # how long a dispatch with no engine alive waits for a queued death (and its restart)
ROUTER_S = 0.1  # ``pump(0)`` waits this long at most for an event the router is moving
UNPUMPED_S = 5.0  # nobody pumped for this long (training, a save): queued results are no evidence of a stall


@dataclass
class TurnTimed:
    """A turn's result went to its episode: its engine's speed, for ``SpeedSplit`` on the main thread."""

    engine: str
    completions: int
    gen_time_s: float


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout side uses of an engine handler (``engine.base.EngineHandler``, every kind); the tests'
    engines without processes implement exactly this (``tests/fakes/engines.py``)."""

    name: str
    reconnects: bool  # True: a server not ours (no stall kill: its HTTP timeouts cover its calls)

    def alive(self) -> bool: ...

    def submit(self, request: GenerationRequest) -> None: ...  # thread-safe, never blocks

    def kill(self, why: str) -> None: ...


class Turn(Protocol):
    """A multi-turn episode's turn in flight (``episode_groups.TurnRequest``)."""

    group: int

    def resolve(self, result: GenerationResult) -> None: ...


@dataclass
class InFlight:
    """A request on an engine."""

    request: GenerationRequest
    engine: RolloutEngine
    sent: float = field(default_factory=time.monotonic)
    turn: Turn | None = None
    """A multi-turn episode's turn: its result goes to ``turn.resolve`` on the router thread, not to the main one."""


class EnginePump:
    """The module docstring's owner of engines, requests in flight and events."""

    def __init__(self, engines: list[RolloutEngine], raw: queue.Queue, *, split: SpeedSplit, stall_s: float,
                 replace: Callable[[RolloutEngine], RolloutEngine | None], handlers: dict[type, Callable],
                 turns: bool):
        """``raw``: the queue every engine handler (and ``EpisodeGroups``) reports to; ``handlers``: event type ->
        handler (``GenerationResult``: ``fn(in_flight, result)``; others ``fn(ev)``; an ``EngineError`` goes to its
        handler before a fatal one is handled here); ``replace(dead)``: a started replacement, or None (the engine is
        dropped); ``turns``: multi-turn episodes send turns (only then does the router run: a single-turn run's main
        thread reads ``raw`` itself, one thread hop less per event)."""
        self.engines, self.split, self.stall_s = list(engines), split, stall_s
        self._replace, self._handlers = replace, handlers
        self.events: queue.Queue = queue.Queue() if turns else raw  # the main thread's (the router's, in order)
        self._raw = raw
        self._lock = threading.Lock()  # guards _in_flight, _parked, last_result, _last_from (three threads)
        self._in_flight: dict[int, InFlight] = {}
        self._parked: collections.deque = collections.deque()  # turns sent while no engine was alive
        self._ids = itertools.count()
        self.redispatched = self.engine_deaths = 0
        self.last_result = time.monotonic()  # when the newest generation result arrived
        self._last_from: dict[str, float] = {}  # engine name -> when its newest result arrived
        self._stall_checked = 0.0
        self._last_pump = self._stall_clock_from = time.monotonic()
        self._router = threading.Thread(target=self._route, name="flux-router", daemon=True) if turns else None
        if self._router is not None:
            self._router.start()

    # -- sending (``send``: main thread; ``send_turn``: any thread)
    def new_id(self) -> int:
        with self._lock:
            return next(self._ids)

    def send(self, request: GenerationRequest, engine: RolloutEngine) -> None:
        with self._lock:
            self._in_flight[request.req_id] = InFlight(request, engine)
        engine.submit(request)

    def send_turn(self, request: GenerationRequest, turn: Turn) -> None:
        """A turn, to the engine alive holding the fewest requests; parked while none is alive."""
        with self._lock:
            alive = [e for e in self.engines if e.alive()]
            if not alive:
                self._parked.append((request, turn, time.monotonic()))
                return
            held = collections.Counter(f.engine.name for f in self._in_flight.values())
            engine = min(alive, key=lambda e: held[e.name])
            self._in_flight[request.req_id] = InFlight(request, engine, turn=turn)
        engine.submit(request)

    def forget(self, keep: Callable[[GenerationRequest, Turn | None], bool]) -> None:
        """Forget the requests in flight and the parked turns for which ``keep(request, turn)`` is False (their
        results will be dropped)."""
        with self._lock:
            for req_id in [k for k, f in self._in_flight.items() if not keep(f.request, f.turn)]:
                del self._in_flight[req_id]
            self._parked = collections.deque(p for p in self._parked if keep(p[0], p[1]))

    def in_flight(self) -> list[InFlight]:
        with self._lock:
            return list(self._in_flight.values())

    def alive(self) -> list[RolloutEngine]:
        """The engines alive now. With none, pump for up to ``DEATH_NOTICE_S``: a death still queued gets its
        replacement instead of ending the run (main thread)."""
        deadline = time.monotonic() + DEATH_NOTICE_S
        while True:
            alive = [e for e in self.engines if e.alive()]
            if alive:
                return alive
            if time.monotonic() > deadline and not self._reconnecting():
                raise NoEngineLeft("no rollout engine is alive")
            self.pump(0.05)

    def fastest(self, alive: list[RolloutEngine]) -> RolloutEngine:
        return next(e for e in alive if e.name == self.split.fastest([a.name for a in alive]))

    # -- events
    def _route(self) -> None:
        """The router thread (module docstring): until ``close`` puts None."""
        while (ev := self._raw.get()) is not None:
            f = None
            if isinstance(ev, GenerationResult):
                with self._lock:
                    f = self._in_flight.get(ev.req_id)
                    if f is not None and f.turn is not None:
                        del self._in_flight[ev.req_id]
                        self.last_result = self._last_from[ev.engine] = time.monotonic()
            if f is not None and f.turn is not None:
                try:
                    f.turn.resolve(ev)
                except RuntimeError as e:  # its episodes' loop closed meanwhile (shutdown)
                    logger.debug(f"dropped a turn's result (request {ev.req_id}): {e}")
                self.events.put(TurnTimed(ev.engine, ev.tokens.shape[0], ev.gen_time_s))  # for the speed split
            else:
                self.events.put(ev)
            self._raw.task_done()  # after the put: an event is always counted in one of the two queues
        self._raw.task_done()  # the sentinel

    def has_events(self) -> bool:
        """Whether ``pump`` has an event to handle now, or the router one still to move."""
        # raw first: the router puts an event on the main queue before it marks it done on raw
        return (self._router is not None and self._raw.unfinished_tasks > 0) or not self.events.empty()

    def pump(self, timeout: float) -> None:
        """Handle at most one event, waiting up to ``timeout`` seconds; once a second, kill stuck engines and send
        parked turns (main thread)."""
        now = time.monotonic()
        if now - self._last_pump > UNPUMPED_S:
            self._stall_clock_from = now
        self._last_pump = now
        if now - self._stall_checked >= 1.0 and not self.has_events():
            self._stall_checked = now
            self._kill_stuck(now)
            self._send_parked()
        try:  # an event reported already but still with the router counts as reported (``has_events``)
            in_transit = self._router is not None and self._raw.unfinished_tasks > 0
            ev = self.events.get(timeout=timeout or ROUTER_S) if timeout > 0 or in_transit else self.events.get_nowait()
        except queue.Empty:
            return
        if isinstance(ev, GenerationResult):
            with self._lock:
                f = self._in_flight.pop(ev.req_id, None)
                self.last_result = self._last_from[ev.engine] = time.monotonic()
            if f is None:  # a re-dispatched request's late original, or a forgotten one
                logger.debug(f"dropped a late result (request {ev.req_id}, engine {ev.engine})")
                return
            self.split.observe(ev.engine, ev.tokens.shape[0], ev.gen_time_s)
            self._handlers[GenerationResult](f, ev)
            return
        if isinstance(ev, TurnTimed):  # a turn's speed, measured on this thread only (``SpeedSplit``)
            self.split.observe(ev.engine, ev.completions, ev.gen_time_s)
            return
        handler = self._handlers.get(type(ev))
        if handler is not None:
            handler(ev)
        if isinstance(ev, Reconnected):
            self._swap(ev.placeholder, ev.engine)
        elif isinstance(ev, EngineError):
            if ev.fatal:
                self._engine_died(ev.engine, ev.message)
            else:
                logger.warning(f"engine {ev.engine}: {ev.message}")

    def _send_parked(self) -> None:
        """Send the parked turns to an engine alive; none alive for ``DEATH_NOTICE_S`` since a turn was parked (no
        restart came): ``NoEngineLeft``, as a dispatch would."""
        with self._lock:
            if not self._parked:
                return
            if not any(e.alive() for e in self.engines):
                if time.monotonic() - self._parked[0][2] > DEATH_NOTICE_S and not self._reconnecting():
                    raise NoEngineLeft("no rollout engine is alive (episodes' turns waited for one)")
                return
            parked, self._parked = self._parked, collections.deque()
        for request, turn, _ in parked:
            self.send_turn(request, turn)

    def _kill_stuck(self, now: float) -> None:
        held = self.in_flight()
        for e in self.engines:
            mine = [f for f in held if f.engine is e]
            if not mine or not e.alive():
                continue
            with self._lock:
                last = self._last_from.get(e.name, 0.0)
            idle = now - max(last, min(f.sent for f in mine), self._stall_clock_from)
            if idle > self.stall_s and not e.reconnects:  # a server's own HTTP timeouts cover its calls
                e.kill(f"no result for {idle:.0f} s while holding {len(mine)} requests "
                       f"(rollout.engine_stall_seconds = {self.stall_s:g}): declared stuck and stopped")

    def _engine_died(self, name: str, message: str) -> None:
        dead = next((e for e in self.engines if e.name == name), None)
        if dead is None:
            return
        self.engine_deaths += 1
        logger.error(f"rollout engine {name} died: {message.strip().splitlines()[-1] if message else ''}")
        self._swap(dead, self._replace(dead))

    def _reconnecting(self) -> bool:
        return any(isinstance(e, Reconnecting) for e in self.engines)

    def _swap(self, old: RolloutEngine, new: RolloutEngine | None) -> None:
        """``new`` takes ``old``'s place (None: dropped); ``old``'s requests go to the fastest engine alive, or, with
        none alive, to a server being reconnected (re-dispatched again once its reconnect ends)."""
        with self._lock:
            if new is None:
                self.engines.remove(old)
            else:
                self.engines[self.engines.index(old)] = new
                self.split.replace(old.name, new.name)
            orphans = [f for f in self._in_flight.values() if f.engine is old]
        if not self.engines:
            raise NoEngineLeft("every rollout engine died (and none could be restarted or reconnected)")
        for f in orphans:
            alive = [e for e in self.engines if e.alive()] or [e for e in self.engines if isinstance(e, Reconnecting)]
            if not alive:
                raise NoEngineLeft("every rollout engine died (and none could be restarted or reconnected)")
            target = self.fastest(alive)
            with self._lock:
                if self._in_flight.pop(f.request.req_id, None) is not f:  # answered meanwhile (the router)
                    continue
                f.request.req_id = next(self._ids)
                f.engine, f.sent = target, time.monotonic()
                self._in_flight[f.request.req_id] = f
            target.submit(f.request)
            self.redispatched += 1

    def close(self) -> None:
        """Stop the router (events still queued are dropped)."""
        if self._router is not None:
            self._raw.put(None)
