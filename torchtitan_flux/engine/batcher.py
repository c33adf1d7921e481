"""Continuous batching in the embedded engine (``rollout.continuous_batching``): the scheduler loop of its main thread.

Sequences (a request's prompts x group) join the running batch at any decode step (the newcomers are prefilled,
then decode with the rest) and leave it when they end (a stop token or the request's ``max_new_tokens``). Several
requests are in flight at once; a request's ``GenerationResult`` is sent as soon as its last sequence ends. Between
decode steps the loop reads the control pipe without blocking, so requests, joins, checksums and probes are served
while a batch decodes. At most ``max_sequences`` sequences decode at once (the rows of the ``SlotCache``, a pool of
``max_sequences`` x ``kv_slots`` allocated at the first request); the others of an admitted request queue in order
and take the rows the finished ones free.

Weights: the engine's ``versions.VersionRule`` (``engine/versions.py`` states both rules) says when a waiting
request is admitted (in arrival order: the head is ready, and may join what is in flight), which version a swap makes
live when nothing is in flight, and whether a newer one goes live between two decode steps, under the running rows
(``rollout.in_flight_weight_updates``: each token then records the version it was sampled on).

Sampling: each sequence's draw for its token at position ``p`` is ``inference.counter_uniforms`` of its key (the
request's seed and the sequence's index) and ``p``, computed on the device for every row at once, so its tokens do
not depend on which sequences share its batch or on its row. What is reproducible: the same request on the same
weights gives the same tokens whatever runs beside it, up to the last bits of the forward (a kernel's rounding may
depend on the batch's size), which can flip a token only where two tokens' cumulative probabilities tie to rounding;
with the same schedule, bit for bit. What is not: the tokens of ``continuous_batching = false`` (one generator per
request, drawn row after row), though logprobs are those of the same model and weights.

The step's sampling and decoding are ``engine/decoding.py``'s ``Decoder``: ``EagerDecode``, or with
``rollout.decode_graphs`` ``GraphDecode`` (the whole step replayed from CUDA graphs; the same draws).

Host synchronisations: one read per decode step (each row's token and logprob, in one copy); the rows' widths are
known here, and index lists go to the device from pinned memory without a synchronisation (``inference.to_device``).

Threads: everything here runs on the engine's main thread; the receiver thread only publishes versions (and wakes
the loop through the engine's wake pipe).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from torchtitan_flux.engine.base import GenerationRequest
from torchtitan_flux.engine.decoding import Decoder, EagerDecode, GraphDecode
from torchtitan_flux.engine.kept import Kept, KeptSequences
from torchtitan_flux.engine.versions import VersionRule
from torchtitan_flux.models import inference

if TYPE_CHECKING:
    from torchtitan_flux.models.weight_dict import ModelShape
    from torchtitan_flux.wire.transport import WeightReceiver

_SEED_STRIDE = 1_000_003  # sequence keys: request seed * stride + index (distinct for indices below the stride)


def sequence_key(seed: int, index: int) -> int:
    """The sampling key of sequence ``index`` of a request seeded ``seed`` (``inference.counter_uniforms``)."""
    return (seed * _SEED_STRIDE + index) % (1 << 63)


class EngineIO(Protocol):
    """What the batcher uses of its engine process (``embedded._EngineProcess``, which imports this module lazily;
    a stand-in in tests/unit/test_continuous_batching.py). Everything runs on the engine's main thread."""

    rule: VersionRule
    """Which version each request runs on (``engine/versions.py``)."""

    receiver: WeightReceiver | None
    """The versions held (None before the first join); the batcher swaps the live one where ``rule`` says."""

    shape: ModelShape
    """The model's shape (``inference.Model.of`` a version's views)."""

    eos_id: list[int]
    """Stop token ids."""

    pad_id: int
    """Written after a sequence's end (as the serial engine does)."""

    kv_slots: int
    """Slots of each row of the KV pool (``inference.SlotCache``, allocated at the first request): the longest
    prompt plus completion a sequence may have (``training.seq_len``)."""

    decode_graphs: str = ""
    """The decode step (``engine/decoding.py``): "" eager (``EagerDecode``); "captured" CUDA graphs
    (``rollout.decode_graphs``); "twin" the graphs' step run eagerly (tests, benchmarks/engine.py on a CPU)."""

    stall_s: float
    """Fault injection: seconds to sleep before admitting each request."""

    def live_model(self) -> inference.Model:
        """The live buffer's model (``inference.Model.of`` its views); the batcher asks at each swap."""

    def serve_messages(self, waiting: collections.deque, timeout: float | None) -> bool:
        """Wait up to ``timeout`` for a message or a landed push, then serve every message already in the control
        pipe (a request joins ``waiting`` with its arrival time); False on shutdown or a closed pipe."""

    def send_result(self, req_id: int, tokens: torch.Tensor, logprobs: torch.Tensor, lengths: torch.Tensor,
                    version: int, gen_time_s: float, token_versions: torch.Tensor | None = None) -> None:
        """A request's result (CPU tensors) to the trainer."""


