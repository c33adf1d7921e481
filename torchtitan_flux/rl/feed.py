"""``BatchFeed``: each training step's batch — admitted and collected on rank 0, broadcast to every rank.

Invariant (no step waits on a version nothing will deliver): the version rollouts are pinned to is never older
than the oldest the step may train on (``OffPolicyControl.oldest``): every rank first has the syncer stage the
current weights if staging is that old (``WeightSyncer.catch_up``), and before each wait for rollouts rank 0 has
the staged version sent to every engine that lacks it (``WeightSyncer.deliver_staged``).

Concurrency: main thread of every trainer rank, between training steps; only rank 0 holds the rollout side. The
broadcast runs on the CPU control group (gloo), so a slow rollout never trips an NCCL timeout. A collection that
fails on rank 0 (a reward function's error or deadline, a task's bad prompt, no engine left) is broadcast in place
of the batch, so every rank stops on the same error instead of the others waiting for a batch that never comes.
So is whether the step is the run's last (``StepInput.last``: a task may finish early, ``Task.finished``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist

from torchtitan_flux.data.tasks import task_finished
from torchtitan_flux.errors import NoEngineLeft, RewardError, UserCodeError
from torchtitan_flux.rl.off_policy import OffPolicyControl
from torchtitan_flux.rollout.batch import RolloutBatch
from torchtitan_flux.sync.syncer import WeightSyncer, control_group


class RolloutSource(Protocol):
    """What the feed uses of rank 0's rollout side (``rollout.rollouts.Rollouts``)."""

    task: object
    task_timeout_s: float
    interrupted: bool

    def dispatch(self, step: int, trainer_version: int, pin_version: int = -1, min_version: int = 0) -> None: ...

    def collect(self, step: int, trainer_version: int, pin_version: int = -1,
                min_version: int = 0) -> RolloutBatch: ...

    def shape(self, step: int) -> tuple[float, int]: ...


@dataclass
class StepInput:
    batch: RolloutBatch
    wait_s: float  # seconds from asking for the batch to having it (flush included)
    flush_s: float  # of which the on-policy flush (or the catch-up staging) of the newest weights
    push_due: bool  # this step's weights are pushed after its optimizer step
    last: bool  # the run ends after this step: training.steps, or the task finished (``Task.finished``)
    budgets: tuple[float, int, int] = (0.0, 0, 0)  # rank 0: this step's mean prompt tokens and generation budget,
    # and the newest admitted step's budget (``Rollouts.shape``): what the throughput law anticipates


class BatchFeed:
    def __init__(self, off_policy: OffPolicyControl, rollouts: RolloutSource | None, syncer: WeightSyncer, *,
                 async_push: bool, last_step: int, rank: int, world: int):
        self.off_policy, self.rollouts, self.syncer = off_policy, rollouts, syncer
        self.async_push, self.last_step, self.rank, self.world = async_push, last_step, rank, world

    def next(self, step: int, version: int) -> StepInput:
        """Step ``step``'s batch, with the trainer at policy ``version`` (= ``step - 1``)."""
        t0 = time.perf_counter()
        if self.off_policy.on_policy and self.async_push:
            self.syncer.flush(version)  # on-policy step: engines must hold the newest weights first
        else:  # every rank: the invariant of the module docstring
            self.syncer.catch_up(version, oldest=self.off_policy.oldest(version))
        flush_s = time.perf_counter() - t0
        batch = stop = None
        budgets = (0.0, 0, 0)
        last = step >= self.last_step
        if self.rank == 0:
            try:
                batch, budgets = self._collect(step, version)
                last = last or self._task_finished(step)
            except (RewardError, NoEngineLeft, UserCodeError) as e:
                if self.world == 1:
                    raise
                stop = e
        wait_s = time.perf_counter() - t0
        due = self.off_policy.push_due(step)
        if self.world > 1:
            batch, due, last, stop = self._broadcast(batch, due, last, stop)
            if stop is not None:
                raise stop
        return StepInput(batch, wait_s, flush_s, due, last, budgets)

    def _task_finished(self, step: int) -> bool:
        """The task's ``finished(step)`` (user code: its failure names it, and every rank stops on it)."""
        r = self.rollouts
        return task_finished(r.task, step, r.task_timeout_s, interrupted=lambda: r.interrupted)

    def _collect(self, step: int, version: int) -> tuple[RolloutBatch, tuple[float, int, int]]:
        """Admit the steps ahead, then wait for ``step``'s batch: (the batch, ``StepInput.budgets``)."""
        policy = self.off_policy
        ahead = policy.admit()
        pin = self.syncer.version  # newest staged: every engine gets it, so requests can run on exactly it
        if pin < policy.oldest(version):  # next() staged the newest weights: cannot happen
            raise RuntimeError(f"step {step}: staged weight version {pin} is older than max_version_gap allows "
                               f"(trainer at {version}); its rollouts would be discarded forever")
        newest = min(step + ahead, self.last_step)
        for k in range(step, newest + 1):
            # born fresh enough: step k is trained at version k - 1, so the engine waits for oldest(k - 1)
            self.rollouts.dispatch(k, version, pin_version=pin, min_version=max(0, policy.oldest(k - 1)))
        budgets = (*self.rollouts.shape(step), self.rollouts.shape(newest)[1])
        while True:
            self.syncer.deliver_staged()  # the pin reaches every engine, broken groups included
            batch = self.rollouts.collect(step, version, pin_version=pin, min_version=max(0, policy.oldest(version)))
            if policy.accept(step, version, batch):
                break
        self.syncer.check_timeouts()
        return batch, budgets

    def _broadcast(self, batch: RolloutBatch | None, due: bool, last: bool, stop: Exception | None):
        obj = [batch, due, last, self.off_policy.decision(), stop]
        dist.broadcast_object_list(obj, src=0, group=control_group())  # CPU gloo: no NCCL timeout
        batch, due, last, decision, stop = obj
        if self.rank != 0 and stop is None:
            self.off_policy.adopt(decision)
        return batch, due, last, stop
