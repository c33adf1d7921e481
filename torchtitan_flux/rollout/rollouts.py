"""``Rollouts``: rank 0's rollout side, composed of the engines (``EngineFleet``), the pump of their events
(``EnginePump``), the one owner of group state (``GroupTable``), a collection policy (``PerStep`` or ``Streaming``),
the reward pool, the multi-turn episodes (``EpisodeGroups``, with ``rollout.environment``) and the weight syncer
that sends to the engines. The trainer, the batch feed and the evaluator use its public methods only.

One life for every group, single- or multi-turn (``groups.py``): ``dispatch`` draws a step's prompts into the table
(QUEUED) and starts them (RUNNING, ``dispatch.py``: on engine requests, or as G episodes that send their own
turns). Its result (a request's rows, or the episodes' ``GroupEnded``) finishes it (FINISHED) and the policy scores
it; ``collect`` takes a step's batch as the policy says (TAKEN).

Direction: ``Rollouts`` builds rank 0's ``WeightSyncer`` with the pump's ``pump`` (the syncer waits by pumping); the
pump hands acks and engine errors to the syncer (``on_event``), a dead engine to ``_replace`` (which restarts it
through the fleet and has the syncer rejoin it, a server once reconnected: ``_on_reconnected``). Ranks > 0 have no
rollout side. Concurrency: the main thread; the pump's router and the episodes' thread only as the pump's docstring
says. An environment's failure is kept (``episode_failure``) and raised by the next wait for rollouts, so a
checkpoint's pumping never raises it.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Callable

import torch

from torchtitan_flux.data.rewards import Scores
from torchtitan_flux.data.tasks import Prompt
from torchtitan_flux.engine.base import EngineError, EngineHandler, GenerationResult, WeightAck
from torchtitan_flux.errors import NoEngineLeft
from torchtitan_flux.models import hf
from torchtitan_flux.models.hf_weights import HFLayout
from torchtitan_flux.rollout.batch import CompletionScorer, RolloutBatch
from torchtitan_flux.rollout.collect import PerStep, Streaming, rows, score
from torchtitan_flux.rollout.dispatch import Dispatcher
from torchtitan_flux.rollout.engines import EngineFleet
from torchtitan_flux.rollout.episode_groups import EpisodeGroups, GroupEnded, TurnSender, episode_groups, group_result
from torchtitan_flux.rollout.groups import GroupState, GroupTable, eval_step
from torchtitan_flux.rollout.pump import EnginePump, InFlight
from torchtitan_flux.rollout.reconnect import Reconnected, Reconnecting
from torchtitan_flux.rollout.requests import Sampling, Versions
from torchtitan_flux.rollout.split import SpeedSplit
from torchtitan_flux.rollout.waiting import WaitNotes, interrupted_wait
from torchtitan_flux.sync.syncer import WeightSyncer

logger = logging.getLogger("torchtitan_flux")


class Rollouts:
    """Built by ``start`` for a run; tests build it over engines of their own (``fleet`` None: a dead engine is
    dropped, not replaced; no syncer: acks and engine errors are only logged)."""

    def __init__(self, engines: list[EngineHandler], raw: queue.Queue, task, tokenizer, *, group_size: int,
                 prompts_per_step: int, max_new_tokens: int, temperature: float, top_k: int, seed: int, pad_id: int,
                 dead_zone: float = 0.1, max_share: float = 0.75, reward_workers: int = 1,
                 reward_timeout_s: float = 300.0, task_timeout_s: float = 300.0, stall_s: float = 600.0,
                 streaming: bool = False, carry_over: bool = True,
                 episodes: Callable[[queue.Queue, TurnSender], EpisodeGroups] | None = None,
                 fleet: EngineFleet | None = None):
        """``raw``: the queue every engine reports to; ``streaming``, ``carry_over``: ``rollout.streaming_admission``
        and ``rollout.streaming_carry_over``; ``episodes(raw, sender)``: builds the multi-turn groups
        (``rollout.environment``), None: single-turn."""
        self.task, self.fleet, self.streaming = task, fleet, streaming
        self.max_new_tokens, self.task_timeout_s = max_new_tokens, task_timeout_s  # read by the feed and evaluation
        self.interrupted = False  # set by ``interrupt`` (a signal handler may call it: a plain flag, no lock)
        self.episode_failure: BaseException | None = None  # the first group that failed (an environment's error)
        self.syncer: WeightSyncer | None = None  # ``start``'s
        self.table = GroupTable()
        multi_turn = episodes is not None
        self.pump = EnginePump(engines, raw, split=SpeedSplit([e.name for e in engines], dead_zone, max_share),
                               stall_s=stall_s, replace=self._replace, handlers={
                                   GenerationResult: self._on_result, GroupEnded: self._on_group_ended,
                                   WeightAck: self._on_weight_event, EngineError: self._on_weight_event,
                                   Reconnected: self._on_reconnected}, turns=multi_turn)
        self.episodes = episodes(raw, self.pump) if multi_turn else None
        self.scoring = CompletionScorer(task, tokenizer, reward_workers, reward_timeout_s)
        self.dispatcher = Dispatcher(self.table, self.pump, self.episodes, task, tokenizer,
                                     sampling=Sampling(seed, top_k, max_new_tokens),
                                     group_size=group_size, prompts_per_step=prompts_per_step, temperature=temperature,
                                     streaming=streaming, task_timeout_s=task_timeout_s,
                                     interrupted=lambda: self.interrupted)
        common = dict(group_size=group_size, pad_id=pad_id, wait=self._wait, interrupted=lambda: self.interrupted)
        self.policy = Streaming(
            self.table, self.scoring, task, prompts_per_step=prompts_per_step, carry_over=carry_over,
            dispatch=self.dispatcher.dispatch, restart=self.dispatcher.stop, has_events=self.pump.has_events,
            pump=self.pump.pump, **common,
        ) if streaming else PerStep(self.table, self.scoring, task, **common)

    @classmethod
    def start(cls, job_config, task, tokenizer, model: torch.nn.Module, *, device: torch.device,
              stops) -> "Rollouts":
        """A run's rollout side: its engines started (``EngineFleet``), the syncer that sends to them built.
        ``stops``: the run's ``StopRequests`` (read: ``signal``)."""
        jc, r = job_config, job_config.rollout
        raw: queue.Queue = queue.Queue()
        fleet = EngineFleet(job_config, raw, device=device, stops=stops)
        engines: list[EngineHandler] = []
        rollouts = None
        try:
            engines = fleet.start()
            rollouts = cls(
                engines, raw, task, tokenizer, group_size=jc.grpo.group_size, prompts_per_step=r.prompts_per_step,
                max_new_tokens=r.max_new_tokens, temperature=jc.grpo.temperature, top_k=r.top_k, seed=r.seed,
                pad_id=hf.pad_id(tokenizer, jc.hf_assets_path), dead_zone=r.dispatch_dead_zone,
                max_share=r.dispatch_max_share, reward_workers=r.reward_workers,
                reward_timeout_s=r.reward_timeout_seconds, task_timeout_s=r.task_timeout_seconds,
                stall_s=r.engine_stall_seconds, streaming=r.streaming_admission, carry_over=r.streaming_carry_over,
                episodes=(lambda raw, sender: episode_groups(jc, tokenizer, raw, sender)) if r.environment else None,
                fleet=fleet,
            )
            rollouts.syncer = WeightSyncer(
                jc.weight_sync, model, rollouts.engines, device=device, is_sender=True,
                backend="nccl" if device.type == "cuda" else "gloo", pump=rollouts.pump.pump,
                layout=HFLayout.from_hf_dir(jc.hf_assets_path))
        except BaseException:
            if rollouts is not None:
                rollouts.close()
            else:
                fleet.close(engines)
            raise
        return rollouts

    @property
    def engines(self) -> list[EngineHandler]:  # now: replacements included
        return self.pump.engines

    def metrics(self) -> dict[str, float]:
        """Per-step counters of the rollout side (``metrics.jsonl``)."""
        return {"engine_restarts": self.fleet.restarts if self.fleet else 0,
                "redispatched_requests": self.pump.redispatched,
                **self.policy.metrics()}

    # -- dispatch
    def dispatch(self, step: int, trainer_version: int, pin_version: int = -1, min_version: int = 0) -> None:
        """Start ``step``'s groups not started yet (once each; later calls for the step do nothing more), pinned to
        ``pin_version``, generated on ``min_version`` or newer (see ``GenerationRequest``)."""
        self.dispatcher.dispatch(step, Versions(trainer_version, pin_version, min_version))

    def shape(self, step: int) -> tuple[float, int]:
        """``GroupTable.shape`` of ``step``'s drawn prompts."""
        return self.table.shape(step, self.max_new_tokens)

    # -- events (``EnginePump.pump``, main thread)
    def _on_result(self, in_flight: InFlight, result: GenerationResult) -> None:
        """A request's result: each of its groups finishes with its rows."""
        groups = sorted((g for g in self.table.in_state(GroupState.RUNNING) if g.request is in_flight.request),
                        key=lambda g: g.index)
        n = in_flight.request.group_size
        for k, g in enumerate(groups):
            self.table.finish(g, result if len(groups) == 1 else rows(result, k, n))
            if g.step >= 0:
                self.policy.finished(g)

    def _on_group_ended(self, ev: GroupEnded) -> None:
        """A multi-turn group's end: finished (or, failed, the failure kept for the next wait)."""
        if not self.episodes.ended(ev.group):  # cancelled (restarted, discarded): dropped
            return
        if ev.error is not None:
            self.episode_failure = self.episode_failure or ev.error
            return
        group = next((g for g in self.table.in_state(GroupState.RUNNING) if g.request.req_id == ev.group), None)
        if group is None:  # dropped meanwhile (a discarded step)
            return
        opening, result = group_result(ev.group, ev.episodes, ev.newest_seen, ev.gen_time_s)
        self.table.finish(group, result, ev.episodes, opening)
        if group.step >= 0:
            self.policy.finished(group)

    def _on_weight_event(self, ev: WeightAck | EngineError) -> None:
        if self.syncer is not None:
            self.syncer.on_event(ev)

    def _replace(self, dead: EngineHandler) -> EngineHandler | Reconnecting | None:
        """A dead engine's replacement, rejoined by the syncer (a server's once reconnected); None: dropped."""
        if self.fleet is None:
            return None
        new = self.fleet.replace(dead, self.pump.engines.index(dead))
        if new is not None and not isinstance(new, Reconnecting):
            self.syncer.replace_engine(dead, new)
        return new

    def _on_reconnected(self, ev: Reconnected) -> None:  # the pump then puts ev.engine in the placeholder's place
        if ev.engine is not None:
            self.syncer.replace_engine(ev.placeholder.dead, ev.engine)

    # -- collection
    def collect(self, step: int, trainer_version: int, pin_version: int = -1, min_version: int = 0) -> RolloutBatch:
        """Dispatch ``step`` (unless admission already has) and take its batch as the policy says (scored, laid out
        for training)."""
        if self.episode_failure is not None:
            raise self.episode_failure
        versions = Versions(trainer_version, pin_version, min_version)
        self.dispatcher.dispatch(step, versions)
        return self.policy.collect(step, versions)

    def _wait(self, step: int) -> WaitNotes:
        return WaitNotes(self.pump, step, lambda: self._check(step), self.episodes)

    def _check(self, step: int = 0) -> None:
        """Raise what ends a wait for rollouts: a signal's interrupt, an environment's failure."""
        if self.interrupted:
            raise interrupted_wait(step)
        if self.episode_failure is not None:
            raise self.episode_failure

    def interrupt(self) -> None:
        """Make ``collect`` raise ``RolloutWaitInterrupted`` within ~50 ms; safe to call from a signal handler."""
        self.interrupted = True

    def discard(self, step: int) -> None:
        """Forget ``step``'s groups (their results will be dropped); the next dispatch starts it afresh."""
        for g in self.table.of_step(step):
            self.dispatcher.stop(g)
            self.table.drop(g)

    # -- evaluation
    def start_eval(self, prompts: list[Prompt], prompt_ids: list[list[int]], n: int, temperature: float,
                   version: int) -> None:
        """``n`` samples of each held-out prompt on exactly policy ``version`` (multi-turn: a group of ``n``
        episodes each), split evenly over the engines alive; ``eval_scores(version)`` gives their scores."""
        self.dispatcher.dispatch_eval(prompts, prompt_ids, n, temperature, version)

    def eval_scores(self, version: int, task, wait: bool) -> Scores | None:
        """The scores of ``start_eval(version)``'s samples, in prompt order, with ``task``'s reward columns (the
        held-out task's); None while they are not all in and scored (``wait``: wait for them). Once returned, its
        groups are forgotten."""
        groups = self.table.of_step(eval_step(version))
        while any(g.state is GroupState.RUNNING for g in groups):
            if not wait and not self.pump.has_events():
                return None
            self.pump.pump(0.05 if wait else 0)
            self._check()
        if groups[0].scores is None:
            score(self.scoring, self.table, task, groups, groups[0].request.group_size)
        if not wait and not groups[0].scores.done():
            return None
        scores = self.scoring.wait(groups[0].scores)
        for g in groups:
            self.table.drop(g)
        return scores

    # -- checkpoint and shutdown
    def state_dict(self, timeout: float) -> dict:
        """The finished groups of training steps, for a checkpoint, after waiting up to ``timeout`` seconds for
        those in flight (``GroupTable.state_dict``): per-step collection saves only steps whose every group
        finished; streaming saves every finished group and the taken ones."""
        deadline = time.monotonic() + timeout
        while (any(g.step >= 0 for g in self.table.in_state(GroupState.RUNNING))  # training steps generating
               and time.monotonic() < deadline):
            waiting = any(e.alive() for e in self.engines)  # else: only take the results already queued
            try:
                self.pump.pump(0.05 if waiting else 0)
            except NoEngineLeft:
                waiting = False
            if not waiting and not self.pump.has_events():
                break
        return {"streaming": self.streaming, "groups": self.table.state_dict(whole_steps_only=not self.streaming)}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict``'s groups; they are trained on as they are, never regenerated. Groups saved with
        the other ``rollout.streaming_admission`` are generated afresh (nothing trained is lost)."""
        if "groups" not in state:  # written before the group table (2026-11-29)
            logger.warning("the checkpoint's rollouts were saved by an earlier torchtitan_flux; generated afresh")
            return
        groups = state["groups"]
        if state["streaming"] != self.streaming and (groups["finished"] or groups["taken"]):
            logger.warning(f"the checkpoint's rollouts were saved with rollout.streaming_admission = "
                           f"{state['streaming']}; they are generated afresh")
            return
        self.table.load_state_dict(groups)
        if self.streaming:
            for g in sorted(self.table.in_state(GroupState.FINISHED), key=lambda g: g.finished_order):
                self.policy.finished(g)

    def drain(self, timeout: float = 5.0) -> None:
        """Forget outstanding requests (shutdown); results that still arrive are dropped."""
        deadline = time.monotonic() + timeout
        try:
            while self.pump.in_flight() and time.monotonic() < deadline:
                self.pump.pump(0.05)
        except NoEngineLeft:  # shutting down anyway: not the run's outcome (which the caller is reporting)
            pass
        self.pump.forget(lambda r, turn: False)  # before the episodes' loop closes: no result goes to it
        if self.episodes is not None:
            self.episodes.close()
        for step in self.table.steps():
            for g in self.table.of_step(step):
                self.table.drop(g)
        self.scoring.close()

    def close(self) -> None:
        """Stop the syncer's threads, every engine, then the servers we launched."""
        if self.syncer is not None:
            self.syncer.close()
        if self.fleet is not None:
            self.fleet.close(self.engines)
        self.pump.close()