@dataclass
class _Request:
    """An admitted request: the version it runs on, its sequences, how many are still generating."""

    req: GenerationRequest
    """The request as the trainer sent it."""

    version: int
    """The live version when it was admitted: every one of its tokens is generated on it, unless the rule swaps
    between steps (``VersionRule.per_token_versions``: then its result reports its oldest token's version)."""

    started: float
    """``time.perf_counter()`` at admission (its result's ``gen_time_s`` counts from here)."""

    sequences: list["_Sequence"] = field(default_factory=list)
    """Its sequences, row ``i`` of its result: prompt ``i // group_size``."""

    unfinished: int = 0
    """Sequences not ended yet; the result is sent when it reaches 0."""


@dataclass
class _Sequence:
    """One completion: where it comes from, its sampling key, what it has sampled so far."""

    request: _Request
    """The request it belongs to."""

    prompt: list[int]
    """Its prompt's token ids."""

    key: int
    """Its draws' key (``sequence_key``)."""

    kv_version: int | None = None
    """The version of the kept K/V it started from (``engine/kept.py``), if any: its tokens are stamped no newer."""

    tokens: list[int] = field(default_factory=list)
    """Sampled token ids, the stop token included."""

    logprobs: list[float] = field(default_factory=list)
    """Behaviour logprob of each sampled token (float32 values)."""

    versions: list[int] = field(default_factory=list)
    """The live version each token was sampled on (sent only with ``VersionRule.per_token_versions``)."""


