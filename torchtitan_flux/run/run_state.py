"""``RunState``: what a checkpoint holds beyond torchtitan's trainer state (step, tokens seen).

The RNG state, the samples discarded as too stale, ``Admission``'s state (async ratio, forced sync, admission
carry, controller, pipeline depth: under the trainer's keys of old), rank 0's finished rollouts of later steps
and its sync cadence (pickled: their sizes vary; broadcast so that every rank saves the same value, whichever one
the checkpoint writer keeps), and the dataset's position and identity.

Concurrency: main thread, called by torchtitan's ``CheckpointManager`` on save and load (collective on every
rank when there are several); on load nothing is in flight.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_flux.rl.admission import Admission
from torchtitan_flux.rl.feed import BatchFeed
from torchtitan_flux.rollout.scheduler import RolloutScheduler
from torchtitan_flux.sync.syncer import control_group

logger = logging.getLogger("torchtitan_flux")


class RunState:
    def __init__(self, admission: Admission, feed: BatchFeed, scheduler: RolloutScheduler | None, task,
                 prompts_per_step: int, config_changes: list[str], save_wait_s: float):
        self.admission, self.feed, self.scheduler, self.task = admission, feed, scheduler, task
        self.prompts_per_step, self.config_changes = prompts_per_step, config_changes
        self.save_wait_s = save_wait_s  # a save waits this long for rollouts in flight (lowered on a signal)

    def state_dict(self, step: int) -> dict[str, Any]:
        rollouts = [b"", b""]  # rank 0's finished rollouts and sync cadence
        if self.scheduler is not None:  # rank 0
            rollouts[0] = pickle.dumps(self.scheduler.state_dict(self.save_wait_s))
            cadence = self.admission.cadence
            rollouts[1] = pickle.dumps(cadence.state_dict() if cadence is not None else None)
        if self.feed.world > 1:  # every rank saves the same value, whichever one the checkpoint writer keeps
            dist.broadcast_object_list(rollouts, src=0, group=control_group())
        data = self.task.data_state(step, self.prompts_per_step) if hasattr(self.task, "data_state") else {}
        return {
            "rng": torch.get_rng_state(),
            "discarded_rollouts": self.feed.discarded_rollouts,
            **self.admission.state_dict(),  # async_ratio, force_sync, admit_carry, controller
            "rollouts": rollouts[0],  # finished rollouts of later steps (async)
            "sync_cadence": rollouts[1],
            "data": pickle.dumps(data),  # dataset position (a function of the step) and identity; {}: generated
        }

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        torch.set_rng_state(state["rng"])
        self.feed.discarded_rollouts = int(state["discarded_rollouts"])
        self.admission.load_state_dict(state)
        if self.scheduler is not None and state.get("rollouts"):
            if self.config_changes:  # generated and to be scored under the old settings (their batch shape too)
                logger.warning(f"the checkpoint's finished rollouts are not used ({', '.join(self.config_changes)} "
                               "changed): those steps are generated afresh")
            else:
                self.scheduler.load_state_dict(pickle.loads(state["rollouts"]))
        cadence = pickle.loads(state["sync_cadence"]) if state.get("sync_cadence") else None
        if self.admission.cadence is not None and cadence is not None:  # absent in older checkpoints, or fixed
            self.admission.cadence.load_state_dict(cadence)
        saved = pickle.loads(state["data"]) if state.get("data") else {}  # absent before it existed
        if saved and hasattr(self.task, "check_resume") and self.scheduler is not None:  # rank 0
            problem = self.task.check_resume(saved, step, self.prompts_per_step)
            if problem:
                logger.warning(problem)
