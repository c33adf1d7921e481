"""``Pusher`` against the fourth GPU review: a ``DeviceRing`` and stream per NCCL engine (finding 1: a stalled engine
is cut alone and never delays another), join retries that back off and give up (finding 2), the deadline set after
the sparse diff (finding 9). CPU has no NCCL: ``compat.broadcast`` is faked, and a Work's ``wait()`` records the
stream wait it would queue on a GPU."""

from __future__ import annotations
from _streams import StreamRecorder

import threading
import time
from types import SimpleNamespace

import torch
from torch import nn

from torchtitan_flux import compat
from torchtitan_flux.config import WeightSync
from torchtitan_flux.sync.links import LinkState, LinkTable
from torchtitan_flux.sync.pusher import FREE_STAGING_S, Pusher
from torchtitan_flux.sync.snapshot import Snapshot


class Work:
    """A broadcast's Work: ``stalled`` ones never complete (the engine stopped receiving)."""

    def __init__(self, pg: "Group", log: list):
        self.pg, self.log = pg, log

    def is_completed(self) -> bool:
        return not self.pg.stalled

    def wait(self, timeout=None) -> bool:
        self.log.append(("wait", self.pg.name))  # on a GPU: the current stream waits on this Work
        return True


class Group:
    def __init__(self, name: str, stalled: bool):
        self.name, self.stalled, self.aborted = name, stalled, False

    def abort(self) -> None:
        self.aborted = True


class Engine:
    """What the pusher calls on an engine that takes our NCCL broadcasts."""

    accepts_patches = False

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def begin_update(self, version: int) -> None:
        self.log.append(("begin", self.name))

    def self_push(self, version, flats):
        return None

    def wire_tensors(self, header, flats):
        return [header, *flats]

    def finish_update(self, version: int) -> None:
        pass

    def alive(self) -> bool:
        return True


def test_a_stalled_nccl_engine_is_cut_alone_and_never_delays_the_next_engine(monkeypatch):
    """Engine A's Works never complete. B's copies and broadcasts are issued without waiting on any of A's Works
    (with one ring shared by engines, B's third slot reuse waited on A's broadcast: on a GPU B queued behind A and
    was cut at the same deadline), B completes within the push, and A alone is cut (aborted, BROKEN) at it."""
    log: list = []
    monkeypatch.setattr(compat, "broadcast", lambda pg, t: log.append(("broadcast", pg.name)) or Work(pg, log))
    model = nn.Sequential(*[nn.Linear(16, 16, bias=False) for _ in range(4)])  # 4 buckets of 1 KiB
    snap = Snapshot(model, device=torch.device("cpu"), is_sender=True, bucket_bytes=1024, wire_dtype=None,
                    ring_engines=2)
    assert len(snap.plan.buckets) == 4
    snap.take(1)
    a, b = Engine("A", log), Engine("B", log)
    table = LinkTable([a, b], timeout_s=1.0)
    groups = {"A": Group("A", stalled=True), "B": Group("B", stalled=False)}
    for link in table.links:
        assert table.joined(table.begin_join(link), groups[link.handler.name], "nccl")
    pusher = Pusher(table, snap, WeightSync(timeout_seconds=1.0), backend="gloo", device=torch.device("cpu"),
                    store=None, token=None, engine_specs=[])
    try:
        t0 = time.monotonic()
        pusher.push(1)
        took = time.monotonic() - t0
    finally:
        pusher.close()
    b_starts = log.index(("begin", "B"))
    assert ("wait", "A") not in log[b_starts:], log  # B never waits on A's Works
    assert log[b_starts:].count(("broadcast", "B")) == 5  # header + 4 buckets
    link_a, link_b = table.links
    assert link_b.state is LinkState.READY and link_b.holds == 1  # B's push completed (the pusher's ack)
    assert link_a.state is LinkState.BROKEN and groups["A"].aborted and not groups["B"].aborted
    assert 0.9 <= took < 10.0, took  # A was polled to the deadline (1 s), not forever (a bound load cannot break)
    assert set(pusher.rings) == {"A", "B"}
    assert snap.memory.peak <= snap.memory.budget  # two rings, both in the ledger's budget


