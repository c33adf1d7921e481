"""``Pusher``: rank 0's join threads and push thread, and the claim that serializes them with snapshots.

Concurrency invariants:
  * ``busy`` is the claim on staging and on the weight-sync groups: set under the link table's lock by its
    taker (main thread: ``claim``; push thread: ``kick``), cleared only by its holder (``release``). So staging is
    never written while sent, and one thread at a time issues collectives on the groups, in push order.
  * Push thread: sends each push it is handed (``hand_over``; blocking mode: the main thread pushes itself):
    header + buckets on every usable engine's group under the push stream (``cuda_rules`` rule 1), all Works
    polled against ONE deadline (rule 3). An engine that misses it is lagging and broken (NCCL: group aborted) and
    rejoins at the next push or ``deliver_staged``. ``release`` serves engines that became usable meanwhile.
  * Joiner threads: one per (re)joining engine; each builds that engine's group eagerly (handshake, NCCL version
    check, group: rule 8), then ``kick``s the push thread; it never touches ``busy``. A refused engine is retried
    at the next push or ``deliver_staged``, not at once.
On a GPU trainer staging is pinned host memory; ``DeviceRing`` moves it to the GPU two buckets at a time.
With ``weight_sync.method = "sparse"`` the push thread also owns ``base`` (``sparse.SparseBase``): an engine whose
``EngineLink.holds`` is the base version gets patches, every other one whole buckets, in the same push.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import torch

from torchtitan_flux import compat
from torchtitan_flux.wire import cuda_rules, transport
from torchtitan_flux.sync import sparse
from torchtitan_flux.engine.base import WeightGroupInfo
from torchtitan_flux.sync.links import EngineLink, LinkTable
from torchtitan_flux.sync.snapshot import Snapshot

logger = logging.getLogger("torchtitan_flux")


def trainer_group(handler, store, info: WeightGroupInfo, device: torch.device | None = None):
    """Rank 0's side of ``handler``'s weight-sync group, connected: the engine's own (``own_group``), else a
    2-rank group on ``handler.group_store`` (NCCL: ``cuda_rules.GROUP_TIMEOUT``, connected at once)."""
    own = handler.own_group(store, info, device)
    if own is not None:
        return own
    timeout = cuda_rules.GROUP_TIMEOUT if info.backend == "nccl" else timedelta(seconds=info.timeout_s)
    return compat.new_weight_sync_group(
        info.backend, handler.group_store(store, info), 0, 2, timeout,
        device=device if info.backend == "nccl" and handler.eager_connect else None,
        listen_host=transport.listen_address(info.host),
    )


class DeviceRing:
    """Two device buffers host tensors pass through on ``stream`` to be broadcast on NCCL (push thread only). A
    slot is rewritten only after its previous reader was ordered before the copy on the stream, unless that
    reader's group was aborted (``forget``: its kernels are gone and its Work would only raise)."""

    def __init__(self, device: torch.device, max_bytes: int, stream):
        self.stream = stream
        self.slots = [torch.empty(max_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.readers: list[list] = [[], []]  # per slot: (group, Work) of its last broadcast
        self.i = 0

    def broadcast(self, pg, t: torch.Tensor):
        if t.device.type != "cpu":
            return compat.broadcast(pg, t)
        self.i = (self.i + 1) % 2
        for _, w in self.readers[self.i]:
            try:
                w.wait()  # rule 1: the stream (not the host) waits for the previous readers of this slot
            except Exception:  # noqa: BLE001 - a failed Work's kernel no longer reads the slot; its link is failed
                pass
        dev = self.slots[self.i][: t.numel() * t.element_size()].view(t.dtype)
        dev.copy_(t.reshape(-1), non_blocking=True)
        work = compat.broadcast(pg, dev)
        self.readers[self.i] = [(pg, work)]
        return work

    def forget(self, pg) -> None:
        """``pg`` was aborted after a missed deadline: no later push waits on its Works."""
        self.readers = [[(g, w) for g, w in slot if g is not pg] for slot in self.readers]


class Pusher:
    """See the module docstring for the ordering invariants."""

    def __init__(self, table: LinkTable, snap: Snapshot, cfg, *, backend: str, device: torch.device,
                 store, token: str | None):
        self.table, self.snap, self.cfg, self.backend = table, snap, cfg, backend
        self.device, self.store, self.token = torch.device(device), store, token
        self.busy = threading.Event()
        self.closed = False
        self._job: int | None = None
        self._job_links: list[EngineLink] | None = None  # None: every usable engine
        self.stream = cuda_rules.group_stream(device) if backend == "nccl" else None
        self.ring: DeviceRing | None = None  # allocated by the first push to an NCCL group (``_nccl_send``)
        self.base = sparse.SparseBase(snap.plan, cfg.sparse_max_bytes_ratio) if cfg.method == "sparse" else None
        self._told_dense = False  # the first all-dense sparse push is logged, once
        threading.Thread(target=self._loop, name="flux-weight-push", daemon=True).start()

    def claim(self) -> bool:
        """Main thread: take ``busy`` if nobody holds it."""
        with self.table.lock:
            if self.busy.is_set():
                return False
            self.busy.set()
            return True

    def hand_over(self, version: int) -> None:
        """Main thread, holding the claim: the push thread sends ``version`` and releases the claim."""
        with self.table.lock:
            self._job, self._job_links = version, None
            self.table.work.notify()

    def release(self) -> None:
        """The holder of ``busy`` lets it go, first serving engines that became usable meanwhile."""
        with self.table.lock:
            self._job = self._job_links = None
            self.busy.clear()
            self.kick()

    def on_event(self, ev) -> None:
        """Main thread: an ack or engine error; a lagging engine that answered again gets the staged version."""
        with self.table.lock:
            if self.table.record(ev):
                self.kick()

    def kick(self) -> None:
        """Caller holds the lock: if ``busy`` is free, the push thread sends the staged version to ``late`` links."""
        if self.busy.is_set() or self.closed:
            return
        late = self.table.late(self.snap.version)
        if late:
            self.busy.set()
            self._job, self._job_links = self.snap.version, late
            self.table.work.notify()

    def deliver_staged(self) -> None:
        """Main thread: rebuild broken groups; the push thread sends the staged version to engines lacking it."""
        with self.table.lock:
            self._rejoin_broken()
            self.kick()

    def _rejoin_broken(self) -> None:
        """Start a fresh group for every broken engine still alive (caller holds the table's lock)."""
        for link in self.table.links:
            if link.broken and not link.joining and not link.dead and link.handler.alive():
                self.table.stats.resyncs += 1
                self.start_join(link)

    def close(self) -> None:
        with self.table.lock:
            self.closed = True
            self.table.work.notify()

    def start_join(self, link: EngineLink) -> threading.Thread:
        """Start ``link``'s rendezvous on a fresh group (caller holds the table's lock)."""
        link.epoch += 1
        epoch = link.epoch
        link.joining, link.pg = True, None
        link.backend = link.handler.weight_backend(self.backend)
        colocated = link.backend == transport.COLOCATED
        info = WeightGroupInfo(
            self.cfg.master_addr, self.store.port, f"flux_ws/{link.handler.name}/{link.epoch}", link.backend,
            self.cfg.timeout_seconds, list(self.snap.specs), self.snap.bucket_bytes,
            shared=(self.snap.staging.flats, self.snap.seqlock.t) if colocated else None,
            patches=self.base is not None and link.handler.accepts_patches and not colocated,
        )
        link.handler.join_weight_group(info)
        t = threading.Thread(target=self._join, args=(link, epoch, info), name=f"flux-join-{link.handler.name}",
                             daemon=True)
        t.start()
        return t

    def _join(self, link: EngineLink, epoch: int, info: WeightGroupInfo) -> None:
        table = self.table
        try:
            if info.backend == transport.COLOCATED:  # no group: the join message carried staging itself
                pg = transport.COLOCATED
            else:
                # a store client of its own: a wait on a shared one would stall every other engine's join
                store = transport.connect_store(info.host, info.port, info.timeout_s, is_master=False)
                if link.handler.rendezvous_handshake:
                    transport.handshake(store, info.prefix, self.token, transport.TRAINER, info.timeout_s)
                    if info.backend == "nccl":
                        cuda_rules.check_nccl_version(store, info.prefix, "trainer", info.timeout_s)
                cuda_rules.bind_thread(self.device)
                pg = trainer_group(link.handler, store, info, self.device)
            with table.lock:
                if link.epoch != epoch:  # superseded by a newer join (engine replaced): drop this group
                    return
                link.pg, link.broken, link.lagging, link.joining = pg, False, False, False
                link.sent = link.acked = link.holds = -1  # a new group starts with a full push
                self.kick()
        except Exception as e:  # noqa: BLE001 - counted, logged, retried
            with table.lock:
                table.fail(link, f"join failed: {e}")
                if link.epoch == epoch:
                    link.joining, link.broken = False, True
                    # a refusal would fail again at once; anything else retries now (a restarted engine may
                    # still be starting, and the trainer may be waiting on its rollouts)
                    refused = isinstance(e, (transport.AuthError, cuda_rules.NcclVersionMismatch))
                    if not (refused or self.closed or link.dead) and link.handler.alive():
                        table.stats.resyncs += 1
                        self.start_join(link)

    def _loop(self) -> None:
        cuda_rules.bind_thread(self.device)
        table = self.table
        while True:
            with table.lock:
                while self._job is None and not self.closed:
                    table.work.wait()
                if self.closed:
                    return
                version, only = self._job, self._job_links
            try:
                self.push(version, only)
            except Exception as e:  # noqa: BLE001 - never lose the thread; counted and logged
                with table.lock:
                    table.stats.errors += 1
                    table.stats.failures.append(f"push {version}: {e}")
                logger.exception("weight push failed")
            finally:
                self.release()

    def _nccl_send(self, pg, t: torch.Tensor):
        """Broadcast ``t`` on an NCCL group, through the ``DeviceRing`` for host tensors (allocated on first use:
        engines that never take an NCCL broadcast from us, e.g. vLLM's own engine, cost no ring)."""
        if self.ring is None:
            top = max((b.numel * transport._DTYPES[b.dtype].itemsize for b in self.snap.plan.buckets), default=1)
            self.ring = DeviceRing(self.device, top, self.stream)
            self.snap.memory.hold(2 * top)  # held for the run
        return self.ring.broadcast(pg, t)

    def push(self, version: int, only: list[EngineLink] | None = None) -> None:
        """Send staging (``version``) to every usable engine (or ``only``), poll the Works; caller holds ``busy``.
        With a ``base`` (sparse), an engine known to hold the base version gets patches, every other one dense."""
        t0 = time.perf_counter()
        table, stats = self.table, self.table.stats
        self.snap.side.synchronize_copy()
        self.snap.publish(version)  # colocated engines copy from here on
        deadline = time.monotonic() + self.cfg.timeout_seconds  # one deadline for the whole push (rule 3)
        with table.lock:
            if only is None:
                self._rejoin_broken()
            targets = [(lk, lk.epoch, lk.pg, lk.handler, lk.backend, lk.holds)
                       for lk in (table.links if only is None else only) if lk.usable]
        plan, staging = self.snap.plan, self.snap.staging
        dense = transport.encode_header(plan, version)
        if only is None:
            stats.last_changed = stats.last_diff_s = 0.0  # until this push's diff, if it makes one
        patches = self._patches(version, targets)
        if patches is not None:
            counts, payload = sparse.payload(staging.flats, patches)
            patch_header = transport.encode_header(plan, version, counts, self.base.version)
        pending, sent_bytes, patched_buckets = [], 0, 0
        with cuda_rules.on_stream(self.stream):
            on_device = {}  # host header -> its device copy, for NCCL groups (rule 2); pinned: no copy that syncs
            for link, epoch, pg, handler, backend, holds in targets:  # the host (N1), on the push stream (rule 1)
                try:
                    handler.begin_update(version)
                    flats = staging.flats
                    own = handler.self_push(version, flats)  # vLLM on GPU, colocated: the engine fetches
                    patched = own is None and patches is not None and holds == self.base.version and \
                        handler.accepts_patches
                    header = patch_header if patched else dense
                    nccl = backend == "nccl"
                    if nccl and id(header) not in on_device:
                        on_device[id(header)] = header.pin_memory().to(self.device, non_blocking=True)
                    wire_header = on_device[id(header)] if nccl else header
                    tensors = ([header, *flats] if own is not None else [wire_header, *payload] if patched
                               else handler.wire_tensors(wire_header, flats))
                    send = self._nccl_send if nccl else compat.broadcast
                    works = [own] if own is not None else [send(pg, t) for t in tensors]
                    with table.lock:
                        if link.epoch == epoch:
                            link.sent, link.sent_at = version, time.time()
                    pending.append((link, epoch, pg, handler, works, tensors, patched))
                except Exception as e:  # noqa: BLE001
                    with table.lock:
                        if link.epoch == epoch:
                            link.broken = True
                        table.fail(link, f"push {version} failed to start: {e}")
            for link, epoch, pg, handler, works, tensors, patched in pending:
                try:
                    if not cuda_rules.wait_works(works, deadline):
                        if link.backend == "nccl":
                            cuda_rules.abort_group(pg)
                            if self.ring is not None:
                                self.ring.forget(pg)
                        raise TimeoutError(f"not complete within weight_sync.timeout_seconds = "
                                           f"{self.cfg.timeout_seconds}")
                    cuda_rules.raise_failed(works)
                    handler.finish_update(version)
                    sent_bytes += sum(t.numel() * t.element_size() for t in tensors[1:])
                    if patched:
                        patched_buckets = max(patched_buckets, sum(c != transport.DENSE for c in counts))
                    with table.lock:
                        if link.epoch == epoch:
                            link.holds = version
                except Exception as e:  # noqa: BLE001 - a slow or dead engine: mark and go on
                    with table.lock:
                        if link.epoch == epoch:  # else it was replaced/rejoined meanwhile: its new group is fine
                            link.broken = link.lagging = True
                            link.holds = -1
                        stats.timeouts += 1
                        table.fail(link, f"push {version} did not complete: {e}")
        if self.base is not None:
            self.base.advance(staging, version)
        stats.pushes += 1
        stats.bytes_sent += sent_bytes
        if only is None:  # a step's push; not a resync of late engines (``kick``), which would mask it
            stats.last_push_bytes, stats.last_patched_buckets = sent_bytes, patched_buckets
        stats.last_push_s = time.perf_counter() - t0
        stats.push_s_total += stats.last_push_s

    def _patches(self, version: int, targets: list) -> list | None:
        """The base's patches to ``version`` if some target holds the base version and takes patches, else None."""
        base = self.base
        if base is None or base.version < 0 or base.version == version or not any(
                holds == base.version and handler.accepts_patches for _, _, _, handler, _, holds in targets):
            return None
        patches = base.patches(self.snap.staging, version)
        stats = self.table.stats
        stats.last_changed, stats.last_diff_s = base.last_changed, base.last_diff_s
        if all(p is None for p in patches):
            if not self._told_dense:
                self._told_dense = True
                logger.info(f"weight sync: push {version} travels dense although weight_sync.method = 'sparse': "
                            f"{base.last_changed:.1%} of the elements changed, more than a patch within "
                            f"sparse_max_bytes_ratio = {base.max_bytes_ratio} can carry (with wire_dtype float32 "
                            "nearly every element changes at every step; bfloat16 is where sparse pays)")
            return None
        return patches


class Bystander:
    """The pusher of ranks > 0: they take part in every snapshot but send nothing and hold no engines, so the
    claim is always free and there is nothing to push, join or wait for."""

    def __init__(self):
        self.busy = threading.Event()  # never set

    def claim(self) -> bool:
        return True

    def hand_over(self, version: int) -> None:
        pass

    def push(self, version: int) -> None:
        pass

    def release(self) -> None:
        pass

    def deliver_staged(self) -> None:
        pass

    def close(self) -> None:
        pass