class ContinuousBatcher:
    """The scheduler loop of the module docstring, over an engine process's messages, versions and weights."""

    def __init__(self, engine: EngineIO, max_sequences: int):
        self.engine, self.rule, self.max_sequences = engine, engine.rule, max_sequences
        self.eos = set(engine.eos_id)  # stop token ids
        self.waiting: collections.deque = collections.deque()  # (request, arrival time): not admitted yet, in order
        self.queued: collections.deque[_Sequence] = collections.deque()  # admitted sequences without a row yet
        self.rows: list[_Sequence] = []  # the sequence in each row in use of ``cache``
        self.in_flight = 0  # admitted requests whose result is not sent yet
        self.model: inference.Model | None = None  # the live weights, looked up at each swap
        self.cache: inference.SlotCache | None = None
        self.decoder: Decoder | None = None  # samples and decodes the rows (``engine/decoding.py``), with the cache
        self.kept = KeptSequences(max_sequences)  # ended turns' K/V, for their episodes' next turns

    def run(self) -> None:
        """Serve until the pipe closes or a shutdown arrives. The pipe is polled after every decode step, and waited
        on only with nothing to decode, no admitted sequence waiting for a row and no request to admit (until a
        message, a landed push or the head's wait bound). Admitted sequences still queued when every row ended in
        the same step take the freed rows on the next turn of the loop, not after the next message."""
        while True:
            self._admit()
            self._fill_rows()
            if self.rows:
                self._step()
            busy = self.rows or self.queued or self._admissible()
            if not self.engine.serve_messages(self.waiting, 0.0 if busy else self.rule.wait_timeout(self.waiting)):
                return

    def _admissible(self) -> bool:
        """Whether the head of ``waiting`` is ready and may run beside what is in flight (the rule's)."""
        if not self.waiting or not self.rule.ready(*self.waiting[0], self.engine.receiver):
            return False
        return not self.in_flight or self.rule.may_join(self.waiting[0][0], self.engine.receiver)

    def _admit(self) -> None:
        """Admit waiting requests in order while the head is admissible."""
        while self._admissible():
            self._start(self.waiting.popleft()[0])

    def _start(self, req: GenerationRequest) -> None:
        if self.engine.stall_s:
            time.sleep(self.engine.stall_s)
        if req.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {req.temperature}")
        longest = max((len(p) for p in req.prompt_ids), default=0) + req.max_new_tokens
        if longest > self.engine.kv_slots:
            raise ValueError(f"request {req.req_id} needs {longest} KV slots (prompt + max_new_tokens), the KV pool's "
                             f"rows have {self.engine.kv_slots} (training.seq_len)")
        if not self.in_flight:
            self._swap(self.rule.swap_target(req))
            if self.cache is None:
                self.cache = inference.SlotCache.allocate(self.model, self.max_sequences, self.engine.kv_slots)
                graphs = self.engine.decode_graphs
                self.decoder = GraphDecode(self.model, self.cache, graphs == "captured") if graphs else EagerDecode()
        request = _Request(req, self.engine.receiver.live_version, time.perf_counter())
        prompts = [p for p in req.prompt_ids for _ in range(req.group_size)]
        request.sequences = [_Sequence(request, p, sequence_key(req.seed, i)) for i, p in enumerate(prompts)]
        request.unfinished = len(prompts)
        self.in_flight += 1
        self.queued.extend(request.sequences)
        if not prompts:
            self._send_result(request)

    def _swap(self, upto: int) -> None:
        """``WeightReceiver.swap(upto)``, and the live version's model (main thread; engine/versions.py says when
        the old live buffer may be freed)."""
        self.engine.receiver.swap(upto)
        self.model = self.engine.live_model()

    def _fill_rows(self) -> None:
        """Prefill queued sequences into the free rows (in order) and append their hidden states; a multi-turn
        turn's prompt starts from the K/V kept of its episode's previous turn where there is one it may use (the
        request's own version, or any with in-flight updates)."""
        count = min(self.max_sequences - len(self.rows), len(self.queued))
        if count <= 0:
            return
        newcomers = [self.queued.popleft() for _ in range(count)]
        kept: list[Kept | None] = []
        for s in newcomers:
            usable = (lambda v: True) if self.rule.per_token_versions else (lambda v, s=s: v == s.request.version)
            kept.append(self.kept.take(s.prompt, usable) if s.request.req.keep_kv else None)
            s.kv_version = kept[-1].version if kept[-1] is not None else None
        capacity = max(len(s.prompt) + s.request.req.max_new_tokens for s in newcomers)
        h = inference.join_rows(self.model, self.cache, [s.prompt for s in newcomers], self.engine.pad_id, capacity,
                                [k.kv if k is not None else None for k in kept])
        self.decoder.join(self.model, self.cache, h, [(s.key, s.request.req.temperature, s.request.req.top_k)
                                                      for s in newcomers])
        self.rows += newcomers

    def _step(self) -> None:
        """Sample one token per row (its one host read), send the results of requests that ended, decode the rows
        that go on (``self.decoder``: each row's next token is sampled with its request's settings and its own
        draw)."""
        tok, logp = self.decoder.sampled(self.model, self.cache)
        version, done = self.engine.receiver.live_version, []
        sampled = torch.stack([tok.double(), logp.double()], dim=1).tolist()  # exact: ids < 2^53, float32 values
        for seq, (t, lp) in zip(self.rows, sampled):
            seq.tokens.append(int(t))
            seq.logprobs.append(lp)
            seq.versions.append(version if seq.kv_version is None else min(version, seq.kv_version))
            done.append(seq.tokens[-1] in self.eos or len(seq.tokens) >= seq.request.req.max_new_tokens)
        ended = [s for s, d in zip(self.rows, done) if d]
        for row, seq in enumerate(self.rows):
            if done[row] and seq.request.req.keep_kv:  # all its tokens but the last are in its row
                tokens = (*seq.prompt, *seq.tokens[:-1])
                self.kept.keep(Kept(tokens, min(seq.versions), inference.kept_rows(self.cache, row, len(tokens))))
        if ended:
            order = inference.drop_rows(self.cache, done)
            self.rows = [self.rows[i] for i in order]
            self.decoder.moved(order, len(done))
        for seq in ended:
            seq.request.unfinished -= 1
            if seq.request.unfinished == 0:
                self._send_result(seq.request)
        if self.rule.swap_between_steps(self.engine.receiver):
            self._swap(-1)  # after the read above: no queued kernel reads the old buffer any more
        if self.rows:
            self.decoder.decode(self.model, self.cache, max(len(s.prompt) + len(s.tokens) for s in self.rows))

    def _send_result(self, request: _Request) -> None:
        """The request's ``GenerationResult`` fields, laid out as the serial engine's (pad and 0 after the end)."""
        req, rows = request.req, len(request.sequences)
        tokens = torch.full((rows, req.max_new_tokens), self.engine.pad_id, dtype=torch.long)
        logprobs = torch.zeros((rows, req.max_new_tokens), dtype=torch.float32)
        for i, seq in enumerate(request.sequences):
            tokens[i, : len(seq.tokens)] = torch.tensor(seq.tokens, dtype=torch.long)
            logprobs[i, : len(seq.logprobs)] = torch.tensor(seq.logprobs, dtype=torch.float32)
        lengths = torch.tensor([len(s.tokens) for s in request.sequences], dtype=torch.long)
        version, token_versions = request.version, None
        if self.rule.per_token_versions:
            token_versions = torch.full((rows, req.max_new_tokens), -1, dtype=torch.long)
            for i, seq in enumerate(request.sequences):
                token_versions[i, : len(seq.versions)] = torch.tensor(seq.versions, dtype=torch.long)
            version = min((s.versions[0] for s in request.sequences), default=version)  # non-decreasing per row
        self.in_flight -= 1
        self.engine.send_result(req.req_id, tokens, logprobs, lengths, version, time.perf_counter() - request.started,
                                token_versions)
