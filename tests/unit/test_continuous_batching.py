"""Continuous batching (``engine/batcher.py``, ``inference.SlotCache``), in-process on the tiny model: sequences join
and leave mid-batch, logprobs equal a recomputation on the full sequence, a sequence's tokens do not depend on its
batch, and weights change only between requests as the admission rule says (with in-flight updates: between decode
steps, each token recording its version). The engine process around the batcher is a stand-in here
(``FakeEngine``, an ``EngineIO`` with the engine's real ``VersionRule``); tests/integration/test_engine.py runs the
real one."""

from __future__ import annotations

import collections
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import DEBUG_TOML, ROOT

from torchtitan_flux.patches import apply_patches

apply_patches()

import model_assets as assets  # noqa: E402

from torchtitan_flux.engine.base import GenerationRequest  # noqa: E402
from torchtitan_flux.engine.batcher import ContinuousBatcher, EngineIO, sequence_key  # noqa: E402
from torchtitan_flux.engine.kinds import ENGINE_KINDS  # noqa: E402
from torchtitan_flux.engine.versions import InFlight, Pinned  # noqa: E402
from torchtitan_flux.errors import ConfigError  # noqa: E402
from torchtitan_flux.models import inference, weight_dict  # noqa: E402
from torchtitan_flux.run.validation import validate_config  # noqa: E402
from torchtitan_flux.run.config_file import load_config
from torchtitan_flux.run.trainer import GRPOTrainer  # noqa: E402


@pytest.fixture(scope="module")
def weights_and_shape(tmp_path_factory):
    return weight_dict.load_hf_weights_dict(assets.build_model_dir(tmp_path_factory.mktemp("tiny"), "tiny", seed=0))


@dataclass
class FakeReceiver:
    """``WeightReceiver``'s face to the batcher: versions ``weights`` holds, the live one, and the swaps made."""

    weights: dict[int, dict]
    live_version: int = -1
    swaps: list[int] = field(default_factory=list)

    @property
    def live(self):
        return SimpleNamespace(views=self.weights[self.live_version])

    def newest(self):
        v = max(self.weights)
        return v, self.weights[v]

    def swap(self, upto: int) -> int:
        self.swaps.append(upto)
        self.live_version = max(v for v in self.weights if upto < 0 or v <= upto)
        return self.live_version


class FakeEngine(EngineIO):
    """``_EngineProcess``'s face to the batcher (``EngineIO``): the engine's version rule over ``FakeReceiver``
    (requests arrive at time 0, so past their wait bound: every request is ready); results are collected in order.
    ``run()`` needs ``PipedEngine``'s messages."""

    def __init__(self, weights: dict[int, dict], shape, in_flight: bool = False):
        self.rule, self.receiver, self.shape = InFlight() if in_flight else Pinned(), FakeReceiver(weights), shape
        self.eos_id, self.pad_id, self.stall_s, self.kv_slots = [assets.EOS_ID], assets.PAD_ID, 0.0, 64
        self.results: list[SimpleNamespace] = []

    def live_model(self):
        return inference.Model.of(self.receiver.live.views, self.shape)

    def send_result(self, req_id, tokens, logprobs, lengths, version, gen_time_s, token_versions=None):
        self.results.append(SimpleNamespace(req_id=req_id, tokens=tokens, logprobs=logprobs, lengths=lengths,
                                            version=version, token_versions=token_versions))


def request(req_id: int, prompts, max_new: int, group: int = 2, seed: int = 7, pin: int = -1, temperature=1.0,
            min_version: int = -1, keep_kv: bool = False):
    return GenerationRequest(req_id, 1, prompts, group, max_new, temperature, 0, seed=seed, dispatch_version=0,
                             pin_version=pin, min_version=min_version, keep_kv=keep_kv)


def batcher(weights_and_shape, max_sequences: int = 64, versions=(0,), in_flight=False) -> ContinuousBatcher:
    weights, shape = weights_and_shape
    return ContinuousBatcher(FakeEngine({v: weights for v in versions}, shape, in_flight), max_sequences)


def perturbed(weights: dict, seed: int = 1) -> dict:
    """Another version of ``weights``: every tensor moved by noise of its own scale (its KV and logits differ)."""
    g = torch.Generator().manual_seed(seed)
    return {k: t + 0.5 * t.abs().mean() * torch.randn(t.shape, generator=g, dtype=t.dtype) for k, t in weights.items()}


def submit(b: ContinuousBatcher, *reqs: GenerationRequest) -> None:
    b.waiting.extend((r, 0.0) for r in reqs)
    b._admit()
    b._fill_rows()


