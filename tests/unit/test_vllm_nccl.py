"""``engine/vllm_nccl.py`` with vLLM's trainer engine replaced by a fake (vLLM is not importable here): our packed
buffer size reaches vLLM (N8), one push at a time (N8), a push abandoned at its deadline kills the handler and is
never acked while a queued one is only cancelled (N2), a rejoin destroys the previous communicator on both sides
(N9), and a server on another NCCL is refused at start (N11)."""

from __future__ import annotations
from _streams import StreamRecorder

import queue
import sys
import threading
import time
import types
from dataclasses import dataclass

import pytest
import torch

from torchtitan_flux.engine import vllm_nccl
from torchtitan_flux.engine.base import EngineError, WeightAck, WeightGroupInfo
from torchtitan_flux.engine.threads import Workers
from torchtitan_flux.wire import cuda_rules, transport

REAL_STAGING_SOURCE = vllm_nccl.staging_source  # the fixture replaces it; the producer test needs the real one


class FakeTransfer:
    made: list = []

    def __init__(self, init, client):
        self.init, self.client, self.shut = init, client, False
        self.sending = threading.Event()
        self.go = threading.Event()
        FakeTransfer.made.append(self)

    @classmethod
    def trainer_init(cls, init, *, client, source):
        return cls(init, client)

    def send_weights(self):
        self.sending.set()
        assert self.go.wait(10)

    def shutdown(self):
        self.shut = True


@dataclass
class FakeInit:
    rank: int
    master_address: str
    master_port: int
    world_size: int
    packed_buffer_size_bytes: int = 2**30


@pytest.fixture
def engines(monkeypatch, tiny_model_dir):
    mod = types.ModuleType("vllm.distributed.weight_transfer.nccl_engine")
    mod.NCCLTrainerInitInfo, mod.NCCLTrainerWeightTransferEngine = FakeInit, FakeTransfer
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(vllm_nccl, "staging_source", lambda engine, device: None)
    FakeTransfer.made = []
    events: queue.Queue = queue.Queue()
    specs = [transport.TensorSpec("model.norm.weight", (4,), "float32")]
    info = WeightGroupInfo("127.0.0.1", 1, "flux_ws/e/1", "nccl", 5.0, specs, 3 * 2**20)
    made = []

    def make(name):
        e = vllm_nccl.VllmNcclEngine(name, "http://127.0.0.1:1", events, model_dir=tiny_model_dir,
                                     health_interval_s=0)
        e.posts = []
        e.client = types.SimpleNamespace(post=lambda path, *a, **k: e.posts.append(path), close=lambda: None)
        e._ctl = Workers(1, f"{name}-ctl")
        e._plan, e._info = transport.plan_buckets(specs, info.bucket_bytes), info
        e._bucket_meta = [(["n"], ["float32"], [[4]])]
        e.group = e.own_group(None, info, torch.device("cpu"))
        made.append(e)
        return e

    yield make, events
    for e in made:
        e.close()


def _events(events: queue.Queue, timeout: float = 0.5) -> list:
    out = []
    try:
        while True:
            out.append(events.get(timeout=timeout))
    except queue.Empty:
        return out


def test_packed_buffers_are_our_bucket_size_and_pushes_go_one_at_a_time(engines):
    make, events = engines
    a, b = make("a"), make("b")
    assert a.group.transfer.init.packed_buffer_size_bytes == 3 * 2**20
    ta, tb = FakeTransfer.made
    pa = a.self_push(1, [])
    assert ta.sending.wait(5)
    pb = b.self_push(1, [])
    assert not tb.sending.wait(0.3)  # b waits for a
    ta.go.set()
    assert tb.sending.wait(5)
    tb.go.set()
    assert cuda_rules.wait_works([pa, pb], deadline=time.monotonic() + 5)
    acks = [ev for ev in _events(events) if isinstance(ev, WeightAck)]
    assert sorted(ev.engine for ev in acks) == ["a", "b"] and all(ev.version == 1 for ev in acks)


