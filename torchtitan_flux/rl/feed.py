"""``BatchFeed``: each training step's batch — admitted and collected on rank 0, broadcast to every rank.

Per step (``next``): in async push mode an on-policy step first flushes the newest weights to the engines; rank 0
asks ``Admission`` how many steps ahead to dispatch, dispatches them pinned to the newest staged version, and
collects this step's rollouts, discarding (and counting) a batch whose oldest sample is more than
``max_version_gap`` versions behind the trainer; then the batch, whether this step pushes, and rank 0's cadence
and pipeline-depth choices go to every rank, which replays the admission so every rank checkpoints the same
state.

Invariant (no step waits on a version nothing will deliver): the version rollouts are pinned to is never older
than the oldest the step may train on (``version - max_version_gap``). Coalesced pushes can leave staging that
old, and then every regeneration would be discarded while no optimizer step -- hence no push -- can come: so
every rank first has the syncer stage the current weights (``WeightSyncer.catch_up``), and before each wait for
rollouts rank 0 has the staged version sent to every engine that lacks it (``WeightSyncer.deliver_staged``).

Concurrency: main thread of every trainer rank, between training steps; only rank 0 holds the scheduler. The
broadcast runs on the CPU control group (gloo), so a slow rollout never trips an NCCL timeout.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch.distributed as dist

from torchtitan_flux.rl.admission import Admission
from torchtitan_flux.rollout.scheduler import RolloutScheduler
from torchtitan_flux.rollout.batch import RolloutBatch
from torchtitan_flux.sync.syncer import WeightSyncer, control_group

logger = logging.getLogger("torchtitan_flux")


@dataclass
class StepInput:
    batch: RolloutBatch
    wait_s: float  # seconds from asking for the batch to having it (flush included)
    flush_s: float  # of which the on-policy flush (or the catch-up staging) of the newest weights
    push_due: bool  # this step's weights are pushed after its optimizer step


class BatchFeed:
    def __init__(self, admission: Admission, scheduler: RolloutScheduler | None, syncer: WeightSyncer, *,
                 max_version_gap: int, async_push: bool, last_step: int, rank: int, world: int):
        self.admission, self.scheduler, self.syncer = admission, scheduler, syncer
        self.max_version_gap, self.async_push, self.last_step = max_version_gap, async_push, last_step
        self.rank, self.world = rank, world
        self.discarded_rollouts = 0  # samples thrown away as too stale (checkpointed by the trainer)

    def next(self, step: int, version: int) -> StepInput:
        """Step ``step``'s batch, with the trainer at policy ``version`` (= ``step - 1``)."""
        t0 = time.perf_counter()
        if self.admission.on_policy and self.async_push:
            self.syncer.flush(version)  # on-policy step: engines must hold the newest weights first
        else:  # every rank: the invariant of the module docstring
            self.syncer.catch_up(version, oldest=version - self.max_version_gap)
        flush_s = time.perf_counter() - t0
        batch = None
        if self.rank == 0:
            batch = self._collect(step, version)
        wait_s = time.perf_counter() - t0
        due = self.admission.push_due(step)
        if self.world > 1:
            batch, due = self._broadcast(batch, due)
        return StepInput(batch, wait_s, flush_s, due)

    def _collect(self, step: int, version: int) -> RolloutBatch:
        ahead = self.admission.admit()
        pin = self.syncer.version  # newest staged: every engine gets it, so requests can run on exactly it
        if pin < version - self.max_version_gap:  # next() staged the newest weights: cannot happen
            raise RuntimeError(f"step {step}: staged weight version {pin} is older than max_version_gap allows "
                               f"(trainer at {version}); its rollouts would be discarded forever")
        for k in range(step, min(step + ahead, self.last_step) + 1):
            self.scheduler.dispatch(k, version, pin_version=pin)
        while True:
            self.syncer.deliver_staged()  # the pin reaches every engine, broken groups included
            batch = self.scheduler.collect(step, version, pin_version=pin)
            gap = version - int(batch.versions.min())
            if gap <= self.max_version_gap:
                break
            self.discarded_rollouts += batch.tokens.shape[0]
            logger.warning(f"step {step}: rollouts {gap} versions old exceed max_version_gap; regenerating")
        self.syncer.check_timeouts()
        return batch

    def _broadcast(self, batch: RolloutBatch | None, due: bool) -> tuple[RolloutBatch, bool]:
        a = self.admission
        depth = a.depth.depth if a.depth is not None else 0
        obj = [batch, due, a.sync_interval, depth]
        dist.broadcast_object_list(obj, src=0, group=control_group())  # CPU gloo: no NCCL timeout
        batch, due, interval, depth = obj
        if self.rank != 0:  # the same inputs as rank 0's admission, so every rank checkpoints the same carry
            if a.cadence is not None:
                a.cadence.interval = interval
            if a.depth is not None:
                a.depth.depth = depth
            a.admit()
        return batch, due
