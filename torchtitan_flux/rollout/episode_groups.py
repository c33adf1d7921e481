"""Multi-turn groups (``rollout.environment``; docs/environments.md): a GRPO group is G episodes of one record,
each turn of each episode one engine request of one sequence.

Concurrency (one way, through queues): ``EpisodeGroups`` runs every episode (``episode.run_episode``) as a coroutine
on an event loop of its own thread ("flux-episodes"); each episode's environment runs on a thread of its own as well
(``data.environments.RunningEnvironment``), under ``rollout.environment_timeout_seconds``. An episode sends its turn
itself, from the episodes' thread (``EnginePump.send_turn``: it never blocks), and awaits the turn's future; the
pump's router thread resolves it when the result arrives (``TurnRequest.resolve``, ``call_soon_threadsafe``), so
episodes go on while the trainer's main thread trains. When the G episodes of a group have ended, the group is
posted as ``GroupEnded`` (its episodes, or the first failure) on the engines' event queue; the main thread turns it
into one finished group (``group_result``) scored and laid out like any other. ``start``, ``ended``, ``cancel`` and
``close`` are called from the main thread only. At most ``rollout.max_episodes_in_flight`` episodes run at once (an
asyncio semaphore on the episodes' loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import queue
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from torchtitan_flux.data.environments import (EnvironmentClass, ParsedToolCall, configure_environment, loop_thread,
                                               load_environment)
from torchtitan_flux.data.tasks import Prompt
from torchtitan_flux.engine.base import GenerationRequest, GenerationResult
from torchtitan_flux.errors import UserCodeError
from torchtitan_flux.rollout.episode import ChatFormat, Episode, EpisodeLimits, run_episode
from torchtitan_flux.rollout.seeds import turn_seed

ENGINE_NAME = "episodes"  # the ``engine`` of a group's result (its turns came from any engine)


class TurnSender(Protocol):
    """What episodes need of the pump (``rollout.pump.EnginePump``): request ids, and a send that never blocks."""

    def new_id(self) -> int: ...

    def send_turn(self, request: GenerationRequest, turn: "TurnRequest") -> None: ...


@dataclass
class TurnRequest:
    """An episode's turn in flight: ``resolve`` hands its result to the episode (any thread)."""

    group: int
    """The group's id: its request's id."""

    future: asyncio.Future
    """On the episodes' loop: gets ``(token_ids, logprobs, versions, newest_seen)``."""

    def resolve(self, result: GenerationResult) -> None:
        n = int(result.lengths[0])
        value = (result.tokens[0, :n].tolist(), result.logprobs[0, :n].tolist(),
                 result.versions_per_token()[0, :n].tolist(), result.newest_seen)
        self.future.get_loop().call_soon_threadsafe(_resolve, self.future, value)


@dataclass
class GroupEnded:
    """Every episode of ``group`` ended (``episodes``, in episode order), or one failed (``error``; the others are
    cancelled)."""

    group: int
    episodes: list[Episode] | None
    error: BaseException | None = None
    newest_seen: int = -1
    """The newest version the engines held when its turns finished."""

    gen_time_s: float = 0.0
    """From its start to its last episode's end."""


def env_input(prompt: Prompt) -> dict:
    """The record an episode's environment is built from: the prompt's columns (``Prompt.columns``: the dataset
    row but its prompt column, ``answer`` included), with ``prompt`` (``Prompt.text``) and, for a chat record,
    ``messages`` where no column has those names. A copy per episode: an environment may edit its own."""
    base: dict[str, Any] = {"prompt": prompt.text}
    if prompt.messages is not None:
        base["messages"] = prompt.messages
    return copy.deepcopy({**base, **prompt.columns})