def test_a_push_abandoned_at_its_deadline_kills_the_engine_and_is_never_acked(engines):
    make, events = engines
    a, b = make("a"), make("b")
    ta, tb = FakeTransfer.made
    pa = a.self_push(2, [])
    assert ta.sending.wait(5)
    pb = b.self_push(2, [])
    assert not cuda_rules.wait_works([pa, pb], deadline=time.monotonic() + 0.2)  # missed
    cuda_rules.abort_group(a.group)  # what the pusher does at the deadline
    cuda_rules.abort_group(b.group)
    assert ta.shut and tb.shut  # communicators destroyed (vLLM: ncclCommAbort)
    assert pa.state == "abandoned" and pb.state == "cancelled"
    ta.go.set()  # the abandoned push completes late
    assert cuda_rules.wait_works([pa, pb], deadline=time.monotonic() + 5)
    evs = _events(events)
    assert not any(isinstance(ev, WeightAck) for ev in evs), evs  # never acked
    dead = [ev for ev in evs if isinstance(ev, EngineError) and ev.fatal]
    assert [ev.engine for ev in dead] == ["a"] and "missed its deadline" in dead[0].message
    assert not a.alive() and b.alive()  # a: reconnected and resynced; b: only rejoins (nothing was sent)
    assert not tb.sending.is_set()  # the cancelled push never started


def test_a_rejoin_destroys_the_previous_communicator_on_both_sides(engines):
    make, _ = engines
    a = make("a")
    first = a.group.transfer
    a.own_group(None, a._info, torch.device("cpu"))
    assert first.shut and "/shutdown_weight_transfer_engine" in a.posts


def test_a_server_on_another_nccl_is_refused_at_start(engines, monkeypatch):
    make, _ = engines
    a = make("a")
    monkeypatch.setattr(cuda_rules, "nccl_version", lambda: "2.21.5")
    info = {"transfer_backend": vllm_nccl.SERVER_BACKEND, "nccl_version": "2.27.3"}
    with pytest.raises(cuda_rules.NcclVersionMismatch, match="has NCCL 2.21.5 but the vLLM server has NCCL 2.27.3"):
        a._check_transfer(info)
    a._check_transfer({**info, "nccl_version": "2.21.5"})


def test_a_push_waiting_on_a_long_generation_is_not_running_and_does_not_hold_up_another_server(engines):
    """Review 4, finding 3: engine a's generation outlasts the push's deadline twice over. Its push only waited
    (gate, pause): it is cancelled at the deadline, not abandoned, so a is not killed; b's push, issued after a's,
    never waits for a's and is acked within the deadline. (Before: a's push was "running" from the moment it took
    the process-wide lock, before its gate wait: a was killed and b, queued behind the lock, cancelled.)"""
    make, events = engines
    a, b = make("a"), make("b")
    ta, tb = FakeTransfer.made
    ta.go.set()
    tb.go.set()
    deadline_s = 0.4
    generating = threading.Event()

    def generation():  # holds a's gate shared, as a generation request does, for 2 x the deadline
        with a._gate.shared():
            generating.set()
            time.sleep(2 * deadline_s)

    threading.Thread(target=generation, daemon=True).start()
    assert generating.wait(5)
    pa, pb = a.self_push(3, []), b.self_push(3, [])
    deadline = time.monotonic() + deadline_s
    assert cuda_rules.wait_works([pb], deadline)  # b: sent and confirmed within the deadline
    assert not cuda_rules.wait_works([pa], deadline)  # a: still waiting for its generation
    cuda_rules.abort_group(a.group)  # what the pusher does at the deadline
    assert pa.state == "cancelled" and pb.state == "done"
    assert cuda_rules.wait_works([pa], time.monotonic() + 5)  # a's generation ends; its push gives up
    with pytest.raises(RuntimeError, match="not applied"):
        pa.wait()  # never counted as completed
    evs = _events(events)
    assert [(ev.engine, ev.version) for ev in evs if isinstance(ev, WeightAck)] == [("b", 3)]
    assert not any(isinstance(ev, EngineError) and ev.fatal for ev in evs), evs
    assert a.alive() and b.alive()  # a rejoins (its group was aborted) and keeps serving its old weights
    assert not ta.sending.is_set()  # nothing was sent to a
    assert a.posts.count("/resume") >= 1  # paused for nothing, then resumed


