"""The one builder of engine requests, and the versions a step's requests carry.

Every ``GenerationRequest`` of the rollout side is built here: a step's groups (one request per engine share, per
step), one group (streaming admission, a multi-turn group's own request, which its turns copy), or held-out groups
on exactly one version (evaluation). Seeds come from ``seeds.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torchtitan_flux.data.tasks import Prompt
from torchtitan_flux.engine.base import GenerationRequest
from torchtitan_flux.rollout.seeds import group_seed


class Group(Protocol):
    """What a request is built from of a group (``groups.Group``)."""

    step: int
    index: int
    prompt: Prompt
    prompt_ids: list[int]


@dataclass(frozen=True)
class Versions:
    """The versions a step's requests carry (``GenerationRequest``)."""

    trainer: int
    """The trainer's policy version at dispatch."""

    pin: int = -1
    """Embedded engines generate on exactly this version when they hold it (-1: the newest)."""

    min: int = 0
    """The oldest version the step may train on: engines start a request only once they hold it."""


@dataclass(frozen=True)
class Sampling:
    """How every request of a run samples (``[grpo]`` and ``[rollout]``)."""

    seed: int
    """``rollout.seed``."""

    top_k: int
    """``rollout.top_k``."""

    max_new_tokens: int
    """``rollout.max_new_tokens``: a request's budget where its prompts set none."""


def request(req_id: int, groups: list[Group], n: int, temperature: float, versions: Versions, sampling: Sampling,
            seed_step: int) -> GenerationRequest:
    """``n`` samples of each of ``groups`` (one step's, consecutive, in order), seeded by the first group (its
    ``seed_step``: the step, or the version an evaluation samples), with their largest budget
    (``Prompt.max_new_tokens``, else ``rollout.max_new_tokens``; a multi-turn group's turns have their own,
    ``EpisodeLimits``)."""
    budget = max(g.prompt.max_new_tokens or sampling.max_new_tokens for g in groups)
    return GenerationRequest(
        req_id=req_id, step=max(groups[0].step, 0), prompt_ids=[g.prompt_ids for g in groups], group_size=n,
        max_new_tokens=budget, temperature=temperature, top_k=sampling.top_k,
        seed=group_seed(sampling.seed, seed_step, groups[0].index), dispatch_version=versions.trainer,
        min_version=versions.min, pin_version=versions.pin,
    )


def even_counts(n: int, engines: int) -> list[int]:
    """``n`` groups split as evenly as possible over ``engines`` (the first ones get one more)."""
    return [n // engines + (i < n % engines) for i in range(engines)]
