"""How a training step takes its batch from the ``GroupTable``: two policies over the same groups.

* ``PerStep`` (the default): a step trains on its own groups, all of them. Its completions go to the reward pool
  when its last group finishes (so scoring overlaps training), and the batch waits for that future only when it is
  built.
* ``Streaming`` (``rollout.streaming_admission``): a step trains on the first ``prompts_per_step`` groups to finish
  among every step dispatched (its own and those admitted ahead), each scored alone as it finishes. Among the groups
  finished when one is taken, the oldest version first (a fresher group can wait for the next step; an older one
  would go stale), else in arrival order. A finished group older than the step's ``min_version`` by its oldest token
  is regenerated (``stale_samples``), never trained on. Groups still generating when a step has its batch stay for
  later steps (``rollout.streaming_carry_over``) or, without carry-over, the step's own are restarted from scratch
  (``restarted_groups``). A prompt is trained on once: a TAKEN group is never generated again, and a step admitted
  ahead whose groups were all taken stays in the table until its own turn (its dispatch must not start it afresh).

Both take the groups (FINISHED -> TAKEN) and lay them out (``batch.layout_batch``). Concurrency: main thread only.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Callable

from torchtitan_flux.data.rewards import Scores
from torchtitan_flux.engine.base import GenerationResult
from torchtitan_flux.errors import RolloutWaitInterrupted
from torchtitan_flux.rollout.batch import CompletionScorer, RolloutBatch, conversation_text, layout_batch
from torchtitan_flux.rollout.episode import openings_too_long
from torchtitan_flux.rollout.episode_groups import episode_record
from torchtitan_flux.rollout.groups import Group, GroupState, GroupTable
from torchtitan_flux.rollout.waiting import WaitNotes
from torchtitan_flux.rollout.requests import Versions

logger = logging.getLogger("torchtitan_flux")


class PerStep:
    """The module docstring's default policy."""

    def __init__(self, table: GroupTable, scoring: CompletionScorer, task, *, group_size: int, pad_id: int,
                 wait: Callable[[int], WaitNotes], interrupted: Callable[[], bool]):
        self.table, self.scoring, self.task = table, scoring, task
        self.group_size, self.pad_id, self.wait, self.interrupted = group_size, pad_id, wait, interrupted

    def finished(self, group: Group) -> None:
        """A group of a training step finished: once the step's last one has, its completions go to the pool."""
        groups = self.table.of_step(group.step)
        if all(g.state is GroupState.FINISHED for g in groups):
            score(self.scoring, self.table, self.task, groups, self.group_size)

    def collect(self, step: int, versions: Versions) -> RolloutBatch:
        groups = self.table.of_step(step)
        waiting = self.wait(step)
        while any(g.state is not GroupState.FINISHED for g in groups):
            waiting.pump()
        stop = openings_too_long([ep for g in groups for ep in g.episodes or ()], step)
        if stop is not None:  # before the rewards: nothing was generated to score
            raise stop
        if groups[0].scores is None:  # restored finished from a checkpoint: scored here
            score(self.scoring, self.table, self.task, groups, self.group_size)
        for g in groups:  # the step is done with (interrupted below: generated afresh, nothing was trained)
            self.table.take(g)
            self.table.drop(g)
        scores = self.scoring.wait(groups[0].scores, self.interrupted)
        if scores is None:
            raise RolloutWaitInterrupted(f"interrupted while waiting for the rewards of step {step}")
        return build(step, groups, scores, self.group_size, self.pad_id, waiting.waited_s)

    def metrics(self) -> dict[str, float]:
        return {}