def test_vllm_runs_its_trainer_init_and_sends_with_a_side_stream_current(engines, monkeypatch):
    """Review 4, finding 4 (rule 1): ``trainer_init`` (its warm-up all_reduce) and ``send_weights`` (which ends with
    ``current_stream().synchronize()``) run with the handler's own stream current, never the default stream, where
    the synchronize would wait for the training step's kernels. CPU has no stream: a stand-in object, and
    ``on_stream`` records which one is current when vLLM's calls run."""

    make, events = engines
    side = object()
    recorder = StreamRecorder()

    seen = []
    monkeypatch.setattr(cuda_rules, "group_stream", lambda device: side)
    monkeypatch.setattr(cuda_rules, "on_stream", recorder.on_stream)
    real_init, real_send = FakeTransfer.trainer_init.__func__, FakeTransfer.send_weights
    monkeypatch.setattr(FakeTransfer, "trainer_init", classmethod(
        lambda cls, *a, **k: seen.append(("init", recorder.current)) or real_init(cls, *a, **k)))
    monkeypatch.setattr(FakeTransfer, "send_weights",
                        lambda self: seen.append(("send", recorder.current)) or real_send(self))
    a = make("a")
    FakeTransfer.made[0].go.set()
    push = a.self_push(4, [])
    assert cuda_rules.wait_works([push], time.monotonic() + 5)
    assert [k for k, _ in seen] == ["init", "send"] and all(s is side for _, s in seen), seen
    assert [ev.engine for ev in _events(events) if isinstance(ev, WeightAck)] == ["a"]


class ProducerTransfer(FakeTransfer):
    """vLLM's sender as far as its producer goes: ``send_weights`` iterates the real ``StagingSource`` and
    broadcasts each tensor; the first broadcast blocks until ``shutdown()`` (the abort ends its kernel), the later
    ones are counted (after a shutdown: a call on a communicator being torn down); then, as vLLM does, it waits for
    the server's ``/update_weights``, which a wedged server never answers (here: 3 s)."""

    def __init__(self, init, client, source):
        super().__init__(init, client)
        self.source, self.broadcasts, self.after_shutdown = source, 0, 0
        self.torn_down = threading.Event()

    @classmethod
    def trainer_init(cls, init, *, client, source):
        return cls(init, client, source)

    def send_weights(self):
        for _name, _tensor in self.source:
            self.broadcasts += 1
            self.after_shutdown += self.torn_down.is_set()
            self.sending.set()
            assert self.torn_down.wait(10)
        time.sleep(3)  # ``future.result()`` on /update_weights

    def shutdown(self):
        super().shutdown()
        self.torn_down.set()


