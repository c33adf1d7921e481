"""``LinkTable`` (sync/links.py): the link states and their transitions, which engines a blocking push still waits
for, the table as the one writer of link and counter fields, and no send while its lock is held."""

from __future__ import annotations

import ast
import dataclasses
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from torchtitan_flux.engine.base import EngineError, WeightAck
from torchtitan_flux.sync.links import EngineLink, LinkState, LinkTable, SyncStats
from torchtitan_flux.sync.pusher import Pusher
from torchtitan_flux.wire import transport

PACKAGE = Path(__file__).resolve().parents[2] / "torchtitan_flux"


def _engine(name: str, alive: bool = True):
    return SimpleNamespace(name=name, alive=lambda: alive)


def _table(*names, sent: int = 3):
    """Links READY on a group, each sent version ``sent``."""
    t = LinkTable([_engine(n) for n in names], timeout_s=30.0)
    for link in t.links:
        join = t.begin_join(link)
        assert t.joined(join, pg=object(), backend="gloo")
        t.sent(link, join.epoch, sent)
    return t


def test_a_dead_engine_is_not_waited_for():
    """Before 2026-11-25 an engine that died between a blocking push and its ack was waited for until
    ``timeout_seconds`` (30 s in debug_cpu.toml): a SIGHUP to the process group during that window killed the
    engine, the trainer waited the full timeout, and torchrun SIGKILLed it at the end of its 30 s grace period,
    with no checkpoint and no ``stopped:`` line (a slow test's CI failure)."""
    t = _table("e0", "e1")
    assert [lk.handler.name for lk in t.waiting_for(3)] == ["e0", "e1"]
    t.record(EngineError("e0", "engine process exited (exit code 255)", fatal=True))
    assert [lk.handler.name for lk in t.waiting_for(3)] == ["e1"]
    t.record(WeightAck("e1", 3, 0.0))
    assert t.waiting_for(3) == []


def test_a_non_fatal_error_breaks_the_link_which_is_neither_waited_for_nor_timed_out():
    """A non-fatal engine error is its receiver giving up on the group (or its join or push failing): no ack comes
    on that group, so a blocking push does not wait for one; the next push or ``deliver_staged`` rejoins it."""
    t = _table("e0")
    t.record(EngineError("e0", "weight receiver: RuntimeError: bad magic"))
    assert t.links[0].state is LinkState.BROKEN and t.waiting_for(3) == []
    t.timeout_s = 0.0
    t.check_timeouts()
    assert t.stats.timeouts == 0 and t.stats.errors == 1
    assert [j.link for j in t.rejoin_broken()] == t.links and t.links[0].state is LinkState.JOINING
    assert t.stats.resyncs == 1 and t.links[0].epoch == 2


def test_a_missed_ack_lags_once_and_the_late_ack_resyncs():
    t = _table("e0")
    link = t.links[0]
    t.timeout_s = 0.0
    time.sleep(0.001)
    t.check_timeouts()
    t.check_timeouts()
    assert link.state is LinkState.LAGGING and t.stats.timeouts == 1  # counted once
    assert t.waiting_for(3) == [] and t.metrics()["engines_lagging"] == 1
    assert t.record(WeightAck("e0", 3, 0.0))  # answered again: READY, and a full push next
    assert link.state is LinkState.READY and (link.sent, link.acked, link.holds) == (-1, 3, -1)
    assert t.stats.resyncs == 1 and t.metrics()["engines_lagging"] == 0


def test_an_incomplete_push_breaks_the_link_and_forgets_what_it_holds():
    t = _table("e0")
    link = t.links[0]
    t.completed(link, link.epoch, 3)
    assert link.holds == 3
    t.push_incomplete(link, link.epoch, 4, "timed out")
    assert link.state is LinkState.BROKEN and link.holds == -1 and t.stats.timeouts == 1
    assert t.stats.failures == ["weight sync to e0: push 4 did not complete: timed out"]


def test_outcomes_of_a_superseded_group_leave_the_link_alone_but_are_counted():
    t = _table("e0")
    link = t.links[0]
    old = link.epoch
    t.record(EngineError("e0", "weight receiver: gone"))
    new = t.rejoin_broken()[0]
    t.sent(link, old, 9)
    t.push_incomplete(link, old, 9, "timed out")
    assert link.state is LinkState.JOINING and link.sent == 3 and t.stats.timeouts == 1
    assert t.join_failed(dataclasses.replace(new, epoch=old), "late failure", retry=True) is None
    assert link.state is LinkState.JOINING and t.stats.errors == 3
    assert not t.joined(dataclasses.replace(new, epoch=old), pg=object(), backend="gloo")
    assert t.joined(new, pg="pg", backend="gloo") and link.state is LinkState.READY and link.pg == "pg"


def test_a_failed_join_retries_at_once_unless_refused_and_a_dead_engine_stays_dead():
    t = LinkTable([_engine("e0")], timeout_s=30.0)
    link = t.links[0]
    first = t.begin_join(link)
    again = t.join_failed(first, "join failed: connection refused", retry=True)
    assert again is not None and again.epoch == first.epoch + 1 and link.state is LinkState.JOINING
    assert t.join_failed(again, "join failed: bad token", retry=False) is None
    assert link.state is LinkState.BROKEN and t.stats.resyncs == 1
    last = t.rejoin_broken()[0]
    t.record(EngineError("e0", "engine process exited", fatal=True))
    assert link.state is LinkState.DEAD and t.join_failed(last, "join failed: pipe closed", retry=True) is None
    assert link.state is LinkState.DEAD
    new = _engine("e0")
    join = t.replaced(link.handler, new)
    assert link.handler is new and join.handler is new and link.state is LinkState.JOINING
    assert t.joined(join, pg="pg", backend="gloo") and link.usable


