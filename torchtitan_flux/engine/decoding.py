"""The continuous batcher's decode step (``engine/batcher.py``): sample each row's next token, then decode it.

Two implementations of one protocol (``Decoder``), chosen by ``rollout.decode_graphs``:

``EagerDecode`` (the default): today's step, bit for bit: each row's hidden state is kept; ``sampled`` draws from
it with ``inference.sample_with`` per distinct (temperature, top_k), ``decode`` runs ``inference.decode_rows``.

``GraphDecode``: the whole step (decode, logits, sampling) is one function on static buffers,
``inference.decode_and_sample``, run for a bucket of rows (powers of two up to the pool's rows) and width (powers
of two from ``MIN_WIDTH`` up to its slots): on a GPU captured once per (rows, width, largest top_k) into a CUDA
graph and replayed (``engine/graphs.py``); elsewhere run eagerly on the same buffers (the twin: tests and
``benchmarks/engine.py --device cpu``). A newcomer's first token is sampled at its join, eagerly, with
``inference.sample_rows`` (the graph's sampling). What the step reads never moves:
  * the KV pool and its lengths (``inference.SlotCache``, allocated once) and a RoPE table of the pool's slots of
    its own (not the shared ``inference._freqs_cis`` cache, which a longer request may replace);
  * per-row buffers of the pool's rows: input/output tokens, logprobs, sequence keys, temperature, top_k, and the
    rows in use (``active``), written at joins and row moves by device copies, never reallocated;
  * the weights: one static copy, into which a swap's new version is copied (``decode`` sees a new model).
    Why one copy rather than a set of graphs per receiver buffer: graphs per buffer multiply captures by the
    buffers held (``off_policy.max_version_gap + 1``) and miss a buffer the receiver allocates later (after an
    abandoned receive); a copy costs one model of memory (counted: ``inference.decode_graph_bytes``) and one
    device copy per swap (GPU review 5 estimates 0.4 ms at 0.6B on an H200), none per step. The copy is queued on
    the engine's stream before the step that reads it, and the step's host read completes it before the batcher's
    next swap can free its source (``engine/versions.py``'s rule for the live buffer).
Also a key of a graph: the largest top_k among the rows (``inference.sample_rows`` needs it static), so a run whose
requests use k distinct top_k values captures up to k graphs per (rows, width).
Padded rows (rows past those in use, up to the bucket) run at position 0 of their own free row and change nothing
a row in use reads. Host reads: none here; the batcher reads ``sampled`` once a step.

Threads: the engine's main thread only.
"""

from __future__ import annotations

from typing import Protocol

import torch

from torchtitan_flux.models import inference

MIN_WIDTH = 32  # the narrowest width bucket (slots attended)


def rows_bucket(rows: int, capacity: int) -> int:
    """The rows a step of ``rows`` rows in use runs: the next power of two, at most the pool's ``capacity``."""
    return min(capacity, 1 << max(0, rows - 1).bit_length())


def width_bucket(width: int, slots: int) -> int:
    """The slots a step whose longest row is ``width`` long attends: the next power of two >= ``MIN_WIDTH``, at
    most the pool's ``slots``."""
    return min(slots, max(MIN_WIDTH, 1 << max(0, width - 1).bit_length()))


Setting = tuple[int, float, int]
"""A sequence's sampling: its key (``batcher.sequence_key``), temperature (0: greedy), top_k (0: whole vocab)."""