def test_a_push_that_fails_midway_on_an_nccl_group_aborts_it_and_the_ring_forgets_it(monkeypatch):
    """A fresh reader's review (2026-11-27): a target whose third broadcast raised kept the two issued ones queued on
    its ring's stream (their receives may never be posted), so every later push to it queued behind them. Now its
    group is aborted and its ring forgets the group's Works; the engine is BROKEN and rejoins."""
    log: list = []

    def broadcast(pg, t):
        if sum(1 for k, n in log if k == "broadcast") == 2:
            raise RuntimeError("NCCL error: the third send")
        log.append(("broadcast", pg.name))
        return Work(pg, log)

    monkeypatch.setattr(compat, "broadcast", broadcast)
    model = nn.Sequential(*[nn.Linear(16, 16, bias=False) for _ in range(4)])
    snap = Snapshot(model, device=torch.device("cpu"), is_sender=True, bucket_bytes=1024, wire_dtype=None,
                    ring_engines=1)
    snap.take(1)
    table = LinkTable([Engine("A", log)], timeout_s=1.0)
    group = Group("A", stalled=False)
    assert table.joined(table.begin_join(table.links[0]), group, "nccl")
    pusher = Pusher(table, snap, WeightSync(timeout_seconds=1.0), backend="gloo", device=torch.device("cpu"),
                    store=None, token=None, engine_specs=[])
    try:
        pusher.push(1)
    finally:
        pusher.close()
    assert group.aborted and table.links[0].state is LinkState.BROKEN
    assert all(g is not group for slot in pusher.rings["A"].readers for g, _ in slot)


class HungAbortGroup(Group):
    """A group whose ``abort`` never returns (a hung ``ncclCommAbort``; here it gives up after 10 s)."""

    def __init__(self, name: str):
        super().__init__(name, stalled=True)
        self.release = threading.Event()

    def abort(self) -> None:
        self.aborted = True
        self.release.wait(10)


def test_a_hung_abort_is_left_on_its_helper_thread_and_kills_the_engine(monkeypatch):
    """Fifth review, finding 24: torch bounds ``ProcessGroupNCCL.abort()`` only by the group's own timeout (7 days,
    rule 4), and the pusher aborted on its own thread, so a hanging ``ncclCommAbort`` wedged every later push. The
    abort now runs on a helper thread joined for ``cuda_rules.ABORT_S``; past it the engine is killed (restarted
    or reconnected, resynced) and the push ends."""
    from torchtitan_flux.wire import cuda_rules

    log: list = []
    monkeypatch.setattr(compat, "broadcast", lambda pg, t: log.append(("broadcast", pg.name)) or Work(pg, log))
    monkeypatch.setattr(cuda_rules, "ABORT_S", 0.3)
    model = nn.Sequential(nn.Linear(16, 16, bias=False))
    snap = Snapshot(model, device=torch.device("cpu"), is_sender=True, bucket_bytes=1024, wire_dtype=None,
                    ring_engines=1)
    snap.take(1)
    group = HungAbortGroup("A")
    engine = Killable("A", log, group)
    table = LinkTable([engine], timeout_s=0.5)
    assert table.joined(table.begin_join(table.links[0]), group, "nccl")
    pusher = Pusher(table, snap, WeightSync(timeout_seconds=0.5), backend="gloo", device=torch.device("cpu"),
                    store=None, token=None, engine_specs=[])
    try:
        t0 = time.monotonic()
        pusher.push(1)
        took = time.monotonic() - t0
    finally:
        group.release.set()
        pusher.close()
    # the deadline (0.5 s) + ABORT_S (0.3 s), not the abort's 10 s: 8 s leaves a loaded machine room
    assert group.aborted and took < 8.0, took
    assert len(engine.killed) == 1 and "did not return within 0.3 s" in engine.killed[0], engine.killed
    assert table.links[0].state is LinkState.BROKEN


class Unjoinable(Engine):
    """An engine whose group never comes up (a vLLM server whose worker is stuck in an abandoned push)."""

    rendezvous_handshake = False

    def __init__(self, name: str, log: list):
        super().__init__(name, log)
        self.joins: list[float] = []
        self.killed: list[str] = []

    def weight_backend(self, trainer_backend: str) -> str:
        return trainer_backend

    def join_weight_group(self, info) -> None:
        self.joins.append(time.monotonic())

    def alive(self) -> bool:
        return not self.killed and len(self.joins) < 50  # the old code's endless loop ends here

    def kill(self, why: str) -> None:
        self.killed.append(why)


