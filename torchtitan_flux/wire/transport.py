"""Wire format of a weight push, and the engine-side receiver. Torch-only (no torchtitan): runs in engines.

A push of policy version ``v`` on a weight-sync group (rank 0: the trainer; ranks 1..: engine workers) is:

    header  int64[3 + n_buckets] = [MAGIC, v, base, count_0, ..., count_{n-1}]
    bucket  for each bucket in order: count -1 (``DENSE``): its flat tensor; count k > 0: a patch, the k flat
            indices that changed (``index_dtype``) then their k values; count 0: nothing

Both sides derive the same ``BucketPlan`` from the same ordered ``TensorSpec`` list (sent once at connect), so
no per-tensor metadata travels per push. A dense push (``base`` -1, every count -1) carries whole buckets; the
receiver of a dense-only group pre-posts bucket 0 with the header into a one-bucket landing buffer (one round trip
per small push, not two). A sparse push (``weight_sync.method = "sparse"``, ``sync/sparse.py``) patches version
``base``, which the receiver must hold (else it raises and is resynced dense): element ``j`` of a patched bucket
is the bit pattern of ``values`` where ``j`` is listed, and ``base``'s elsewhere, so the result is bit-exact.

A colocated engine (backend ``COLOCATED``: on the trainer's device) has no group and no wire: the join message hands
it rank 0's staging flats by reference, and it copies them whenever the ``Seqlock`` shows a new whole version
(``WeightReceiver.start_shared``).

Simplification: a tensor is never split across buckets; one larger than ``bucket_bytes`` gets a bucket of its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import math
import secrets
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, NamedTuple

import torch

from torchtitan_flux import compat
from torchtitan_flux.wire import cuda_rules

logger = logging.getLogger("torchtitan_flux")

MAGIC = 0x46_4C_58_33  # "FLX3": per-bucket counts and a base version (sparse pushes, 2026-11-26); an engine of
# an older version sees another magic and says so, instead of misreading the header
DENSE = -1  # a bucket's count in the header: it travels whole
# The wait for the next push's header is idle time, not a failure: it gets this timeout, not the group's
# ``timeout_s`` (which still bounds a push's buckets where the backend honours it: ``compat.op_timeout_honoured``).
IDLE_TIMEOUT = timedelta(days=7)
COLOCATED = "colocated"  # the "backend" of an engine on the trainer's device: no group, staging shared by reference
SHARED_POLL_S = (0.0005, 0.005)  # colocated receiver: poll period after activity, doubling up to the second when idle
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # a key of _DTYPES

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Bucket:
    start: int  # index range [start, end) into BucketPlan.specs
    end: int
    dtype: str
    numel: int


@dataclass(frozen=True)
class BucketPlan:
    specs: tuple[TensorSpec, ...]
    buckets: tuple[Bucket, ...]

    @property
    def header_len(self) -> int:
        return 3 + len(self.buckets)

    @property
    def nbytes(self) -> int:
        return sum(b.numel * _DTYPES[b.dtype].itemsize for b in self.buckets)

    def allocate(self, device: torch.device | str = "cpu", pin_memory: bool = False) -> "FlatWeights":
        # written once, so the pages are resident from the start and memory accounting is honest
        return FlatWeights(self, [torch.empty(b.numel, dtype=_DTYPES[b.dtype], device=device,
                                              pin_memory=pin_memory).zero_() for b in self.buckets])


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int) -> BucketPlan:
    """Group consecutive tensors of one dtype into buckets of at most ``bucket_bytes`` (see the header note)."""
    buckets: list[Bucket] = []
    start, numel = 0, 0
    for i, s in enumerate(specs):
        size = _DTYPES[s.dtype].itemsize
        if i > start and (s.dtype != specs[start].dtype or (numel + s.numel) * size > bucket_bytes):
            buckets.append(Bucket(start, i, specs[start].dtype, numel))
            start, numel = i, 0
        numel += s.numel
    if specs:
        buckets.append(Bucket(start, len(specs), specs[start].dtype, numel))
    return BucketPlan(tuple(specs), tuple(buckets))


class FlatWeights:
    """One flat tensor per bucket, and a ``name -> view`` dict into them (the dict a model reads)."""

    def __init__(self, plan: BucketPlan, flats: list[torch.Tensor]):
        self.plan, self.flats = plan, flats
        self.views: dict[str, torch.Tensor] = {}
        for b, flat in zip(plan.buckets, flats):
            off = 0
            for s in plan.specs[b.start : b.end]:
                self.views[s.name] = flat[off : off + s.numel].view(s.shape)
                off += s.numel

    def bucket_views(self, i: int) -> list[torch.Tensor]:
        b = self.plan.buckets[i]
        return [self.views[s.name] for s in self.plan.specs[b.start : b.end]]

    def checksum(self) -> str:
        """sha256 over the raw bytes of every bucket in order: equal iff bitwise-equal weights."""
        h = hashlib.sha256()
        for flat in self.flats:
            h.update(flat.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


class Header(NamedTuple):
    version: int
    base: int  # -1: every bucket travels whole; else the version the patches apply to
    counts: list[int]  # per bucket: ``DENSE``, or the number of changed elements its patch lists


def encode_header(plan: BucketPlan, version: int, counts: list[int] | None = None, base: int = -1) -> torch.Tensor:
    """The header of a push of ``version``: ``counts`` None is a dense push (one ``torch.tensor``: cheap)."""
    counts = [DENSE] * len(plan.buckets) if counts is None else counts
    if len(counts) != len(plan.buckets) or (base < 0) != all(c == DENSE for c in counts):
        raise ValueError(f"push header: {len(counts)} counts for {len(plan.buckets)} buckets, base {base}")
    return torch.tensor([MAGIC, version, base, *counts], dtype=torch.int64)


def decode_header(h: torch.Tensor) -> Header:
    vals = h.tolist()
    if vals[0] != MAGIC:
        raise RuntimeError(f"weight push header has bad magic {vals[0]:#x}; sender and receiver disagree on the plan "
                           "(trainer and engine must run the same torchtitan_flux version)")
    return Header(vals[1], vals[2], vals[3:])


def index_dtype(numel: int) -> torch.dtype:
    """The dtype of a patch's flat indices into a bucket of ``numel`` elements (int32 where it fits, as vLLM's)."""
    return torch.int32 if numel < 2**31 else torch.int64


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def changed(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Flat indices where the bit patterns of two flat tensors differ (so -0.0 vs 0.0 and NaNs count exactly).
    Host tensors go through numpy: its ``flatnonzero`` is ~2.5x faster than torch's ``nonzero`` on one core."""
    bits, dtype = _BITS[new.element_size()], index_dtype(new.numel())
    if new.device.type == "cpu":
        import numpy as np

        hits = np.flatnonzero(new.view(bits).numpy() != old.view(bits).numpy())
        return torch.from_numpy(hits.astype(np.int32 if dtype == torch.int32 else np.int64))
    return (new.view(bits) != old.view(bits)).nonzero().flatten().to(dtype)