class Decoder(Protocol):
    """What the batcher calls, in this order each step: ``sampled`` (then its one host read), ``moved`` if rows
    ended, ``decode`` if rows remain; ``join`` after newcomers were prefilled into the rows after those in use."""

    def join(self, model: inference.Model, cache: inference.SlotCache, hidden: torch.Tensor,
             settings: list[Setting]) -> None:
        """Rows ``[cache.rows - len(settings), cache.rows)`` were just prefilled; ``hidden`` their last states."""

    def sampled(self, model: inference.Model, cache: inference.SlotCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row in use's next token and its logprob [rows], on the device."""

    def moved(self, order: list[int], before: int) -> None:
        """``inference.drop_rows`` freed rows: row ``i`` in use now was row ``order[i]`` of the ``before``."""

    def decode(self, model: inference.Model, cache: inference.SlotCache, width: int) -> None:
        """Decode the sampled tokens; ``width``: the longest row's length after it."""


def _normalised(top_k: int, vocab: int) -> int:
    return top_k if 0 < top_k < vocab else 0  # a top_k past the vocabulary samples from all of it, as generate


class EagerDecode:
    """Today's step (module docstring)."""

    def __init__(self):
        self.hidden: torch.Tensor | None = None  # [rows, dim]: each row's last hidden state, to sample from
        self.keys: torch.Tensor | None = None  # [rows] int64: each row's sequence key, on the model's device
        self.settings: list[tuple[float, int]] = []  # each row's (temperature, top_k)
        self.tokens: torch.Tensor | None = None  # the last ``sampled`` tokens, to decode

    def join(self, model, cache, hidden, settings):
        keys = inference.to_device([key for key, _, _ in settings], hidden.device)
        self.hidden = hidden if self.hidden is None else torch.cat([self.hidden, hidden])
        self.keys = keys if self.keys is None else torch.cat([self.keys, keys])
        self.settings += [(t, _normalised(k, model.shape.vocab_size)) for _, t, k in settings]

    def sampled(self, model, cache):
        logits = inference.logits(model, self.hidden)
        uniforms = inference.counter_uniforms(self.keys, cache.lengths[: cache.rows])
        if len(set(self.settings)) == 1:
            tok, logp = inference.sample_with(logits, *self.settings[0], uniforms)
            self.tokens = tok.view(-1)
            return self.tokens, logp.view(-1)
        tok = torch.empty(len(self.settings), dtype=torch.long, device=logits.device)
        logp = torch.empty(len(self.settings), dtype=torch.float32, device=logits.device)
        for setting in dict.fromkeys(self.settings):
            index = inference.to_device([i for i, k in enumerate(self.settings) if k == setting], logits.device)
            t, lp = inference.sample_with(logits[index], *setting, uniforms[index])
            tok[index], logp[index] = t.view(-1), lp.view(-1)
        self.tokens = tok
        return tok, logp

    def moved(self, order, before):
        if not order:
            self.hidden = self.keys = self.tokens = None
            self.settings = []
            return
        index = inference.to_device(order, self.keys.device)
        self.tokens, self.keys = self.tokens[index], self.keys[index]
        self.settings = [self.settings[i] for i in order]

    def decode(self, model, cache, width):
        self.hidden = inference.decode_rows(model, cache, self.tokens, width)


class GraphDecode:
    """The captured step, or its twin (module docstring). ``capture``: CUDA graphs (``engine/graphs.py``; a CUDA
    pool only); False: the same function run eagerly on the same buffers."""

    def __init__(self, model: inference.Model, cache: inference.SlotCache, capture: bool):
        device, rows = model.device, cache.capacity
        if capture and device.type != "cuda":
            raise ValueError(f"captured decode steps need a CUDA device, the KV pool is on {device}")
        self.weights, self._static = _static_copy(model)  # what every step reads; ``_source``'s version copied in
        self._source: inference.Model | None = None
        self.freqs = inference._freqs_cis(model.shape, cache.slots, device)[: cache.slots].clone()
        self.active = torch.zeros(rows, dtype=torch.bool, device=device)  # the rows in use (a prefix)
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)  # each row's last sampled token
        self.logprobs = torch.zeros(rows, dtype=torch.float32, device=device)
        self.keys = torch.zeros(rows, dtype=torch.long, device=device)
        self.temperature = torch.ones(rows, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(rows, dtype=torch.long, device=device)
        self.top_ks: list[int] = []  # each row in use's top_k, on the host (the step's largest is a bucket key)
        if capture:
            from torchtitan_flux.engine.graphs import CapturedSteps

            self.graphs: CapturedSteps | None = CapturedSteps(device)
        else:
            self.graphs = None

    def join(self, model, cache, hidden, settings):
        first, end = cache.rows - len(settings), cache.rows
        vocab, device = model.shape.vocab_size, hidden.device
        top_ks = [_normalised(k, vocab) for _, _, k in settings]
        self.keys[first:end] = inference.to_device([key for key, _, _ in settings], device)
        self.temperature[first:end] = inference.to_device([t for _, t, _ in settings], device, torch.float32)
        self.top_k[first:end] = inference.to_device(top_ks, device)
        self.active[first:end] = True
        self.top_ks += top_ks
        uniforms = inference.counter_uniforms(self.keys[first:end], cache.lengths[first:end])
        tok, logp = inference.sample_rows(inference.logits(model, hidden), self.temperature[first:end],
                                          self.top_k[first:end], uniforms, max(top_ks))
        self.tokens[first:end], self.logprobs[first:end] = tok.view(-1), logp.view(-1)

    def sampled(self, model, cache):
        return self.tokens[: cache.rows], self.logprobs[: cache.rows]

    def moved(self, order, before):
        self.active[len(order): before] = False
        self.top_ks = [self.top_ks[i] for i in order]
        holes = [i for i, o in enumerate(order) if i != o]
        if holes:
            dst, src = (inference.to_device(rows, self.tokens.device) for rows in (holes, [order[i] for i in holes]))
            for buf in (self.tokens, self.keys, self.temperature, self.top_k):
                buf[dst] = buf[src]

    def decode(self, model, cache, width):
        if model is not self._source:  # a swap: its version into the static set (queued, no host read)
            torch._foreach_copy_(self._static, _tensors_of(model))
            self._source = model
        rows, width = rows_bucket(cache.rows, cache.capacity), width_bucket(width, cache.slots)
        k_max = max(self.top_ks)
        args = (self.weights, cache, self.freqs, rows, width, k_max, self.active, self.tokens, self.logprobs,
                self.keys, self.temperature, self.top_k)
        if self.graphs is None:
            inference.decode_and_sample(*args)
        else:
            self.graphs.run((rows, width, k_max), lambda: inference.decode_and_sample(*args))


def _tensors_of(model: inference.Model) -> list[torch.Tensor]:
    """Every weight tensor ``model`` reads, in a fixed order, each distinct tensor once (a tied output is the
    embedding)."""
    tensors = [model.embedding, model.norm, model.output]
    tensors += [t for layer in model.layers for t in layer if t is not None]
    seen: set[int] = set()
    return [t for t in tensors if not (id(t) in seen or seen.add(id(t)))]


def _static_copy(model: inference.Model) -> tuple[inference.Model, list[torch.Tensor]]:
    """A ``Model`` of fresh tensors shaped as ``model``'s (one model of memory; filled by ``GraphDecode.decode``),
    and its tensors in ``_tensors_of``'s order."""
    static = {id(t): torch.empty_like(t) for t in _tensors_of(model)}
    layers = [type(layer)(*(static[id(t)] if t is not None else None for t in layer)) for layer in model.layers]
    copy = inference.Model(model.shape, static[id(model.embedding)], layers, static[id(model.norm)],
                           static[id(model.output)])
    return copy, [static[id(t)] for t in _tensors_of(model)]
