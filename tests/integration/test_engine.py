"""The embedded engine process: pushed weights reach generation exactly, and its behaviour log-probs equal the
trainer's (torchtitan model) within 1e-4 in fp32; every test runs on a serial engine and on one with continuous
batching (``rollout.continuous_batching``). The last tests run an engine with in-flight weight updates
(``rollout.in_flight_weight_updates``) too."""

from __future__ import annotations

import contextlib
import queue
import time
from types import SimpleNamespace

import pytest
from _engine_push import layout_of
from _sync_harness import ResultPump
import torch

from torchtitan_flux.patches import apply_patches

apply_patches()


from torchtitan_flux.rl import loss as grpo  # noqa: E402
from torchtitan_flux.config import WeightSync  # noqa: E402
from torchtitan_flux.engine.base import GenerationRequest, GenerationResult  # noqa: E402
from torchtitan_flux.engine.embedded import EmbeddedEngine  # noqa: E402
from torchtitan_flux.models import hf, inference, weight_dict  # noqa: E402
from torchtitan_flux.models.hf_weights import load_hf_weights  # noqa: E402
from torchtitan_flux.models.families import config_from_hf_dir  # noqa: E402
from torchtitan_flux.sync.syncer import WeightSyncer  # noqa: E402


@pytest.fixture(scope="module", params=[False, True], ids=["serial", "continuous"])
def rig(tiny_model_dir, request):
    with serving(tiny_model_dir, continuous_batching=request.param, kv_slots=128) as r:
        yield r


@contextlib.contextmanager
def serving(tiny_model_dir, **engine_kw):
    """A torchtitan model (the trainer's, seeded) pushing to one embedded engine (``engine_kw``) through a
    ``WeightSyncer``; ``results`` collects what ``pump`` reads."""
    torch.manual_seed(0)
    config = config_from_hf_dir(tiny_model_dir, max_seq_len=128)
    model = config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    load_hf_weights(model, tiny_model_dir, config)
    model.eval()
    events: queue.Queue = queue.Queue()
    engine = EmbeddedEngine("engine0", str(tiny_model_dir), 1, events, **engine_kw)
    engine.start()
    cfg = WeightSync(async_weight_update=False, timeout_seconds=30.0, bucket_size_mb=0.05, master_port=0)
    pump = ResultPump(events)
    results = pump.results
    syncer = WeightSyncer(cfg, model, [engine], device=torch.device("cpu"), is_sender=True, pump=pump,
                          layout=layout_of(engine.model_dir))
    pump.attach(syncer)
    syncer.connect()
    try:
        yield SimpleNamespace(model=model, engine=engine, syncer=syncer, results=results, pump=pump, config=config,
                              continuous=engine_kw.get("continuous_batching", False), model_dir=tiny_model_dir)
    finally:
        syncer.close()
        engine.close()


def generate(rig, req_id: int, prompts, temperature=1.0, max_new=12) -> GenerationResult:
    rig.engine.submit(GenerationRequest(req_id, 1, prompts, 4, max_new, temperature, 0, seed=123, dispatch_version=0))
    deadline = time.monotonic() + 60
    while req_id not in rig.results and time.monotonic() < deadline:
        rig.pump(0.05)
    return rig.results.pop(req_id)


def trainer_logprobs(model, prompts, res: GenerationResult, group: int, temperature: float):
    """Right-padded teacher forcing with the torchtitan model, as the trainer does."""
    rows = [p for p in prompts for _ in range(group)]
    L = max(len(p) for p in rows) + res.tokens.shape[1]
    seq = torch.zeros(len(rows), L, dtype=torch.long)
    for i, p in enumerate(rows):
        seq[i, : len(p)] = torch.tensor(p)
        seq[i, len(p) : len(p) + int(res.lengths[i])] = res.tokens[i, : int(res.lengths[i])]
    with torch.no_grad():
        lp = grpo.token_logprobs(rig_logits(model, seq), seq[:, 1:], temperature)
    return [lp[i, len(p) - 1 : len(p) - 1 + int(res.lengths[i])] for i, p in enumerate(rows)]


