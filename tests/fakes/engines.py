"""Engines without processes, for tests of the scheduler's dispatch."""

from __future__ import annotations

import queue
import random

import torch

from torchtitan_flux.engine.base import GenerationResult


class FakeEngine:
    """An engine without a process: answers each request at once, through the scheduler's event queue, with a
    ``gen_time_s`` that corresponds to ``rate`` (completions/s), jittered by up to ``jitter`` (a fraction)."""

    reconnects = False  # restarted, not reconnected, when it dies (as an embedded engine)

    def __init__(self, name: str, rate: float, events: queue.Queue, jitter: float = 0.0, seed: int = 0,
                 answer: bool = True):
        self.name, self.rate, self.events, self.jitter = name, rate, events, jitter
        self.rng = random.Random(seed)
        self.answer = answer  # False: hold requests (to die with them in flight)
        self.is_alive = True
        self.received: list[int] = []  # prompts per request

    def alive(self) -> bool:
        return self.is_alive

    def submit(self, req) -> None:
        self.received.append(len(req.prompt_ids))
        if not self.answer:
            return
        n = len(req.prompt_ids) * req.group_size
        rate = self.rate * (1 + self.rng.uniform(-self.jitter, self.jitter))
        T = req.max_new_tokens  # padded to the request's budget, as the engines pad
        self.events.put(GenerationResult(req.req_id, self.name, torch.full((n, T), 5, dtype=torch.int64),
                                         torch.zeros(n, T), torch.ones(n, dtype=torch.int64), 0, 0, n / rate))
