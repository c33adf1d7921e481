"""The engine-side receiver (``torchtitan_flux.wire.transport``) with torch alone: bucket planning, the push header, flat
buffers and checksums, and real pushes over a 2-process gloo group into a ``WeightReceiver`` (swap semantics,
coalescing, the two-buffer invariant, the idle timeout).

Torch-only (no torchtitan anywhere in the import chain): ``scripts/check_old_torch.sh`` also runs this file under
torch 2.3.1. Set ``FLUX_PEER_PYTHON`` to another interpreter (e.g. one with a different torch) to also run the
receiver process there, against a sender on this interpreter's torch.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torchtitan_flux import compat

from torchtitan_flux.wire import transport
from torchtitan_flux.wire.transport import TensorSpec, decode_header, encode_header, plan_buckets

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


# ------------------------------------------------------------------------------------------ import chain


def test_engine_side_imports_no_torchtitan():
    code = (
        "import sys\n"
        "import torchtitan_flux.wire.transport, torchtitan_flux.models.inference, torchtitan_flux.compat\n"
        "import torchtitan_flux.engine.base, torchtitan_flux.engine.embedded\n"
        "assert torchtitan_flux.wire.transport.__file__.startswith(sys.argv[1]), torchtitan_flux.wire.transport.__file__\n"
        "bad = sorted(m for m in sys.modules if m == 'torchtitan' or m.startswith('torchtitan.'))\n"
        "assert 'torchtitan' not in sys.modules and not bad, bad\n"
        "print('ok')\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, str(ROOT)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


# ---------------------------------------------------------------------------------------------- planning


def _ranges(plan) -> list[tuple[int, int, str]]:
    return [(b.start, b.end, b.dtype) for b in plan.buckets]


def test_plan_splits_at_dtype_boundaries():
    specs = [
        TensorSpec("a", (4, 4), "float32"), TensorSpec("b", (4,), "float32"),
        TensorSpec("c", (8,), "bfloat16"), TensorSpec("d", (2, 3), "bfloat16"),
        TensorSpec("e", (3,), "float16"), TensorSpec("f", (5,), "float32"),
    ]
    plan = plan_buckets(specs, 1 << 20)
    assert _ranges(plan) == [(0, 2, "float32"), (2, 4, "bfloat16"), (4, 5, "float16"), (5, 6, "float32")]
    assert [b.numel for b in plan.buckets] == [20, 14, 3, 5]
    assert plan.nbytes == 20 * 4 + 14 * 2 + 3 * 2 + 5 * 4
    assert plan.header_len == 3 + 4
    assert plan == plan_buckets(list(specs), 1 << 20)  # both sides derive the same plan from the same specs


@pytest.mark.parametrize("bucket_bytes, expected", [
    (800, [(0, 2), (2, 4)]),  # exactly full
    (799, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    (1200, [(0, 3), (3, 4)]),
    (10_000, [(0, 4)]),
])
def test_plan_respects_bucket_size(bucket_bytes, expected):
    specs = [TensorSpec(f"w{i}", (10, 10), "float32") for i in range(4)]  # 400 bytes each
    plan = plan_buckets(specs, bucket_bytes)
    assert [(b.start, b.end) for b in plan.buckets] == expected
    for b in plan.buckets:
        assert b.numel * 4 <= bucket_bytes or b.end - b.start == 1


def test_plan_oversized_tensor_gets_its_own_bucket():
    specs = [
        TensorSpec("big0", (100,), "float32"), TensorSpec("s1", (2,), "float32"), TensorSpec("s2", (2,), "float32"),
        TensorSpec("big", (1000,), "float32"), TensorSpec("s3", (2,), "float32"),
    ]
    plan = plan_buckets(specs, 64)
    assert [(b.start, b.end, b.numel) for b in plan.buckets] == [(0, 1, 100), (1, 3, 4), (3, 4, 1000), (4, 5, 2)]
    weights = plan.allocate()
    assert [f.numel() for f in weights.flats] == [100, 4, 1000, 2]


def test_plan_empty():
    plan = plan_buckets([], 1024)
    assert plan.buckets == () and plan.header_len == 3 and plan.nbytes == 0


# ------------------------------------------------------------------------------------------------ header


def test_header_round_trip():
    plan = plan_buckets([TensorSpec(f"w{i}", (4,), "float32") for i in range(5)], 16)
    assert len(plan.buckets) == 5
    h = encode_header(plan, 12345)
    assert h.dtype == torch.int64 and h.shape == (plan.header_len,)
    assert h.tolist() == [transport.MAGIC, 12345, -1, -1, -1, -1, -1, -1]
    assert decode_header(h) == (12345, -1, [transport.DENSE] * 5)
    sparse = encode_header(plan, 7, [3, -1, 0, 2**40, 1], base=5)
    assert decode_header(sparse) == (7, 5, [3, -1, 0, 2**40, 1])
    assert decode_header(encode_header(plan, 2**40)).version == 2**40
    with pytest.raises(ValueError):  # a patch needs the version it patches, and a count per bucket
        encode_header(plan, 7, [3, -1, 0, 1, 1])
    with pytest.raises(ValueError):
        encode_header(plan, 7, [3], base=5)


def test_header_bad_magic():
    plan = plan_buckets([TensorSpec("w", (4,), "float32")], 16)
    h = encode_header(plan, 1)
    h[0] = 0x1234
    with pytest.raises(RuntimeError, match="bad magic 0x1234"):
        decode_header(h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_patch_is_bit_exact(dtype):
    """``changed`` compares bit patterns, so -0.0 vs 0.0 and NaN payloads count, and ``apply_patch`` rebuilds the new
    tensor bit for bit from the old one; a patch of nothing changes nothing."""
    g = torch.Generator().manual_seed(0)
    old = torch.randn(1000, generator=g).to(dtype)
    new = old.clone()
    new[::7] += 1e-3 * torch.randn(new[::7].shape, generator=g).to(dtype)
    new[3], old[3] = -0.0, 0.0
    new[5] = float("nan")
    bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
    idx = transport.changed(new, old)
    assert idx.dtype == torch.int32
    assert idx.tolist() == (new.view(bits) != old.view(bits)).nonzero().flatten().tolist() and 3 in idx.tolist()
    out = old.clone()
    transport.apply_patch(out, idx, new[idx.long()])
    assert torch.equal(out.view(bits), new.view(bits))
    assert transport.changed(new, new).numel() == 0
    assert transport.index_dtype(2**31 - 1) == torch.int32 and transport.index_dtype(2**31) == torch.int64


# ----------------------------------------------------------------------------------- flat weights, checksum


_SPECS = [
    TensorSpec("a", (3, 4), "float32"), TensorSpec("b", (5,), "float32"),
    TensorSpec("c", (2, 2), "bfloat16"), TensorSpec("d", (7,), "float16"),
]


def test_flat_views_share_storage():
    plan = plan_buckets(_SPECS, 1 << 20)
    w = plan.allocate()
    assert len(w.flats) == 3
    for f in w.flats:
        f.copy_(torch.arange(f.numel()).to(f.dtype))
    assert torch.equal(w.views["a"], torch.arange(12.0).view(3, 4))
    assert torch.equal(w.views["b"], torch.arange(12.0, 17.0))
    for name, flat_idx in (("a", 0), ("b", 0), ("c", 1), ("d", 2)):
        v = w.views[name]
        assert v.shape == {s.name: s.shape for s in _SPECS}[name]
        assert v.untyped_storage().data_ptr() == w.flats[flat_idx].untyped_storage().data_ptr()
    w.views["b"].fill_(-1.0)  # writes through into the flat buffer
    assert torch.equal(w.flats[0][12:], torch.full((5,), -1.0))
    w.flats[1].zero_()
    assert torch.equal(w.views["c"], torch.zeros(2, 2, dtype=torch.bfloat16))
    assert [t.shape for t in w.bucket_views(0)] == [(3, 4), (5,)]
    assert all(t.data_ptr() == w.views[n].data_ptr() for t, n in zip(w.bucket_views(0), "ab"))


def _filled(seed: int):
    plan = plan_buckets(_SPECS, 1 << 20)
    w = plan.allocate()
    g = torch.Generator().manual_seed(seed)
    for f in w.flats:
        f.copy_(torch.randn(f.numel(), generator=g).to(f.dtype))
    return w


def test_a_buffer_read_by_a_probe_or_checksum_is_never_taken_to_receive_into():
    """Fifth review, finding 25: a probe or checksum on the engine's main thread reads the newest complete buffer
    while the receiver may take that same buffer (the newest pending one, with nothing free) to receive the next
    push into: on a GPU a write on the receiver's stream racing the read, a torn probe or checksum. The reader holds
    it pinned (``reading_newest``); the receiver takes no pinned buffer and waits while it is the only one."""
    plan = plan_buckets([TensorSpec("w", (4,), "float32")], 2**20)
    rx = transport.WeightReceiver(plan, "cpu", lambda v: None, lambda e: None, buffers=2)
    stop = threading.Event()
    for v in (1, 2):
        buf = rx._take_buffer(stop)
        buf.flats[0].fill_(v)
        assert rx._publish(v, buf, stop)
    assert rx.swap(1) == 1  # live: 1; pending: 2; nothing free
    taken: list = []
    with rx.reading_newest() as (version, weights):
        assert version == 2
        receiver = threading.Thread(target=lambda: taken.append(rx._take_buffer(stop)), daemon=True)
        receiver.start()
        receiver.join(0.5)
        assert not taken  # waits while the one buffer it could take is read
        assert weights.flats[0].eq(2).all()
    receiver.join(5)
    assert taken and taken[0] is weights  # then takes it
    assert rx.newest() == (1, rx.live)  # version 2 is being overwritten: the newest complete one is the live one


def test_checksum_is_bitwise():
    w, same = _filled(0), _filled(0)
    ref = w.checksum()
    assert len(ref) == 64 and same.checksum() == ref
    assert _filled(1).checksum() != ref
    for flat_idx, int_dtype in ((0, torch.int32), (1, torch.int16), (2, torch.int16)):
        bits = w.flats[flat_idx].view(int_dtype)
        bits[-1] ^= 1  # one flipped mantissa bit in the last element of one bucket
        assert w.checksum() != ref, flat_idx
        bits[-1] ^= 1
        assert w.checksum() == ref
    zero = w.flats[0][0].item()
    w.flats[0][0] = 0.0
    pos = w.checksum()
    w.flats[0][0] = -0.0  # equal as numbers, different bits
    assert w.checksum() != pos
    w.flats[0][0] = zero
    assert w.checksum() == ref


# -------------------------------------------------------------------------------- 2-process gloo pushes

# The receiver process: a WeightReceiver on rank 1 of a 2-member gloo group (what engine/embedded.py does), driven by
# one command per line on stdin; it answers (and acks pushes) with "FLUX " + one JSON object per line on stdout.
_RECEIVER = r"""
import json, os, sys, threading
from datetime import timedelta