def test_failed_joins_back_off_and_the_engine_is_declared_dead_after_join_attempts(monkeypatch):
    """Review 4, finding 2: a join whose group cannot be built was retried at once, forever. Now each retry waits
    twice as long as the one before (capped), and after ``JOIN_ATTEMPTS`` failures in a row the engine is killed
    once, with one message naming the count (its replacement joins afresh)."""
    from torchtitan_flux.sync import links, pusher as pusher_module
    from torchtitan_flux.wire import transport

    monkeypatch.setattr(links, "JOIN_BACKOFF_S", (0.05, 0.2))
    monkeypatch.setattr(links, "JOIN_ATTEMPTS", 5)
    monkeypatch.setattr(transport, "connect_store", lambda *a, **k: None)

    def no_group(*a, **k):
        raise ConnectionError("rendezvous timed out")

    monkeypatch.setattr(pusher_module, "trainer_group", no_group)
    model = nn.Sequential(nn.Linear(4, 4, bias=False))
    snap = Snapshot(model, device=torch.device("cpu"), is_sender=True, bucket_bytes=1024, wire_dtype=None)
    engine = Unjoinable("srv", [])
    table = LinkTable([engine], timeout_s=1.0)
    pusher = Pusher(table, snap, WeightSync(timeout_seconds=1.0), backend="gloo", device=torch.device("cpu"),
                    store=SimpleNamespace(port=1), token=None, engine_specs=[])
    try:
        pusher.start_join(table.begin_join(table.links[0]))
        end = time.monotonic() + 5
        while not engine.killed and time.monotonic() < end and len(engine.joins) < 50:
            time.sleep(0.02)
    finally:
        pusher.close()
    gaps = [b - a for a, b in zip(engine.joins, engine.joins[1:])]
    assert len(engine.joins) == 5, gaps
    assert [round(g, 2) >= d for g, d in zip(gaps, (0.05, 0.1, 0.2, 0.2))] == [True] * 4, gaps
    assert gaps[0] < 0.15 and gaps[-1] < 0.4, gaps  # doubling, capped at 0.2 s
    assert len(engine.killed) == 1 and "5 joins of its weight-sync group failed in a row" in engine.killed[0]
    assert table.links[0].state is LinkState.BROKEN and table.stats.errors == 5


def test_the_push_deadline_starts_after_the_sparse_diff(monkeypatch):
    """Review 4, finding 9: the diff (host work over the whole model) ran after the deadline was set, so a slow diff
    cut engines that answered in time. Here the diff takes 1.2 x the deadline and the engine completes 0.2 s after
    its sends: it completes within the push."""
    from torchtitan_flux.sync.pusher import Pusher as P

    class Late(Work):
        def __init__(self, pg, log):
            super().__init__(pg, log)
            self.at = time.monotonic() + 0.2

        def is_completed(self) -> bool:
            return time.monotonic() >= self.at

    monkeypatch.setattr(compat, "broadcast", lambda pg, t: Late(pg, []))
    monkeypatch.setattr(P, "_patch", lambda self, version, targets: time.sleep(1.2))
    model = nn.Sequential(nn.Linear(4, 4, bias=False))
    snap = Snapshot(model, device=torch.device("cpu"), is_sender=True, bucket_bytes=1024, wire_dtype=None)
    snap.take(1)
    table = LinkTable([Engine("e", [])], timeout_s=1.0)
    link = table.links[0]
    assert table.joined(table.begin_join(link), Group("e", stalled=False), "gloo")
    pusher = P(table, snap, WeightSync(timeout_seconds=1.0), backend="gloo", device=torch.device("cpu"), store=None,
               token=None, engine_specs=[])
    try:
        pusher.push(1)
    finally:
        pusher.close()
    assert link.state is LinkState.READY and link.holds == 1 and table.stats.timeouts == 0


