"""Trainer-side weight sync: snapshot after ``optimizer.step()``, bucketed push to every engine, versions, timeouts.

Layout (data flows front -> collaborators, never back): ``WeightSyncer`` here is the front; ``snapshot.Snapshot``
(every rank), ``links.LinkTable`` and ``pusher.Pusher`` (rank 0) its collaborators; ``cuda_rules`` the rules.

Main thread, every rank: ``after_optimizer_step(version)``. If rank 0 can claim the idle pusher, every rank
snapshots (rank 0's decision is agreed on the CPU control group) and the push thread sends it; if a push is in
flight the version is *coalesced*. Blocking mode: rank 0 pushes and waits for acks itself. ``catch_up`` and
``deliver_staged`` keep coalescing from leaving a step waiting for weights no push will bring (the async livelock,
docs/architecture.md). Every wait for the claim is on the main thread, delivering engine events, and bounded;
ranks > 0 wait for rank 0 on the control group, never inside a gather or any other training collective: before
a snapshot (``agree``) and after rank 0 waited on engines (``_hold_others``). No pipe send, HTTP call or collective
runs under ``LinkTable.lock``, and the main thread never sends a join message itself (joiner threads do): a stopped
engine that no longer reads its pipe cannot stall ``pump``, ``claim`` or ``deliver_staged``. The syncer never calls
back into the trainer: ``rollout.rollouts.Rollouts`` gives it its ``pump`` and calls ``on_event`` and ``replace_engine``.

Simplification: one data-parallel replica sends (rank 0 of the whole job); every replica holds the same weights.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from torchtitan_flux.auth import read_token
from torchtitan_flux.engine.base import EngineHandler
from torchtitan_flux.sync.links import LinkTable
from torchtitan_flux.sync.pusher import Bystander, Pusher
from torchtitan_flux.sync.snapshot import Snapshot, control_group
from torchtitan_flux.wire import transport

__all__ = ["WeightSyncer", "control_group"]

logger = logging.getLogger("torchtitan_flux")


class WeightSyncer:
    """The front: see the package docstring. ``pump(timeout)`` delivers engine events (rank 0)."""

    def __init__(self, cfg, model: torch.nn.Module, engines: list[EngineHandler], *, device: torch.device,
                 is_sender: bool, backend: str = "gloo", pump: Callable[[float], None] = time.sleep,
                 layout: Any = None):
        """``layout``: the names and tensor layout every engine loads (``models.hf_weights.HFLayout``: Hugging
        Face's), required with engines: staging holds the parameters in it, and joins carry its names. None
        without engines (ranks > 0 hold no staging)."""
        self.cfg, self.pump = cfg, pump
        self.async_mode = cfg.async_weight_update
        if engines and layout is None:
            raise ValueError("WeightSyncer with engines needs the engines' layout (models.hf_weights.HFLayout)")
        self.snap = Snapshot(
            model, device=device, is_sender=is_sender, bucket_bytes=int(cfg.bucket_size_mb * 2**20),
            wire_dtype=None if cfg.wire_dtype == "auto" else getattr(torch, cfg.wire_dtype),
            wire_tensor=layout.wire_tensor if layout is not None else None,
            colocated=any(e.weight_backend(backend) == transport.COLOCATED for e in engines),
            ring_engines=sum(e.weight_backend(backend) == "nccl" for e in engines),  # vLLM's own engine: an upper bound
        )
        self._same_plan_on_every_rank()
        self.table = LinkTable(engines if is_sender else [], cfg.timeout_seconds)
        self.pusher: Pusher | Bystander = Bystander()  # ranks > 0: no rank branches below
        if is_sender:
            token = read_token(cfg.auth_token_env)  # never logged or checkpointed
            store = transport.connect_store(cfg.master_addr, cfg.master_port, cfg.timeout_seconds, True)
            self.pusher = Pusher(self.table, self.snap, cfg, backend=backend, device=device, store=store,
                                 token=token, engine_specs=layout.hf_specs(self.snap.specs) if layout else [])

    def _same_plan_on_every_rank(self) -> None:
        """Every rank gathers each bucket with its own plan, so the plans must be equal: they depend only on the
        model and on config every rank reads alike (``wire_dtype = "auto"``: each parameter's own dtype, never an
        engine's, which only rank 0 holds). Checked once here (control group) instead of hanging in a gather."""
        pg = control_group()
        if pg is None:
            return
        mine = [(s.name, s.shape, s.dtype) for s in self.snap.specs], [(b.start, b.end) for b in self.plan.buckets]
        plans: list = [None] * dist.get_world_size()
        dist.all_gather_object(plans, mine, group=pg)
        bad = [r for r, p in enumerate(plans) if p != plans[0]]
        if bad:
            raise RuntimeError(f"weight sync: ranks {bad} built another bucket plan than rank 0 (parameters, wire "
                               "dtypes or buckets differ); every rank must read the same weight_sync config "
                               "(bucket_size_mb, wire_dtype) and build the same model")

    # views the trainer and tests read
    plan = property(lambda self: self.snap.plan)
    staging = property(lambda self: self.snap.staging)
    bucket_bytes = property(lambda self: self.snap.bucket_bytes)
    version = property(lambda self: self.snap.version)
    stats = property(lambda self: self.table.stats)
    links = property(lambda self: self.table.links)

    def busy(self) -> bool:
        """Whether a push (or a resync) is in flight."""
        return self.pusher.busy.is_set()

    def connect(self) -> None:
        """Create every engine's group (rank 0; blocks until each engine joined or failed)."""
        joiners = [self.pusher.start_join(self.table.begin_join(link)) for link in self.links]
        for j in joiners:
            j.join()
        failed = [link.handler.name for link in self.links if link.pg is None]
        if failed:
            why = [f for f in self.stats.failures if f.startswith(tuple(f"weight sync to {n}:" for n in failed))]
            raise RuntimeError(f"engines {failed} did not join the weight-sync group within "
                               f"weight_sync.timeout_seconds = {self.cfg.timeout_seconds}: {'; '.join(why)}")

    def before_optimizer_step(self) -> None:
        """GPU: the optimizer must not overwrite parameters the side stream is still copying."""
        self.snap.side.wait_copy_done()

    def after_optimizer_step(self, version: int, due: bool = True) -> None:
        """Every rank, right after ``optimizer.step()``; ``due``: whether the cadence pushes this version."""
        if not due:
            return
        if self.async_mode:
            claimed = self.pusher.claim()
            idle = self._snapshot_or_release(version, lambda: self.snap.agree(claimed), claimed)
            if not idle:
                self.table.push_coalesced()
            else:
                self.pusher.hand_over(version)
        else:
            self.stage(version)

    def stage(self, version: int) -> None:
        """Every rank: snapshot ``version`` and push it once the push in flight ended (blocking: acked here too)."""
        self._claim_waiting()
        self._snapshot_or_release(version, lambda: self.snap.agree(True), True)
        if self.async_mode:
            self.pusher.hand_over(version)
            return
        try:
            self.pusher.push(version)
            self._wait_acks(version)
        finally:
            self.pusher.release()
        self._hold_others()

    def catch_up(self, version: int, oldest: int) -> bool:
        """Every rank, before a step's rollouts are dispatched: stage ``version`` now if the staged version is
        older than ``oldest`` (the oldest the step may train on). Returns whether it staged (same on every rank)."""
        if self.version >= oldest:
            return False
        self.table.caught_up()
        logger.info(f"weight sync: staged version {self.version} is older than {oldest}, the oldest this step may "
                    f"train on (pushes were coalesced); staging version {version} now")
        self.stage(version)
        return True

    def deliver_staged(self) -> None:
        """Rank 0: rebuild broken groups (joiner threads) and send the staged version to usable engines lacking it
        (the push thread); returns at once, whatever the engines do (ranks > 0: no-op)."""
        self.pusher.deliver_staged()

    def _claim_waiting(self) -> None:
        """Wait (delivering events) until the claim is ours. Every push and resync ends by its deadline, so past
        ``(engines + 2) * timeout_seconds`` the push thread is stuck and the run stops instead of hanging."""
        limit = (len(self.links) + 2) * self.cfg.timeout_seconds
        start = noted = time.monotonic()
        while not self.pusher.claim():
            self.pump(0.01)
            now = time.monotonic()
            if now - start > limit:
                raise RuntimeError(f"the weight push in flight did not end within {limit:.0f} s ((engines + 2) x "
                                   f"weight_sync.timeout_seconds); the push thread is stuck: {self.stats.failures[-3:]}")
            if now - noted >= 30.0:
                logger.warning(f"weight sync: waiting {now - start:.0f} s for the push in flight to end")
                noted = now

    def _snapshot_or_release(self, version: int, decide: Callable[[], bool], claimed: bool) -> bool:
        """Snapshot if ``decide()`` (every rank's agreed answer); on any failure rank 0 lets its claim go."""
        try:
            idle = decide()
            if idle:
                self.pusher.free_staging(version)  # no abandoned gloo send reads what the snapshot writes
                self.snap.take(version)
                self.table.snapshot_taken(self.snap.last_s)
        except BaseException:
            if claimed:
                self.pusher.release()
            raise
        return idle

    def on_event(self, ev) -> None:
        """Acks and engine errors, delivered on the main thread by the pump."""
        self.pusher.on_event(ev)

    def check_timeouts(self) -> None:
        self.table.check_timeouts()

    def replace_engine(self, old: EngineHandler, new: EngineHandler) -> None:
        """A restarted engine rejoins on a fresh group and gets the newest version (its joiner sends the join)."""
        self.pusher.start_join(self.table.replaced(old, new))

    def _wait_acks(self, version: int) -> None:
        """Wait until every usable engine acked ``version`` (ranks > 0 hold no engines: at once)."""
        deadline = time.monotonic() + self.cfg.timeout_seconds
        while True:
            waiting = self.table.waiting_for(version)
            if not waiting or time.monotonic() > deadline:
                break
            self.pump(min(0.05, max(0.0, deadline - time.monotonic())))
        if waiting:
            self.check_timeouts()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the push thread is idle (end of training, checkpoints, tests)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.busy():
            if deadline is not None and time.monotonic() > deadline:
                return False
            self.pump(0.01)
        return True

    def flush(self, version: int) -> None:
        """Make sure ``version`` is pushed and acked (start, end of training, on-policy steps). Every rank."""
        if not self.async_mode:
            if self.version < version:
                self.after_optimizer_step(version)
            return
        if self.version < version:  # the same on every rank (snapshots are agreed), so is this branch
            self.stage(version)
        self.wait_idle(self.cfg.timeout_seconds)
        self._wait_acks(version)
        self._hold_others()

    def _hold_others(self) -> None:
        """Every rank, after rank 0's waits on engines (blocking push, ``flush``): ranks > 0 wait here, on the gloo
        control group (no timeout), instead of inside the next training, probe or export collective, whose
        timeout (``comm.train_timeout_seconds``) is shorter than those waits (up to 2 x ``timeout_seconds``)."""
        self.snap.agree(True)

    def metrics(self) -> dict[str, float]:
        mem = self.snap.memory
        return {**self.table.metrics(), "sync_peak_bytes": mem.peak, "sync_budget_bytes": mem.budget}

    def close(self) -> None:
        self.pusher.close()
