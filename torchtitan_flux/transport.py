"""Wire format of a weight push, and the engine-side receiver. Torch-only (no torchtitan): runs in engines.

A push of policy version ``v`` on a weight-sync process group (rank 0 = the trainer's sending rank, ranks 1.. =
engine workers) is:

    header  int64[HEADER_LEN] = [MAGIC, v, n_sent, method, idx_0, ..., idx_{n_sent-1}, -1 ...]
    bucket  one flat tensor per listed bucket index, in that order

Both sides derive the same ``BucketPlan`` from the same ordered ``TensorSpec`` list (sent once at connect), so
no per-tensor metadata travels per push. Bucket 0 is always sent, first (a delta push includes it even when it
did not change): the receiver pre-posts its receive next to the header's into a one-bucket landing buffer, so
a small model's push costs one round trip, like a raw broadcast, instead of two (header, then the wake-up of
the receiving thread before its bucket receives are posted). ``method`` is 0 for a full push (every bucket) and 1 for a delta push
(only the listed buckets changed; the others keep their last values).

Simplification: a tensor is never split across buckets; one larger than ``bucket_bytes`` gets a bucket of its own.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch

from torchtitan_flux import compat

logger = logging.getLogger("torchtitan_flux")

MAGIC = 0x46_4C_55_58  # "FLUX"
# Waiting for the next push's header is idle time, not a failure: it gets this timeout instead of the group's
# ``timeout_s`` (which still bounds every bucket of a push once its header arrived, where the backend honours
# per-collective timeouts: see ``compat.op_timeout_honoured``; the receiver's group is built with
# ``new_weight_sync_group(idle_timeout=IDLE_TIMEOUT)``).
IDLE_TIMEOUT = timedelta(days=7)
METHOD_FULL, METHOD_DELTA = 0, 1
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # a key of _DTYPES

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


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
        return 4 + len(self.buckets)

    @property
    def nbytes(self) -> int:
        return sum(b.numel * _DTYPES[b.dtype].itemsize for b in self.buckets)

    def allocate(self, device: torch.device | str = "cpu") -> "FlatWeights":
        # written once, so the pages are resident from the start and memory accounting is honest
        flats = [torch.empty(b.numel, dtype=_DTYPES[b.dtype], device=device).zero_() for b in self.buckets]
        return FlatWeights(self, flats)


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

    def copy_from(self, other: "FlatWeights") -> None:
        for dst, src in zip(self.flats, other.flats):
            dst.copy_(src)

    def checksum(self) -> str:
        """sha256 over the raw bytes of every bucket in order: equal iff bitwise-equal weights."""
        h = hashlib.sha256()
        for flat in self.flats:
            h.update(flat.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


def encode_header(plan: BucketPlan, version: int, bucket_ids: list[int], method: int) -> torch.Tensor:
    """The header of a push sending ``bucket_ids`` in that order; bucket 0 must come first (see the module
    docstring). Built from one Python list: a handful of small torch ops here cost 0.3 ms, a third of a push of
    the tiny model."""
    pad = plan.header_len - 4 - len(bucket_ids)
    return torch.tensor([MAGIC, version, len(bucket_ids), method, *bucket_ids, *([-1] * pad)], dtype=torch.int64)


def decode_header(h: torch.Tensor) -> tuple[int, list[int], int]:
    vals = h.tolist()
    if vals[0] != MAGIC:
        raise RuntimeError(f"weight push header has bad magic {vals[0]:#x}; sender and receiver disagree on the plan")
    version, n, method = vals[1], vals[2], vals[3]
    return version, vals[4 : 4 + n], method


def connect_store(host: str, port: int, timeout: float, is_master: bool) -> torch.distributed.TCPStore:
    """The weight-sync rendezvous store: the trainer hosts it (``is_master``); engines connect to it."""
    return torch.distributed.TCPStore(
        host, port, None, is_master=is_master, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )


def _broadcast_idle(pg, tensor: torch.Tensor):
    """``compat.broadcast`` from rank 0 with ``IDLE_TIMEOUT`` instead of the group's timeout."""
    return compat.broadcast(pg, tensor, timeout=IDLE_TIMEOUT)