def run_until_idle(b: ContinuousBatcher, limit: int = 1000) -> None:
    for _ in range(limit):
        if not b.rows:
            return
        b._step()
        b._fill_rows()
    raise AssertionError("the batch never drained")


def serve_alone(weights_and_shape, req: GenerationRequest):
    b = batcher(weights_and_shape)
    submit(b, req)
    run_until_idle(b)
    return b.engine.results[0]


PROMPTS = [[1, 40, 41, 42], [1, 50, 51, 52, 53, 54, 55, 56, 57], [1, 60]]


def recomputed_logprobs(weights_and_shape, prompts, group, result) -> float:
    """Largest |engine logprob - ``inference.score`` of prompt + completion| over every sampled token."""
    weights, shape = weights_and_shape
    worst = 0.0
    for i, prompt in enumerate(p for p in prompts for _ in range(group)):
        n = int(result.lengths[i])
        seq = torch.tensor([prompt + result.tokens[i, :n].tolist()])
        ref = inference.score(weights, shape, seq)[0, len(prompt) - 1:]
        worst = max(worst, (ref - result.logprobs[i, :n]).abs().max().item())
    return worst


def test_a_short_request_joins_a_long_one_mid_batch_and_its_result_comes_back_first(weights_and_shape):
    b = batcher(weights_and_shape)
    submit(b, request(1, PROMPTS, max_new=24, seed=1))
    for _ in range(5):
        b._step()
    assert len(b.rows) == 6 and len({int(n) for n in b.cache.lengths[:6]}) > 1  # rows at different lengths
    submit(b, request(2, [[1, 70, 71]], max_new=3, seed=2))  # joins at decode step 5
    assert len(b.rows) == 8 and b.in_flight == 2
    run_until_idle(b)
    assert [r.req_id for r in b.engine.results] == [2, 1]
    assert b.in_flight == 0 and b.cache.rows == 0
    for req_id, prompts in ((1, PROMPTS), (2, [[1, 70, 71]])):
        result = next(r for r in b.engine.results if r.req_id == req_id)
        assert recomputed_logprobs(weights_and_shape, prompts, 2, result) < 1e-4
        assert result.tokens.shape == (len(prompts) * 2, 24 if req_id == 1 else 3)
        for i, n in enumerate(result.lengths.tolist()):  # the serial engine's layout past a row's end
            assert (result.tokens[i, n:] == assets.PAD_ID).all() and (result.logprobs[i, n:] == 0).all()
            assert n == result.tokens.shape[1] or int(result.tokens[i, n - 1]) == assets.EOS_ID


def test_batch_invariant_a_sequence_samples_the_same_alone_or_beside_others(weights_and_shape):
    """Each sequence has its own draws (``counter_uniforms``): the same request gives the same tokens whatever
    shares its batch (and whichever rows it lands in), and logprobs equal to rounding."""
    alone = serve_alone(weights_and_shape, request(5, PROMPTS, max_new=16, seed=11))
    b = batcher(weights_and_shape)
    submit(b, request(4, [[1, 90, 91, 92, 93]], max_new=16, group=3, seed=3))
    b._step()
    b._step()
    submit(b, request(5, PROMPTS, max_new=16, seed=11))
    run_until_idle(b)
    beside = next(r for r in b.engine.results if r.req_id == 5)
    assert torch.equal(beside.tokens, alone.tokens) and torch.equal(beside.lengths, alone.lengths)
    torch.testing.assert_close(beside.logprobs, alone.logprobs, atol=1e-5, rtol=0)
    again = serve_alone(weights_and_shape, request(5, PROMPTS, max_new=16, seed=11))
    assert torch.equal(again.tokens, alone.tokens) and torch.equal(again.logprobs, alone.logprobs)


def test_a_full_batch_queues_sequences_until_rows_free(weights_and_shape):
    """Rows bound the batch: 8 sequences through 3 rows, with the same tokens as through 64."""
    b = batcher(weights_and_shape, max_sequences=3)
    submit(b, request(1, PROMPTS + [[1, 33]], max_new=10, seed=4))
    assert len(b.rows) == 3 and len(b.queued) == 5
    peak = 0
    while b.rows:
        b._step()
        b._fill_rows()
        peak = max(peak, len(b.rows))
    assert peak == 3 and b.cache.layers[0][0].shape[0] == 3
    wide = serve_alone(weights_and_shape, request(1, PROMPTS + [[1, 33]], max_new=10, seed=4))
    assert torch.equal(b.engine.results[0].tokens, wide.tokens)


