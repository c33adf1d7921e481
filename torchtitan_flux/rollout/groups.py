"""``GroupTable``: the one owner of every rollout group's state on rank 0 (docs/architecture.md, "Rollouts").

A group is one prompt of one training step and its ``group_size`` samples, keyed by (step, index): the index is
the prompt's place in the step's prompt list. Its life::

    QUEUED --start--> RUNNING --finish--> FINISHED --take--> TAKEN
       ^                 |                    |
       +----requeue------+--------------------+            (stale or restarted: generated afresh)
    any state --drop--> DROPPED                            (a discarded step; a shutdown)

Every field below the key is set only by the transition methods here (``init=False``; checked by
``tests/unit/test_groups.py``, which parses every module of the package), so what a group holds follows from its
state: a RUNNING group has its ``request``; a FINISHED one its ``result`` (its rows of the request's result) and,
multi-turn, its ``episodes`` and the ``opening`` they share, which is the prompt it is trained on; the collection
policies (``collect.py``) add its scoring (``scored``) and take it.

``state_dict`` is the rollout side's checkpoint: the FINISHED groups (trained on as they are after a resume, never
regenerated) and which prompts were TAKEN already (streaming admission: a resumed step generates only the rest).
A group still RUNNING is left out and generated afresh on resume.

Concurrency: main thread only (``Rollouts``); episodes and engine threads never touch the table.
"""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field

from torchtitan_flux.data.tasks import Prompt
from torchtitan_flux.engine.base import GenerationRequest, GenerationResult


class GroupState(enum.Enum):
    QUEUED = "queued"  # known (its prompt drawn), not sent to any engine or episodes yet
    RUNNING = "running"  # its request is on an engine, or its episodes run
    FINISHED = "finished"  # its result is in; scored (``scored``) before it is taken
    TAKEN = "taken"  # in a training batch
    DROPPED = "dropped"  # forgotten: its result, if one still arrives, is dropped


@dataclass(eq=False)
class Group:
    """One prompt of step ``step`` (``index`` in its prompt list) and its samples."""

    step: int
    """The training step it was drawn for (an evaluation's groups: ``eval_step(version)``, below 0)."""

    index: int
    """Its prompt's index in the step's prompt list (its seed and order in a batch follow from it)."""

    prompt: Prompt
    """The task's prompt."""

    prompt_ids: list[int]
    """The prompt's tokens, as sent to an engine (multi-turn groups send none: their episodes render openings)."""

    state: GroupState = field(default=GroupState.QUEUED, init=False)
    """Where it is in its life (module docstring)."""

    request: GenerationRequest | None = field(default=None, init=False)
    """RUNNING and later: the request that generates it (single-turn: possibly with other groups of its step), or
    the group's own request of its episodes (multi-turn: sampling, seed and versions of every turn)."""

    result: GenerationResult | None = field(default=None, init=False)
    """FINISHED and later: its ``group_size`` rows of the request's result (multi-turn: the episodes' tokens after
    ``opening``)."""

    episodes: list | None = field(default=None, init=False)
    """FINISHED multi-turn groups: their ``episode.Episode``s, in order."""

    opening: list[int] | None = field(default=None, init=False)
    """FINISHED multi-turn groups: the opening tokens every episode starts with (the prompt trained on)."""

    completions: list[str] | None = field(default=None, init=False)
    """Scored: the decoded completions (or conversations) of its samples."""

    scores: Future | None = field(default=None, init=False)
    """Scored: the future of its ``rewards.Scores`` (the reward pool's)."""

    finished_order: int = field(default=-1, init=False)
    """FINISHED and later: how many groups finished before it (arrival order, kept across a resume)."""

    @property
    def trained_prompt_ids(self) -> list[int]:
        """The prompt tokens its samples are laid out after: the episodes' shared opening, else the prompt."""
        return self.opening if self.opening is not None else self.prompt_ids


def eval_step(version: int) -> int:
    """Where the evaluation of policy ``version`` keeps its groups: a step below 0, never a training step's."""
    return -1 - version