import torch
from torchtitan_flux import compat
from torchtitan_flux.wire import transport
import torchtitan_flux.models.inference, torchtitan_flux.engine.embedded  # the engine's import chain

cfg = json.loads(sys.argv[1])
specs = [transport.TensorSpec(n, tuple(s), d) for n, s, d in cfg["specs"]]
plan = transport.plan_buckets(specs, cfg["bucket_bytes"])
out = threading.Lock()


def emit(**msg):
    with out:
        sys.stdout.write("FLUX " + json.dumps(msg) + "\n")
        sys.stdout.flush()


def make_group():  # as engine/embedded.py builds it
    store = transport.connect_store("127.0.0.1", cfg["port"], 60.0, is_master=False)
    prefixed = torch.distributed.PrefixStore(cfg["prefix"], store)
    return compat.new_weight_sync_group(
        "gloo", prefixed, 1, 2, timedelta(seconds=cfg["group_timeout"]), idle_timeout=transport.IDLE_TIMEOUT
    )


rx = transport.WeightReceiver(
    plan, "cpu", lambda v: emit(ack=v), lambda e: emit(error=f"{type(e).__name__}: {e}")
)
index = {id(b): i for i, b in enumerate(rx._free)}  # the two buffers, by allocation order
rx.start(make_group)
emit(ready=torch.__version__)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "swap":
        emit(swapped=rx.swap())
    elif cmd == "state":
        with rx._lock:
            live, free = rx.live, list(rx._free)
            assert len(rx._pending) <= 1, "two buffers hold at most one pending version"
            pending = rx._pending[0] if rx._pending else None
            live_version = rx.live_version
        newest_version, newest = rx.newest()
        emit(
            live_version=live_version,
            live=index.get(id(live)) if live is not None else None,
            live_sum=live.checksum() if live is not None else None,
            pending_version=pending[0] if pending is not None else None,
            pending=index.get(id(pending[1]), -1) if pending is not None else None,
            free=[index.get(id(b), -1) for b in free],
            newest_version=newest_version,
            newest_sum=newest.checksum() if newest is not None else None,
        )
    elif cmd == "quit":
        emit(bye=sorted(m for m in sys.modules if m == "torchtitan" or m.startswith("torchtitan.")))
        os._exit(0)  # the receiver thread is blocked in the next header's broadcast