class PipedEngine(FakeEngine):
    """``FakeEngine`` with the scripted messages ``run()`` serves, in order. A wait that would block (no message
    left, a timeout other than 0) records how many sequences were still admitted, then serves a shutdown: the real
    engine would wait there for a message that never comes."""

    def __init__(self, weights, shape, *messages):
        super().__init__(weights, shape)
        self.messages = list(messages)
        self.blocked_with_queued: list[int] = []
        self.batcher: ContinuousBatcher | None = None

    def serve_messages(self, waiting, timeout):
        if not self.messages:
            if timeout == 0.0:
                return True
            self.blocked_with_queued.append(len(self.batcher.queued))
            return False
        while self.messages:
            msg = self.messages.pop(0)
            if msg[0] == "shutdown":
                return False
            if msg[0] == "generate":
                waiting.append((msg[1], 0.0))
        return True


def test_run_serves_sequences_still_queued_when_every_row_ends_in_the_same_step(weights_and_shape):
    """The hang of ``rollout.continuous_batching`` with few rows: greedy copies of one prompt end in the same decode
    step while more copies wait for a row; ``run()`` must go on decoding them, not wait on the pipe."""
    weights, shape = weights_and_shape
    greedy = [request(1, [[1, 40, 41]], max_new=3, group=4, temperature=0.0),
              request(2, [[1, 50, 51]], max_new=2, group=6, temperature=0.0)]
    engine = PipedEngine({0: weights}, shape, *(("generate", r) for r in greedy))
    b = engine.batcher = ContinuousBatcher(engine, max_sequences=2)
    b.run()
    assert engine.blocked_with_queued == [0], "run() waited on the pipe with admitted sequences still queued"
    assert sorted(r.req_id for r in engine.results) == [1, 2]
    ref = serve_alone(weights_and_shape, greedy[0])
    assert torch.equal(next(r for r in engine.results if r.req_id == 1).tokens, ref.tokens)


def test_mixed_sampling_settings_in_one_batch(weights_and_shape):
    """A greedy request beside a sampled one: each row follows its own request's temperature."""
    b = batcher(weights_and_shape)
    submit(b, request(1, PROMPTS, max_new=8, seed=1), request(2, [[1, 70, 71]], max_new=8, temperature=0.0))
    run_until_idle(b)
    greedy = next(r for r in b.engine.results if r.req_id == 2)
    weights, shape = weights_and_shape
    ref = inference.generate(weights, shape, [[1, 70, 71]] * 2, max_new_tokens=8, temperature=0.0,
                             eos_id=assets.EOS_ID, pad_id=assets.PAD_ID)
    assert torch.equal(greedy.tokens, ref[0]) and torch.equal(greedy.lengths, ref[2])


def test_a_newer_pin_waits_for_the_batch_to_drain_and_an_older_one_joins(weights_and_shape):
    """Admission by version: versions swap only with nothing in flight; a request pinned to the live version (or
    an older one, which swap would leave on the live one) joins, one pinned to a newer version waits, and so does
    every request behind it."""
    b = batcher(weights_and_shape, versions=(1, 2, 3))
    submit(b, request(1, PROMPTS, max_new=12, pin=2))
    assert b.engine.receiver.swaps == [2]
    submit(b, request(2, [[1, 5]], max_new=4, pin=1), request(3, [[1, 6]], max_new=4, pin=3),
           request(4, [[1, 7]], max_new=4, pin=2))
    assert [r.req_id for r, _ in b.waiting] == [3, 4] and b.in_flight == 2
    run_until_idle(b)
    assert {r.req_id for r in b.engine.results} == {1, 2} and all(r.version == 2 for r in b.engine.results)
    b._admit()
    assert b.engine.receiver.swaps == [2, 3]
    b._fill_rows()
    run_until_idle(b)
    assert [(r.req_id, r.version) for r in b.engine.results[2:]] == [(3, 3), (4, 3)]


def mixed_logprobs(weights_of: dict, shape, prompt, tokens, versions) -> torch.Tensor:
    """Each token's logprob (temperature 1) the way in-flight updates compute it, one row alone: the hidden state
    it is sampled from is decoded by its own version, over the K/V the earlier tokens' versions wrote, kept."""
    models = {v: inference.Model.of(weights_of[v], shape) for v in set(versions)}
    cache = inference.SlotCache.allocate(models[versions[0]], 1, len(prompt) + len(tokens))
    h = inference.join_rows(models[versions[0]], cache, [prompt], assets.PAD_ID, len(prompt) + len(tokens))
    out = []
    for k, (t, v) in enumerate(zip(tokens, versions)):
        out.append(torch.log_softmax(F.linear(h, models[v].output).float(), dim=-1)[0, t])
        if k + 1 < len(tokens):
            h = inference.decode_rows(models[versions[k + 1]], cache, torch.tensor([t]), len(prompt) + k + 1)
    return torch.stack(out)