def test_a_broken_engine_that_is_gone_is_not_rejoined():
    t = LinkTable([_engine("e0", alive=False)], timeout_s=30.0)
    t.join_failed(t.begin_join(t.links[0]), "join failed", retry=False)
    assert t.rejoin_broken() == [] and t.links[0].state is LinkState.BROKEN and t.stats.resyncs == 0


# ------------------------------------------------------------------------------------- one writer, no I/O held


_MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear"}
# attributes of these names that belong to other objects (module, the assigned expression): a request's time on the
# pump, a rollout group's state (``GroupTable``'s own writes: tests/unit/test_groups.py)
_UNRELATED = {("rollout/pump.py", "f.sent"), ("rollout/groups.py", "group.state")}


def _field_writes(path: Path, fields: set[str], lists: set[str]) -> list[str]:
    """Every assignment (``=``, ``+=``, annotated, ``del``) to ``<expr>.<field>`` with ``<expr>`` other than the bare
    name ``self``, every ``<expr>.<list field>.append(...)`` and the like, every ``setattr(<expr>, "<field>", ...)``."""
    found = []

    def flat(t):
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                yield from flat(e)
        elif isinstance(t, ast.Starred):
            yield from flat(t.value)
        else:
            yield t

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr in _MUTATORS and isinstance(f.value, ast.Attribute) and f.value.attr in lists:
                found.append(f"{node.lineno}: {ast.unparse(f)}")
            continue
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and name.value in fields:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
            continue
        else:
            continue
        for t in (a for target in targets for a in flat(target)):
            if isinstance(t, ast.Attribute) and t.attr in fields and \
                    not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                found.append(f"{node.lineno}: {ast.unparse(t)}")
    return found


def test_only_the_link_table_assigns_link_and_counter_fields():
    """``EngineLink`` fields and ``SyncStats`` counters are assigned in ``sync/links.py`` only (its transitions):
    before, the pusher and the syncer wrote about 24 of them and the counters were written from three classes."""
    fields = {f.name for f in dataclasses.fields(EngineLink)} | {f.name for f in dataclasses.fields(SyncStats)}
    lists = {f.name for f in dataclasses.fields(SyncStats) if f.default_factory is list}
    assert lists == {"failures"}
    owner = PACKAGE / "sync" / "links.py"
    assert len(_field_writes(owner, fields, lists)) > 20  # the scan sees the table's own writes: it is not vacuous
    elsewhere = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if path != owner:
            elsewhere += [f"{rel}:{w}" for w in _field_writes(path, fields, lists)
                          if (rel, w.split(": ", 1)[1]) not in _UNRELATED]
    assert not elsewhere, elsewhere


class _BlockingJoin:
    """An engine whose join message cannot be sent until ``sendable`` is set: a stopped engine's full pipe."""

    name = "e0"
    accepts_patches = False

    def __init__(self):
        self.sendable, self.sending = threading.Event(), threading.Event()

    def alive(self) -> bool:
        return True

    def weight_backend(self, trainer_backend: str) -> str:
        return transport.COLOCATED  # no rendezvous: the join is the message alone

    def join_weight_group(self, info) -> None:
        self.sending.set()
        assert self.sendable.wait(30)


def test_a_join_message_that_cannot_be_sent_holds_no_lock():
    """Review 4, finding 5: rejoins and join retries sent the join message while holding the table's lock, so an
    engine that stopped reading its pipe left the main thread's ``pump`` and ``claim`` (and the stuck-engine kill
    behind them) blocked on that lock. The joiner thread sends it now, without the lock."""
    engine = _BlockingJoin()
    table = LinkTable([engine], timeout_s=2.0)
    snap = SimpleNamespace(specs=[], bucket_bytes=0, version=-1, plan=None,
                           staging=SimpleNamespace(flats=[]), seqlock=SimpleNamespace(t=None))
    cfg = SimpleNamespace(method="dense", master_addr="127.0.0.1", timeout_seconds=2.0)
    pusher = Pusher(table, snap, cfg, backend="gloo", device="cpu", store=SimpleNamespace(port=0), token=None,
                    engine_specs=[])
    try:
        table.join_failed(table.begin_join(table.links[0]), "join failed: test", retry=False)  # BROKEN
        t0 = time.monotonic()
        pusher.deliver_staged()  # starts the rejoin
        assert engine.sending.wait(5)
        assert time.monotonic() - t0 < 10.0  # the send blocks forever: returning at all is the point
        assert table.lock.acquire(timeout=10.0)  # free while the send blocks
        table.lock.release()
        assert pusher.claim()
        pusher.release()
        table.record(WeightAck("e0", 0, 0.0))
        table.check_timeouts()
        assert table.links[0].state is LinkState.JOINING
        engine.sendable.set()
        deadline = time.monotonic() + 5
        while table.links[0].state is not LinkState.READY:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert table.links[0].pg == transport.COLOCATED
    finally:
        engine.sendable.set()
        pusher.close()
