"""``Pusher``: rank 0's join threads and push thread, and the claim that serializes them with snapshots.

Concurrency invariants:
  * No pipe send, HTTP call or collective while ``LinkTable.lock`` is held (``sync/links.py``): decisions and state
    transitions are made under the lock, the sends after it; a stale send is recognised by its epoch.
  * ``busy`` is the claim on staging and on the weight-sync groups: set under the link table's lock by its
    taker (main thread: ``claim``; whoever finds it free with a late engine: ``kick``), cleared only by its holder
    (``release``). So staging is never written while sent, and one thread at a time issues collectives on the
    groups, in push order.
  * Push thread: sends each push it is handed (``hand_over``; blocking mode: the main thread pushes itself):
    header + buckets on every usable engine's group under the push stream (``cuda_rules`` rule 1), all Works
    polled against ONE deadline (rule 3). An engine that misses it is BROKEN (NCCL: group aborted) and rejoins at
    the next push or ``deliver_staged``. ``release`` serves engines that became usable meanwhile.
  * Joiner threads: one per join the table decided; each sends its engine the join message (it alone may block on
    a stopped engine's full pipe), builds that engine's group eagerly (handshake, NCCL version check, group: rule
    8), then ``kick``s the push thread; it never touches ``busy``. A refused engine is retried at the next push or
    ``deliver_staged``, not at once; any other failure is retried after a backoff, and ``links.JOIN_ATTEMPTS``
    failures in a row kill the engine (its replacement joins); the main thread starts joiners but never sends a
    join itself.
  * A gloo send that misses its push's deadline cannot be cancelled (gloo's ``abort`` leaves it running: torch 2.13
    on CPU) and may read staging until its group's own timeout (``timeout_seconds`` too, counted from the start of
    each broadcast: for an engine stalled at the first one, moments after the deadline; for one that stalls later,
    or crawls, up to ``timeout_seconds`` after it) fails it. It is kept in ``abandoned`` (owned by the holder of
    ``busy``), and the next snapshot does not rewrite staging before it ended (``free_staging``: it waits up to
    ``FREE_STAGING_S`` past the deadline, then kills the engine). An embedded engine's death fails the send at once,
    so it never receives a torn copy; an HTTP server keeps its socket when its handler is killed, so a send to one
    that still runs ``FREE_STAGING_S`` after the kill is logged and staging rewritten anyway (docs/gpu.md, Open).
On a GPU trainer staging is pinned host memory; each NCCL engine's ``DeviceRing`` moves it to the GPU two buckets at a
time, on that engine's own stream.
With ``weight_sync.method = "sparse"`` the push thread also owns ``base`` (``sparse.SparseBase``): an engine whose
``EngineLink.holds`` is the base version gets patches, every other one whole buckets, in the same push.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from torchtitan_flux import compat
from torchtitan_flux.wire import cuda_rules, transport
from torchtitan_flux.sync import sparse
from torchtitan_flux.engine.base import EngineHandler, WeightGroupInfo
from torchtitan_flux.sync.links import EngineLink, Join, LinkTable
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
    """ONE NCCL engine's path from host staging to its group (push thread only): its own stream and two device
    buffers that host tensors pass through to be broadcast. A slot is rewritten only after its previous reader was
    ordered before the copy on the stream, unless that reader's group was aborted (``forget``: its kernels are gone
    and its Work would only raise).

    Rule (``cuda_rules`` rule 1, review 4 finding 1): a ring serves one engine, so no copy, broadcast or wait for
    one engine is ever queued behind another engine's: a stalled engine stalls only its own stream and slots, and
    is cut alone at the deadline. A ring shared by engines made every engine wait for the slowest earlier one, and
    cut them all when it stalled. Memory: 2 x the largest bucket per NCCL engine, held for the run
    (``SyncMemory``'s budget counts it per engine). Kept across the engine's rejoins, never freed: a copy queued on
    the stream of an aborted group could otherwise land in a block the allocator gave to someone else."""

    def __init__(self, device: torch.device, max_bytes: int, stream):
        self.stream = stream
        self.slots = [torch.empty(max_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.readers: list[list] = [[], []]  # per slot: (group, Work) of its last broadcast
        self.i = 0

    def broadcast(self, pg, t: torch.Tensor):
        """Broadcast ``t`` on ``pg`` with this ring's stream current; a host tensor (pinned: the copy never blocks
        the host) goes through the next slot."""
        with cuda_rules.on_stream(self.stream):
            if t.device.type != "cpu":
                return compat.broadcast(pg, t)
            self.i = (self.i + 1) % 2
            for _, w in self.readers[self.i]:
                try:
                    w.wait()  # rule 1: this ring's stream (not the host) waits for the slot's previous reader
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


@dataclass(frozen=True)
class PushTarget:
    """A usable link as one push found it (read under the table's lock): the push sends on this group and reports
    its outcome with this ``epoch``, never with the link's later fields."""

    link: EngineLink
    """The link, for the table's transitions."""
    epoch: int
    """Its group's number when the push started: an outcome for an older group changes nothing."""
    handler: EngineHandler
    """Its engine."""
    pg: object
    """Rank 0's side of its group."""
    backend: str
    """That group's backend."""
    holds: int
    """The version the engine holds for sure (``EngineLink.holds``): the base of a patch it may take."""


@dataclass
class InFlight:
    """One target's sends of a push, until its Works complete or the push's deadline passes."""

    target: PushTarget
    """Where they went."""
    works: list
    """Their Works (or the engine's own handle, ``self_push``)."""
    tensors: list[torch.Tensor]
    """What was sent, header first (the bytes counted once complete)."""
    patched: bool
    """Whether it was sent patches (sparse) rather than whole buckets."""
    own: bool
    """Whether ``works`` is the engine's own push handle (``self_push``) rather than our broadcasts' Works."""


@dataclass(frozen=True)
class Abandoned:
    """A target's gloo sends given up at a push's deadline: they may still read staging."""

    handler: EngineHandler
    """Their engine."""
    version: int
    """The version they send."""
    works: list
    """Their Works."""
    deadline: float
    """The push's deadline (``time.monotonic()``): their group's timeout ends them moments after it."""


# how long past a push's deadline ``free_staging`` waits for its abandoned gloo sends to end (their group's timeout
# fails a send stalled at the first broadcast within milliseconds of it) before it kills the engine; and then for
# the killed engine's sends to fail (an embedded engine's: 20 ms, measured)
FREE_STAGING_S = 2.0


@dataclass(frozen=True)
class SparsePayload:
    """What a sparse push sends to the targets that hold its base version (``transport``'s wire format)."""

    header: torch.Tensor
    """Its header: the version, the base and each bucket's count (-1: whole)."""
    tensors: list[torch.Tensor]
    """What follows the header: each patched bucket's indices and values, each other bucket whole."""
    base: int
    """The version the patches apply to."""
    buckets: int
    """How many buckets travel as patches."""


class Pusher:
    """See the module docstring for the ordering invariants."""

    def __init__(self, table: LinkTable, snap: Snapshot, cfg, *, backend: str, device: torch.device,
                 store, token: str | None, engine_specs: list):
        """``engine_specs``: staging's parameter list under the names the engines load (HF's), for their joins."""
        self.table, self.snap, self.cfg, self.backend = table, snap, cfg, backend
        self.engine_specs = engine_specs
        self.device, self.store, self.token = torch.device(device), store, token
        self.busy = threading.Event()
        self.closed = False
        self._job: int | None = None
        self._job_links: list[EngineLink] | None = None  # None: every usable engine
        self.stream = cuda_rules.group_stream(device) if backend == "nccl" else None  # the polls' and gloo sends'
        self.rings: dict[str, DeviceRing] = {}  # per NCCL engine (by name), allocated at its first push (``_ring``)
        self.base = sparse.SparseBase(snap.plan, cfg.sparse_max_bytes_ratio) if cfg.method == "sparse" else None
        self._told_dense = False  # the first all-dense sparse push is logged, once
        self.abandoned: list[Abandoned] = []  # gloo sends past their deadline (holder of ``busy`` only)
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
        if self.table.record(ev):
            with self.table.lock:
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
        """Main thread: rejoin broken engines (their joiners send; this thread sends nothing, so a stopped engine's
        full pipe cannot stall it) and have the push thread send the staged version to engines lacking it."""
        for join in self.table.rejoin_broken():
            self.start_join(join)
        with self.table.lock:
            self.kick()

    def close(self) -> None:
        with self.table.lock:
            self.closed = True
            self.table.work.notify()

    def start_join(self, join: Join) -> threading.Thread:
        """Start the joiner thread of ``join`` (a join the table decided); the caller holds no lock."""
        handler = join.handler
        backend = handler.weight_backend(self.backend)
        colocated = backend == transport.COLOCATED
        info = WeightGroupInfo(
            self.cfg.master_addr, self.store.port, f"flux_ws/{handler.name}/{join.epoch}", backend,
            self.cfg.timeout_seconds, list(self.engine_specs), self.snap.bucket_bytes,
            shared=(self.snap.staging.flats, self.snap.seqlock.t) if colocated else None,
            patches=self.base is not None and handler.accepts_patches and not colocated,
        )
        t = threading.Thread(target=self._join, args=(join, info), name=f"flux-join-{handler.name}", daemon=True)
        t.start()
        return t

    def _join(self, join: Join, info: WeightGroupInfo) -> None:
        """Joiner thread: ask the engine to join (a pipe send or HTTP call, which may block on a stopped engine: no
        lock is held), build rank 0's side of the group, report the outcome to the table."""
        handler = join.handler
        if join.delay_s:  # a retry's backoff (``links.JOIN_BACKOFF_S``)
            time.sleep(join.delay_s)
            if self.closed:
                return
        try:
            cuda_rules.bind_thread(self.device)  # rule 6; colocated: the join message shares CUDA staging (IPC)
            handler.join_weight_group(info)
        except Exception as e:  # noqa: BLE001 - this engine cannot take the join: it would fail again at once
            self.table.join_failed(join, f"join failed: {e}", retry=False)
            return
        try:
            if info.backend == transport.COLOCATED:  # no group: the join message carried staging itself
                pg = transport.COLOCATED
            else:
                # a store client of its own: a wait on a shared one would stall every other engine's join
                store = transport.connect_store(info.host, info.port, info.timeout_s, is_master=False)
                if handler.rendezvous_handshake:
                    transport.handshake(store, info.prefix, self.token, transport.TRAINER, info.timeout_s)
                    if info.backend == "nccl":
                        cuda_rules.check_nccl_version(store, info.prefix, "trainer", info.timeout_s)
                pg = trainer_group(handler, store, info, self.device)
        except Exception as e:  # noqa: BLE001 - counted, logged, retried
            # a refusal would fail again at once; anything else retries now (a restarted engine may still be
            # starting, and the trainer may be waiting on its rollouts)
            refused = isinstance(e, (transport.AuthError, cuda_rules.NcclVersionMismatch))
            retry = not (refused or self.closed) and handler.alive()
            again = self.table.join_failed(join, f"join failed: {e}", retry=retry)
            if again is not None:
                self.start_join(again)
            elif retry and self.table.gave_up(join):  # e.g. a server stuck in an abandoned push: replace it
                handler.kill(f"{join.attempt} joins of its weight-sync group failed in a row (last: {e}); declared "
                             "dead: restarted or reconnected by the rollouts (rollout.max_engine_restarts)")
            return
        if self.table.joined(join, pg, info.backend):  # else superseded by a newer join: the group is dropped
            with self.table.lock:
                self.kick()

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
                table.push_crashed(version, e)
                logger.exception("weight push failed")
            finally:
                self.release()

    def free_staging(self, version: int) -> None:
        """Main thread, holding ``busy``, before the snapshot of ``version`` rewrites staging: wait until every gloo
        send abandoned at a deadline ended (its group's timeout fails it), up to ``FREE_STAGING_S`` past that
        deadline; the engine of one still running then is killed (restarted or reconnected and resynced; an embedded
        engine's socket closes and the send fails) and the send waited for, up to ``FREE_STAGING_S`` more."""
        abandoned, self.abandoned = self.abandoned, []
        for a in abandoned:
            if cuda_rules.wait_works(a.works, a.deadline + FREE_STAGING_S):
                continue
            a.handler.kill(f"its weight push of version {a.version} missed weight_sync.timeout_seconds and was still "
                           f"sending when the snapshot of version {version} was due: a gloo send cannot be "
                           "cancelled and would carry the new weights into the old push (a torn copy), so the "
                           "engine is stopped")
            if not cuda_rules.wait_works(a.works, time.monotonic() + FREE_STAGING_S):
                logger.error(f"weight sync: the abandoned push of version {a.version} to {a.handler.name} still "
                             f"runs {FREE_STAGING_S:.0f} s after its engine was stopped; staging is rewritten anyway")

    def _abandon(self, handler: EngineHandler, version: int, works: list, deadline: float) -> None:
        """Keep gloo ``works`` given up at ``deadline`` (or after a failed send) until ``free_staging``."""
        self.abandoned = [a for a in self.abandoned if not all(w.is_completed() for w in a.works)]
        if works and not all(w.is_completed() for w in works):
            self.abandoned.append(Abandoned(handler, version, list(works), deadline))

    def _ring(self, name: str) -> DeviceRing:
        """Engine ``name``'s ``DeviceRing`` (allocated at its first NCCL broadcast from us: engines that never take
        one, e.g. vLLM's own engine, cost no ring). Slots fit the largest bucket and the push header."""
        ring = self.rings.get(name)
        if ring is None:
            plan = self.snap.plan
            top = max([b.numel * transport._DTYPES[b.dtype].itemsize for b in plan.buckets]
                      + [transport.encode_header(plan, 0).nbytes])
            ring = self.rings[name] = DeviceRing(self.device, top, cuda_rules.group_stream(self.device))
            self.snap.memory.hold(2 * top)  # held for the run
        return ring

    def push(self, version: int, only: list[EngineLink] | None = None) -> None:
        """Send staging (``version``) to every usable engine (or ``only``), poll the Works; caller holds ``busy``.
        With a ``base`` (sparse), an engine known to hold the base version gets patches, every other one dense."""
        t0 = time.perf_counter()
        self.snap.side.synchronize_copy()
        self.snap.publish(version)  # colocated engines copy from here on
        if only is None:
            for join in self.table.rejoin_broken():
                self.start_join(join)
            self.table.diffed(0.0, 0.0)  # until this push's diff, if it makes one
        with self.table.lock:
            targets = [PushTarget(lk, lk.epoch, lk.handler, lk.pg, lk.backend, lk.holds)
                       for lk in (self.table.links if only is None else only) if lk.usable]
        dense = self._host(transport.encode_header(self.snap.plan, version))
        patch = self._patch(version, targets)  # the sparse diff: host work, never counted against the engines
        # one deadline for the whole push (rule 3), set before the first send, after the diff (review 4, finding 9)
        deadline = time.monotonic() + self.cfg.timeout_seconds
        with cuda_rules.on_stream(self.stream):
            in_flight = self._send(version, targets, dense, patch)
            sent_bytes, patched = self._complete(version, in_flight, deadline)
        if self.base is not None:
            self.base.advance(self.snap.staging, version)
        self.table.pushed(time.perf_counter() - t0, sent_bytes, patch.buckets if patched else 0,
                          step_push=only is None)

    def _send(self, version: int, targets: list[PushTarget], dense: torch.Tensor,
              patch: SparsePayload | None) -> list[InFlight]:
        """Issue every target's broadcasts: ``patch`` to a target that holds its base version and takes patches, else
        whole buckets under the ``dense`` header (or the engine's own push). A target that fails to start is
        BROKEN."""
        flats = self.snap.staging.flats
        in_flight = []
        for target in targets:  # NCCL: each engine's own ring and stream (rule 1); its header goes through the ring
            handler, own, works = target.handler, None, []
            try:
                handler.begin_update(version)
                own = handler.self_push(version, flats)  # vLLM on GPU, colocated: the engine fetches
                patched = own is None and patch is not None and target.holds == patch.base and \
                    handler.accepts_patches
                header = patch.header if patched else dense
                tensors = ([header, *flats] if own is not None else [header, *patch.tensors] if patched
                           else handler.wire_tensors(header, flats))
                send = self._ring(handler.name).broadcast if target.backend == "nccl" else compat.broadcast
                if own is not None:
                    works.append(own)
                else:
                    for t in tensors:  # appended one by one: a failure midway knows what was issued
                        works.append(send(target.pg, t))
                self.table.sent(target.link, target.epoch, version)
                in_flight.append(InFlight(target, works, tensors, patched, own is not None))
            except Exception as e:  # noqa: BLE001
                if target.backend == "nccl" and own is None and works:  # part of it issued: nothing may stay queued
                    self._abort(target)  # on its ring's stream behind receives never posted
                elif own is None:  # gloo: what was issued may still read staging, until its group's timeout
                    self._abandon(handler, version, works, time.monotonic() + self.cfg.timeout_seconds)
                self.table.push_failed(target.link, target.epoch, version, str(e))
        return in_flight

    def _complete(self, version: int, in_flight: list[InFlight], deadline: float) -> tuple[int, bool]:
        """Poll every target's Works against the push's one ``deadline`` (rule 3); one that misses it is BROKEN (its
        NCCL group aborted). Returns the bytes completed and whether a patched target completed."""
        sent_bytes, patched = 0, False
        for sent in in_flight:
            target = sent.target
            try:
                if not cuda_rules.wait_works(sent.works, deadline):
                    if target.backend == "nccl":
                        self._abort(target)
                    elif not sent.own:  # gloo: cannot be cancelled, may still read staging
                        self._abandon(target.handler, version, sent.works, deadline)
                    raise TimeoutError(f"not complete within weight_sync.timeout_seconds = "
                                       f"{self.cfg.timeout_seconds}")
                cuda_rules.raise_failed(sent.works)
                target.handler.finish_update(version)
                sent_bytes += sum(t.numel() * t.element_size() for t in sent.tensors[1:])
                patched = patched or sent.patched
                self.table.completed(target.link, target.epoch, version)
            except Exception as e:  # noqa: BLE001 - a slow or dead engine: mark and go on
                self.table.push_incomplete(target.link, target.epoch, version, str(e))
        return sent_bytes, patched

    def _abort(self, target: PushTarget) -> None:
        """Rule 3: abort ``target``'s NCCL group (vLLM's: its transfer engine) and forget its Works on its ring. An
        abort that hangs past ``cuda_rules.ABORT_S`` (left on its helper thread) kills the engine: restarted or
        reconnected and resynced, never waited for on this thread (fifth review, finding 24)."""
        if not cuda_rules.abort_group(target.pg):
            target.handler.kill(f"aborting its weight-sync group after a missed deadline did not return within "
                                f"{cuda_rules.ABORT_S:g} s")
        ring = self.rings.get(target.handler.name)
        if ring is not None:
            ring.forget(target.pg)

    def _host(self, header: torch.Tensor) -> torch.Tensor:
        """A push header as the rings take it: pinned on a GPU trainer (its copy to the device never blocks the host
        before the deadline, N1; rule 2: it is broadcast from the device), as is on CPU."""
        return header.pin_memory() if self.device.type == "cuda" else header

    def _patch(self, version: int, targets: list[PushTarget]) -> SparsePayload | None:
        """The base's patches to ``version`` if some target holds the base version and takes patches and some bucket
        fits as a patch, else None (every target gets whole buckets)."""
        patches = self._patches(version, targets)
        if patches is None:
            return None
        counts, tensors = sparse.payload(self.snap.staging.flats, patches)
        header = self._host(transport.encode_header(self.snap.plan, version, counts, self.base.version))
        return SparsePayload(header, tensors, self.base.version, sum(c != transport.DENSE for c in counts))

    def _patches(self, version: int, targets: list[PushTarget]) -> list | None:
        """The base's patches to ``version`` if some target holds the base version and takes patches, else None."""
        base = self.base
        if base is None or base.version < 0 or base.version == version or not any(
                t.holds == base.version and t.handler.accepts_patches for t in targets):
            return None
        patches = base.patches(self.snap.staging, version)
        self.table.diffed(base.last_changed, base.last_diff_s)
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

    def free_staging(self, version: int) -> None:
        pass

    def deliver_staged(self) -> None:
        pass

    def close(self) -> None:
        pass