def test_each_nccl_engine_is_sent_to_on_its_own_stream(monkeypatch):
    """Rule 1 as finding 1 needs it: every copy and broadcast for an NCCL engine is issued with that engine's own
    stream current (one stream per group), never the push stream another engine also uses. CPU has no stream:
    ``group_stream`` gives stand-in objects and ``on_stream`` records which one is current."""

    from torchtitan_flux.wire import cuda_rules

    recorder = StreamRecorder()

    made: list = []
    monkeypatch.setattr(cuda_rules, "group_stream", lambda device: made.append(object()) or made[-1])
    monkeypatch.setattr(cuda_rules, "on_stream", recorder.on_stream)
    seen: list = []

    def broadcast(pg, t):
        seen.append((pg.name, recorder.current))
        return Work(pg, [])

    monkeypatch.setattr(compat, "broadcast", broadcast)
    model = nn.Sequential(*[nn.Linear(16, 16, bias=False) for _ in range(2)])
    snap = Snapshot(model, device=torch.device("cpu"), is_sender=True, bucket_bytes=1024, wire_dtype=None)
    snap.take(1)
    table = LinkTable([Engine("A", []), Engine("B", [])], timeout_s=1.0)
    for link in table.links:
        assert table.joined(table.begin_join(link), Group(link.handler.name, stalled=False), "nccl")
    pusher = Pusher(table, snap, WeightSync(timeout_seconds=1.0), backend="nccl", device=torch.device("cpu"),
                    store=None, token=None, engine_specs=[])
    try:
        pusher.push(1)
    finally:
        pusher.close()
    push_stream = pusher.stream
    streams = {name: {s for n, s in seen if n == name} for name in ("A", "B")}
    assert streams["A"] == {pusher.rings["A"].stream} and streams["B"] == {pusher.rings["B"].stream}, streams
    assert len({push_stream, pusher.rings["A"].stream, pusher.rings["B"].stream}) == 3
    assert len(seen) == 6  # header + 2 buckets, per engine


class Killable(Engine):
    """An engine on a gloo group: its stalled sends end (fail) once it is killed, as a dead peer's socket closes."""

    def __init__(self, name: str, log: list, group: Group):
        super().__init__(name, log)
        self.group, self.killed = group, []

    def kill(self, why: str) -> None:
        self.killed.append(why)
        self.group.stalled = False


def test_a_gloo_send_past_its_deadline_is_ended_by_killing_its_engine_before_staging_is_rewritten(monkeypatch):
    """Review 4, finding 12: gloo cannot cancel a send (its ``abort`` leaves it running, torch 2.13), so a send
    given up at its deadline could keep reading staging, and the next snapshot's bytes could reach the engine inside
    the old push (a torn copy). Now ``free_staging``, before the snapshot, waits for such sends (their group's
    timeout ends them moments after the deadline: tests/integration/test_faults.py), and kills the engine of one
    still running ``FREE_STAGING_S`` past the deadline (the send then fails); an engine whose send ended meanwhile
    (it resumed) is left alone."""
    log: list = []
    monkeypatch.setattr(compat, "broadcast", lambda pg, t: Work(pg, log))
    model = nn.Sequential(*[nn.Linear(16, 16, bias=False) for _ in range(4)])
    snap = Snapshot(model, device=torch.device("cpu"), is_sender=True, bucket_bytes=1024, wire_dtype=None)
    snap.take(1)
    groups = {n: Group(n, stalled=n != "fine") for n in ("stuck", "resumed", "fine")}
    engines = [Killable(n, log, g) for n, g in groups.items()]
    table = LinkTable(engines, timeout_s=0.5)
    for link in table.links:
        assert table.joined(table.begin_join(link), groups[link.handler.name], "gloo")
    pusher = Pusher(table, snap, WeightSync(timeout_seconds=0.5), backend="gloo", device=torch.device("cpu"),
                    store=None, token=None, engine_specs=[])
    try:
        pusher.push(1)
        assert [lk.state for lk in table.links] == [LinkState.BROKEN, LinkState.BROKEN, LinkState.READY]
        assert [a.handler.name for a in pusher.abandoned] == ["stuck", "resumed"]
        groups["resumed"].stalled = False  # it answered again and finished receiving version 1
        t0 = time.monotonic()
        pusher.free_staging(2)
        took = time.monotonic() - t0
    finally:
        pusher.close()
    stuck, resumed, fine = engines
    assert len(stuck.killed) == 1 and "version 1" in stuck.killed[0] and "version 2" in stuck.killed[0]
    assert resumed.killed == [] and fine.killed == [] and pusher.abandoned == []
    assert took < FREE_STAGING_S + 3.0, took  # up to FREE_STAGING_S past the deadline, then the kill ends it at once
