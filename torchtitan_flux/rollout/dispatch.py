"""``Dispatcher``: how groups start (QUEUED -> RUNNING) and stop, on the engines or as episodes.

A training step's groups are drawn from the task once (``task_prompts``) into the table, then started:

* single-turn, per step: the step's groups split over the engines alive in proportion to their measured speed
  (``split.SpeedSplit``), one request per engine of consecutive groups;
* single-turn, streaming admission: one request per group, on engines in the same proportion;
* multi-turn: each group's own request (its sampling, seed and versions) goes to ``EpisodeGroups``, whose episodes
  send their turns themselves;
* evaluation: held-out groups on exactly one version, split evenly (multi-turn: as episodes).

A step restored in part from a checkpoint starts only its groups not in the table. Concurrency: main thread only.
"""

from __future__ import annotations

from typing import Callable

from torchtitan_flux.data.tasks import Prompt, task_prompts
from torchtitan_flux.engine.base import EngineHandler, GenerationRequest
from torchtitan_flux.rollout.episode_groups import EpisodeGroups, env_input
from torchtitan_flux.rollout.groups import Group, GroupState, GroupTable, eval_step
from torchtitan_flux.rollout.pump import EnginePump
from torchtitan_flux.rollout.requests import Sampling, Versions, even_counts, request


class Dispatcher:
    def __init__(self, table: GroupTable, pump: EnginePump, episodes: EpisodeGroups | None, task, tokenizer, *,
                 sampling: Sampling, group_size: int, prompts_per_step: int, temperature: float, streaming: bool,
                 task_timeout_s: float, interrupted: Callable[[], bool]):
        self.table, self.pump, self.episodes, self.task, self.tokenizer = table, pump, episodes, task, tokenizer
        self.sampling, self.group_size, self.prompts_per_step = sampling, group_size, prompts_per_step
        self.temperature, self.streaming, self.task_timeout_s = temperature, streaming, task_timeout_s
        self.interrupted = interrupted

    def dispatch(self, step: int, versions: Versions) -> None:
        """Draw ``step``'s prompts if the table lacks some, and start its QUEUED groups (once each)."""
        if len(self.table.of_step(step)) < self.prompts_per_step:  # not drawn yet (or restored in part)
            prompts = task_prompts(self.task, self.sampling.seed, step, self.prompts_per_step,
                                   self.sampling.max_new_tokens, self.task_timeout_s, interrupted=self.interrupted)
            for i, p in enumerate(prompts):
                if self.table.get(step, i) is None:
                    self.table.add(step, i, p, self.tokenizer.encode(p.text, add_bos=p.add_bos, add_eos=False))
        queued = [g for g in self.table.of_step(step) if g.state is GroupState.QUEUED]
        if not queued:
            return
        if self.episodes is not None:
            for g in queued:
                self._start_episodes(g, self._request([g], self.group_size, self.temperature, versions, step))
            return
        alive = self.pump.alive()
        counts = self.pump.split.split(len(queued), [e.name for e in alive])
        if self.streaming:  # one request per group, on engines in proportion to their speed
            engines = [e for e, n in zip(alive, counts) for _ in range(n)]
            for g, engine in zip(queued, engines):
                self._send([g], engine, self._request([g], self.group_size, self.temperature, versions, step))
            return
        self._send_split(queued, alive, counts, self.group_size, self.temperature, versions, step)

    def dispatch_eval(self, prompts: list[Prompt], prompt_ids: list[list[int]], n: int, temperature: float,
                      version: int) -> None:
        """The held-out prompts' groups on exactly policy ``version``, at ``eval_step(version)``."""
        groups = [self.table.add(eval_step(version), i, p, ids) for i, (p, ids) in enumerate(zip(prompts, prompt_ids))]
        versions = Versions(version, version, version)
        if self.episodes is not None:
            for g in groups:
                self._start_episodes(g, self._request([g], n, temperature, versions, version))
            return
        alive = self.pump.alive()
        self._send_split(groups, alive, even_counts(len(groups), len(alive)), n, temperature, versions, version)

    def stop(self, group: Group) -> None:
        """Whatever still generates ``group`` stops: its request is forgotten once no other group shares it (its
        result will be dropped), or its episodes are cancelled with their turns in flight."""
        if group.state is not GroupState.RUNNING:
            return
        req = group.request
        if self.episodes is not None:
            self.episodes.cancel(req.req_id)
            self.pump.forget(lambda r, turn: turn is None or turn.group != req.req_id)
        elif not any(g.request is req for g in self.table.in_state(GroupState.RUNNING) if g is not group):
            self.pump.forget(lambda r, turn: r is not req)

    def _send_split(self, groups: list[Group], engines: list[EngineHandler], counts: list[int], n: int,
                    temperature: float, versions: Versions, seed_step: int) -> None:
        """``counts[i]`` consecutive groups in one request on ``engines[i]``."""
        first = 0
        for engine, count in zip(engines, counts):
            if count:
                chunk = groups[first: first + count]
                self._send(chunk, engine, self._request(chunk, n, temperature, versions, seed_step))
            first += count

    def _request(self, groups: list[Group], n: int, temperature: float, versions: Versions,
                 seed_step: int) -> GenerationRequest:
        return request(self.pump.new_id(), groups, n, temperature, versions, self.sampling, seed_step)

    def _send(self, groups: list[Group], engine: EngineHandler, req: GenerationRequest) -> None:
        for g in groups:
            self.table.start(g, req)
        self.pump.send(req, engine)

    def _start_episodes(self, group: Group, req: GenerationRequest) -> None:
        self.table.start(group, req)
        self.episodes.start(req, env_input(group.prompt))