def test_a_push_landing_mid_generation_goes_live_at_the_next_step_and_each_token_records_its_version(
        weights_and_shape):
    """In-flight updates: version 4 lands while version 3 decodes (no stop token, so every row runs 20 tokens).
    Tokens 0-5 were sampled before it landed; step 6 samples from version 3's hidden state, then swaps, so tokens
    7 on come from version 4. What is comparable: the prefix (tokens 0-6) to scoring with version 3 alone; the rest
    to version 4 decoding over the K/V version 3 wrote (``mixed_logprobs``), not to either version alone (the KV
    cache is kept, not recomputed)."""
    weights, shape = weights_and_shape
    weights_of = {3: weights, 4: perturbed(weights)}
    b = batcher(weights_and_shape, versions=(3,), in_flight=True)
    b.eos = set()  # no stop token: every row runs max_new tokens
    submit(b, request(1, PROMPTS, max_new=20, seed=5, pin=3, min_version=3))
    for _ in range(6):
        b._step()
    b.engine.receiver.weights[4] = weights_of[4]  # the push lands between two decode steps
    run_until_idle(b)
    assert b.engine.receiver.swaps == [-1, -1]  # the admission's, then the mid-generation one
    (result,) = b.engine.results
    assert result.version == 3 and (result.lengths == 20).all()
    expected = torch.tensor([3] * 7 + [4] * 13)
    for i, prompt in enumerate(p for p in PROMPTS for _ in range(2)):
        tokens = result.tokens[i].tolist()
        assert torch.equal(result.token_versions[i], expected)  # switches once, monotonically, at 7
        scored = {v: inference.score(w, shape, torch.tensor([prompt + tokens]))[0, len(prompt) - 1:]
                  for v, w in weights_of.items()}
        torch.testing.assert_close(result.logprobs[i, :7], scored[3][:7], atol=1e-4, rtol=0)
        torch.testing.assert_close(result.logprobs[i], mixed_logprobs(weights_of, shape, prompt, tokens,
                                                                      expected.tolist()), atol=1e-4, rtol=0)
        assert (result.logprobs[i, 7:] - scored[3][7:]).abs().max() > 1e-2  # the new weights made these
        assert (result.logprobs[i, 8:] - scored[4][8:]).abs().max() > 1e-3  # on version 3's K/V, not recomputed


@pytest.mark.parametrize("in_flight", [False, True], ids=["off", "in_flight"])
def test_a_request_joins_a_batch_on_an_older_version_at_once_only_with_in_flight_updates(weights_and_shape,
                                                                                        in_flight):
    """Version 2 lands while request 1 decodes on version 1; then requests 2 (pinned to 2) and 3 (``min_version``
    2) arrive. In flight: 2 joins at once (the live version serves it; its pin is ignored), and 3 at the next step,
    whose swap makes 2 live; nothing drains. Off: both wait until request 1 has ended, then run on version 2."""
    weights, _ = weights_and_shape
    b = batcher(weights_and_shape, versions=(1,), in_flight=in_flight)
    b.eos = set()  # no stop token: every row runs max_new tokens
    submit(b, request(1, PROMPTS, max_new=12, seed=3))
    b._step()
    b.engine.receiver.weights[2] = perturbed(weights)
    submit(b, request(2, [[1, 70, 71]], max_new=4, pin=2), request(3, [[1, 5]], max_new=4, pin=2, min_version=2))
    waiting = [r.req_id for r, _ in b.waiting]
    b._step()
    submit(b)
    running = {s.request.req.req_id for s in b.rows}
    run_until_idle(b)
    results = {r.req_id: r for r in b.engine.results}
    if in_flight:
        assert waiting == [3] and running == {1, 2, 3}
        assert [r.req_id for r in b.engine.results][-1] == 1  # still decoding when both joined
        versions = {k: r.token_versions[0].tolist() for k, r in results.items()}
        assert versions == {1: [1, 1] + [2] * 10, 2: [1, 2, 2, 2], 3: [2] * 4}  # 2: prefilled on the live one
        assert [results[k].version for k in (1, 2, 3)] == [1, 1, 2]
    else:
        assert waiting == [2, 3] and running == {1} and set(results) == {1}
        assert all(r.token_versions is None for r in results.values())
        submit(b)
        run_until_idle(b)
        assert [(r.req_id, r.version, r.token_versions) for r in b.engine.results] == [(1, 1, None), (2, 2, None),
                                                                                        (3, 2, None)]