def rig_logits(model, seq):
    return model(seq)[:, :-1].float()


def test_push_then_generate_matches_trainer_logprobs(rig):
    rig.syncer.after_optimizer_step(1)  # blocking push of version 1, waits for the ack
    assert rig.syncer.links[0].acked == 1
    version, checksum = rig.engine.checksum()
    assert (version, checksum) == (1, rig.syncer.staging.checksum())
    assert len(rig.syncer.plan.buckets) > 1  # 0.05 MB buckets: the model travels in several

    prompts = [[1, 40, 41, 42], [1, 50, 51, 52, 53, 54, 55, 56, 57], [1, 60]]
    res = generate(rig, 1, prompts)
    assert res.version == 1 and res.newest_seen == 1 and res.token_versions is None  # no in-flight updates
    ref = trainer_logprobs(rig.model, prompts, res, 4, 1.0)
    diff = max((r - res.logprobs[i, : len(r)]).abs().max().item() for i, r in enumerate(ref))
    assert diff < 1e-4, diff


def test_serial_engine_generates_what_inference_generate_does_bit_for_bit(rig):
    """``continuous_batching = false`` is ``inference.generate`` on the pushed version (here, the HF folder's
    weights) with the request's seeded generator, bit for bit."""
    if rig.continuous:
        pytest.skip("continuous batching samples per sequence (engine/batcher.py)")
    prompts = [[1, 40, 41, 42], [1, 60]]
    res = generate(rig, 4, prompts)
    weights, shape = weight_dict.load_hf_weights_dict(rig.model_dir)
    cfg = hf.read_config(rig.model_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine's
    try:
        tokens, logprobs, lengths = inference.generate(
            weights, shape, [p for p in prompts for _ in range(4)], max_new_tokens=12, temperature=1.0,
            eos_id=hf.eos_token_ids(cfg), pad_id=int(cfg.get("pad_token_id") or 0),
            generator=torch.Generator().manual_seed(123))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(res.tokens, tokens) and torch.equal(res.logprobs, logprobs)
    assert torch.equal(res.lengths, lengths)


def test_a_short_request_submitted_behind_a_long_one_returns_first_with_continuous_batching(rig):
    """Continuous batching: the short request joins the long one's running batch and its result comes back first;
    a serial engine returns them in order. Both match the trainer's logprobs."""
    long_prompts, short_prompts = [[1, 40, 41, 42], [1, 50, 51]], [[1, 60]]
    rig.engine.submit(GenerationRequest(20, 1, long_prompts, 4, 120, 1.0, 0, seed=1, dispatch_version=0))
    rig.engine.submit(GenerationRequest(21, 1, short_prompts, 2, 2, 1.0, 0, seed=2, dispatch_version=0))
    order = []
    deadline = time.monotonic() + 60
    while len(order) < 2 and time.monotonic() < deadline:
        rig.pump(0.05)
        order += [r for r in (20, 21) if r in rig.results and r not in order]
    assert order == ([21, 20] if rig.continuous else [20, 21])
    for req_id, prompts, group in ((20, long_prompts, 4), (21, short_prompts, 2)):
        res = rig.results.pop(req_id)
        ref = trainer_logprobs(rig.model, prompts, res, group, 1.0)
        assert max((r - res.logprobs[i, : len(r)]).abs().max().item() for i, r in enumerate(ref)) < 1e-4


def test_new_weights_change_generation_and_version(rig):
    prompts = [[1, 70, 71]]
    before = generate(rig, 2, prompts, temperature=0.0)
    with torch.no_grad():
        rig.model.lm_head.weight.mul_(3.0)
        rig.model.norm.weight.mul_(0.5)
    rig.syncer.after_optimizer_step(2)
    after = generate(rig, 3, prompts, temperature=0.0)
    assert (before.version, after.version) == (1, 2)
    assert not torch.equal(before.logprobs, after.logprobs)
    ref = trainer_logprobs(rig.model, prompts, after, 4, 1.0)  # greedy logprobs are at temperature 1
    diff = max((r - after.logprobs[i, : len(r)]).abs().max().item() for i, r in enumerate(ref))
    assert diff < 1e-4, diff
    assert rig.engine.checksum() == (2, rig.syncer.staging.checksum())


def test_request_waits_for_its_min_version(rig):
    """Admission by version: a request that needs version v starts only once v has landed (no stale start)."""
    rig.syncer.after_optimizer_step(3)
    prompts = [[1, 80, 81]]
    rig.engine.submit(GenerationRequest(10, 1, prompts, 4, 8, 1.0, 0, seed=5, dispatch_version=3, min_version=4))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.5:
        rig.pump(0.05)
    assert 10 not in rig.results  # still waiting for version 4
    rig.syncer.after_optimizer_step(4)
    deadline = time.monotonic() + 30
    while 10 not in rig.results and time.monotonic() < deadline:
        rig.pump(0.05)
    assert rig.results.pop(10).version == 4


def test_engine_is_idle_only_between_a_submit_and_its_result(rig):
    """``EmbeddedEngine.idle`` (what ``TrainerThreads`` borrows cores by): False from ``submit`` until the
    request's result has been read, True after."""
    rig.syncer.after_optimizer_step(5)  # weights to generate with, whatever ran before (blocking: waits for the ack)
    assert rig.engine.idle()
    rig.engine.submit(GenerationRequest(900, 1, [[1, 5, 6]], 2, 8, 1.0, 0, seed=1, dispatch_version=0))
    assert not rig.engine.idle()  # at once: submit records it before the engine can start
    deadline = time.monotonic() + 60
    while 900 not in rig.results and time.monotonic() < deadline:
        rig.pump(0.05)
    assert rig.results.pop(900).req_id == 900
    assert rig.engine.idle()


def test_a_request_pinned_to_a_newer_version_starts_as_soon_as_the_one_before_ends(rig):
    """The request behind a running one, pinned to the pending version, swaps and starts when the first ends (with
    continuous batching: once the batch has drained), not at the next push or its wait bound (30 s here)."""
    rig.syncer.after_optimizer_step(6)
    generate(rig, 30, [[1, 5]])  # makes 6 live
    rig.syncer.after_optimizer_step(7)  # pending: no request has swapped to it
    rig.engine.submit(GenerationRequest(31, 1, [[1, 40, 41]], 4, 60, 1.0, 0, seed=1, dispatch_version=6,
                                        pin_version=6))
    rig.engine.submit(GenerationRequest(32, 1, [[1, 50]], 2, 4, 1.0, 0, seed=2, dispatch_version=7, pin_version=7))
    deadline = time.monotonic() + 10
    while not {31, 32} <= set(rig.results) and time.monotonic() < deadline:
        rig.pump(0.05)
    assert (rig.results.pop(31).version, rig.results.pop(32).version) == (6, 7)


def wait_result(rig, req_id: int, timeout: float = 20.0) -> GenerationResult:
    deadline = time.monotonic() + timeout
    while req_id not in rig.results and time.monotonic() < deadline:
        rig.pump(0.05)
    assert req_id in rig.results, f"request {req_id}: no result within {timeout:g} s"
    return rig.results.pop(req_id)


def test_in_flight_updates_apply_a_push_mid_request_and_report_each_tokens_version(tiny_model_dir):
    """``in_flight_weight_updates``, over the pipe: request 1 (greedy, 120 tokens; the tiny model's greedy rows meet
    no stop token) starts on version 1; request 0 (one token), admitted after it, shows it has. Request 2 is pinned
    to version 5, never pushed, and starts anyway (its ``min_version`` 1 is held); its admission stalls the engine's
    main thread 1.5 s (fault injection) while version 2 lands, so request 1 is mid-generation when it does: its
    tokens switch from 1 to 2 once, those of version 1 have the trainer's version-1 logprobs, and its ``version``
    is 1."""
    with serving(tiny_model_dir, continuous_batching=True, kv_slots=128, in_flight_weight_updates=True) as rig:
        rig.syncer.after_optimizer_step(1)
        prompts = [[1, 40, 41, 42]]
        rig.engine.submit(GenerationRequest(1, 1, prompts, 1, 120, 0.0, 0, seed=1, dispatch_version=1,
                                            min_version=1, pin_version=1))
        rig.engine.submit(GenerationRequest(0, 1, [[1, 5]], 1, 1, 1.0, 0, seed=1, dispatch_version=1))
        assert wait_result(rig, 0).token_versions.tolist() == [[1]]  # request 1 decodes on version 1 now
        rig.engine.inject_fault("stall_generate", 1.5)  # far longer than the push, under load too
        rig.engine.submit(GenerationRequest(2, 1, [[1, 60]], 2, 4, 1.0, 0, seed=2, dispatch_version=1,
                                            min_version=1, pin_version=5))
        v1 = {n: p.detach().clone() for n, p in rig.model.state_dict().items()}
        with torch.no_grad():
            rig.model.lm_head.weight.mul_(3.0)
            rig.model.norm.weight.mul_(0.5)
        rig.syncer.after_optimizer_step(2)  # blocking: the engine acked version 2
        first, second = wait_result(rig, 1), wait_result(rig, 2)
        assert first.token_versions.shape == first.tokens.shape == (1, 120) and int(first.lengths[0]) == 120
        versions = first.token_versions[0]
        switch = int((versions == 2).nonzero()[0])
        assert 0 < switch < 120 and (versions[:switch] == 1).all() and (versions[switch:] == 2).all()
        assert first.version == 1
        assert second.token_versions.shape == (2, 4) and set(second.token_versions.flatten().tolist()) <= {1, 2, -1}
        assert second.version == int(second.token_versions[:, 0].min())  # its oldest token's
        rig.model.load_state_dict(v1)
        ref = trainer_logprobs(rig.model, prompts, first, 1, 1.0)[0]  # greedy logprobs are at temperature 1
        assert (ref[:switch] - first.logprobs[0, :switch]).abs().max() < 1e-4


def test_continuous_batching_with_fewer_rows_than_sequences_serves_every_one(tiny_model_dir):
    """The engine process's own loop: 2 rows, a greedy request of 4 copies whose rows all end in the same decode
    step while 2 copies still wait for a row (before: the engine then waited on its pipe for a message that never
    came, and the run never trained a step). Every copy comes back, alike."""
    with serving(tiny_model_dir, continuous_batching=True, max_batch_sequences=2, kv_slots=128) as rig:
        rig.syncer.after_optimizer_step(1)
        rig.engine.submit(GenerationRequest(7, 1, [[1, 40, 41]], 4, 3, 0.0, 0, seed=1, dispatch_version=1))
        res = wait_result(rig, 7, timeout=30.0)
        assert res.tokens.shape == (4, 3) and all(torch.equal(res.tokens[0], row) for row in res.tokens)


def test_in_flight_updates_without_continuous_batching_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match=r"in_flight_weight_updates = true needs continuous_batching = true"):
        EmbeddedEngine("engine0", str(tiny_model_dir), 1, queue.Queue(), in_flight_weight_updates=True)


@pytest.mark.parametrize("batching,device", [(False, "cuda:0"), (True, "cpu")], ids=["serial", "cpu"])
def test_decode_graphs_without_continuous_batching_or_a_gpu_are_refused(tiny_model_dir, batching, device):
    with pytest.raises(ValueError, match=r"decode_graphs needs continuous_batching on a CUDA device, got "
                                         rf"{batching} on {device} \(rollout.decode_graphs\)"):
        EmbeddedEngine("engine0", str(tiny_model_dir), 1, queue.Queue(), device=device, decode_graphs=True,
                       continuous_batching=batching, kv_slots=64)