class WeightReceiver:
    """Engine side: receives pushes on its own thread and publishes each complete version for an atomic swap.

    Concurrency invariants (two buffers, three owners):
      * ``live`` is read only by the generation thread; it is never written while referenced as live.
      * The receiver thread writes only into a buffer it took under ``_lock``: the unpublished ``pending``
        one (a newer push supersedes it: engine-side coalescing) or a free one. A superseded loop (``start``
        again) takes no buffer any more, so it never steals a version the new loop published.
      * ``swap()`` is called by the generation thread between requests; under ``_lock`` it makes ``pending``
        live and frees the old live buffer. So a request always runs on one complete version.
      * live + pending + free + the one being received are always exactly the two allocated buffers (plus one
        replacement per buffer an abandoned loop still holds, see ``_take_buffer``).
    All collectives on the group are issued by the receiver thread alone, in push order. The wait for the next
    header has no deadline (``IDLE_TIMEOUT``): the time between pushes is the trainer's business, and a receiver
    whose trainer gave up on it is abandoned by the next ``start``.
    """

    def __init__(
        self,
        plan: BucketPlan,
        device: torch.device | str,
        on_received: Callable[[int], None],
        on_error: Callable[[BaseException], None],
    ):
        self.plan = plan
        self._on_received, self._on_error = on_received, on_error
        self._lock = threading.Lock()
        self.live: FlatWeights | None = None
        self.live_version = -1
        self._pending: tuple[int, FlatWeights] | None = None
        self._free: list[FlatWeights] = [plan.allocate(device), plan.allocate(device)]
        self._newest: tuple[int, FlatWeights] | None = None  # newest complete version, for delta pushes
        self.device = device
        self._stop = threading.Event()
        self.fault_stall_s = 0.0  # fault injection: sleep before each receive (tests only)

    def start(self, make_group: Callable[[], object]) -> None:
        """Start the receive loop on a new group from ``make_group``; on a restart (resync after a failure) the
        previous loop is told to stop and abandoned (it may be blocked in a dead collective), and the live
        version keeps serving until the new group delivers."""
        self._stop.set()
        self._stop = threading.Event()
        threading.Thread(
            target=self._run, args=(make_group, self._stop), name="flux-weight-receiver", daemon=True
        ).start()

    def _take_buffer(self, stop: threading.Event) -> FlatWeights | None:
        """A buffer to receive into, or None if this loop was superseded (it must not touch any buffer then)."""
        with self._lock:
            if stop.is_set():
                return None
            if self._pending is not None:
                buf, self._pending = self._pending[1], None
                return buf
            if self._free:
                return self._free.pop()
        # only after a restart whose predecessor still holds a buffer in a dead collective
        logger.warning("weight receiver: allocating a replacement buffer (previous receive was abandoned)")
        return self.plan.allocate(self.device)

    def _run(self, make_group: Callable[[], object], stop: threading.Event) -> None:
        try:
            pg = make_group()
            b0 = self.plan.buckets[0]
            landing = torch.empty(b0.numel, dtype=_DTYPES[b0.dtype], device=self.device)  # one bucket
            while not stop.is_set():
                header = torch.empty(self.plan.header_len, dtype=torch.int64)
                header_work = _broadcast_idle(pg, header)
                landing_work = _broadcast_idle(pg, landing)  # pre-posted: bucket 0 needs no wake-up round trip
                header_work.wait()
                version, ids, method = decode_header(header)
                if not ids or ids[0] != 0:
                    raise RuntimeError(f"push {version}: bucket 0 must travel first, got buckets {ids}")
                if self.fault_stall_s:
                    stop.wait(self.fault_stall_s)
                buf = self._take_buffer(stop)
                if buf is None:  # superseded (e.g. during a stall): the new loop owns pending and free
                    return
                if method == METHOD_DELTA:
                    if self._newest is None:
                        raise RuntimeError("delta push received before any full push")
                    if self._newest[1] is not buf:
                        buf.copy_from(self._newest[1])
                works = [compat.broadcast(pg, buf.flats[i]) for i in ids[1:]]  # posted before bucket 0 is copied
                landing_work.wait()
                buf.flats[0].copy_(landing)
                for w in works:
                    w.wait()
                with self._lock:
                    if stop.is_set():  # superseded while receiving: drop this buffer, never publish it
                        return
                    self._pending = (version, buf)
                    self._newest = (version, buf)
                self._on_received(version)
        except BaseException as e:  # reported to the trainer through on_error; the trainer decides on resync
            if not stop.is_set():
                self._on_error(e)

    def swap(self) -> int:
        """Make the newest complete version live (generation thread, between requests). Returns the live version."""
        with self._lock:
            if self._pending is not None:
                old = self.live
                self.live_version, self.live = self._pending
                self._pending = None
                if old is not None:
                    self._free.append(old)
        return self.live_version

    def newest(self) -> tuple[int, FlatWeights | None]:
        """(version, buffer) of the newest complete push, live or pending; (-1, None) before the first."""
        with self._lock:
            return self._newest if self._newest is not None else (-1, None)

    def stop(self) -> None:
        self._stop.set()
