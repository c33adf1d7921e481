"""The engine-handler interface every rollout engine implements, and the messages handlers emit.

A handler is the trainer-side proxy of one inference engine (an embedded child process, or a vLLM / SGLang
server). It never blocks the caller on the engine: ``submit`` queues work and returns, and everything the engine
reports (finished generations, weight acks, errors, death) arrives as an event on the ``events`` queue shared by
all handlers, consumed by ``RolloutScheduler`` and ``WeightSyncer``.

Weight pushes are not done by handlers: ``WeightSyncer`` owns the bucketed broadcast and only asks the handler
for the engine-specific steps around it (``join_weight_group``, ``begin_update``, ``finish_update``).
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class GenerationRequest:
    req_id: int
    step: int  # the training step this batch is for
    prompt_ids: list[list[int]]  # one entry per prompt; the engine samples group_size completions of each
    group_size: int
    max_new_tokens: int
    temperature: float
    top_k: int
    seed: int  # sampling seed of this request: same seed, same weights, same batch => same tokens
    dispatch_version: int  # trainer policy version when the request was dispatched
    min_version: int = -1  # the engine starts it only once it holds this version (or after its wait bound)
    # embedded engines generate on exactly this version (the newest the trainer had staged at dispatch) when they
    # hold it, which makes async runs reproducible: see ``WeightReceiver.swap``. -1: the newest they hold.
    pin_version: int = -1


@dataclass
class GenerationResult:
    req_id: int
    engine: str
    tokens: torch.Tensor  # [n * G, max_new_tokens] int64, pad after EOS
    logprobs: torch.Tensor  # [n * G, max_new_tokens] float32 behaviour log-probs, 0 after EOS
    lengths: torch.Tensor  # [n * G] int64, completion lengths including EOS
    version: int  # engine policy version that generated every token of this request
    newest_seen: int  # newest version the engine had received when the request finished
    gen_time_s: float


@dataclass
class WeightAck:
    engine: str
    version: int  # the engine holds this version completely (staged for its next request)
    received_at: float


@dataclass
class EngineError:
    engine: str
    message: str
    fatal: bool = False  # the engine process/server is gone


@dataclass
class WeightGroupInfo:
    """How an engine joins its weight-sync group: the trainer hosts the store, the engine takes ranks 1..."""

    host: str
    port: int
    prefix: str
    backend: str
    timeout_s: float
    specs: list = field(default_factory=list)  # list[transport.TensorSpec]
    bucket_bytes: int = 0


Event = GenerationResult | WeightAck | EngineError


class EngineHandler(Protocol):
    name: str
    events: queue.Queue  # shared by all handlers; see the module docstring

    def start(self) -> None:
        """Start or connect to the engine; raise with a clear message if it is unusable."""

    def alive(self) -> bool:
        """Whether the engine process/server is still there."""

    def submit(self, request: GenerationRequest) -> None:
        """Queue a generation request; never blocks on the engine."""

    def join_weight_group(self, info: WeightGroupInfo) -> None:
        """Ask the engine to join a new weight-sync group (rendezvous happens concurrently with the trainer)."""

    def begin_update(self, version: int) -> None:
        """Engine-specific step before a push's broadcasts (HTTP engines: start a weight-update session)."""

    def finish_update(self, version: int) -> None:
        """Engine-specific step after a push's broadcasts (HTTP engines: finish, reset caches)."""

    def close(self) -> None:
        """Stop the engine if this handler started it; idempotent."""