def apply_patch(flat: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """``flat[indices] = values``, in place (bit-exact: a copy of the values' bit patterns)."""
    flat.index_copy_(0, indices.long() if indices.dtype != torch.int64 else indices, values)


def connect_store(host: str, port: int, timeout: float, is_master: bool) -> torch.distributed.TCPStore:
    """The weight-sync store: the trainer hosts it (``is_master``), listening on ``host`` only; engines connect."""
    kw = {}
    if is_master and compat.store_listens_on_given_socket():  # libuv server on a socket bound here; the store owns it
        family, *_, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.create_server(addr[:2], family=family)
        port, kw = sock.getsockname()[1], dict(master_listen_fd=sock.detach(), use_libuv=True)
    return torch.distributed.TCPStore(
        host, port, None, is_master=is_master, wait_for_workers=False, timeout=timedelta(seconds=timeout), **kw
    )


def listen_address(peer: str) -> str:
    """The local address this machine reaches ``peer`` from: where a weight-sync group listens. Sends nothing."""
    family, *_, addr = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


class Seqlock:
    """The guard of a colocated hand-over: ``[seq, version]`` in shared CPU memory, one writer (rank 0).

    The writer makes ``seq`` odd before it writes staging (``begin_write``: the snapshot, main thread) and even,
    with the staged ``version``, once the copies landed (``publish``: the push thread, holding the claim). A
    reader copies staging only at an even ``seq`` and keeps the copy only if ``seq`` is unchanged afterwards
    (``stable``), so a copy torn by a later snapshot is dropped, never published or acked. Ordering: plain
    stores and loads, version before seq on write, seq before version on read (x86-64 keeps both orders)."""

    def __init__(self, shared: torch.Tensor | None = None):
        # version -1 until the first publish: an engine that joins before the first snapshot must not take the
        # zero-filled staging for version 0 (it did, 1 run in 2 on 2026-11-26: a colocated run's first rollouts
        # came from all-zero weights and its acks let the first push "complete")
        self.t = shared if shared is not None else torch.tensor([0, -1], dtype=torch.int64).share_memory_()

    def begin_write(self) -> None:
        if int(self.t[0]) % 2 == 0:
            self.t[0] += 1

    def publish(self, version: int) -> None:
        self.t[1] = version
        if int(self.t[0]) % 2:
            self.t[0] += 1

    def read(self) -> tuple[int, int]:
        """(seq, version); an odd seq: staging is being written."""
        seq = int(self.t[0])
        return seq, int(self.t[1])

    def stable(self, seq: int) -> bool:
        return int(self.t[0]) == seq


TRAINER, ENGINE = "trainer", "engine"
_OK, _REFUSED = b"ok", b"refused"


class AuthError(RuntimeError):
    """The weight-sync handshake refused a peer: it holds another token than this side."""


def handshake(store, prefix: str, token: str | None, role: str, timeout_s: float) -> None:
    """Mutual proof of the shared token before a weight-sync group is built on ``prefix`` (both sides, ``role``
    TRAINER or ENGINE); a no-op without a token. Keys under ``{prefix}/auth/``. A proof is HMAC-SHA256(token,
    "role|prefix|trainer nonce|engine nonce"): bound to one side and one join, so it cannot be replayed or reflected:
      1. trainer: ``nonce`` = a fresh trainer nonce;
      2. engine: ``engine`` = a fresh engine nonce and its proof;
      3. trainer: checks that proof (constant time); ``trainer`` = its own proof, or ``refused``;
      4. engine: checks the trainer's proof; ``verdict`` = ``ok`` or ``refused``;
      5. trainer: reads the verdict.
    A side that refuses or is refused raises ``AuthError`` and builds no group; a silent peer, ``TimeoutError``.
    The store itself is unauthenticated (README, "Security")."""
    if not token:
        return
    s = torch.distributed.PrefixStore(f"{prefix}/auth", store)
    peer = ENGINE if role == TRAINER else TRAINER
    where = f"weight-sync handshake of {role} on {prefix}"

    def get(key: str) -> bytes:
        try:
            s.wait([key], timedelta(seconds=timeout_s))
        except RuntimeError as e:  # DistStoreError: no answer
            raise TimeoutError(f"{where}: no answer from the {peer} within {timeout_s:g} s (does it hold the "
                               "shared token?)") from e
        return s.get(key)

    def proof(who: str, nonce_t: bytes, nonce_e: bytes) -> bytes:
        msg = b"|".join([who.encode(), prefix.encode(), nonce_t, nonce_e])
        return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest().encode()

    def check(got: bytes, want: bytes, reply_key: str) -> None:
        if not hmac.compare_digest(got, want):
            s.set(reply_key, _REFUSED)
            raise AuthError(f"{where}: refused the {peer}: its proof does not match (it holds another token)")

    if role == TRAINER:
        nonce_t = secrets.token_hex(16).encode()
        s.set("nonce", nonce_t)
        nonce_e, _, got = get("engine").partition(b":")
        check(got, proof(ENGINE, nonce_t, nonce_e), "trainer")
        s.set("trainer", proof(TRAINER, nonce_t, nonce_e))
        if get("verdict") != _OK:
            raise AuthError(f"{where}: the engine refused the trainer's proof (it holds another token)")
    else:
        nonce_t, nonce_e = get("nonce"), secrets.token_hex(16).encode()
        s.set("engine", nonce_e + b":" + proof(ENGINE, nonce_t, nonce_e))
        got = get("trainer")
        if got == _REFUSED:
            raise AuthError(f"{where}: the trainer refused this engine's proof (it holds another token)")
        check(got, proof(TRAINER, nonce_t, nonce_e), "verdict")
        s.set("verdict", _OK)


class WeightReceiver:
    """Engine side: receives pushes on its own thread and publishes each complete version for an atomic swap.

    Concurrency invariants (``buffers`` >= 2 buffers, three owners):
      * ``live`` is read only by the generation thread; it is never written while live.
      * The receiver thread writes only into a buffer it took under ``_lock``: a free one, else the oldest
        ``pending`` one (engine-side coalescing). A superseded loop (``start`` again) takes no buffer any more.
      * ``swap()`` (generation thread, between requests) makes a pending version live under ``_lock`` and frees
        the old live buffer and older pending ones, so a request always runs on one complete version.
      * live + pending + free + the one being received are the allocated buffers (+ those abandoned loops hold).
      * ``newest()`` names a complete version whose buffer nobody writes: when the receiver takes the newest
        pending buffer to overwrite, the newest becomes the next pending one, else the live one. A reader of that
        buffer on another thread (a probe, a checksum) holds it pinned (``reading_newest``): the receiver takes no
        pinned buffer, and waits for one while every buffer it could take is pinned (fifth review, finding 25).
    ``max_version_gap + 1`` buffers keep every version a queued pinned request can ask for. Only the receiver
    thread issues collectives on the group, in push order; the wait for a header has no deadline.
    """

    def __init__(self, plan: BucketPlan, device: torch.device | str, on_received: Callable[[int], None],
                 on_error: Callable[[BaseException], None], buffers: int = 2):
        self.plan = plan
        self._on_received, self._on_error = on_received, on_error
        self._lock = threading.Lock()
        self._unpinned = threading.Condition(self._lock)  # notified when a reader's pin ends
        self._pins: list[FlatWeights] = []  # buffers read through ``reading_newest`` now
        self.live: FlatWeights | None = None
        self.live_version = -1
        self._pending: list[tuple[int, FlatWeights]] = []  # complete, not yet live; oldest first
        self._free: list[FlatWeights] = [plan.allocate(device) for _ in range(max(2, buffers))]
        self._newest: tuple[int, FlatWeights] | None = None  # newest complete version (``newest``)
        # what a sparse push may patch: the newest complete version while its buffer is untouched; None after a
        # restart (a new group starts dense) and once its buffer is taken to receive into (it may end up torn)
        self._base: tuple[int, FlatWeights] | None = None
        self.device = device
        self._stop = threading.Event()
        self.fault_stall_s = 0.0  # fault injection: sleep before each receive (tests only)

    def start(self, make_group: Callable[[], object], patches: bool = False) -> None:
        """Start the receive loop on a new group from ``make_group``; a previous loop is stopped and abandoned (it
        may be blocked in a dead collective) and the live version serves until the new group delivers.
        ``patches``: the trainer may send sparse pushes on it (``weight_sync.method = "sparse"``), so bucket 0's
        size is known only from the header and is not pre-posted."""
        self._restart(self._run, make_group, patches)

    def start_shared(self, staging: list[torch.Tensor], seqlock: Seqlock) -> None:
        """Colocated: receive by copying the trainer's ``staging`` flats (shared memory on CPU, CUDA IPC on GPU)
        whenever ``seqlock`` shows a new stable version; replaces any previous loop like ``start``."""
        self._restart(self._run_shared, staging, seqlock)

    def _restart(self, target, *args) -> None:
        with self._lock:
            self._base = None
        self._stop.set()
        self._stop = threading.Event()
        threading.Thread(target=target, args=(*args, self._stop), name="flux-weight-receiver", daemon=True).start()

    def _take_buffer(self, stop: threading.Event) -> FlatWeights | None:
        """A buffer to receive into, or None if this loop was superseded (it must not touch any buffer then)."""
        with self._lock:
            while True:
                if stop.is_set():
                    return None
                free = [i for i, b in enumerate(self._free) if not self._pinned(b)]
                if free:
                    return self._free.pop(free[-1])
                pending = [i for i, (_, b) in enumerate(self._pending) if not self._pinned(b)]
                if pending:
                    buf = self._pending.pop(pending[0])[1]
                    if self._base is not None and self._base[1] is buf:
                        self._base = None
                    if self._newest is not None and self._newest[1] is buf:  # about to be overwritten: the newest
                        # complete version is now the newest pending one, else the live one
                        live = (self.live_version, self.live) if self.live is not None else None
                        self._newest = self._pending[-1] if self._pending else live
                    return buf
                if not self._pins:
                    break
                self._unpinned.wait(0.1)  # a probe or checksum reads the one buffer to take: it ends soon
        # only after a restart whose predecessor still holds a buffer in a dead collective
        logger.warning("weight receiver: allocating a replacement buffer (previous receive was abandoned)")
        return self.plan.allocate(self.device)

    def _run(self, make_group: Callable[[], object], patches: bool, stop: threading.Event) -> None:
        """The receive loop, following ``cuda_rules`` rules 6, 1, 2 and 5 (ack only after the bytes landed)."""
        try:
            cuda_rules.bind_thread(self.device)
            stream = cuda_rules.group_stream(self.device)
            pg = make_group()
            b0 = self.plan.buckets[0]
            on_gpu = torch.device(self.device).type == "cuda"
            hdev = cuda_rules.header_device("nccl" if on_gpu else "gloo", self.device)
            with cuda_rules.on_stream(stream):
                # dense-only groups: bucket 0 lands here, posted with the header
                landing = None if patches else torch.empty(b0.numel, dtype=_DTYPES[b0.dtype], device=self.device)
                while not stop.is_set():
                    header = torch.empty(self.plan.header_len, dtype=torch.int64, device=hdev)
                    header_work = compat.broadcast(pg, header, timeout=IDLE_TIMEOUT)
                    landing_work = None if landing is None else compat.broadcast(pg, landing, timeout=IDLE_TIMEOUT)
                    cuda_rules.landed([header_work], stream)
                    h = decode_header(header)
                    if landing is not None and h.base >= 0:
                        raise RuntimeError(f"push {h.version} is sparse, but this group was joined for dense pushes")
                    if self.fault_stall_s:
                        stop.wait(self.fault_stall_s)
                    base = self._patch_base(h) if h.base >= 0 else None  # checked before any buffer is taken
                    buf = self._take_buffer(stop)
                    if buf is None:  # superseded (e.g. during a stall): the new loop owns pending and free
                        return
                    if base is not None and base is not buf:  # else the patch lands in the base itself
                        torch._foreach_copy_(buf.flats, base.flats, non_blocking=True)
                    works, patched = [], []
                    for i, (flat, count) in enumerate(zip(buf.flats, h.counts)):
                        if count == DENSE and not (i == 0 and landing is not None):
                            works.append(compat.broadcast(pg, flat))  # posted before bucket 0 is copied
                        elif count > 0:
                            idx = torch.empty(count, dtype=index_dtype(flat.numel()), device=self.device)
                            vals = torch.empty(count, dtype=flat.dtype, device=self.device)
                            works += [compat.broadcast(pg, idx), compat.broadcast(pg, vals)]
                            patched.append((flat, idx, vals))
                    if landing_work is not None:
                        landing_work.wait()
                        buf.flats[0].copy_(landing)
                    cuda_rules.landed(works, stream)
                    if patched:
                        for flat, idx, vals in patched:
                            apply_patch(flat, idx, vals)
                        cuda_rules.landed([], stream)  # rule 5: the scatters too, before anyone reads ``buf``
                    if not self._publish(h.version, buf, stop):  # superseded while receiving: never published
                        return
                    self._on_received(h.version)
        except BaseException as e:  # reported to the trainer through on_error; the trainer decides on resync
            if not stop.is_set():
                self._on_error(e)

    def _patch_base(self, h: Header) -> FlatWeights:
        """Receiver thread, before a sparse push takes a buffer: the buffer holding version ``h.base`` whole (only
        this thread writes buffers, so it stays so while copied); raise if this engine does not hold it (the
        trainer then resyncs it dense)."""
        with self._lock:
            version, buf = self._base if self._base is not None else (-1, None)
        if version != h.base:
            raise RuntimeError(f"push {h.version} patches version {h.base}, but this engine holds "
                               f"{'version ' + str(version) if version >= 0 else 'no version it may patch'}; "
                               "it needs a dense push (resync)")
        return buf

    def _run_shared(self, staging: list[torch.Tensor], seqlock: Seqlock, stop: threading.Event) -> None:
        """The colocated loop: poll ``seqlock``; copy a new stable version on this thread's stream (rules 6, 1),
        wait for the copy (rule 5), keep it only if ``seqlock`` did not move meanwhile (``Seqlock``)."""
        try:
            cuda_rules.bind_thread(self.device)
            stream = cuda_rules.group_stream(self.device)
            copied, period = -1, SHARED_POLL_S[0]
            while not stop.is_set():
                seq, version = seqlock.read()
                if seq % 2 or seq == copied or version < 0:
                    stop.wait(period)
                    period = min(2 * period, SHARED_POLL_S[1])
                    continue
                period = SHARED_POLL_S[0]
                if self.fault_stall_s:
                    stop.wait(self.fault_stall_s)
                buf = self._take_buffer(stop)
                if buf is None:
                    return
                with cuda_rules.on_stream(stream):
                    torch._foreach_copy_(buf.flats, staging, non_blocking=True)
                cuda_rules.landed([], stream)
                if not seqlock.stable(seq):  # torn by a newer snapshot: drop it and copy that one
                    with self._lock:
                        self._free.append(buf)
                    continue
                copied = seq
                if not self._publish(version, buf, stop):
                    return
                self._on_received(version)
        except BaseException as e:  # noqa: BLE001 - reported like the group loop's errors
            if not stop.is_set():
                self._on_error(e)

    def _publish(self, version: int, buf: FlatWeights, stop: threading.Event) -> bool:
        """Receiver thread: ``buf`` now holds ``version`` completely; pending until a ``swap``."""
        with self._lock:
            if stop.is_set():
                return False
            self._pending.append((version, buf))
            self._newest = self._base = (version, buf)
            return True

    def swap(self, upto: int = -1) -> int:
        """Make the newest complete version live (generation thread, between requests); returns the live version.
        ``upto >= 0`` (a pinned request): the newest pending version <= ``upto``, else, if the live one is older
        than ``upto``, the oldest pending one (the pin was superseded before it went live)."""
        with self._lock:
            fits = [i for i, (v, _) in enumerate(self._pending) if upto < 0 or v <= upto]
            if fits:
                i = fits[-1]
            elif self._pending and self.live_version < upto:
                i = 0
            else:
                return self.live_version
            if self.live is not None:
                self._free.append(self.live)
            self._free.extend(buf for _, buf in self._pending[:i])
            self.live_version, self.live = self._pending[i]
            del self._pending[: i + 1]
        return self.live_version

    def newest(self) -> tuple[int, FlatWeights | None]:
        """(version, buffer) of the newest complete push, live or pending; (-1, None) before the first. The buffer
        may be taken to receive into at any time: read it through ``reading_newest``."""
        with self._lock:
            return self._newest if self._newest is not None else (-1, None)

    @contextlib.contextmanager
    def reading_newest(self):
        """``newest()``, its buffer pinned until the block ends: the receiver never takes it to write into
        meanwhile. The block must end with its reads complete (a probe and a checksum end in a copy to the host)."""
        with self._lock:
            version, buf = self._newest if self._newest is not None else (-1, None)
            if buf is not None:
                self._pins.append(buf)
        try:
            yield version, buf
        finally:
            if buf is not None:
                with self._lock:
                    del self._pins[next(i for i, b in enumerate(self._pins) if b is buf)]
                    self._unpinned.notify_all()

    def _pinned(self, buf: FlatWeights) -> bool:
        return any(b is buf for b in self._pins)

    def stop(self) -> None:
        self._stop.set()
