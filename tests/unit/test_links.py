"""``LinkTable``: which engines a blocking push still waits for."""

from __future__ import annotations

from types import SimpleNamespace

from torchtitan_flux.engine.base import EngineError, WeightAck
from torchtitan_flux.sync.links import LinkTable


def _table(*names):
    t = LinkTable([SimpleNamespace(name=n) for n in names], timeout_s=30.0)
    for link in t.links:
        link.sent = 3
    return t


def _record(t: LinkTable, ev) -> bool:
    with t.lock:
        return t.record(ev)


def test_a_dead_engine_is_not_waited_for():
    """Before 2026-11-25 an engine that died between a blocking push and its ack was waited for until
    ``timeout_seconds`` (30 s in debug_cpu.toml): a SIGHUP to the process group during that window killed the
    engine, the trainer waited the full timeout, and torchrun SIGKILLed it at the end of its 30 s grace period,
    with no checkpoint and no ``stopped:`` line (a slow test's CI failure)."""
    t = _table("e0", "e1")
    assert [lk.handler.name for lk in t.waiting_for(3)] == ["e0", "e1"]
    _record(t, EngineError("e0", "engine process exited (exit code 255)", fatal=True))
    assert [lk.handler.name for lk in t.waiting_for(3)] == ["e1"]
    _record(t, WeightAck("e1", 3, 0.0))
    assert t.waiting_for(3) == []


def test_a_non_fatal_error_keeps_waiting_and_lagging_does_not():
    t = _table("e0")
    _record(t, EngineError("e0", "a request failed"))  # broken group, engine alive: may ack
    assert len(t.waiting_for(3)) == 1
    t.links[0].sent_at = 0.0
    t.check_timeouts()
    assert t.waiting_for(3) == [] and t.stats.timeouts == 1
