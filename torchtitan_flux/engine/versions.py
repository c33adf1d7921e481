"""Which weights a request runs on in the embedded engine: one ``VersionRule`` per engine process, read by both of
its serving loops (``embedded._EngineProcess.serve``, one request at a time, and ``batcher.ContinuousBatcher``).
``transport.WeightReceiver.swap(upto)`` is the mechanism; a rule only decides when a request may start, which version
a swap makes live, and when a version may change under running sequences. Every method runs on the engine's main
thread; the receiver thread only publishes versions (``newest``), and only the main thread swaps (``live_version``).

``Pinned`` (``rollout.in_flight_weight_updates`` off; the embedded engine's invariant: a request runs on exactly one
version, its ``pin_version``): requests start in arrival order, each once the engine holds its versions (its pin and
``min_version``). With nothing in flight, a starting request makes its pinned version live (``swap_target``). With
requests in flight (continuous batching), a request joins only if it would run on the live version anyway (its pin
is not newer than the live version, or no newer version has arrived); else it, and every request behind it, waits
until the running batch has drained, and then swaps. So versions change only between decode steps with nothing
running, and every sequence of a request decodes on the version its result reports.

``InFlight`` (on, continuous batching only: a token runs on the newest version held when it is sampled): a request
starts once the engine holds its ``min_version`` (its pin is ignored beyond that), without waiting for the running
batch to drain; with nothing in flight it makes the newest version live. Right after a step's tokens are sampled, if
a newer complete version has arrived (``swap_between_steps``), ``swap(-1)`` makes it live and the model is rebuilt
from its views; the rows go on from their KV cache as it is (written by the older versions, not recomputed:
docs/architecture.md says why), and the next decode step, prefills included, runs on the new version. A newcomer is
prefilled on the live version, so one whose ``min_version`` is newer than the live one (but held) waits one decode
step, for that swap. Each token records the live version it was sampled on (``GenerationResult.token_versions``;
non-decreasing along a sequence), and the result's ``version`` is its oldest token's. Which token a push lands at
depends on timing, so such runs are not reproducible. The swap frees the old live buffer to the receiver thread
while no kernel reads it any more: the step's ``tolist()`` waited for every kernel queued before it on the engine's
stream (all those that read the old buffer), and nothing reads it after the swap.

Both: a request waits for its versions at most ``wait_bound_s`` from its arrival (the weight-sync timeout, set at
each join), then starts on the newest version held; no request starts before the first version arrives.
"""

from __future__ import annotations

import abc
import collections
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from torchtitan_flux.engine.base import GenerationRequest

if TYPE_CHECKING:
    from torchtitan_flux.wire.transport import WeightReceiver


@dataclass
class VersionRule(abc.ABC):
    """What both rules share: the wait bound, and ``ready`` over the version each needs (``need``)."""

    wait_bound_s: float = 60.0
    """How long a request waits for its versions before it starts on the newest held (seconds from its arrival);
    ``_EngineProcess.join`` sets it to the weight-sync timeout (``WeightGroupInfo.timeout_s``)."""

    per_token_versions: ClassVar[bool] = False
    """Whether a request may run on several versions, so its result carries each token's (``token_versions``)."""

    @abc.abstractmethod
    def need(self, req: GenerationRequest) -> int:
        """The newest version ``req`` waits for."""

    def ready(self, req: GenerationRequest, arrived: float, receiver: WeightReceiver | None) -> bool:
        """Whether ``req``, arrived at ``arrived`` (``time.monotonic()``), may start: the engine holds some version
        and ``need(req)``, or the wait bound passed. ``receiver``: None before the first join."""
        newest = receiver.newest()[0] if receiver is not None else -1
        return newest >= 0 and (newest >= self.need(req) or time.monotonic() - arrived > self.wait_bound_s)

    def wait_timeout(self, waiting: collections.deque) -> float | None:
        """How long a serving loop with nothing to run waits for a message: until the wait bound of the oldest
        ``waiting`` (request, arrival) pair (None: no request)."""
        if not waiting:
            return None
        return max(0.0, waiting[0][1] + self.wait_bound_s - time.monotonic()) + 0.001

    @abc.abstractmethod
    def swap_target(self, req: GenerationRequest) -> int:
        """The ``upto`` of ``WeightReceiver.swap`` before ``req`` starts with nothing in flight (-1: the newest)."""

    @abc.abstractmethod
    def may_join(self, req: GenerationRequest, receiver: WeightReceiver) -> bool:
        """Whether ``req`` (ready) may start beside the requests in flight, on the live version."""

    def swap_between_steps(self, receiver: WeightReceiver) -> bool:
        """Whether a swap makes a newer version live between two decode steps, under the running sequences."""
        return False


@dataclass
class Pinned(VersionRule):
    """A request runs on exactly its pinned version (module docstring)."""

    def need(self, req: GenerationRequest) -> int:
        return max(req.min_version, req.pin_version)

    def swap_target(self, req: GenerationRequest) -> int:
        """Its pin, or ``min_version`` where the pin is older (see ``GenerationRequest.pin_version``); -1
        (unpinned): the newest."""
        return max(req.pin_version, req.min_version) if req.pin_version >= 0 else -1

    def may_join(self, req: GenerationRequest, receiver: WeightReceiver) -> bool:
        """Whether ``swap(swap_target(req))`` would leave the live version live."""
        target = self.swap_target(req)
        return receiver.newest()[0] == receiver.live_version or 0 <= target <= receiver.live_version


@dataclass
class InFlight(VersionRule):
    """Newer versions go live between decode steps (module docstring)."""

    per_token_versions: ClassVar[bool] = True

    def need(self, req: GenerationRequest) -> int:
        return req.min_version

    def swap_target(self, req: GenerationRequest) -> int:
        return -1

    def may_join(self, req: GenerationRequest, receiver: WeightReceiver) -> bool:
        """Whether the live version is at least ``req``'s ``min_version``, or no newer one has arrived (its wait
        bound passed); else the next decode step's swap makes a fresh enough one live."""
        return req.min_version <= receiver.live_version or receiver.newest()[0] == receiver.live_version

    def swap_between_steps(self, receiver: WeightReceiver) -> bool:
        return receiver.newest()[0] > receiver.live_version
