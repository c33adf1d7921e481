"""The captured decode step (``rollout.decode_graphs``, ``engine/decoding.GraphDecode``) run as its CPU twin: the
function a CUDA graph captures (``inference.decode_and_sample``), run eagerly on the same static, padded buffers.
It must give the eager path's tokens and logprobs through joins, drops, bucket changes, mixed sampling settings and
a weight swap; read only tensors whose address never changes (docs/gpu.md's graph rules); let padded rows write
nothing a row in use reads; and read the host once a step. The capture itself needs a GPU
(``scripts/gpu_smoke.sh --only decode``)."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import ROOT
from test_continuous_batching import (PROMPTS, FakeEngine, perturbed, recomputed_logprobs, request, run_until_idle,
                                      steps_reading_the_host_once, submit)

import model_assets as assets
from torchtitan_flux.engine import decoding
from torchtitan_flux.engine.batcher import ContinuousBatcher
from torchtitan_flux.models import inference, weight_dict


@pytest.fixture(scope="module")
def weights_and_shape(tmp_path_factory):
    return weight_dict.load_hf_weights_dict(assets.build_model_dir(tmp_path_factory.mktemp("tiny"), "tiny", seed=0))


def batcher(weights_and_shape, graphs: str, max_sequences: int = 8, versions=(0,), in_flight=False):
    weights, shape = weights_and_shape
    engine = FakeEngine({v: weights for v in versions}, shape, in_flight)
    engine.decode_graphs = graphs
    return ContinuousBatcher(engine, max_sequences)


class StepCalls:
    """Every ``decode_and_sample`` call: its bucket, rows in use, and the address of every tensor it reads."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple] = []
        step = inference.decode_and_sample

        def recording(model, cache, freqs, rows, width, k_max, *buffers):
            tensors = decoding._tensors_of(model) + [t for kv in cache.layers for t in kv]
            tensors += [cache.lengths, freqs, *buffers]
            self.calls.append(((rows, width, k_max), cache.rows, tuple(t.data_ptr() for t in tensors)))
            return step(model, cache, freqs, rows, width, k_max, *buffers)

        monkeypatch.setattr(inference, "decode_and_sample", recording)


def mixed_run(weights_and_shape, graphs: str):
    """Three requests through 8 rows: sampled, greedy (joins at step 3) and top-k (queued: takes freed rows)."""
    b = batcher(weights_and_shape, graphs)
    submit(b, request(1, PROMPTS, max_new=30, seed=1))
    for _ in range(3):
        b._step()
    submit(b, request(2, [[1, 70, 71]], max_new=5, temperature=0.0, group=1))
    top_k = request(3, [[1, 80, 81, 82], [1, 90]], max_new=12, seed=3, temperature=0.8)
    top_k.top_k = 5
    submit(b, top_k)
    run_until_idle(b)
    return {r.req_id: r for r in b.engine.results}


def test_graph_twin_equals_eager_through_joins_drops_bucket_changes_and_mixed_settings(weights_and_shape,
                                                                                       monkeypatch):
    eager = mixed_run(weights_and_shape, "")
    calls = StepCalls(monkeypatch)
    twin = mixed_run(weights_and_shape, "twin")
    buckets = {key for key, _, _ in calls.calls}
    assert len({r for r, _, _ in buckets}) >= 2 and len({w for _, w, _ in buckets}) >= 2  # rows and widths moved
    assert {k for _, _, k in buckets} == {0, 5} and any(key[0] > rows for key, rows, _ in calls.calls)  # padded
    for req_id, prompts, group in ((1, PROMPTS, 2), (2, [[1, 70, 71]], 1), (3, [[1, 80, 81, 82], [1, 90]], 2)):
        assert torch.equal(twin[req_id].tokens, eager[req_id].tokens), req_id
        torch.testing.assert_close(twin[req_id].logprobs, eager[req_id].logprobs, atol=1e-5, rtol=0)
        if req_id != 3:  # the trainer's logprobs (temperature 1); request 3 samples at 0.8
            assert recomputed_logprobs(weights_and_shape, prompts, group, twin[req_id]) < 1e-4


