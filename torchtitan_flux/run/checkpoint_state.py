"""``CheckpointState``: what a checkpoint holds beyond torchtitan's trainer state: the RNG state, the off-policy state
and rank 0's finished rollouts of later steps (broadcast from rank 0), and the dataset's position and identity.

Concurrency: main thread, called by torchtitan's ``CheckpointManager`` (collective on every rank).
"""

from __future__ import annotations

import logging
import pickle
from typing import Any, Protocol

import torch
import torch.distributed as dist

from torchtitan_flux.rl.off_policy import OffPolicyControl
from torchtitan_flux.run.stops import StopRequests
from torchtitan_flux.sync.syncer import control_group

logger = logging.getLogger("torchtitan_flux")


class RolloutState(Protocol):
    """Rank 0's rollout side as a checkpoint sees it (``rollout.rollouts.Rollouts``)."""

    def state_dict(self, timeout: float) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class CheckpointState:
    def __init__(self, off_policy: OffPolicyControl, rollouts: RolloutState | None, task, prompts_per_step: int,
                 config_changes: list[str], stops: StopRequests, timeout_s: float, world: int):
        self.off_policy, self.rollouts, self.task = off_policy, rollouts, task
        self.prompts_per_step, self.config_changes, self.world = prompts_per_step, config_changes, world
        self.stops, self.timeout_s = stops, timeout_s  # a save waits for rollouts in flight (less after a signal)

    def state_dict(self, step: int) -> dict[str, Any]:
        shared = [b"", pickle.dumps(self.off_policy.state_dict())]  # rank 0's finished rollouts, off-policy state
        if self.rollouts is not None:  # rank 0
            shared[0] = pickle.dumps(self.rollouts.state_dict(self.stops.wait_s(self.timeout_s)))
        if self.world > 1:  # every rank saves the same value, whichever one the checkpoint writer keeps
            dist.broadcast_object_list(shared, src=0, group=control_group())
        data = self.task.data_state(step, self.prompts_per_step) if hasattr(self.task, "data_state") else {}
        return {
            "rng": torch.get_rng_state(),
            "rollouts": shared[0],  # finished rollouts of later steps (async)
            "off_policy": shared[1],
            "data": pickle.dumps(data),  # dataset position (a function of the step) and identity; {}: generated
        }

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        torch.set_rng_state(state["rng"])
        self.off_policy.load_state_dict(pickle.loads(state["off_policy"]))
        if self.rollouts is not None and state["rollouts"]:
            if self.config_changes:  # generated and to be scored under the old settings (their batch shape too)
                logger.warning(f"the checkpoint's finished rollouts are not used ({', '.join(self.config_changes)} "
                               "changed): those steps are generated afresh")
            else:
                self.rollouts.load_state_dict(pickle.loads(state["rollouts"]))
        saved = pickle.loads(state["data"])
        if saved and hasattr(self.task, "check_resume") and self.rollouts is not None:  # rank 0
            problem = self.task.check_resume(saved, step, self.prompts_per_step)
            if problem:
                logger.warning(problem)
