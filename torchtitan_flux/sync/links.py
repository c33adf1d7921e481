"""``LinkTable``: rank 0's view of every engine (its group, versions sent/acked, health) and the counters.

Every ``EngineLink`` field is read and written under ``LinkTable.lock`` (shared with ``Pusher``). ``epoch``
counts an engine's groups: a joiner or push whose epoch is no longer the link's counts its failure but leaves
the link alone. Acks, engine errors and timeouts are handled on the main thread.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from torchtitan_flux.engine.base import EngineError, EngineHandler, WeightAck

logger = logging.getLogger("torchtitan_flux")


@dataclass
class EngineLink:
    """Rank 0's view of one engine. Mutated under ``LinkTable.lock``."""

    handler: EngineHandler
    epoch: int = 0
    pg: object | None = None
    backend: str = ""  # of its current group: "nccl", "gloo" or ``transport.COLOCATED`` (set at each join)
    joining: bool = False
    sent: int = -1  # newest version sent
    sent_at: float = 0.0
    acked: int = -1  # newest version the engine acked
    holds: int = -1  # the version a push to it completed last on this group; -1: unknown (it gets dense pushes)
    lagging: bool = False
    broken: bool = False  # its group must be rebuilt before the next push
    dead: bool = False

    @property
    def usable(self) -> bool:
        return self.pg is not None and not (self.joining or self.lagging or self.broken or self.dead)


@dataclass
class SyncStats:
    pushes: int = 0
    coalesced: int = 0
    catch_ups: int = 0  # steps that had to stage the newest weights first: coalescing had left staging too old
    timeouts: int = 0
    errors: int = 0
    resyncs: int = 0
    bytes_sent: int = 0
    # of the last push of a step (not of a resync of late engines), as completed:
    last_push_bytes: int = 0  # sent to every engine together
    last_patched_buckets: int = 0  # buckets sent as patches (``weight_sync.method = "sparse"``), to any one engine
    last_changed: float = 0.0  # share of the elements that changed since the version patched (0: no diff made)
    last_diff_s: float = 0.0  # time of its diff (0: none)
    last_push_s: float = 0.0  # wall time of the last push on the push thread (or main thread, blocking)
    push_s_total: float = 0.0  # wall time of every push so far (read by the trainer's sync cadence)
    last_snapshot_s: float = 0.0
    failures: list[str] = field(default_factory=list)


class LinkTable:
    """The links, their lock, and ``work``, the condition the push thread sleeps on."""

    def __init__(self, engines: list[EngineHandler], timeout_s: float):
        self.links = [EngineLink(e) for e in engines]
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.work = threading.Condition(self.lock)
        self.stats = SyncStats()

    def find(self, name: str) -> EngineLink | None:
        return next((lk for lk in self.links if lk.handler.name == name), None)

    def fail(self, link: EngineLink, why: str) -> None:
        """Count and log one failure (caller holds ``lock``)."""
        self.stats.errors += 1
        msg = f"weight sync to {link.handler.name}: {why}"
        self.stats.failures.append(msg)
        logger.warning(msg)

    def late(self, version: int) -> list[EngineLink]:
        """Usable links that do not hold ``version`` yet (caller holds ``lock``)."""
        return [] if version < 0 else [lk for lk in self.links if lk.usable and lk.sent < version]

    def record(self, ev) -> bool:
        """An ack or engine error (caller holds ``lock``). True when a lagging engine answered again (resync)."""
        link = self.find(ev.engine)
        if link is None:
            return False
        if isinstance(ev, WeightAck):
            link.acked = max(link.acked, ev.version)
            if link.lagging and link.acked >= link.sent:
                link.lagging = False
                link.sent = link.holds = -1  # answered again: next push is a full resync
                self.stats.resyncs += 1
                logger.info(f"weight sync: {link.handler.name} answered again; resyncing")
                return True
        elif isinstance(ev, EngineError):
            self.fail(link, ev.message.strip().splitlines()[-1] if ev.message else "error")
            if ev.fatal:
                link.dead = True
            else:
                link.broken = True
        return False

    def check_timeouts(self) -> None:
        """Mark engines whose last push was not acked within ``timeout_s`` as lagging (main thread)."""
        now = time.time()
        with self.lock:
            for link in self.links:
                if not link.lagging and link.sent > link.acked and now - link.sent_at > self.timeout_s:
                    link.lagging = True
                    self.stats.timeouts += 1
                    self.fail(link, f"version {link.sent} not acked within {self.timeout_s}s; lagging")

    def waiting_for(self, version: int) -> list[EngineLink]:
        """Links that were sent ``version`` and may still ack it (not lagging, not dead)."""
        with self.lock:
            return [lk for lk in self.links
                    if lk.sent == version and lk.acked < version and not (lk.lagging or lk.dead)]

    def metrics(self) -> dict[str, float]:
        with self.lock:
            lagging = sum(lk.lagging or lk.broken for lk in self.links)
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
