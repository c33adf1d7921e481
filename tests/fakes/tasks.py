"""Tasks for tests that dispatch rollouts without a dataset."""

from __future__ import annotations

from torchtitan_flux.data.rewards import RewardFunc
from torchtitan_flux.data.tasks import Prompt


class FakeTask:
    """Prompts ``p{step}_{i}``, one reward function that scores 0."""

    chat = False
    reward_funcs = [RewardFunc("zero", lambda completions, **kw: [0.0] * len(completions))]

    def prompts(self, seed, step, n):
        return [Prompt(f"p{step}_{i}") for i in range(n)]
