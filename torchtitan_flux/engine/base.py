"""The engine-handler interface every rollout engine implements, and the messages handlers emit.

A handler is the trainer-side proxy of one inference engine (an embedded child process, or a vLLM / SGLang
server). It never blocks the caller on the engine: ``submit`` queues work and returns, and everything the engine
reports (finished generations, weight acks, errors, death) arrives as an event on the ``events`` queue shared by
all handlers, consumed by ``RolloutScheduler`` and ``WeightSyncer``.

Weight pushes are not done by handlers: ``WeightSyncer`` owns the bucketed broadcast and only asks the handler
for the engine-specific steps around it (``join_weight_group``, ``begin_update``, ``finish_update``) and for the
declared weight-sync hooks (``wire_tensor``, ``wire_tensors``, ``trainer_group``, ``checksum``, ...), whose
defaults live in ``EngineBase``: the syncer calls them, never probes for them.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch


class EngineStartError(RuntimeError):
    """The server cannot serve as a rollout engine; the message names the server and what is wrong."""


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
    # hold it, which makes async runs reproducible: see ``WeightReceiver.swap``. -1: the newest they hold. A pin
    # older than ``min_version`` (the trainer caught up after coalesced pushes) gives way to ``min_version``.
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

    def kill(self, why: str) -> None:
        """Declare the engine dead with ``why`` as its fatal ``EngineError`` (the scheduler restarts or reconnects
        it and re-dispatches its requests), and stop its process if this handler started it. For an engine that
        is alive but makes no progress (``RolloutScheduler``'s stall check)."""

    # weight-sync hooks: defaults in ``EngineBase``
    rendezvous_handshake: bool  # False where the server builds its side of the group with its own code
    supports_delta: bool  # whether delta pushes (only the changed buckets) can be sent
    reconnects: bool  # True: a dead handler is replaced by ``reconnect()`` (a server not ours), else restarted
    wire_dtype: str | None  # the dtype the engine loads ("bfloat16"...); None: the parameters' dtype

    def wire_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A parameter (clean torchtitan name) in the layout the engine loads; applied while snapshotting."""

    def wire_tensors(self, header: torch.Tensor, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors one push broadcasts to this engine, in order."""

    def trainer_group(self, store: Any, info: WeightGroupInfo, device: torch.device | None = None) -> Any:
        """Rank 0's side of this engine's weight-sync group, connected (built in the joiner thread)."""

    def checksum(self, timeout: float = 30.0) -> tuple[int, str | None]:
        """(version held, sha256 of the received bytes), or (version, None) where the engine cannot tell."""

    def reconnect(self) -> "EngineHandler":
        """A new, started handler for the same engine (only where ``reconnects``)."""

    def self_push(self, version: int, flats: list[torch.Tensor]) -> Any | None:
        """None, or a Work-like handle when the engine sends a push by its own means."""


class EngineBase:
    """Defaults of the weight-sync hooks of ``EngineHandler`` (the embedded engine's choices)."""

    rendezvous_handshake = True
    supports_delta = True
    reconnects = False
    eager_connect = True  # NCCL: connect rank 0 at join (cuda_rules rule 8); only where the peer connects eagerly too
    wire_dtype: str | None = None

    def wire_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def wire_tensors(self, header: torch.Tensor, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        return [header, *flats]

    def trainer_group(self, store: Any, info: WeightGroupInfo, device: torch.device | None = None) -> Any:
        """Rank 0 of a 2-rank group on ``{prefix}`` of ``store``: NCCL groups get ``cuda_rules.GROUP_TIMEOUT``
        (our push deadline decides, not the watchdog) and connect at once on ``device``."""
        from torchtitan_flux import compat
        from torchtitan_flux.sync import cuda_rules
        from torchtitan_flux.sync import transport

        timeout = cuda_rules.GROUP_TIMEOUT if info.backend == "nccl" else timedelta(seconds=info.timeout_s)
        return compat.new_weight_sync_group(
            info.backend, self.group_store(store, info), 0, 2, timeout,
            device=device if info.backend == "nccl" and self.eager_connect else None,
            listen_host=transport.listen_address(info.host),
        )

    def group_store(self, store: Any, info: WeightGroupInfo) -> Any:
        """The store the group's rendezvous uses (the embedded engine's layout: ``{prefix}``)."""
        return torch.distributed.PrefixStore(info.prefix, store)

    def checksum(self, timeout: float = 30.0) -> tuple[int, str | None]:
        return -1, None

    def self_push(self, version: int, flats: list[torch.Tensor]) -> Any | None:
        """None: the pusher broadcasts ``wire_tensors`` itself. Else the engine sends ``flats`` by its own means
        (``engine/vllm_nccl.py``) and returns a handle with ``is_completed()`` / ``wait()``, polled like a Work."""
        return None

    def reconnect(self) -> "EngineHandler":
        raise NotImplementedError(f"{type(self).__name__} is restarted, not reconnected")
