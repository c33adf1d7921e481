"""Trainer-side weight sync: snapshot after ``optimizer.step()``, bucketed push to every engine, versions, timeouts.

``WeightSyncer`` is built on every trainer rank. Rank 0 (the sending rank of the one data-parallel replica we
support; see below) holds the staging copy and one weight-sync group per engine; the other ranks only take part
in the bucket-by-bucket gathers of FSDP shards.

Concurrency invariants (who waits for what):
  * ``_busy`` is the claim on the staging buffer and on the weight-sync groups. It is set, under ``_lock``, by
    the one that takes it (the main thread before a snapshot, or ``_kick_locked`` for the push thread) and
    cleared only by its holder, so staging is never written while it is being sent, and collectives on the
    weight-sync groups are issued by one thread at a time, in push order.
  * Main thread, every rank: ``after_optimizer_step(version)`` is called right after ``optimizer.step()``. If a
    push is due and rank 0 can claim ``_busy`` (the push thread is idle), the parameters are copied bucket by
    bucket into the staging buffer (gathering FSDP shards with collectives on the trainer's group, in the same
    order on every rank), then the push is handed to the push thread. If a push is still in flight, the new
    version is *coalesced*: nothing is copied, ``coalesced`` is counted, and the next step boundary with an idle
    push thread sends the then-newest weights. On multi-rank runs rank 0 broadcasts that idle/busy decision
    first, so every rank agrees on whether to gather. On GPU the copy runs on a side stream
    (``compat.SideStream``) and the next ``optimizer.step()`` waits only for that copy (``before_optimizer_step``).
    Blocking mode: the main thread waits for the claim, then snapshots, pushes and waits for acks itself.
  * Push thread, rank 0 only: sends every push it is handed while holding ``_busy`` (every push in async mode;
    only resyncs in blocking mode, where the main thread sends the regular pushes). For one push it issues
    header + buckets on every usable engine's group, then waits for each engine's Works with the deadline
    ``timeout_seconds``; the staging buffer is read-only to it. Before letting go of ``_busy`` it re-sends the
    staged version to engines that became usable meanwhile (rejoined or answered again), so a restarted engine
    gets weights without waiting for the next optimizer step.
  * Joiner threads, rank 0: one per (re)joining engine; they only create that engine's group (a rendezvous, after
    the token handshake ``transport.handshake`` when a token is set) and then ask the push thread
    (``_kick_locked``) to send it the staged version. An engine the handshake refuses is not rejoined at once
    (it would be refused again): like any broken engine, it is retried at the next push.
  * Every ``EngineLink`` field is written under ``_lock``. ``epoch`` counts an engine's groups: a joiner or a
    push whose epoch is no longer the link's (the engine was replaced or rejoined meanwhile) counts and logs
    its failure but leaves the link alone.
  * Acks and engine errors are delivered by ``RolloutScheduler.pump`` on the main thread to ``on_event``.
  An engine whose push Works or ack miss ``timeout_seconds`` is marked lagging and skipped: it keeps serving its
  old version (its rollouts carry that version). When it acks again it is resynced with a full push; if its
  group broke, it rejoins on a fresh group first (at the next push) and then gets the staged version. The
  trainer never waits on an engine in async mode; in blocking mode it waits at most ``timeout_seconds`` per push
  (plus, at most, one in-flight resync push of the push thread).

Simplification: one data-parallel replica sends (rank 0 of the whole job). With HSDP/several replicas, every
replica holds the same weights, so one sender is enough; spreading engines over replicas is future work.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from torchtitan_flux import compat, transport
from torchtitan_flux.engine.auth import read_token
from torchtitan_flux.engine.base import EngineError, EngineHandler, WeightAck, WeightGroupInfo

logger = logging.getLogger("torchtitan_flux")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_specs(model: torch.nn.Module) -> list[transport.TensorSpec]:
    """The ordered parameter list a push carries (global shapes; FSDP shards are gathered)."""
    return [transport.TensorSpec(n, tuple(p.shape), _dtype_name(p.dtype)) for n, p in model.named_parameters()]


@dataclass
class EngineLink:
    """Rank 0's view of one engine. Mutated under ``WeightSyncer._lock``."""

    handler: EngineHandler
    epoch: int = 0
    pg: object | None = None
    joining: bool = False
    sent: int = -1  # newest version sent
    sent_at: float = 0.0
    acked: int = -1  # newest version the engine acked
    lagging: bool = False
    broken: bool = False  # its group must be rebuilt before the next push
    dead: bool = False