"""

_PUSH_SPECS = [  # mixed dtypes, and tensors larger than a bucket (bucket_bytes = 2048)
    TensorSpec("tok_embeddings.weight", (64, 16), "float32"),  # 4096 B: a bucket of its own
    TensorSpec("layers.0.attention.wq.weight", (16, 16), "float32"),
    TensorSpec("layers.0.attention_norm.weight", (16,), "float32"),
    TensorSpec("layers.0.feed_forward.w1.weight", (32, 16), "bfloat16"),
    TensorSpec("layers.0.feed_forward.w2.weight", (16, 32), "bfloat16"),
    TensorSpec("norm.weight", (16,), "float16"),
    TensorSpec("output.weight", (64, 16), "float32"),
]
_PUSH_BUCKET_BYTES = 2048


def _peers() -> list[str]:
    peers = [sys.executable]
    if os.environ.get("FLUX_PEER_PYTHON"):
        peers.append(os.environ["FLUX_PEER_PYTHON"])
    return peers


class _Link:
    """The sending side (rank 0), plain torch: a TCPStore, a gloo group from ``compat.new_weight_sync_group``, and
    ``compat.broadcast`` of the header and the listed buckets, per the wire format in ``transport``'s docstring."""

    def __init__(self, tmp_path: Path, python: str, group_timeout: float = 60.0):
        self.plan = plan_buckets(_PUSH_SPECS, _PUSH_BUCKET_BYTES)
        self.staging = self.plan.allocate()
        self.store = transport.connect_store("127.0.0.1", 0, 60.0, is_master=True)
        cfg = dict(
            port=self.store.port, prefix="flux_ws/test/1", group_timeout=group_timeout, bucket_bytes=_PUSH_BUCKET_BYTES,
            specs=[[s.name, list(s.shape), s.dtype] for s in _PUSH_SPECS],
        )
        self.stderr_path = tmp_path / "receiver.stderr"
        self._stderr = open(self.stderr_path, "w")
        self.proc = subprocess.Popen(
            [python, "-c", _RECEIVER, json.dumps(cfg)], cwd=ROOT, env=_env(), text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
        )
        self.msgs: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.peer_torch = self.recv("ready", 120)["ready"]
        prefixed = dist.PrefixStore(cfg["prefix"], self.store)
        self.pg = compat.new_weight_sync_group("gloo", prefixed, 0, 2, timedelta(seconds=group_timeout))

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("FLUX "):  # other lines: torch's own prints (gloo 2.8 prints on connect)
                self.msgs.put(json.loads(line[5:]))
        self.msgs.put(None)

    def recv(self, key: str, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.msgs.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                msg = {"error": f"nothing from the receiver for {timeout}s (waiting for {key!r})"}
            if msg is None:
                msg = {"error": f"receiver exited with {self.proc.wait()}"}
            if key in msg:
                return msg
            stderr = self.stderr_path.read_text()[-4000:]
            raise AssertionError(f"expected {key!r}, got {msg}; receiver stderr:\n{stderr}")

    def command(self, cmd: str, key: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.recv(key)

    def fill(self, version: int, ids: list[int]) -> str:
        """Give the listed buckets of the staging buffer new values for ``version``; returns the checksum of the
        whole staging buffer (what a receiver must hold after the push)."""
        for i in ids:
            g = torch.Generator().manual_seed(1000 * version + i)
            for v in self.staging.bucket_views(i):
                v.copy_(torch.randn(v.shape, generator=g).to(v.dtype))
        return self.staging.checksum()

    def push(self, version: int) -> str:
        ids = list(range(len(self.plan.buckets)))
        expected = self.fill(version, ids)
        compat.broadcast(self.pg, encode_header(self.plan, version)).wait()
        for i in ids:
            compat.broadcast(self.pg, self.staging.flats[i]).wait()
        return expected

    def state(self) -> dict:
        return self.command("state", "live_version")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self._stderr.close()


@pytest.fixture
def link_factory(tmp_path):
    links = []

    def make(python: str, **kw) -> _Link:
        links.append(_Link(tmp_path, python, **kw))
        return links[-1]

    yield make
    for lk in links:
        lk.close()


def _assert_two_buffers(st: dict) -> None:
    """Idle receiver: live + pending + free are exactly the two allocated buffers."""
    held = [b for b in (st["live"], st["pending"]) if b is not None] + st["free"]
    assert sorted(held) == [0, 1], st


@pytest.mark.parametrize("peer", _peers(), ids=lambda p: "same-python" if p == sys.executable else "peer-python")
def test_pushes_swap_coalesce(link_factory, peer):
    link = link_factory(peer)
    assert len(link.plan.buckets) == 5
    sums = {}

    # v0: received and acked, but nothing is live until swap()
    sums[0] = link.push(0)
    assert link.recv("ack")["ack"] == 0
    st = link.state()
    assert st["live_version"] == -1 and st["live"] is None and st["live_sum"] is None
    assert st["pending_version"] == 0 and st["newest_version"] == 0 and st["newest_sum"] == sums[0]
    _assert_two_buffers(st)
    assert link.command("swap", "swapped")["swapped"] == 0
    st = link.state()
    assert st["live_version"] == 0 and st["live_sum"] == sums[0] and st["pending"] is None
    _assert_two_buffers(st)
    assert link.command("swap", "swapped")["swapped"] == 0  # nothing new: swap keeps the live version

    # v1 lands in the free buffer; the live buffer keeps serving v0, bitwise, until the swap
    sums[1] = link.push(1)
    assert link.recv("ack")["ack"] == 1
    st = link.state()
    assert st["live_version"] == 0 and st["live_sum"] == sums[0] and st["pending_version"] == 1
    assert st["pending"] != st["live"] and st["newest_sum"] == sums[1]
    _assert_two_buffers(st)
    assert link.command("swap", "swapped")["swapped"] == 1
    assert link.state()["live_sum"] == sums[1]

    # v2 and v3 before a swap: v3 is received into v2's (pending) buffer; v2 is never live
    sums[2] = link.push(2)
    sums[3] = link.push(3)
    assert [link.recv("ack")["ack"] for _ in range(2)] == [2, 3]
    st = link.state()
    assert st["live_version"] == 1 and st["live_sum"] == sums[1]
    assert st["pending_version"] == 3 and st["free"] == [] and st["newest_sum"] == sums[3]
    _assert_two_buffers(st)
    assert link.command("swap", "swapped")["swapped"] == 3
    st = link.state()
    assert st["live_sum"] == sums[3]
    _assert_two_buffers(st)
    assert len(set(sums.values())) == len(sums)

    # a header the receiver cannot decode is reported through on_error
    bad = encode_header(link.plan, 7)
    bad[0] = 0
    compat.broadcast(link.pg, bad).wait()
    assert "bad magic" in link.recv("error")["error"]
    assert link.command("quit", "bye")["bye"] == []  # no torchtitan module in the engine process


@pytest.mark.parametrize("peer", _peers(), ids=lambda p: "same-python" if p == sys.executable else "peer-python")
def test_idle_wait_outlasts_group_timeout(link_factory, peer):
    """The wait for the next header uses ``IDLE_TIMEOUT``, not the group's timeout: a push that comes later than
    ``group_timeout`` after the previous one is still received (per-collective timeout on torch >= 2.9 gloo; the
    group's own timeout raised to ``IDLE_TIMEOUT`` before, see ``compat.op_timeout_honoured``)."""
    link = link_factory(peer, group_timeout=3.0)
    time.sleep(4.0)
    expected = link.push(0)
    assert link.recv("ack", 30)["ack"] == 0
    assert link.command("swap", "swapped")["swapped"] == 0
    assert link.state()["live_sum"] == expected


@pytest.mark.parametrize("buffers", [2, 3])
def test_pinned_swap_runs_each_request_on_its_pin_when_kept(buffers):
    """Versions 1 and 2 land while a request on version 0 runs; then requests pinned to 1, 2, 3. With three
    buffers every pin is served exactly; with two, version 1 is superseded by 2 before it could go live, and
    the request pinned to 1 runs on 2 (the closest newer), never on an older one."""
    plan = transport.plan_buckets([TensorSpec("w", (4,), "float32")], 1024)
    rx = transport.WeightReceiver(plan, "cpu", lambda v: None, lambda e: None, buffers=buffers)
    stop = threading.Event()

    def land(version: int) -> None:
        buf = rx._take_buffer(stop)
        buf.flats[0].fill_(version)
        assert rx._publish(version, buf, stop)

    land(0)
    assert rx.swap(0) == 0
    land(1)
    land(2)
    served = rx.swap(1)
    assert served == (1 if buffers == 3 else 2) and float(rx.live.flats[0][0]) == served
    land(3)
    assert rx.swap(2) == 2 and float(rx.live.flats[0][0]) == 2.0
    assert rx.swap(3) == 3 and float(rx.live.flats[0][0]) == 3.0
    assert rx.swap(1) == 3  # never back to an older version
    assert rx.swap() == 3 and len(rx._free) == buffers - 1  # every buffer accounted for


def test_newest_never_names_a_buffer_taken_to_be_overwritten():
    """Two buffers: version 0 live, version 1 pending, then a third push takes version 1's buffer to receive into
    (engine-side coalescing). Until version 2 lands, the newest complete version is 0 (live): ``newest()`` must not
    name 1, whose buffer is being overwritten (a probe or checksum would read torn weights, and a request needing
    version 1 would be admitted and then run on 0). The old code named 1."""
    plan = transport.plan_buckets([TensorSpec("w", (4,), "float32")], 1024)
    rx = transport.WeightReceiver(plan, "cpu", lambda v: None, lambda e: None, buffers=2)
    stop = threading.Event()
    buf = rx._take_buffer(stop)
    buf.flats[0].fill_(0)
    assert rx._publish(0, buf, stop) and rx.swap() == 0
    buf = rx._take_buffer(stop)
    buf.flats[0].fill_(1)
    assert rx._publish(1, buf, stop) and rx.newest()[0] == 1
    taken = rx._take_buffer(stop)  # no free buffer: version 1's, the only pending one
    assert taken is buf
    version, weights = rx.newest()
    assert version == 0 and weights is rx.live
    taken.flats[0].fill_(2)
    assert rx._publish(2, taken, stop) and rx.newest()[0] == 2 and rx.swap() == 2