class GroupTable:
    """Every group by (step, index), and the transitions of the module docstring."""

    def __init__(self):
        self._groups: dict[tuple[int, int], Group] = {}
        self._finished = 0  # groups finished so far (``Group.finished_order``)

    # -- queries
    def get(self, step: int, index: int) -> Group | None:
        return self._groups.get((step, index))

    def of_step(self, step: int) -> list[Group]:
        """The step's groups (any state but DROPPED), in prompt order."""
        return sorted((g for (s, _), g in self._groups.items() if s == step), key=lambda g: g.index)

    def shape(self, step: int, default_budget: int) -> tuple[float, int]:
        """``step``'s prompts: their mean length in tokens and their largest generation budget
        (``Prompt.max_new_tokens``, else ``default_budget``); (0, 0) when none is drawn."""
        groups = self.of_step(step)
        if not groups:
            return 0.0, 0
        return (sum(len(g.prompt_ids) for g in groups) / len(groups),
                max(g.prompt.max_new_tokens or default_budget for g in groups))

    def steps(self) -> list[int]:
        return sorted({s for s, _ in self._groups})

    def in_state(self, state: GroupState) -> list[Group]:
        return [g for g in self._groups.values() if g.state is state]

    def __contains__(self, group: Group) -> bool:
        return self._groups.get((group.step, group.index)) is group

    # -- transitions
    def add(self, step: int, index: int, prompt: Prompt, prompt_ids: list[int]) -> Group:
        """A new QUEUED group (replacing none: a key is added once until dropped)."""
        if (step, index) in self._groups:
            raise RuntimeError(f"group ({step}, {index}) is already in the table")
        group = self._groups[(step, index)] = Group(step, index, prompt, prompt_ids)
        return group

    def start(self, group: Group, request: GenerationRequest) -> None:
        """QUEUED -> RUNNING on ``request``."""
        self._expect(group, GroupState.QUEUED)
        group.request, group.state = request, GroupState.RUNNING

    def finish(self, group: Group, result: GenerationResult, episodes: list | None = None,
               opening: list[int] | None = None) -> None:
        """RUNNING -> FINISHED with its rows of the result (and, multi-turn, its episodes and their opening)."""
        self._expect(group, GroupState.RUNNING)
        group.result, group.episodes, group.opening, group.state = result, episodes, opening, GroupState.FINISHED
        group.finished_order, self._finished = self._finished, self._finished + 1

    def scored(self, group: Group, completions: list[str], scores: Future) -> None:
        """A FINISHED group's completions went to the reward pool."""
        self._expect(group, GroupState.FINISHED)
        group.completions, group.scores = completions, scores

    def take(self, group: Group) -> None:
        """FINISHED -> TAKEN: it is in a batch."""
        self._expect(group, GroupState.FINISHED)
        group.state = GroupState.TAKEN

    def requeue(self, group: Group) -> None:
        """RUNNING or FINISHED -> QUEUED: generated afresh (stale, or restarted unfinished)."""
        if group.state not in (GroupState.RUNNING, GroupState.FINISHED):
            raise RuntimeError(f"group ({group.step}, {group.index}) is {group.state.value}; cannot requeue it")
        group.state = GroupState.QUEUED
        group.request = group.result = group.episodes = group.opening = group.completions = group.scores = None

    def drop(self, group: Group) -> None:
        """Any state -> DROPPED, and out of the table."""
        group.state = GroupState.DROPPED
        if self._groups.get((group.step, group.index)) is group:
            del self._groups[(group.step, group.index)]

    def _expect(self, group: Group, state: GroupState) -> None:
        if group.state is not state or group not in self:
            raise RuntimeError(f"group ({group.step}, {group.index}) is {group.state.value}; expected {state.value}")

    # -- checkpoint
    def state_dict(self, whole_steps_only: bool) -> dict:
        """The FINISHED groups in arrival order (``whole_steps_only``: only of steps whose every group is FINISHED,
        as per-step collection trains a step whole) and the TAKEN ones, of every training step."""
        whole = {s for s in self.steps() if all(g.state is GroupState.FINISHED for g in self.of_step(s))}
        finished = sorted((g for g in self.in_state(GroupState.FINISHED)
                           if g.step >= 0 and (g.step in whole or not whole_steps_only)),
                          key=lambda g: g.finished_order)
        return {"finished": [_saved(g) for g in finished],
                "taken": [_saved(g) for g in self.in_state(GroupState.TAKEN)]}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict``'s groups as they were: FINISHED (in their arrival order) and TAKEN."""
        for kind in ("finished", "taken"):
            for step, index, prompt, prompt_ids, request, result, episodes, opening in state[kind]:
                group = self.add(step, index, prompt, prompt_ids)
                self.start(group, request)
                self.finish(group, result, episodes, opening)
                if kind == "taken":
                    self.take(group)


def _saved(g: Group) -> tuple:
    return g.step, g.index, g.prompt, g.prompt_ids, g.request, g.result, g.episodes, g.opening
