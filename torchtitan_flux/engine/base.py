"""The engine-handler interface every rollout engine implements, and the messages handlers emit.

A handler is the trainer-side proxy of one inference engine (an embedded child process, or a vLLM / SGLang
server). It never blocks on the engine: ``submit`` queues work, and everything the engine reports arrives as an
event on the ``events`` queue all handlers share. ``WeightSyncer`` owns the pushes and calls the handler's
weight-sync hooks (defaults: ``EngineHandler``'s) for the engine-specific steps. Every engine is pushed HF names and
layout: the syncer maps them (``models.hf_weights.HFLayout``) before a join's parameter list or a push reaches a
handler, so only the trainer side knows torchtitan's.
"""

from __future__ import annotations

import abc
import os
import queue
from dataclasses import dataclass, field
from typing import Any

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
    # embedded engines generate on exactly this version when they hold it (reproducible async runs; see
    # ``WeightReceiver.swap``); -1: the newest they hold. A pin older than ``min_version`` gives way to it.
    pin_version: int = -1
    # a multi-turn episode's turn: an embedded engine with continuous batching keeps each sequence's K/V when it
    # ends, and a later request whose prompt extends it prefills only the new tokens (engine/kept.py)
    keep_kv: bool = False


@dataclass
class GenerationResult:
    req_id: int
    engine: str
    tokens: torch.Tensor  # [n * G, max_new_tokens] int64, pad after EOS
    logprobs: torch.Tensor  # [n * G, max_new_tokens] float32 behaviour log-probs, 0 after EOS
    lengths: torch.Tensor  # [n * G] int64, completion lengths including EOS
    version: int  # engine policy version of the request's oldest token (of every token, without in-flight updates)
    newest_seen: int  # newest version the engine had received when the request finished
    gen_time_s: float
    # [n * G, max_new_tokens] int64: the version that generated each token (-1 after EOS), where the engine applies
    # pushes mid-generation and knows (``rollout.in_flight_weight_updates``, embedded); None: every token ``version``
    token_versions: torch.Tensor | None = None
    # [n * G, max_new_tokens] bool: which tokens the model generated, where others are interleaved (a multi-turn
    # episode's environment replies and chat scaffolding, ``rollout/episode.py``: logprobs 0 and version -1 there);
    # only those are in the loss (``rollout.batch.layout_batch``). None: every token up to ``lengths`` is the model's
    model_mask: torch.Tensor | None = None

    def versions_per_token(self) -> torch.Tensor:
        """``token_versions``, or every position ``version`` where the engine reports none."""
        if self.token_versions is not None:
            return self.token_versions
        return torch.full(self.tokens.shape, self.version, dtype=torch.int64)


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
    # colocated engines (backend ``transport.COLOCATED``): rank 0's staging flats and its ``Seqlock`` tensor, passed
    # by reference through the engine's control pipe (shared memory on CPU, CUDA IPC on GPU); None otherwise
    shared: tuple | None = None
    # the trainer may send this engine sparse pushes (``weight_sync.method = "sparse"``, ``sync/sparse.py``)
    patches: bool = False


Event = GenerationResult | WeightAck | EngineError


class EngineHandler(abc.ABC):
    """The trainer-side proxy of one engine. Subclasses implement the abstract methods; the weight-sync hooks below
    them have the embedded engine's defaults. ``engine/kinds.py`` names each ``rollout.engine``'s handler."""

    name: str
    events: queue.Queue  # shared by all handlers; see the module docstring
    model_dir: str | os.PathLike  # the trainer's HF folder: the names and layout every push carries
    rendezvous_handshake = True  # False where the server builds its side of the group with its own code
    reconnects = False  # True: a dead handler is replaced by ``reconnect()`` (a server not ours), else restarted
    eager_connect = True  # NCCL: connect rank 0 at join (cuda_rules rule 8); only where the peer connects eagerly too
    accepts_patches = True  # sparse pushes (``sync/sparse.py``); False: this engine always gets whole buckets

    @abc.abstractmethod
    def start(self) -> None:
        """Start or connect to the engine; raise with a clear message if it is unusable."""

    @abc.abstractmethod
    def alive(self) -> bool:
        """Whether the engine process/server is still there."""

    @abc.abstractmethod
    def submit(self, request: GenerationRequest) -> None:
        """Queue a generation request. Thread-safe (the main thread and the episodes thread call it concurrently);
        never blocks on the engine, even one that stopped reading: its result, or the engine's fatal
        ``EngineError``, arrives as an event."""

    @abc.abstractmethod
    def join_weight_group(self, info: WeightGroupInfo) -> None:
        """Ask the engine to join a new weight-sync group (rendezvous happens concurrently with the trainer)."""

    @abc.abstractmethod
    def begin_update(self, version: int) -> None:
        """Engine-specific step before a push's broadcasts (HTTP engines: start a weight-update session)."""

    @abc.abstractmethod
    def finish_update(self, version: int) -> None:
        """Engine-specific step after a push's broadcasts (HTTP engines: finish, reset caches)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the engine if this handler started it; idempotent."""

    @abc.abstractmethod
    def kill(self, why: str) -> None:
        """Declare a stalled engine dead with ``why`` as its fatal ``EngineError`` (it is restarted or reconnected,
        its requests re-dispatched), and stop its process if this handler started it."""

    def weight_backend(self, trainer_backend: str) -> str:
        """The backend of this engine's weight-sync group: the trainer's ("nccl" on GPU, "gloo" on CPU), or the
        engine's own choice (an embedded engine on CPU beside a GPU trainer: "gloo"; colocated: no group)."""
        return trainer_backend

    def wire_tensors(self, header: torch.Tensor, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors one push broadcasts to this engine, in order."""
        return [header, *flats]

    def own_group(self, store: Any, info: WeightGroupInfo, device: torch.device | None = None) -> Any | None:
        """None: the pusher builds rank 0's side of the weight-sync group (``pusher.trainer_group``). Else the
        engine builds it with its own code (``engine/vllm_nccl.py``) and returns it, connected."""
        return None

    def group_store(self, store: Any, info: WeightGroupInfo) -> Any:
        """The store the group's rendezvous uses (the embedded engine's layout: ``{prefix}``)."""
        return torch.distributed.PrefixStore(info.prefix, store)

    def checksum(self, timeout: float = 30.0) -> tuple[int, str | None]:
        """(version held, sha256 of the received bytes), or (version, None) where the engine cannot tell."""
        return -1, None

    def self_push(self, version: int, flats: list[torch.Tensor]) -> Any | None:
        """None: the pusher broadcasts ``wire_tensors`` itself. Else the engine sends ``flats`` by its own means
        (``engine/vllm_nccl.py``) and returns a handle with ``is_completed()`` / ``wait()``, polled like a Work."""
        return None

    def reconnect(self) -> "EngineHandler":
        """A new, started handler for the same engine (only where ``reconnects``)."""
        raise NotImplementedError(f"{type(self).__name__} is restarted, not reconnected")