def test_an_in_flight_request_reports_its_oldest_token_not_its_admission(weights_and_shape):
    """Two rows: request 2 is admitted on version 1 but its sequences wait for request 1's rows, which a swap to
    version 2 precedes; every token of request 2 is version 2's, and so is its ``version``."""
    weights, _ = weights_and_shape
    b = batcher(weights_and_shape, max_sequences=2, versions=(1,), in_flight=True)
    b.eos = set()
    submit(b, request(1, [[1, 40]], max_new=3), request(2, [[1, 50]], max_new=2))
    assert len(b.queued) == 2 and b.in_flight == 2
    b._step()
    b.engine.receiver.weights[2] = perturbed(weights)
    run_until_idle(b)
    results = {r.req_id: r for r in b.engine.results}
    assert results[1].token_versions.tolist() == [[1, 1, 2]] * 2 and results[1].version == 1
    assert results[2].token_versions.tolist() == [[2, 2]] * 2 and results[2].version == 2


def test_in_flight_updates_run_a_request_on_the_newest_version_whatever_its_pin(weights_and_shape):
    """With nothing in flight, a request pinned to version 1 makes the newest held (2) live, not its pin."""
    b = batcher(weights_and_shape, versions=(1, 2), in_flight=True)
    submit(b, request(1, [[1, 40]], max_new=3, pin=1, min_version=1))
    run_until_idle(b)
    (result,) = b.engine.results
    assert b.engine.receiver.swaps == [-1] and result.version == 2
    assert set(result.token_versions[result.token_versions >= 0].tolist()) == {2}


def test_without_in_flight_updates_results_carry_no_token_versions(weights_and_shape):
    """Off: no per-token versions (every token is the result's ``version``), and the tokens are the same as those
    of an in-flight batcher when no push lands (one version: nothing to swap)."""
    off = serve_alone(weights_and_shape, request(1, PROMPTS, max_new=10, seed=2))
    b = batcher(weights_and_shape, in_flight=True)
    submit(b, request(1, PROMPTS, max_new=10, seed=2))
    run_until_idle(b)
    (on,) = b.engine.results
    assert off.token_versions is None and off.version == 0
    written = torch.arange(10)[None, :] < on.lengths[:, None]  # -1 after each row's end
    assert torch.equal(on.token_versions, torch.where(written, 0, -1)) and on.version == 0
    assert torch.equal(on.tokens, off.tokens) and torch.equal(on.logprobs, off.logprobs)


def test_slot_cache_decode_matches_the_padded_batch_path(weights_and_shape):
    """``join_rows`` + ``decode_rows`` (rows at their own lengths) give ``prefill`` + ``decode_step``'s hidden
    states (one left-padded batch) to rounding, after rows were dropped and moved."""
    weights, shape = weights_and_shape
    model = inference.Model.of(weights, shape)
    prompts = [[1, 40, 41, 42], [1, 50, 51, 52, 53, 54, 55, 56, 57], [1, 60], [1, 61, 62]]
    tokens = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14]])  # three steps' tokens per row
    freqs = inference._freqs_cis(shape, 32, model.device)
    with torch.no_grad():
        _, padded = inference.prefill(model, prompts, assets.PAD_ID, 32, freqs)
        expected = [inference.decode_step(model, padded, t, freqs) for t in tokens]
    cache = inference.SlotCache.allocate(model, 5, 32)
    inference.join_rows(model, cache, prompts[:1], assets.PAD_ID, 16)
    inference.join_rows(model, cache, [[1, 2, 3]] + prompts[1:], assets.PAD_ID, 32)
    order = inference.drop_rows(cache, [False, True, False, False, False])  # the last row moves into row 1
    assert order == [0, 4, 2, 3]
    padded_row = [0, 3, 1, 2]  # of each row in use now
    for step, t in enumerate(tokens):
        h = inference.decode_rows(model, cache, t[padded_row], int(cache.lengths[: cache.rows].max()) + 1)
        torch.testing.assert_close(h, expected[step][padded_row], atol=1e-5, rtol=0)