class Streaming:
    """The module docstring's streaming admission. ``dispatch(step, versions)`` sends a step's QUEUED groups
    (``Rollouts.dispatch``); ``restart(group)`` stops what still generates ``group`` (it is requeued after)."""

    def __init__(self, table: GroupTable, scoring: CompletionScorer, task, *, group_size: int, pad_id: int,
                 prompts_per_step: int, carry_over: bool, wait: Callable[[int], WaitNotes],
                 interrupted: Callable[[], bool], dispatch: Callable[[int, Versions], None],
                 restart: Callable[[Group], None], has_events: Callable[[], bool], pump: Callable[[float], None]):
        self.table, self.scoring, self.task = table, scoring, task
        self.group_size, self.pad_id, self.prompts_per_step, self.carry_over = (group_size, pad_id,
                                                                                prompts_per_step, carry_over)
        self.wait, self.interrupted, self.dispatch, self.restart = wait, interrupted, dispatch, restart
        self.has_events, self.pump = has_events, pump
        self.stale_samples = self.restarted_groups = 0
        self._arrived: list[tuple[GenerationResult, Future]] = []  # groups finished since the last batch
        self.generated: dict[str, float] = {}  # mean length and reward of the groups finished during the last
        # collect's window, trained or not (the bias toward short completions: docs/benchmarks.md)

    def finished(self, group: Group) -> None:
        """A group finished: scored alone, ready to be taken."""
        score(self.scoring, self.table, self.task, [group], self.group_size)
        self._arrived.append((group.result, group.scores))

    def collect(self, step: int, versions: Versions) -> RolloutBatch:
        for k in self.table.steps():  # restored from a checkpoint, older than the admission's steps
            if 0 <= k < step:
                self.dispatch(k, versions)
        chosen: list[Group] = []
        waiting = self.wait(step)
        while len(chosen) < self.prompts_per_step:
            while self.has_events():  # every group finished by now is a candidate
                self.pump(0)
            ready = [g for g in self.table.in_state(GroupState.FINISHED) if g not in chosen and g.step >= 0]
            if not ready:
                waiting.pump()
                continue
            group = min(ready, key=lambda g: (g.result.version, g.finished_order))  # the oldest first
            if group.result.version >= versions.min:  # the bound is on the oldest token (GenerationResult.version)
                chosen.append(group)
                continue
            self.stale_samples += group.result.tokens.shape[0]
            logger.info(f"step {step}: a group of step {group.step} from version {group.result.version} is older "
                        f"than {versions.min} allows (off_policy.max_version_gap); regenerating it")
            self._regenerate(group, versions)
        if not self.carry_over:
            for g in [g for g in self.table.of_step(step) if g.state is GroupState.RUNNING]:
                if g.state is GroupState.RUNNING:  # (a dispatch above may pump it to FINISHED meanwhile)
                    self.restarted_groups += 1
                    self._regenerate(g, versions)
        chosen.sort(key=lambda g: (g.step, g.index))
        stop = openings_too_long([ep for g in chosen for ep in g.episodes or ()], step)
        if stop is not None:
            raise stop
        scores = []
        for g in chosen:
            got = self.scoring.wait(g.scores, self.interrupted)
            if got is None:
                raise RolloutWaitInterrupted(f"interrupted while waiting for the rewards of step {step}")
            scores.append(got)
        batch = build(step, chosen, Scores.concat(scores), self.group_size, self.pad_id, waiting.waited_s)
        for g in chosen:
            self.table.take(g)
        self.generated = self._generated_stats()
        for k in self.table.steps():
            groups = self.table.of_step(k)
            if 0 <= k <= step and all(g.state is GroupState.TAKEN for g in groups):
                for g in groups:
                    self.table.drop(g)
        return batch

    def _regenerate(self, group: Group, versions: Versions) -> None:
        self.restart(group)
        self.table.requeue(group)
        self.dispatch(group.step, versions)

    def _generated_stats(self) -> dict[str, float]:
        """Mean completion length (the model's tokens: a multi-turn episode's environment tokens left out) and reward
        of every group finished since the last batch (their rewards waited for), trained or not; the window starts
        afresh."""
        arrived, self._arrived = self._arrived, []
        lengths = [float(x) for r, _ in arrived
                   for x in (r.lengths if r.model_mask is None else r.model_mask.sum(1)).tolist()]
        scores = [self.scoring.wait(future, self.interrupted) for _, future in arrived]
        rewards = [r for got in scores if got is not None for r in got.total]  # None: interrupted (the run stops)
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        return {"generated_completion_len_mean": mean(lengths), "generated_reward_mean": mean(rewards)}

    def metrics(self) -> dict[str, float]:
        return {"stale_samples": self.stale_samples, "restarted_groups": self.restarted_groups, **self.generated}


def score(scoring: CompletionScorer, table: GroupTable, task, groups: list[Group], n: int) -> None:
    """``groups`` (FINISHED, ``n`` samples each, in order) to the reward pool as one submission; multi-turn groups
    are scored as conversations. Each group keeps its completions and the submission's future."""
    prompts = [g.prompt for g in groups]
    if groups[0].episodes is not None:
        completions, future = scoring.submit_episodes(task, prompts, [g.episodes for g in groups])
    else:
        completions, future = scoring.submit(task, prompts, [g.result for g in groups], n)
    for i, g in enumerate(groups):
        table.scored(g, completions[i * n: (i + 1) * n], future)


def build(step: int, groups: list[Group], scores: Scores, n: int, pad_id: int, waited_s: float) -> RolloutBatch:
    """Step ``step``'s batch of ``groups`` (FINISHED, in order) and their ``scores``, laid out for training, with
    their episodes (``completions.jsonl``; their prompt: the first episode's opening messages) where they have
    some, and the time its collection waited on the engines (``waited_s``)."""
    batch = layout_batch(step, [g.prompt for g in groups], [g.trained_prompt_ids for g in groups],
                         [(g.request, g.result) for g in groups], scores, [c for g in groups for c in g.completions],
                         n, pad_id)
    batch.generation_wait_s = waited_s
    if groups[0].episodes is not None:
        batch.episodes = [episode_record(ep) for g in groups for ep in g.episodes]
        batch.prompts = [conversation_text(g.episodes[0].messages[: g.episodes[0].prompt_messages]) for g in groups]
    return batch


def rows(result: GenerationResult, k: int, n: int) -> GenerationResult:
    """The ``k``-th group's ``n`` rows of a request's ``result`` (the request's other fields as they are)."""
    cut = slice(k * n, (k + 1) * n)
    pick = lambda t: None if t is None else t[cut]  # noqa: E731
    return GenerationResult(result.req_id, result.engine, result.tokens[cut], result.logprobs[cut],
                            result.lengths[cut], result.version, result.newest_seen, result.gen_time_s,
                            pick(result.token_versions), pick(result.model_mask))
