"""``LinkTable``: rank 0's view of every engine (its group, the versions sent and acked, its state) and the counters.

The table is the one owner of that state: every ``EngineLink`` field and every ``SyncStats`` counter is assigned
here, by the transitions below, under ``LinkTable.lock``; the pusher and the syncer say what happened, the table
moves the state (``tests/unit/test_links.py`` scans the package for writes from anywhere else).

A link's ``state`` (``LinkState``) and the transitions that move it::

    JOINING --joined--> READY --check_timeouts--> LAGGING --record(its ack of what it was sent)--> READY
    JOINING --join_failed--> BROKEN                 (retried unless refused, after a backoff: --> JOINING)
    READY, LAGGING --push_failed, push_incomplete, record(non-fatal error)--> BROKEN
    BROKEN --rejoin_broken (engine alive)--> JOINING
    any --record(fatal error)--> DEAD;  any --replaced (a restarted engine)--> JOINING

* JOINING: a joiner thread is building a fresh group (``connect`` starts the first); the link has no group.
* READY: its group is up; every push goes to it (the only usable state).
* LAGGING: its group is up but it did not ack what it was sent within ``timeout_s``; pushes skip it (it keeps
  serving its old version) until it acks, then it is READY and gets a full push (a resync).
* BROKEN: its group must be rebuilt (a push failed or missed its deadline, the engine reported an error on its
  weight path, or the join failed); the next push or ``deliver_staged`` rejoins it while the engine is alive. Its
  receiver gave up on the group: it is neither waited for nor timed out.
* DEAD: the engine process or server is gone; only ``replaced`` (its restart) moves it on.

A failed join is retried (``join_failed``) after ``JOIN_BACKOFF_S`` doubling per consecutive failure, at most
``JOIN_ATTEMPTS`` joins in a row; then the table stops retrying and the joiner declares the engine dead (review 4,
finding 2: a server whose worker is stuck in an abandoned push never rendezvouses, and an immediate retry looped
forever). ``rejoin_broken`` starts a fresh series.

``epoch`` numbers a link's groups: each join takes the next. A joiner or a push whose epoch is no longer the link's
(a newer join superseded it) counts its failure but leaves the link alone.

Concurrency: every method takes ``lock`` itself, except where it says the caller holds it. No pipe send, HTTP call
or collective runs while ``lock`` is held, by anyone: a stopped engine does not read its pipe, so a send to it can
block for good, and the main thread's ``pump`` and ``claim`` take this lock. Decisions are made under the lock and
the sends after it is released (the join message by the joiner thread itself); a send that turned out stale is
recognised by its epoch. Acks, engine errors and timeouts are handled on the main thread.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field

from torchtitan_flux.engine.base import EngineError, EngineHandler, WeightAck

logger = logging.getLogger("torchtitan_flux")

JOIN_BACKOFF_S = (0.5, 30.0)  # a join retry waits the first, doubling per failure in a row, up to the second
JOIN_ATTEMPTS = 8  # joins in a row (about a minute of backoff) before the engine is declared dead


class LinkState(enum.Enum):
    """Where one engine's weight-sync link stands; the states and transitions are in the module docstring."""

    JOINING = "joining"
    READY = "ready"
    LAGGING = "lagging"
    BROKEN = "broken"
    DEAD = "dead"


@dataclass
class EngineLink:
    """Rank 0's view of one engine. Read under ``LinkTable.lock``; assigned only by ``LinkTable``."""

    handler: EngineHandler
    """The engine (a restarted or reconnected one replaces it: ``LinkTable.replaced``)."""
    state: LinkState = field(default=LinkState.JOINING, init=False)
    """See the module docstring."""
    epoch: int = field(default=0, init=False)
    """The number of its newest group: every join takes the next."""
    pg: object | None = field(default=None, init=False)
    """Rank 0's side of its group (``transport.COLOCATED``: none is needed), set when joined; None while joining."""
    backend: str = field(default="", init=False)
    """Its group's backend: "nccl", "gloo" or ``transport.COLOCATED`` (set when joined)."""
    sent: int = field(default=-1, init=False)
    """The newest version sent on its group; -1: none yet (a new group starts with a full push)."""
    sent_at: float = field(default=0.0, init=False)
    """``time.time()`` when ``sent`` was sent: ``check_timeouts`` measures its ack against it."""
    acked: int = field(default=-1, init=False)
    """The newest version the engine acked."""
    holds: int = field(default=-1, init=False)
    """The version a push to it completed last on this group; -1: unknown (it gets dense pushes)."""

    @property
    def usable(self) -> bool:
        """Whether pushes go to it (READY)."""
        return self.state is LinkState.READY