def test_batch_invariant_graph_twin_a_sequence_samples_the_same_alone_or_beside_others(weights_and_shape):
    def alone(graphs):
        b = batcher(weights_and_shape, graphs)
        submit(b, request(5, PROMPTS, max_new=16, seed=11))
        run_until_idle(b)
        return b.engine.results[0]

    b = batcher(weights_and_shape, "twin")
    submit(b, request(4, [[1, 90, 91, 92, 93]], max_new=16, group=1, seed=3))
    b._step()
    submit(b, request(5, PROMPTS, max_new=16, seed=11))
    run_until_idle(b)
    beside, solo, eager = next(r for r in b.engine.results if r.req_id == 5), alone("twin"), alone("")
    for other in (solo, eager):
        assert torch.equal(beside.tokens, other.tokens) and torch.equal(beside.lengths, other.lengths)
        torch.testing.assert_close(beside.logprobs, other.logprobs, atol=1e-5, rtol=0)


def test_graph_twin_reads_the_swapped_version_from_its_static_copy_in_flight(weights_and_shape, monkeypatch):
    """A push lands mid-generation (in-flight updates): the next step reads the new version, copied into the same
    static weights (their addresses unchanged), and gives the eager path's tokens, logprobs and versions."""
    weights, _ = weights_and_shape
    newer = perturbed(weights)

    def run(graphs):
        b = batcher(weights_and_shape, graphs, versions=(3,), in_flight=True)
        b.eos = set()
        submit(b, request(1, PROMPTS, max_new=20, seed=5, min_version=3))
        for _ in range(6):
            b._step()
        b.engine.receiver.weights[4] = newer
        run_until_idle(b)
        return b, b.engine.results[0]

    _, eager = run("")
    calls = StepCalls(monkeypatch)
    b, twin = run("twin")
    assert torch.equal(twin.token_versions, eager.token_versions) and (twin.token_versions[:, -1] == 4).all()
    assert torch.equal(twin.tokens, eager.tokens)
    torch.testing.assert_close(twin.logprobs, eager.logprobs, atol=1e-5, rtol=0)
    assert len({addresses for _, _, addresses in calls.calls}) == 1  # every step, before and after the swap
    live = b.engine.live_model()
    assert all(torch.equal(s, t) for s, t in zip(decoding._tensors_of(b.decoder.weights), decoding._tensors_of(live)))