def test_an_abandoned_push_stops_its_producer_and_frees_the_send_lock_at_once(engines, monkeypatch):
    """Fifth review, finding 17: once a running push is abandoned at its deadline, vLLM's producer, on the control
    thread, stops at its next tensor: it never broadcasts on the communicator the abort tears down, and the
    process-wide ``_SENDING`` is free within 1 s (before: the producer ran on and held it through a wait on the
    wedged server's /update_weights, cancelling every other server's push meanwhile)."""
    make, events = engines
    base = types.ModuleType("vllm.distributed.weight_transfer.base")
    base.ParamMeta = lambda name, dtype, shape: (name, dtype, shape)
    base.WeightSource = object
    monkeypatch.setitem(sys.modules, base.__name__, base)
    monkeypatch.setattr(vllm_nccl, "staging_source", REAL_STAGING_SOURCE)
    monkeypatch.setattr(sys.modules["vllm.distributed.weight_transfer.nccl_engine"],
                        "NCCLTrainerWeightTransferEngine", ProducerTransfer)
    a = make("a")
    specs = [transport.TensorSpec(n, (4,), "float32") for n in ("x", "y", "z")]
    a._plan = transport.plan_buckets(specs, 2**20)
    a._bucket_meta = [([s.name for s in specs], ["float32"] * 3, [[4]] * 3)]
    t = a.group.transfer
    push = a.self_push(5, [torch.arange(12.0)])
    assert t.sending.wait(5) and t.broadcasts == 1
    cuda_rules.abort_group(a.group)  # the pusher, at the missed deadline
    assert vllm_nccl._SENDING.acquire(timeout=1.0), "the abandoned push still holds the send lock"
    vllm_nccl._SENDING.release()
    assert cuda_rules.wait_works([push], time.monotonic() + 5)
    assert t.after_shutdown == 0 and t.broadcasts == 1, (t.broadcasts, t.after_shutdown)
    with pytest.raises(RuntimeError, match="abandoned"):
        push.wait()
    assert not any(isinstance(ev, WeightAck) for ev in _events(events))


def test_with_in_flight_updates_a_server_is_paused_only_once_its_push_can_send(engines):
    """Fifth review, finding 18: ``/pause?mode=keep`` freezes a server's running requests at once, so it was posted
    before the push waited for ``_SENDING``: b's requests stayed frozen through a's whole push. With in-flight
    updates b now takes ``_SENDING`` first; without them ``mode=wait`` still comes first (review 4, finding 3)."""
    make, events = engines
    a, b = make("a"), make("b")
    b.in_flight = True
    ta, tb = FakeTransfer.made
    pa = a.self_push(6, [])
    assert ta.sending.wait(5)  # a holds _SENDING
    assert "/pause" in a.posts
    pb = b.self_push(6, [])
    time.sleep(0.3)
    assert "/pause" not in b.posts and not tb.sending.is_set()  # b's requests still run
    ta.go.set()
    assert tb.sending.wait(5) and "/pause" in b.posts
    tb.go.set()
    assert cuda_rules.wait_works([pa, pb], deadline=time.monotonic() + 5)


def test_a_join_whose_server_never_connects_fails_at_our_deadline_not_vllms_store_wait(engines, monkeypatch):
    """Fourth review's finding 2, its remainder (fifth review, section 1): vLLM's ``trainer_init`` waits up to 300 s
    in its TCPStore for a server that never connects (a wedged one), and the joiner thread waited with it, so 8
    failed joins took 40 minutes. The rendezvous now runs on a helper thread bounded by the join's
    ``timeout_seconds``; one that completes later is shut down at once."""
    make, _ = engines
    a = make("a")
    connects = threading.Event()
    late: list = []

    class NeverConnects(FakeTransfer):
        @classmethod
        def trainer_init(cls, init, *, client, source):
            assert connects.wait(10)  # vLLM: the master TCPStore waiting for its worker
            late.append(cls(init, client))
            return late[-1]

    monkeypatch.setattr(sys.modules["vllm.distributed.weight_transfer.nccl_engine"],
                        "NCCLTrainerWeightTransferEngine", NeverConnects)
    info = a._info  # timeout_s = 5.0
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rendezvous with a .* did not complete within 5 s"):
        a.own_group(None, info, torch.device("cpu"))
    assert 4.5 < time.monotonic() - t0 < 8.0
    connects.set()  # it connects after all: nobody uses that communicator
    deadline = time.monotonic() + 5
    while not (late and late[0].shut):
        assert time.monotonic() < deadline
        time.sleep(0.02)