@dataclass(frozen=True)
class Join:
    """One join the table decided: ``link``'s group number ``epoch``, with ``handler``, the link's engine when it
    was decided. The joiner sends the join message and builds the group without the lock, and reports the outcome
    with this (``joined`` / ``join_failed``): a stale one changes nothing."""

    link: EngineLink
    """The link that joins."""
    epoch: int
    """The group number this join builds."""
    handler: EngineHandler
    """The engine it joins (a replaced link's new engine gets a join of its own)."""
    attempt: int = 1
    """Its number in a series of failed joins in a row (``join_failed``); at most ``JOIN_ATTEMPTS``."""
    delay_s: float = 0.0
    """How long the joiner waits before it starts: a retry's backoff (``JOIN_BACKOFF_S``)."""


@dataclass
class SyncStats:
    """Counters of rank 0's weight sync (every rank counts coalesced pushes, catch-ups and snapshots); assigned only
    by ``LinkTable``, read anywhere (``metrics``)."""

    pushes: int = 0
    """Pushes sent (a step's, a catch-up's or a resync of late engines)."""
    coalesced: int = 0
    """Due pushes not sent because one was in flight (the next due push sends the then-newest weights)."""
    catch_ups: int = 0
    """Steps that had to stage the newest weights first: coalescing had left staging too old."""
    timeouts: int = 0
    """Pushes not completed, and acks not seen, within ``timeout_s``."""
    errors: int = 0
    """Failures counted (``failures``)."""
    resyncs: int = 0
    """Rejoins of broken engines and full pushes to lagging engines that answered again."""
    bytes_sent: int = 0
    """Bytes of every completed push, to every engine."""
    last_push_bytes: int = 0
    """Bytes of the last push of a step (not a resync of late engines), as completed, to every engine together."""
    last_patched_buckets: int = 0
    """Buckets that push sent as patches (``weight_sync.method = "sparse"``), to any one engine."""
    last_changed: float = 0.0
    """The share of the elements changed since the version patched, of the last diff (0: no diff made)."""
    last_diff_s: float = 0.0
    """The time of that diff (0: none)."""
    last_push_s: float = 0.0
    """Wall time of the last push on the push thread (or on the main thread, blocking)."""
    push_s_total: float = 0.0
    """Wall time of every push so far (read by the trainer's sync cadence)."""
    last_snapshot_s: float = 0.0
    """Wall time of the last snapshot."""
    failures: list[str] = field(default_factory=list)
    """Every failure counted, as logged."""