@dataclass
class SyncStats:
    pushes: int = 0
    coalesced: int = 0
    timeouts: int = 0
    errors: int = 0
    resyncs: int = 0
    bytes_sent: int = 0
    delta_buckets_skipped: int = 0  # method "delta": unchanged buckets not sent
    last_push_s: float = 0.0  # wall time of the last push on the push thread (or main thread, blocking)
    last_snapshot_s: float = 0.0
    blocked_s: float = 0.0  # main-thread time spent in sync during the last step
    failures: list[str] = field(default_factory=list)


class WeightSyncer:
    """See the module docstring for the ordering invariants."""

    def __init__(
        self,
        cfg,  # config.WeightSync
        model: torch.nn.Module,
        engines: list[EngineHandler],
        *,
        device: torch.device,
        is_sender: bool,
        backend: str = "gloo",
    ):
        self.cfg, self.model, self.is_sender, self.backend = cfg, model, is_sender, backend
        self.async_mode = cfg.async_weight_update
        self.specs = tensor_specs(model)
        self.bucket_bytes = int(cfg.bucket_size_mb * 2**20)
        self.plan = transport.plan_buckets(self.specs, self.bucket_bytes)
        self._params = dict(model.named_parameters())
        self.stats = SyncStats()
        self.side = compat.SideStream(device)
        self._lock = threading.Lock()
        self._busy = threading.Event()  # set while the push thread owns the staging buffer
        self._work = threading.Condition(self._lock)
        self._job: int | None = None
        self._job_links: list[EngineLink] | None = None  # None: every usable engine
        self._closed = False
        self.version = -1  # newest version snapshotted
        self._delta: tuple[int, list[int]] | None = None  # method "delta": (previous version, changed buckets)
        self.links = [EngineLink(e) for e in engines] if is_sender else []
        # Wire-layout hook: HTTP engines load HF-layout tensors; converting while snapshotting keeps one staging
        # buffer holding exactly what goes on the wire. All engines of a run must agree on the layout.
        if len({getattr(type(e), "wire_tensor", None) for e in engines}) > 1:
            raise ValueError("engines with different wire layouts cannot share one staging buffer")
        self._wire = getattr(engines[0], "wire_tensor", None) if engines else None
        self.staging = self.plan.allocate(device) if is_sender else None
        self._token = read_token(cfg.auth_token_env) if is_sender else None  # never logged or checkpointed
        self._store = None
        if is_sender:
            self._store = transport.connect_store(cfg.master_addr, cfg.master_port, cfg.timeout_seconds, True)
            self._thread = threading.Thread(target=self._push_loop, name="flux-weight-push", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------------------------------ groups

    def connect(self) -> None:
        """Create every engine's group (rank 0; blocks until each engine joined or timed out)."""
        with self._lock:
            joiners = [self._start_join(link) for link in self.links]
        for j in joiners:
            j.join()
        failed = [link.handler.name for link in self.links if link.pg is None]
        if failed:
            why = [f for f in self.stats.failures if f.startswith(tuple(f"weight sync to {n}:" for n in failed))]
            raise RuntimeError(f"engines {failed} did not join the weight-sync group within "
                               f"weight_sync.timeout_seconds = {self.cfg.timeout_seconds}: {'; '.join(why)}")

    def _start_join(self, link: EngineLink) -> threading.Thread:
        """Start ``link``'s rendezvous on a fresh group (caller holds ``_lock``)."""
        link.epoch += 1
        epoch = link.epoch
        link.joining, link.pg = True, None
        info = WeightGroupInfo(
            self.cfg.master_addr, self._store.port, f"flux_ws/{link.handler.name}/{link.epoch}", self.backend,
            self.cfg.timeout_seconds, list(self.specs), self.bucket_bytes,
        )
        link.handler.join_weight_group(info)

        def join():
            try:
                # a connection of its own: a store client serves one call at a time, so a wait on a shared one
                # (an engine that does not answer) would stall every other engine's join
                store = transport.connect_store(info.host, info.port, info.timeout_s, is_master=False)
                if getattr(link.handler, "rendezvous_handshake", True):  # hook: False where the server joins itself
                    transport.handshake(store, info.prefix, self._token, transport.TRAINER, info.timeout_s)
                trainer_group = getattr(link.handler, "trainer_group", None)  # hook: the engine's store layout
                if trainer_group is not None:
                    pg = trainer_group(store, info)
                else:
                    pg = compat.new_weight_sync_group(
                        self.backend, dist.PrefixStore(info.prefix, store), 0, 2,
                        timedelta(seconds=self.cfg.timeout_seconds), listen_host=transport.listen_address(info.host),
                    )
                with self._lock:
                    if link.epoch != epoch:  # superseded by a newer join (engine replaced): drop this group
                        return
                    link.pg, link.broken, link.lagging, link.joining = pg, False, False, False
                    link.sent = link.acked = -1  # a new group starts with a full push
                    self._kick_locked()
            except Exception as e:  # noqa: BLE001 - counted, logged, retried
                with self._lock:
                    self._fail(link, f"join failed: {e}")
                    if link.epoch == epoch:
                        link.joining, link.broken = False, True
                        refused = isinstance(e, transport.AuthError)  # retried at the next push, not at once
                        if not (refused or self._closed or link.dead) and link.handler.alive():
                            # retry now, not at the next push: a restarted engine may still be starting up,
                            # and the trainer may be waiting on its rollouts (no push comes until they do)
                            self.stats.resyncs += 1
                            self._start_join(link)

        t = threading.Thread(target=join, name=f"flux-join-{link.handler.name}", daemon=True)
        t.start()
        return t

    def _fail(self, link: EngineLink, why: str) -> None:
        """Count and log one failure (caller holds ``_lock``)."""
        self.stats.errors += 1
        msg = f"weight sync to {link.handler.name}: {why}"
        self.stats.failures.append(msg)
        logger.warning(msg)

    # ------------------------------------------------------------------------------------- main thread

    def before_optimizer_step(self) -> None:
        """GPU: the optimizer must not overwrite parameters the side stream is still copying."""
        self.side.wait_copy_done()

    def after_optimizer_step(self, version: int, force: bool = False) -> None:
        """Called by every rank right after ``optimizer.step()``; see the module docstring."""
        t0 = time.perf_counter()
        due = force or version % self.cfg.interval == 0
        if not due:
            self.stats.blocked_s = 0.0
            return
        if self.async_mode:
            claimed = self._claim() if self.is_sender else True
            try:
                idle = self._agree(claimed)
                if idle:
                    self._snapshot(version)
            except BaseException:
                if self.is_sender and claimed:
                    with self._lock:
                        self._release_locked()
                raise
            if idle:
                if self.is_sender:
                    with self._lock:
                        self._job, self._job_links = version, None
                        self._work.notify()
            else:
                self.stats.coalesced += 1
        else:
            while self.is_sender and not self._claim():  # a resync push of the push thread is in flight
                self.pump(0.01)
            try:
                self._snapshot(version)
                if self.is_sender:
                    self._push(version)
                    self._wait_acks(version)
            finally:
                if self.is_sender:
                    with self._lock:
                        self._release_locked()
        self.stats.blocked_s = time.perf_counter() - t0

    def _claim(self) -> bool:
        """Rank 0: take ``_busy`` (staging + weight-sync groups) if nobody holds it."""
        with self._lock:
            if self._busy.is_set():
                return False
            self._busy.set()
            return True

    def _kick_locked(self) -> None:
        """If ``_busy`` is free, have the push thread send the staged version to engines that do not have it
        (rejoined, or answered again after lagging). Caller holds ``_lock``."""
        if self._busy.is_set() or self._closed:
            return
        late = self._late_links()
        if late:
            self._busy.set()
            self._job, self._job_links = self.version, late
            self._work.notify()

    def _late_links(self) -> list[EngineLink]:
        if self.version < 0:
            return []
        return [
            lk for lk in self.links
            if lk.pg is not None and lk.sent < self.version
            and not (lk.joining or lk.lagging or lk.broken or lk.dead)
        ]

    def _release_locked(self) -> None:
        """The holder of ``_busy`` lets it go, first serving engines that became usable meanwhile."""
        self._job = self._job_links = None
        self._busy.clear()
        self._kick_locked()

    def _agree(self, flag: bool) -> bool:
        """Rank 0's decision, seen by every rank (one tiny broadcast on multi-rank runs)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int64, device=self.staging_device)
        dist.broadcast(t, src=0)
        return bool(t.item())

    @property
    def staging_device(self) -> torch.device:
        return next(iter(self._params.values())).device

    @torch.no_grad()
    def _snapshot(self, version: int) -> None:
        """Copy (gathering shards) the parameters into the staging buffer, bucket by bucket."""
        t0 = time.perf_counter()
        self.side.record_after_main()
        changed = []
        for i, bucket in enumerate(self.plan.buckets):
            specs = self.plan.specs[bucket.start : bucket.end]
            srcs = [self._full(self._params[s.name]) for s in specs]
            if self.is_sender:
                with self.side.copy_context():
                    if self._wire is not None:  # hook: torchtitan -> HF layout (q/k rows), on the copy stream
                        srcs = [self._wire(s.name, t) for s, t in zip(specs, srcs)]
                    views = self.staging.bucket_views(i)
                    # delta: staging still holds the previous snapshot, which is what the engines were sent
                    if self.cfg.method == "delta" and not all(torch.equal(d, t) for d, t in zip(views, srcs)):
                        changed.append(i)
                    torch._foreach_copy_(views, srcs)
        self._delta = (self.version, changed) if self.cfg.method == "delta" else None
        self.version = version
        self.stats.last_snapshot_s = time.perf_counter() - t0

    @staticmethod
    def _full(p: torch.Tensor) -> torch.Tensor:
        return p.full_tensor() if compat.is_dtensor(p) else p.detach()  # FSDP2 shard: all-gather this one tensor

    def on_event(self, ev) -> None:
        """Acks and engine errors, delivered on the main thread by ``RolloutScheduler.pump``."""
        with self._lock:
            link = next((lk for lk in self.links if lk.handler.name == ev.engine), None)
            if link is None:
                return
            if isinstance(ev, WeightAck):
                link.acked = max(link.acked, ev.version)
                if link.lagging and link.acked >= link.sent:
                    link.lagging = False
                    link.sent = -1  # answered again: next push is a full resync
                    self.stats.resyncs += 1
                    logger.info(f"weight sync: {link.handler.name} answered again; resyncing")
                    self._kick_locked()
            elif isinstance(ev, EngineError):
                self._fail(link, ev.message.strip().splitlines()[-1] if ev.message else "error")
                if ev.fatal:
                    link.dead = True
                else:
                    link.broken = True

    def check_timeouts(self) -> None:
        """Mark engines whose last push was not acked within ``timeout_seconds`` as lagging (main thread)."""
        now = time.time()
        with self._lock:
            for link in self.links:
                if not link.lagging and link.sent > link.acked and now - link.sent_at > self.cfg.timeout_seconds:
                    link.lagging = True
                    self.stats.timeouts += 1
                    self._fail(link, f"version {link.sent} not acked within {self.cfg.timeout_seconds}s; lagging")

    def replace_engine(self, old: EngineHandler, new: EngineHandler) -> None:
        """A restarted engine rejoins on a fresh group and gets the newest version."""
        with self._lock:
            link = next(lk for lk in self.links if lk.handler is old)
            link.handler, link.dead, link.lagging, link.broken = new, False, False, False
            self._start_join(link)

    # ------------------------------------------------------------------------------------- push thread

    def _push_loop(self) -> None:
        while True:
            with self._lock:
                while self._job is None and not self._closed:
                    self._work.wait()
                if self._closed:
                    return
                version, only = self._job, self._job_links
            try:
                self._push(version, only)
            except Exception as e:  # noqa: BLE001 - never lose the thread; counted and logged
                with self._lock:
                    self.stats.errors += 1
                    self.stats.failures.append(f"push {version}: {e}")
                logger.exception("weight push failed")
            finally:
                with self._lock:
                    self._release_locked()

    def _push(self, version: int, only: list[EngineLink] | None = None) -> None:
        """Send staging (holding ``version``) to every usable engine (or to those of ``only``: a resync); wait on
        Works up to the deadline. The caller holds ``_busy``."""
        t0 = time.perf_counter()
        self.side.synchronize_copy()
        with self._lock:
            if only is None:
                for link in self.links:
                    if link.broken and not link.joining and not link.dead and link.handler.alive():
                        self.stats.resyncs += 1
                        self._start_join(link)
            targets = [
                (lk, lk.epoch, lk.pg, lk.handler) for lk in (self.links if only is None else only)
                if lk.pg is not None and not (lk.joining or lk.lagging or lk.broken or lk.dead)
            ]
        full_ids = list(range(len(self.plan.buckets)))
        full_header = transport.encode_header(self.plan, version, full_ids, transport.METHOD_FULL)
        pending = []
        for link, epoch, pg, handler in targets:
            try:
                handler.begin_update(version)
                wire_tensors = getattr(handler, "wire_tensors", None)  # hook: what this engine receives
                ids, header = full_ids, full_header
                base = self._delta[0] if self._delta is not None else None
                if base is not None and base >= 0 and wire_tensors is None and link.sent == link.acked == base:
                    # the engine holds exactly the previous snapshot: send bucket 0 and the changed ones
                    ids = [0] + [i for i in self._delta[1] if i != 0]
                    header = transport.encode_header(self.plan, version, ids, transport.METHOD_DELTA)
                    self.stats.delta_buckets_skipped += len(full_ids) - len(ids)
                flats = [self.staging.flats[i] for i in ids]
                tensors = wire_tensors(header.clone(), flats) if wire_tensors else [header.clone(), *flats]
                works = [compat.broadcast(pg, t) for t in tensors]
                with self._lock:
                    if link.epoch == epoch:
                        link.sent, link.sent_at = version, time.time()
                pending.append((link, epoch, handler, works, tensors))
            except Exception as e:  # noqa: BLE001
                with self._lock:
                    if link.epoch == epoch:
                        link.broken = True
                    self._fail(link, f"push {version} failed to start: {e}")
        deadline = time.monotonic() + self.cfg.timeout_seconds
        for link, epoch, handler, works, tensors in pending:
            try:
                for w in works:
                    w.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
                handler.finish_update(version)
                self.stats.bytes_sent += sum(t.numel() * t.element_size() for t in tensors[1:])
            except Exception as e:  # noqa: BLE001 - a slow or dead engine: mark and go on
                with self._lock:
                    if link.epoch == epoch:  # else it was replaced/rejoined meanwhile: its new group is fine
                        link.broken = link.lagging = True
                    self.stats.timeouts += 1
                    self._fail(link, f"push {version} did not complete: {e}")
        self.stats.pushes += 1
        self.stats.last_push_s = time.perf_counter() - t0

    # ----------------------------------------------------------------------------------- blocking path

    def _wait_acks(self, version: int) -> None:
        """Blocking mode: wait until every usable engine acked ``version`` (events pumped by ``pump``)."""
        deadline = time.monotonic() + self.cfg.timeout_seconds
        while True:
            with self._lock:
                waiting = [lk for lk in self.links if lk.sent == version and lk.acked < version and not lk.lagging]
            if not waiting or time.monotonic() > deadline:
                break
            self.pump(min(0.05, max(0.0, deadline - time.monotonic())))
        if waiting:
            self.check_timeouts()

    @staticmethod
    def pump(timeout: float) -> None:
        """Deliver engine events; the trainer replaces it with ``RolloutScheduler.pump`` on rank 0."""
        time.sleep(timeout)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the push thread is idle (end of training, checkpoints, tests)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._busy.is_set():
            if deadline is not None and time.monotonic() > deadline:
                return False
            self.pump(0.01)
        return True

    def flush(self, version: int) -> None:
        """Make sure ``version`` is pushed (end of training): wait for the push thread, push if needed."""
        if self.async_mode:
            for _ in range(3):  # a resync push may take ``_busy`` between the wait and the claim: try again
                if self.version >= version:  # the same on every rank (snapshots are agreed), so is the loop
                    break
                self.wait_idle(self.cfg.timeout_seconds)
                self.after_optimizer_step(version, force=True)
            self.wait_idle(self.cfg.timeout_seconds)
            if self.is_sender:
                self._wait_acks(version)
        elif self.version < version:
            self.after_optimizer_step(version, force=True)

    def metrics(self) -> dict[str, float]:
        with self._lock:
            lagging = sum(lk.lagging or lk.broken for lk in self.links)
            min_acked = min((lk.acked for lk in self.links), default=-1)
        s = self.stats
        return {
            "weight_sync_s": s.blocked_s,
            "weight_push_s": s.last_push_s,
            "weight_snapshot_s": s.last_snapshot_s,
            "weight_pushes": s.pushes,
            "weight_coalesced": s.coalesced,
            "weight_sync_timeouts": s.timeouts,
            "weight_sync_errors": s.errors,
            "weight_resyncs": s.resyncs,
            "weight_delta_buckets_skipped": s.delta_buckets_skipped,
            "engines_lagging": lagging,
            "engine_min_version": min_acked,
        }

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._work.notify()