def test_each_rule_waits_for_its_own_versions_until_the_wait_bound():
    """``Pinned`` waits for the pin and ``min_version``, ``InFlight`` for ``min_version`` only; either starts a
    request on what is held once its wait bound (the join's timeout) passed, and none before the first version."""
    now = time.monotonic()
    held = FakeReceiver({1: {}})
    req = request(1, [[1, 5]], max_new=2, pin=2, min_version=1)
    pinned, in_flight = Pinned(wait_bound_s=30.0), InFlight(wait_bound_s=30.0)
    assert not pinned.ready(req, now, held) and in_flight.ready(req, now, held)
    assert pinned.ready(req, now - 31.0, held) and not pinned.ready(req, now - 31.0, None)
    assert pinned.wait_timeout(collections.deque([(req, now)])) == pytest.approx(30.001, abs=0.1)
    assert (pinned.swap_target(req), in_flight.swap_target(req)) == (2, -1)


def test_batch_invariant_counter_uniforms_depend_on_their_own_key_and_counter_only():
    """A row's draw is the same alone or among others, differs by sequence key and position, and is uniform."""
    keys = torch.tensor([sequence_key(s, i) for s in (0, 1) for i in (0, 1, 2)])
    draws = inference.counter_uniforms(keys, torch.full((6,), 5))
    assert len(set(draws.view(-1).tolist())) == 6
    for r in range(6):
        assert torch.equal(inference.counter_uniforms(keys[r: r + 1], torch.tensor([5])), draws[r: r + 1])
    many = inference.counter_uniforms(torch.full((20000,), sequence_key(3, 0)), torch.arange(20000)).view(-1)
    assert 0 <= float(many.min()) and float(many.max()) < 1
    assert abs(float(many.mean()) - 0.5) < 0.01 and abs(float((many < 0.1).float().mean()) - 0.1) < 0.01


def test_continuous_batching_lifts_the_serial_pipeline_depth_cap():
    embedded, vllm = ENGINE_KINDS["embedded"], ENGINE_KINDS["vllm"]
    assert embedded.serves_serially(continuous_batching=False)
    assert not embedded.serves_serially(continuous_batching=True)
    assert not vllm.serves_serially(continuous_batching=False)


def test_the_fields_parse_and_a_batch_without_rows_is_refused(tiny_model_dir):
    def parse(*overrides):
        return load_config(["--job.config_file", str(DEBUG_TOML), *overrides], GRPOTrainer.Config())

    default = parse()
    assert not default.rollout.continuous_batching and default.rollout.max_batch_sequences == 256
    cfg = parse("--rollout.continuous_batching", "true", "--rollout.max_batch_sequences", "8")
    validate_config(cfg)
    assert cfg.rollout.continuous_batching and cfg.rollout.max_batch_sequences == 8
    with pytest.raises(ConfigError, match=r"rollout\.max_batch_sequences = 0 is out of"):
        validate_config(parse("--rollout.max_batch_sequences", "0"))
    # rows set without continuous batching were silently ignored (the fifth sweep): refused, naming the field
    with pytest.raises(ConfigError, match=r"^rollout\.max_batch_sequences = 8 is out of range; allowed: 256 \(the "
                                          r"default\) unless rollout\.continuous_batching = true"):
        validate_config(parse("--rollout.max_batch_sequences", "8"))


class PrefillCount:
    """Tokens ``inference`` runs in prefills while it is active (every forward but a decode step's: theirs take an
    additive mask, prefills a boolean one)."""

    def __init__(self, monkeypatch):
        self.tokens = 0
        forward = inference._forward_hidden

        def counting(model, tokens, fc, mask, *args):
            if mask.dtype == torch.bool:
                self.tokens += tokens.numel()
            return forward(model, tokens, fc, mask, *args)

        monkeypatch.setattr(inference, "_forward_hidden", counting)


def next_turn(prompt: list[int], result, row: int = 0) -> list[int]:
    """A multi-turn episode's next prompt: the turn's prompt, its tokens, then an environment's reply."""
    return prompt + result.tokens[row, : int(result.lengths[row])].tolist() + [3, 77, 78, 79]


