"""Engines without processes, for tests of the rollout side: each implements ``rollout.pump.RolloutEngine``, the
face the rollout side uses of an engine handler, through ``FakeEngineBase`` (checked against every real handler by
tests/unit/test_dispatch.py). Fakes of other faces (the pusher's, the probe's) live beside their tests."""

from __future__ import annotations

import queue
import random

import torch

from torchtitan_flux.engine.base import GenerationResult
from torchtitan_flux.rollout.seeds import group_seed


class FakeEngineBase:
    """``rollout.pump.RolloutEngine`` without a process: alive until ``is_alive`` is cleared or it is killed (``why``
    kept); reports to ``events``. Subclasses answer ``submit``."""

    reconnects = False  # restarted, not reconnected, when it dies (as an embedded engine)

    def __init__(self, name: str, events: queue.Queue):
        self.name, self.events = name, events
        self.is_alive = True
        self.killed: str | None = None

    def alive(self) -> bool:
        return self.is_alive

    def submit(self, req) -> None:
        raise NotImplementedError

    def kill(self, why: str) -> None:
        self.killed, self.is_alive = why, False


class FakeEngine(FakeEngineBase):
    """Answers each request at once, through the engines' event queue, with a ``gen_time_s`` that corresponds to
    ``rate`` (completions/s), jittered by up to ``jitter`` (a fraction)."""

    def __init__(self, name: str, rate: float, events: queue.Queue, jitter: float = 0.0, seed: int = 0,
                 answer: bool = True):
        super().__init__(name, events)
        self.rate, self.jitter = rate, jitter
        self.rng = random.Random(seed)
        self.answer = answer  # False: hold requests (to die with them in flight)
        self.received: list[int] = []  # prompts per request

    def submit(self, req) -> None:
        self.received.append(len(req.prompt_ids))
        if not self.answer:
            return
        n = len(req.prompt_ids) * req.group_size
        rate = self.rate * (1 + self.rng.uniform(-self.jitter, self.jitter))
        T = req.max_new_tokens  # padded to the request's budget, as the engines pad
        self.events.put(GenerationResult(req.req_id, self.name, torch.full((n, T), 5, dtype=torch.int64),
                                         torch.zeros(n, T), torch.ones(n, dtype=torch.int64), 0, 0, n / rate))


def prompt_of(req) -> int:
    """The index of a one-group request's prompt in its step, from its seed (``rollout.seeds``; run seed 0)."""
    return req.seed - group_seed(0, req.step, 0)


class HeldEngine(FakeEngineBase):
    """Holds every request until the test finishes it (``finish``), in any order and with any version: for tests
    of streaming admission."""

    def __init__(self, name: str, events: queue.Queue):
        super().__init__(name, events)
        self.requests: list = []  # every request received, in order
        self.held: dict[int, object] = {}  # req_id -> request not finished yet

    def submit(self, req) -> None:
        self.requests.append(req)
        self.held[req.req_id] = req

    def held_for(self, step: int, prompt: int):
        """The request held for prompt ``prompt`` of ``step`` (streaming: one prompt per request)."""
        return next(r for r in self.held.values() if r.step == step and prompt_of(r) == prompt)

    def finish(self, req, length: int, version: int = 0, token_versions: list[int] | None = None) -> None:
        """Answer ``req``: every completion ``length`` tokens of id 5, generated on ``version`` (or per token)."""
        del self.held[req.req_id]
        n, T = len(req.prompt_ids) * req.group_size, req.max_new_tokens
        tokens = torch.full((n, T), 0, dtype=torch.int64)
        tokens[:, :length] = 5
        by_token = None
        if token_versions is not None:
            by_token = torch.full((n, T), -1, dtype=torch.int64)
            by_token[:, :length] = torch.tensor(token_versions)
        self.events.put(GenerationResult(req.req_id, self.name, tokens, torch.zeros(n, T),
                                         torch.full((n,), length, dtype=torch.int64), version, version, 0.01,
                                         token_versions=by_token))