def test_host_sync_graph_twin_one_read_a_step_and_only_static_addresses(weights_and_shape, monkeypatch):
    """docs/gpu.md's graph rules, on the twin: every tensor the step reads keeps its address over joins, drops,
    bucket changes and a new request; the step takes no RoPE table from the shared cache (a longer request may
    replace it) and reads nothing back to the host."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from engine import SyncCount

    calls = StepCalls(monkeypatch)
    b = batcher(weights_and_shape, "twin", max_sequences=3)
    submit(b, request(1, PROMPTS + [[1, 33]], max_new=10, seed=4), request(2, [[1, 5]], max_new=3))
    step = inference.decode_and_sample

    def guarded(*args):
        monkeypatch.setattr(inference, "_freqs_cis", None)  # a call would raise
        reads = SyncCount()
        with reads:
            step(*args)
        monkeypatch.undo()  # (restores ``decode_and_sample`` too: set again below)
        monkeypatch.setattr(inference, "decode_and_sample", guarded)
        assert reads.reads == 0

    monkeypatch.setattr(inference, "decode_and_sample", guarded)
    assert steps_reading_the_host_once(b) >= 10 and len(b.engine.results) == 2  # test_host_sync's, with the twin
    assert len({addresses for _, _, addresses in calls.calls}) == 1


def test_graph_step_padded_rows_write_only_their_own_free_row(weights_and_shape):
    """Rows past those in use, with stale settings (a huge top_k, greedy, a length at the pool's end, a token
    id at the vocabulary's end), run in the bucket: the rows in use come out as with no padding, their K/V
    untouched by the padded ones, and a padded row writes only slot 0 of its own row and keeps its length."""
    model = inference.Model.of(*weights_and_shape)
    vocab = model.shape.vocab_size

    def state():
        cache = inference.SlotCache.allocate(model, 8, 48)
        h = inference.join_rows(model, cache, PROMPTS, assets.PAD_ID, 40)
        d = decoding.GraphDecode(model, cache, capture=False)
        d.join(model, cache, h, [(7, 1.0, 0), (8, 0.0, 0), (9, 0.7, 3)])
        d._source = model
        d.weights = model
        d.top_k[3:], d.temperature[3:], d.tokens[3:] = 10 ** 6, 0.0, vocab - 1
        cache.lengths[3:] = 47
        return cache, d

    outs = {}
    for rows in (3, 8):
        cache, d = state()
        before = [(k.clone(), v.clone()) for k, v in cache.layers]
        inference.decode_and_sample(model, cache, d.freqs, rows, 32, 3, d.active, d.tokens, d.logprobs, d.keys,
                                    d.temperature, d.top_k)
        outs[rows] = (d.tokens[:3].clone(), d.logprobs[:3].clone(), [(k[:3], v[:3]) for k, v in cache.layers])
        assert cache.lengths[3:].tolist() == [47] * 5 and (d.tokens[3:rows] < vocab).all()
        for (k, v), (k0, v0) in zip(cache.layers, before):
            assert torch.equal(k[3:, :, 1:], k0[3:, :, 1:]) and torch.equal(v[3:, :, 1:], v0[3:, :, 1:])
            assert torch.equal(k[rows:], k0[rows:])
    assert torch.equal(outs[3][0], outs[8][0])
    torch.testing.assert_close(outs[3][1], outs[8][1], atol=1e-6, rtol=0)
    for (k3, v3), (k8, v8) in zip(outs[3][2], outs[8][2]):
        torch.testing.assert_close(k8, k3, atol=1e-6, rtol=0)


def test_sample_rows_equals_sample_with_for_each_rows_setting():
    """Per-row settings on the device give ``sample_with``'s tokens and logprobs bit for bit where a row's
    ``top_k`` is 0 or the largest; a smaller ``top_k`` draws among its own top k."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 50, generator=g) * 3
    uniforms = torch.rand(8, 1, generator=g)
    settings = [(1.0, 0), (0.0, 0), (0.7, 6), (1.3, 6), (0.7, 0), (0.0, 6), (1.0, 2), (0.5, 6)]
    tok, logp = inference.sample_rows(logits, torch.tensor([t for t, _ in settings]),
                                      torch.tensor([k for _, k in settings]), uniforms, 6)
    for r, (t, k) in enumerate(settings):
        want_tok, want_logp = inference.sample_with(logits[r: r + 1], t, k, uniforms[r: r + 1])
        if k != 2:
            assert torch.equal(tok[r], want_tok[0]) and torch.equal(logp[r], want_logp[0]), r
    # top_k 2 among rows of up to 6: the same draws as sample_with's top 2 (its softmax spans 6, 4 of them -inf),
    # where the third largest logit is the vocabulary's last (a padding index of the top-k scratch points there)
    many = torch.rand(400, 1, generator=g)
    row = torch.randn(1, 50, generator=g)
    row[0, 10], row[0, 20], row[0, 49] = 5.0, 4.8, 4.6
    row = row.expand(400, -1)
    tok, _ = inference.sample_rows(row, torch.ones(400), torch.full((400,), 2), many, 6)
    want, _ = inference.sample_with(row, 1.0, 2, many)
    assert (tok == want).float().mean() > 0.99 and len(set(tok.view(-1).tolist())) == 2


def test_buckets_are_powers_of_two_within_the_pool():
    assert [decoding.rows_bucket(n, 48) for n in (1, 2, 3, 5, 17, 33, 48)] == [1, 2, 4, 8, 32, 48, 48]
    assert [decoding.width_bucket(w, 1000) for w in (1, 32, 33, 100, 600, 1000)] == [32, 32, 64, 128, 1000, 1000]
    assert decoding.width_bucket(40, 36) == 36


def test_captured_steps_are_refused_off_a_cuda_device(weights_and_shape):
    model = inference.Model.of(*weights_and_shape)
    with pytest.raises(ValueError, match="captured decode steps need a CUDA device, the KV pool is on cpu"):
        decoding.GraphDecode(model, inference.SlotCache.allocate(model, 2, 8), capture=True)


class FakeCuda:
    """The ``torch.cuda`` calls ``engine/graphs.py`` may make, recorded in order (no GPU here); any other
    attribute (``synchronize``, ``empty_cache``, ``graph``) raises."""

    def __init__(self):
        self.log: list[tuple] = []
        self.on = "engine"  # the current stream
        cuda = self

        class Stream:
            def __init__(self, device=None, priority=0, name="side"):
                self.name, self.priority = name, priority

            def wait_stream(self, other):
                cuda.log.append(("wait", self.name, other.name))

        class CUDAGraph:
            def capture_begin(self, pool=None, capture_error_mode="global"):
                cuda.log.append(("capture_begin", cuda.on, pool, capture_error_mode))

            def capture_end(self):
                cuda.log.append(("capture_end", cuda.on))

            def replay(self):
                cuda.log.append(("replay", cuda.on, id(self)))

        self.Stream, self.CUDAGraph = Stream, CUDAGraph
        self.engine_stream = Stream(name="engine")

    def graph_pool_handle(self):
        return "pool"

    def current_stream(self, device=None):
        return self.engine_stream

    def stream(self, s):
        import contextlib

        @contextlib.contextmanager
        def on():
            before, self.on = self.on, s.name
            yield
            self.on = before

        return on()


def test_captured_steps_warm_up_and_capture_on_a_side_stream_without_a_device_wide_wait(monkeypatch):
    """docs/gpu.md's graph rules, on ``CapturedSteps`` against a recording ``torch.cuda``: a bucket's first step
    runs once eagerly on the side stream (a high-priority one: never a normal-priority pool stream that a receiver or
    NCCL draws, rule 16) after it waited for the engine's stream, is then captured on that stream
    into the one shared pool in ``thread_local`` mode (run nowhere), and the engine's stream waits for the side
    stream; later steps of that bucket only replay, on the engine's stream. Nothing synchronises the device or
    empties the cache (``torch.cuda.graph`` would: a hang behind the receiver's pending NCCL receive)."""
    from torchtitan_flux.engine import graphs

    fake = FakeCuda()
    monkeypatch.setattr(graphs.torch, "cuda", fake)
    steps = graphs.CapturedSteps("cuda:0")
    assert steps.stream.priority < 0
    ran = []
    step = lambda: ran.append(fake.on)  # noqa: E731
    steps.run((8, 64, 0), step)
    assert ran == ["side", "side"] and fake.log == [
        ("wait", "side", "engine"), ("capture_begin", "side", "pool", "thread_local"), ("capture_end", "side"),
        ("wait", "engine", "side")]
    fake.log.clear()
    steps.run((8, 64, 0), step)
    steps.run((8, 64, 0), step)
    assert ran == ["side", "side"] and [e[:2] for e in fake.log] == [("replay", "engine")] * 2
    steps.run((4, 64, 0), step)
    assert len(steps.graphs) == 2 and fake.log[3][2] == "pool"  # the same pool for every graph