def test_a_turn_prefills_only_the_tokens_after_its_episodes_kept_kv(weights_and_shape, monkeypatch):
    """``keep_kv``: an ended turn's K/V is kept, and the episode's next turn (its prompt extends the turn's prompt
    and tokens) runs only the tokens the kept K/V does not cover: the ended turn's last token and the reply.
    Tokens equal, logprobs to rounding, a fresh prefill of the whole prompt; a request without ``keep_kv`` neither
    keeps nor takes."""
    prompt = [1, 50, 51, 52, 53, 54, 55, 56, 57]
    b = batcher(weights_and_shape)
    b.eos = set()  # every turn runs its budget
    submit(b, request(1, [prompt], max_new=6, group=1, seed=3, keep_kv=True))
    run_until_idle(b)
    assert len(b.kept) == 1
    second = next_turn(prompt, b.engine.results[0])
    count = PrefillCount(monkeypatch)
    submit(b, request(2, [second], max_new=6, group=1, seed=4, keep_kv=True))
    assert count.tokens == 1 + 4  # the first turn's last token and the reply
    submit(b, request(3, [second], max_new=6, group=1, seed=4, keep_kv=True))  # another episode, the same turn
    assert count.tokens == 2 * (1 + 4)
    run_until_idle(b)
    fresh = batcher(weights_and_shape)
    fresh.eos = set()
    count.tokens = 0
    submit(fresh, request(2, [second], max_new=6, group=1, seed=4))
    assert count.tokens == len(second)
    run_until_idle(fresh)
    assert len(fresh.kept) == 0
    kept, again = b.engine.results[1], fresh.engine.results[0]
    assert torch.equal(b.engine.results[2].tokens, kept.tokens)
    assert torch.equal(kept.tokens, again.tokens)
    torch.testing.assert_close(kept.logprobs, again.logprobs, atol=1e-5, rtol=0)
    assert recomputed_logprobs(weights_and_shape, [second], 1, kept) < 1e-4


@pytest.mark.parametrize("in_flight", [False, True])
def test_kept_kv_of_an_older_version_is_used_only_with_in_flight_updates_and_stamps_its_version(
        weights_and_shape, monkeypatch, in_flight):
    """A turn kept on version 0 and a next turn on version 1: pinned requests prefill it all again (each token on
    its request's version); with in-flight updates the kept K/V is used and every token of the next turn says
    version 0, the oldest its K/V was computed on."""
    weights, _ = weights_and_shape
    b = batcher(weights_and_shape, in_flight=in_flight)
    b.eos = set()
    prompt = [1, 40, 41, 42]
    submit(b, request(1, [prompt], max_new=5, group=1, pin=0, keep_kv=True))
    run_until_idle(b)
    b.engine.receiver.weights[1] = perturbed(weights)
    second = next_turn(prompt, b.engine.results[0])
    count = PrefillCount(monkeypatch)
    submit(b, request(2, [second], max_new=5, group=1, pin=1, min_version=1, keep_kv=True))
    run_until_idle(b)
    result = b.engine.results[1]
    assert count.tokens == (5 if in_flight else len(second))
    if in_flight:
        assert result.version == 0 and (result.token_versions[0] == 0).all()
    else:
        assert result.version == 1 and len(b.kept) == 2  # both turns kept


def test_kept_sequences_give_the_longest_proper_prefix_to_every_taker_and_drop_the_least_recent():
    """Episodes that sampled the same turn share its K/V (a group's episodes often do): each taker gets it."""
    from torchtitan_flux.engine.kept import Kept, KeptSequences

    store = KeptSequences(capacity=2)
    for tokens in ((1, 2), (1, 2, 3), (1, 2, 3, 4, 5)):
        store.keep(Kept(tokens, 0, []))
    assert len(store) == 2  # (1, 2) dropped
    assert store.take([1, 2, 3, 4, 5], lambda v: True).tokens == (1, 2, 3)  # a proper prefix only
    assert store.take([1, 2, 3, 9], lambda v: True).tokens == (1, 2, 3)  # shared: taken again
    assert store.take([1, 2, 3, 4, 5, 6], lambda v: v == 1) is None  # not a usable version
    assert store.take([1, 2, 3, 4, 5, 6], lambda v: v == 0).tokens == (1, 2, 3, 4, 5)
    store.take([1, 2, 3, 9], lambda v: True)  # (1, 2, 3) used last: (1, 2, 3, 4, 5) goes first
    store.keep(Kept((7, 8), 0, []))
    assert store.take([1, 2, 3, 4, 5, 6], lambda v: True).tokens == (1, 2, 3)


def test_host_sync_one_read_per_decode_step(weights_and_shape):
    """The batcher's decode step reads the device once (every row's token and logprob in one copy), also in steps
    where rows end, move and newcomers join: every device-to-host read a ``TorchFunctionMode`` sees is counted, and
    no ``torch.tensor(..., device=...)`` is made (on a GPU a synchronous copy: ``inference.to_device`` instead)."""
    b = batcher(weights_and_shape, max_sequences=3)
    submit(b, request(1, PROMPTS, max_new=6, seed=4), request(2, [[1, 33]], max_new=3, seed=5))
    assert steps_reading_the_host_once(b) >= 6 and len(b.engine.results) == 2