class EpisodeGroups:
    """The episodes of every group in flight, on the episodes' thread (the module docstring)."""

    def __init__(self, env_class: EnvironmentClass, chat: ChatFormat, limits: EpisodeLimits, events: queue.Queue,
                 max_in_flight: int, sender: TurnSender):
        """``events``: the engines' queue (``GroupEnded`` goes there); ``max_in_flight``:
        ``rollout.max_episodes_in_flight`` (0: no cap)."""
        self.env_class, self.chat, self.limits, self.events = env_class, chat, limits, events
        self.sender = sender
        self._slots = asyncio.Semaphore(max_in_flight) if max_in_flight else None
        self._groups: dict[int, Future] = {}  # group id -> its coroutine's future (main thread only)
        self.running = 0  # episodes holding a slot, not ended (written on the episodes' loop; read for notes)
        self._loop = loop_thread("flux-episodes")  # until ``close``; then what still runs is cancelled

    def start(self, group: GenerationRequest, record: dict) -> None:
        """Run ``group.group_size`` episodes built from ``record``, each turn sampled as ``group`` says;
        ``GroupEnded`` for ``group.req_id`` comes when they end."""
        self._groups[group.req_id] = asyncio.run_coroutine_threadsafe(self._group(group, record), self._loop)

    def ended(self, group: int) -> bool:
        """Forget ``group`` once its ``GroupEnded`` arrived: False when it was cancelled (drop the event)."""
        return self._groups.pop(group, None) is not None

    def cancel(self, group: int) -> None:
        """Stop ``group``'s episodes (their environments are closed); nothing is posted for it."""
        running = self._groups.pop(group, None)
        if running is not None:
            running.cancel()

    def close(self) -> None:
        """Cancel every group; the episodes' thread ends once their environments are closed (a daemon thread: an
        environment stuck past its deadline does not hold the process)."""
        for group in list(self._groups):
            self.cancel(group)
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.stop)

    async def _group(self, group: GenerationRequest, record: dict) -> None:
        started, newest = time.monotonic(), [-1]
        tasks = [asyncio.ensure_future(self._episode(group, copy.deepcopy(record), e, newest))
                 for e in range(group.group_size)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        failed = next((t.exception() for t in tasks if t.done() and t.exception() is not None), None)
        if failed is not None:  # reported at once: the others' cancellation may wait on their environments
            if not isinstance(failed, UserCodeError):  # the chat template's refusal, say
                failed = UserCodeError(f"rollout.environment = {self.env_class.spec!r}: an episode failed: {failed}")
            self.events.put(GroupEnded(group.req_id, None, failed))
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return
        self.events.put(GroupEnded(group.req_id, [t.result() for t in tasks], None, newest[0],
                                   time.monotonic() - started))

    async def _episode(self, group: GenerationRequest, record: dict, episode: int, newest: list[int]) -> Episode:
        turns = itertools.count()

        async def generate(prompt_ids: list[int], max_new_tokens: int):
            future = asyncio.get_running_loop().create_future()
            request = GenerationRequest(
                req_id=self.sender.new_id(), step=group.step, prompt_ids=[prompt_ids], group_size=1,
                max_new_tokens=max_new_tokens, temperature=group.temperature, top_k=group.top_k,
                seed=turn_seed(group.seed, episode, next(turns)), dispatch_version=group.dispatch_version,
                min_version=group.min_version, pin_version=group.pin_version, keep_kv=True,
            )
            self.sender.send_turn(request, TurnRequest(group.req_id, future))
            ids, logprobs, versions, newest_seen = await future
            newest[0] = max(newest[0], newest_seen)
            return ids, logprobs, versions

        async with self._slots or contextlib.nullcontext():
            self.running += 1
            try:
                return await run_episode(self.env_class, record, generate, self.chat, self.limits)
            finally:
                self.running -= 1


def load_configured_environment(rollout_cfg) -> EnvironmentClass:
    """``rollout.environment``'s class, checked, its ``Config`` set from ``rollout.environment_args``
    (``ConfigError`` naming the field)."""
    env_class = load_environment(rollout_cfg.environment, "rollout.environment",
                                 rollout_cfg.environment_timeout_seconds, "rollout.environment_timeout_seconds")
    return configure_environment(env_class, list(rollout_cfg.environment_args), "rollout.environment_args")


def episode_groups(job_config, tokenizer, events: queue.Queue, sender: TurnSender) -> EpisodeGroups:
    """The multi-turn episodes of ``rollout.environment``: the model folder's chat template, ``rollout.max_turns``
    and ``max_new_tokens`` per turn, ``training.seq_len`` per episode."""
    r = job_config.rollout
    limits = EpisodeLimits(max_turns=r.max_turns, max_new_tokens=r.max_new_tokens,
                           max_total_tokens=job_config.training.seq_len)
    chat = ChatFormat.from_model_dir(job_config.hf_assets_path, tokenizer)
    return EpisodeGroups(load_configured_environment(r), chat, limits, events, r.max_episodes_in_flight, sender)


def _resolve(future: asyncio.Future, value: Any) -> None:
    if not future.done():  # cancelled meanwhile
        future.set_result(value)


def group_result(req_id: int, episodes: list[Episode], newest_seen: int, gen_time_s: float
                 ) -> tuple[list[int], GenerationResult]:
    """A finished group as one result: (the prompt: the opening tokens its episodes share, the result: each
    episode's tokens after it, the model's and the environment's as generated, with ``model_mask`` on the model's,
    logprobs 0 and version -1 elsewhere (an environment whose openings differ within the group: the rest of each
    opening is laid out with its sample as masked context, docs/environments.md); ``version`` the oldest model
    token's; ``gen_time_s`` the group's wall time, from its start to its last episode's end)."""
    first = episodes[0].token_ids[: episodes[0].prompt_tokens]
    shared = min(next((i for i, (a, b) in enumerate(zip(first, ep.token_ids)) if a != b), len(first))
                 for ep in episodes)  # the same record opens alike, unless its environment draws at random
    prompt = first[:shared]
    width = max(1, max(len(ep.token_ids) - shared for ep in episodes))
    G = len(episodes)
    tokens = torch.zeros(G, width, dtype=torch.int64)
    logprobs = torch.zeros(G, width)
    versions = torch.full((G, width), -1, dtype=torch.int64)
    model = torch.zeros(G, width, dtype=torch.bool)
    lengths = torch.zeros(G, dtype=torch.int64)
    for i, ep in enumerate(episodes):
        n = len(ep.token_ids) - shared
        lengths[i] = n
        tokens[i, :n] = torch.tensor(ep.token_ids[shared:], dtype=torch.int64)
        logprobs[i, :n] = torch.tensor(ep.logprobs[shared:])
        versions[i, :n] = torch.tensor(ep.versions[shared:], dtype=torch.int64)
        model[i, :n] = torch.tensor(ep.loss_mask[shared:], dtype=torch.bool)
    oldest = versions[model].min().item() if model.any() else newest_seen
    return prompt, GenerationResult(req_id=req_id, engine=ENGINE_NAME, tokens=tokens, logprobs=logprobs,
                                    lengths=lengths, version=int(oldest), newest_seen=newest_seen,
                                    gen_time_s=gen_time_s, token_versions=versions, model_mask=model)


def plain_message(m: dict) -> dict:
    """A message as JSON: parsed tool calls as dicts."""
    if not m.get("tool_calls"):
        return dict(m)
    return {**m, "tool_calls": [{"name": c.name, "arguments": c.arguments, "status": c.status.value, "raw": c.raw}
                                if isinstance(c, ParsedToolCall) else c for c in m["tool_calls"]]}


def episode_record(ep: Episode) -> dict:
    """One episode for ``completions.jsonl``: the conversation after the opening, how it ended, its rewards."""
    return {"messages": [plain_message(m) for m in ep.messages[ep.prompt_messages:]], "end": ep.end.value,
            "turns": ep.turns, "env_rewards": ep.env_rewards}