class LinkTable:
    """The links, the counters, their lock, and ``work``, the condition the push thread sleeps on. The one writer
    of ``EngineLink`` and ``SyncStats``: see the module docstring."""

    def __init__(self, engines: list[EngineHandler], timeout_s: float):
        self.links = [EngineLink(e) for e in engines]
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.work = threading.Condition(self.lock)
        self.stats = SyncStats()

    # ---------------------------------------------------------------------------------------------- joins

    def begin_join(self, link: EngineLink) -> Join:
        """``link`` joins a fresh group (``connect``)."""
        with self.lock:
            return self._begin_join(link)

    def rejoin_broken(self) -> list[Join]:
        """Every BROKEN link whose engine is alive joins a fresh group (a resync each). ``alive`` is a process poll
        or a flag, no I/O."""
        with self.lock:
            joins = []
            for link in self.links:
                if link.state is LinkState.BROKEN and link.handler.alive():
                    self.stats.resyncs += 1
                    joins.append(self._begin_join(link))
            return joins

    def replaced(self, old: EngineHandler, new: EngineHandler) -> Join:
        """``old``'s engine was restarted or reconnected as ``new``: its link joins a fresh group, whatever its
        state."""
        with self.lock:
            link = next(lk for lk in self.links if lk.handler is old)
            link.handler = new
            return self._begin_join(link)

    def joined(self, join: Join, pg: object, backend: str) -> bool:
        """``join`` built group ``pg`` on ``backend``: READY, with a full push next. False (``pg`` unused) when a
        newer join superseded it. A link that died meanwhile keeps the group but stays DEAD."""
        with self.lock:
            link = join.link
            if link.epoch != join.epoch:
                return False
            link.pg, link.backend = pg, backend
            link.sent = link.acked = link.holds = -1
            if link.state is LinkState.JOINING:
                link.state = LinkState.READY
            return True

    def join_failed(self, join: Join, why: str, retry: bool) -> Join | None:
        """``join`` failed (counted): BROKEN. With ``retry`` (not refused, engine alive) the link joins again (a
        resync), returned with its backoff, unless ``join`` was the last of ``JOIN_ATTEMPTS`` in a row (then the
        caller gives the engine up: ``gave_up``); a stale join or a DEAD link is not retried."""
        with self.lock:
            link = join.link
            self._fail(link, why)
            if link.epoch != join.epoch or link.state is not LinkState.JOINING:
                return None
            link.state = LinkState.BROKEN
            if not retry or self.gave_up(join):
                return None
            self.stats.resyncs += 1
            delay = min(JOIN_BACKOFF_S[1], JOIN_BACKOFF_S[0] * 2 ** (join.attempt - 1))
            return self._begin_join(link, join.attempt + 1, delay)

    @staticmethod
    def gave_up(join: Join) -> bool:
        """Whether a failure of ``join`` ends its series: ``JOIN_ATTEMPTS`` joins failed in a row."""
        return join.attempt >= JOIN_ATTEMPTS

    def _begin_join(self, link: EngineLink, attempt: int = 1, delay_s: float = 0.0) -> Join:
        """(Caller holds ``lock``.)"""
        link.epoch += 1
        link.state, link.pg = LinkState.JOINING, None
        return Join(link, link.epoch, link.handler, attempt, delay_s)

    # --------------------------------------------------------------------------------------------- pushes

    def sent(self, link: EngineLink, epoch: int, version: int) -> None:
        """Every tensor of push ``version`` was handed to ``link``'s group number ``epoch``."""
        with self.lock:
            if link.epoch == epoch:
                link.sent, link.sent_at = version, time.time()

    def completed(self, link: EngineLink, epoch: int, version: int) -> None:
        """Push ``version`` to ``link``'s group number ``epoch`` completed: the engine holds it (sparse base)."""
        with self.lock:
            if link.epoch == epoch:
                link.holds = version

    def push_failed(self, link: EngineLink, epoch: int, version: int, why: str) -> None:
        """Push ``version`` could not start on ``link``'s group number ``epoch`` (counted): BROKEN."""
        with self.lock:
            if link.epoch == epoch:
                self._break(link)
            self._fail(link, f"push {version} failed to start: {why}")

    def push_incomplete(self, link: EngineLink, epoch: int, version: int, why: str) -> None:
        """Push ``version`` did not complete on ``link``'s group number ``epoch`` (a timeout, counted): BROKEN, and it
        may hold anything. A newer epoch's group is fine and left alone."""
        with self.lock:
            if link.epoch == epoch:
                self._break(link)
                link.holds = -1
            self.stats.timeouts += 1
            self._fail(link, f"push {version} did not complete: {why}")

    def late(self, version: int) -> list[EngineLink]:
        """Usable links that were not sent ``version`` yet (caller holds ``lock``)."""
        return [] if version < 0 else [lk for lk in self.links if lk.usable and lk.sent < version]

    def waiting_for(self, version: int) -> list[EngineLink]:
        """READY links that were sent ``version`` and have not acked it (a blocking push's wait)."""
        with self.lock:
            return [lk for lk in self.links if lk.usable and lk.sent == version and lk.acked < version]

    # ----------------------------------------------------------------------------- engine events (main thread)

    def record(self, ev) -> bool:
        """An ack or an engine error. True when a LAGGING engine acked what it was sent: READY, and its next push is
        a full one (a resync)."""
        with self.lock:
            link = next((lk for lk in self.links if lk.handler.name == ev.engine), None)
            if link is None:
                return False
            if isinstance(ev, WeightAck):
                link.acked = max(link.acked, ev.version)
                if link.state is LinkState.LAGGING and link.acked >= link.sent:
                    link.state = LinkState.READY
                    link.sent = link.holds = -1
                    self.stats.resyncs += 1
                    logger.info(f"weight sync: {link.handler.name} answered again; resyncing")
                    return True
            elif isinstance(ev, EngineError):
                self._fail(link, ev.message.strip().splitlines()[-1] if ev.message else "error")
                if ev.fatal:
                    link.state = LinkState.DEAD
                else:  # its receiver gave up on the group; a join in flight decides for itself
                    self._break(link)
            return False

    def check_timeouts(self) -> None:
        """READY links whose last push was not acked within ``timeout_s`` are LAGGING (counted)."""
        now = time.time()
        with self.lock:
            for link in self.links:
                if link.usable and link.sent > link.acked and now - link.sent_at > self.timeout_s:
                    link.state = LinkState.LAGGING
                    self.stats.timeouts += 1
                    self._fail(link, f"version {link.sent} not acked within {self.timeout_s}s; lagging")

    def _break(self, link: EngineLink) -> None:
        """READY or LAGGING -> BROKEN (caller holds ``lock``)."""
        if link.state in (LinkState.READY, LinkState.LAGGING):
            link.state = LinkState.BROKEN

    def _fail(self, link: EngineLink, why: str) -> None:
        """Count and log one failure (caller holds ``lock``)."""
        self.stats.errors += 1
        msg = f"weight sync to {link.handler.name}: {why}"
        self.stats.failures.append(msg)
        logger.warning(msg)

    # ------------------------------------------------------------------------------------------- counters

    def push_coalesced(self) -> None:
        """A due push was not sent: one was in flight."""
        with self.lock:
            self.stats.coalesced += 1

    def caught_up(self) -> None:
        """A step staged the newest weights first (coalescing had left staging too old)."""
        with self.lock:
            self.stats.catch_ups += 1

    def snapshot_taken(self, seconds: float) -> None:
        """A snapshot took ``seconds``."""
        with self.lock:
            self.stats.last_snapshot_s = seconds

    def diffed(self, changed: float, seconds: float) -> None:
        """The sparse base's last diff: the share of elements ``changed`` and its time (0, 0: a step's push before
        its diff, or without one)."""
        with self.lock:
            self.stats.last_changed, self.stats.last_diff_s = changed, seconds

    def pushed(self, seconds: float, sent_bytes: int, patched_buckets: int, step_push: bool) -> None:
        """A push ended after ``seconds``, with ``sent_bytes`` completed; ``step_push``: a step's push (not a resync
        of late engines, whose figures would mask it) sets the last push's bytes and patched buckets."""
        with self.lock:
            s = self.stats
            s.pushes += 1
            s.bytes_sent += sent_bytes
            if step_push:
                s.last_push_bytes, s.last_patched_buckets = sent_bytes, patched_buckets
            s.last_push_s = seconds
            s.push_s_total += seconds

    def push_crashed(self, version: int, e: BaseException) -> None:
        """Push ``version`` raised on the push thread (counted; the thread logs it and goes on)."""
        with self.lock:
            self.stats.errors += 1
            self.stats.failures.append(f"push {version}: {e}")

    def metrics(self) -> dict[str, float]:
        """The counters and the links' health, for every metrics row (``engines_lagging``: LAGGING or BROKEN)."""
        with self.lock:
            lagging = sum(lk.state in (LinkState.LAGGING, LinkState.BROKEN) for lk in self.links)
            min_acked = min((lk.acked for lk in self.links), default=-1)
            s = self.stats
            return {
                "weight_push_s": s.last_push_s, "weight_snapshot_s": s.last_snapshot_s,
                "weight_pushes": s.pushes, "weight_coalesced": s.coalesced, "weight_catch_ups": s.catch_ups,
                "weight_sync_timeouts": s.timeouts, "weight_sync_errors": s.errors, "weight_resyncs": s.resyncs,
                "engines_lagging": lagging, "engine_min_version": min_acked, "weight_push_bytes": s.last_push_bytes,
                "weight_patched_buckets": s.last_patched_buckets, "weight_changed_fraction": s.last_changed,
                "weight_diff_s": s.last_diff_s,
            }