def steps_reading_the_host_once(b: ContinuousBatcher) -> int:
    """Run ``b``'s serving steps (``_step``, then ``_fill_rows``) until no row is in use, asserting each reads the
    host once (``benchmarks/engine.py``'s ``SyncCount``: what its ``host_syncs_per_decode_step`` counts); returns
    the steps run."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from engine import SyncCount

    steps = 0
    while b.rows:
        reads = SyncCount()
        with reads:
            b._step()
            b._fill_rows()
        assert reads.reads == 1, steps
        steps += 1
    return steps


def test_kv_pool_is_allocated_once_and_never_grows_or_moves(weights_and_shape):
    """The KV pool (rows x slots) is allocated at the first request and is the same tensors, of the same size,
    after sequences joined, ended, moved and joined again; a request longer than its rows is refused in one line
    naming training.seq_len, and so is a join past the free rows."""
    b = batcher(weights_and_shape, max_sequences=3)
    submit(b, request(1, PROMPTS + [[1, 33]], max_new=10, seed=4))
    pool = [(k.data_ptr(), v.data_ptr(), tuple(k.shape)) for k, v in b.cache.layers]
    assert pool[0][2][0] == 3 and pool[0][2][2] == b.engine.kv_slots
    run_until_idle(b)
    submit(b, request(2, PROMPTS, max_new=20, seed=5))
    run_until_idle(b)
    assert [(k.data_ptr(), v.data_ptr(), tuple(k.shape)) for k, v in b.cache.layers] == pool
    with pytest.raises(ValueError, match=r"request 3 needs 66 KV slots .* have 64 \(training.seq_len\)"):
        submit(b, request(3, [[1, 2]], max_new=64))
    model = inference.Model.of(*weights_and_shape)
    with pytest.raises(ValueError, match="do not fit in the KV pool's free rows"):
        inference.join_rows(model, inference.SlotCache.allocate(model, 1, 8), [[1, 2], [1, 3]], assets.PAD_ID, 4)


def test_one_join_of_kept_fresh_and_repeated_prompts_equals_each_prefilled_alone(weights_and_shape):
    """``join_rows`` with rows that start after kept K/V, fresh rows and a repeated prompt in one call (different
    offsets, right-padded): each row's hidden state and K/V equal its prompt prefilled alone, to rounding."""
    model = inference.Model.of(*weights_and_shape)
    long, short = [1, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59], [1, 40, 41]
    alone = inference.SlotCache.allocate(model, 1, 32)
    inference.join_rows(model, alone, [long[:7]], assets.PAD_ID, 16)
    kept = inference.kept_rows(alone, 0, 7)
    prompts = [long, short, short, [1, 60, 61, 62, 63, 64]]
    cache = inference.SlotCache.allocate(model, 4, 32)
    h = inference.join_rows(model, cache, prompts, assets.PAD_ID, 16, [kept, None, None, None])
    for row, prompt in enumerate(prompts):
        one = inference.SlotCache.allocate(model, 1, 32)
        want = inference.join_rows(model, one, [prompt], assets.PAD_ID, 16)
        torch.testing.assert_close(h[row], want[0], atol=1e-5, rtol=0)
        n = len(prompt)
        assert int(cache.lengths[row]) == n
        for (k, _), (k1, _) in zip(cache.layers, one.layers):
            torch.testing.assert_close(k[row, :, :n], k1[0, :, :n], atol=1e-5, rtol=0)


def test_run_gives_an_episodes_next_turn_the_kept_kv_of_its_last(weights_and_shape, monkeypatch):
    """Through ``run()``, the engine's serving loop: an episode's first turn ends, its result goes out, the next turn
    (its prompt, tokens and a reply) comes back through the pipe, and only the tokens after the kept K/V run again:
    the opening once, then the first turn's last token and the reply."""
    weights, shape = weights_and_shape
    opening = [1, 50, 51, 52, 53, 54, 55, 56, 57]

    class Episode(PipedEngine):
        def send_result(self, req_id, tokens, *rest, **kw):
            super().send_result(req_id, tokens, *rest, **kw)
            if req_id == 1:  # the episode answers, and sends its next turn
                second = opening + tokens[0].tolist() + [3, 77, 78, 79]
                self.messages.append(("generate", request(2, [second], max_new=4, group=1, seed=4, keep_kv=True)))

    engine = Episode({0: weights}, shape, ("generate", request(1, [opening], max_new=5, group=1, seed=3,
                                                                keep_kv=True)))
    b = engine.batcher = ContinuousBatcher(engine, max_sequences=4)
    b.eos = set()  # every turn runs its budget
    count = PrefillCount(monkeypatch)
    b.run()
    assert [r.req_id for r in engine.results] == [1, 2]
    assert count.tokens == len(opening) + 1 + 4
