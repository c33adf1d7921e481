"""Sparse pushes (``weight_sync.method = "sparse"``, ``sync/sparse.py``) at component level: real ``EmbeddedEngine``
child processes on gloo (``_sync_harness``), and the receiver alone on an in-process gloo pair.

"In sync" as in ``test_weight_sync.py``: the engine's newest version has the sha256 of the trainer's staging buffer,
which holds the model's parameters cast to the wire dtype, bitwise.
"""

from __future__ import annotations

import time

import pytest
import torch
from _sync_harness import params_snapshot, perturb

from _engine_push import gloo_pair

from torchtitan_flux import compat
from torchtitan_flux.wire import transport


@torch.no_grad()
def nudge(model, seed: int, share: float, scale: float = 0.05) -> None:
    """Stand-in for an optimizer step at an RL learning rate: change about ``share`` of each parameter's elements."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        mask = torch.rand(p.shape, generator=g) < share
        p.add_(mask * torch.randn(p.shape, generator=g) * scale * p.abs().clamp(min=1e-3))


def in_sync(h, version: int, i: int = 0) -> None:
    assert h.engine_checksum(i) == (version, h.staging_checksum())
    for n, p in h.wire(params_snapshot(h.model)).items():
        assert torch.equal(h.syncer.staging.views[n], p.to(torch.bfloat16)), n


def test_sparse_pushes_are_bit_exact_and_carry_only_what_changed(harness_factory, caplog):
    h = harness_factory(async_mode=False, bucket_size_mb=0.01, timeout_s=10.0, wire_dtype="bfloat16",
                        method="sparse", num_engines=2)
    syncer, dense_bytes = h.syncer, h.syncer.plan.nbytes
    syncer.flush(0)  # no base yet: dense
    m = syncer.metrics()
    assert m["weight_patched_buckets"] == 0 and m["weight_push_bytes"] == 2 * dense_bytes
    for i in (0, 1):
        in_sync(h, 0, i)
    for v in (1, 2, 3):
        nudge(h.model, seed=v, share=0.02)
        syncer.after_optimizer_step(v)
        m = syncer.metrics()
        assert 0 < m["weight_changed_fraction"] < 0.05, m
        assert m["weight_patched_buckets"] == len(syncer.plan.buckets), m  # every bucket fits as a patch
        assert m["weight_push_bytes"] < 0.2 * 2 * dense_bytes, m  # 2 engines, ~2% changed x 6 bytes / 2 bytes
        for i in (0, 1):
            in_sync(h, v, i)
    perturb(h.model, seed=9)  # every element changes (an fp32 wire at any learning rate): every bucket travels whole
    with caplog.at_level("INFO", logger="torchtitan_flux"):
        syncer.after_optimizer_step(4)
    assert "push 4 travels dense although weight_sync.method = 'sparse'" in caplog.text
    m = syncer.metrics()
    assert m["weight_changed_fraction"] > 0.9 and m["weight_patched_buckets"] == 0
    assert m["weight_push_bytes"] == 2 * dense_bytes
    for i in (0, 1):
        in_sync(h, 4, i)
    assert not syncer.stats.failures


def test_a_restarted_engine_gets_a_dense_push_first(harness_factory):
    """An engine that does not hold the base version (here: restarted, so it holds nothing) is never sent a patch;
    the other engine still is, in the same push."""
    h = harness_factory(async_mode=False, bucket_size_mb=0.01, timeout_s=10.0, wire_dtype="bfloat16",
                        method="sparse", num_engines=2)
    syncer = h.syncer
    syncer.flush(0)
    nudge(h.model, seed=1, share=0.02)
    syncer.after_optimizer_step(1)
    h.engines[1].kill("test: engine 1 killed")
    h.pump_until(lambda: h.restarts >= 1 and syncer.links[1].pg is not None, 60, "engine 1 restarted and rejoined")
    # (``holds`` is reset on the rejoin, but the dense resync of version 1 may complete within the same pump, so the
    # evidence is the engine's: a patch it does not hold the base of is refused, and that refusal is a failure)
    h.pump_until(lambda: syncer.links[1].acked >= 1, 60, "the staged version delivered to the restarted engine")
    nudge(h.model, seed=2, share=0.02)
    syncer.after_optimizer_step(2)
    assert [lk.holds for lk in syncer.links] == [2, 2]
    assert not [f for f in syncer.stats.failures if "patches version" in f], syncer.stats.failures
    assert syncer.metrics()["weight_patched_buckets"] > 0  # engine 0 was patched in the same push
    for i in (0, 1):
        in_sync(h, 2, i)


def test_an_engine_that_missed_a_push_is_sent_whole_buckets_and_needs_no_resync(harness_factory):
    """The trainer's side of the rule (``EngineLink.holds``): an engine that does not hold the patches' base gets whole
    buckets in the same push in which the other is patched; no patch is refused and nothing is resynced. Engine 1
    misses version 2 (the pusher sends 2 to engine 0 alone, as it sends the staged version to late engines), so at
    version 3 the base is 2, held by engine 0 only. A mutation audit found a pusher that ignores ``holds`` passing
    every other sparse test: there the engine's refusal and the resync after it hid the mistake."""
    h = harness_factory(async_mode=False, bucket_size_mb=0.01, timeout_s=10.0, wire_dtype="bfloat16",
                        method="sparse", num_engines=2)
    syncer, pusher, dense_bytes = h.syncer, h.syncer.pusher, h.syncer.plan.nbytes
    syncer.flush(0)
    nudge(h.model, seed=1, share=0.02)
    syncer.after_optimizer_step(1)
    resyncs = syncer.stats.resyncs
    assert pusher.claim()  # both pushes under one claim: releasing it would send 2 to engine 1 (a late engine)
    try:
        nudge(h.model, seed=2, share=0.02)
        syncer.snap.take(2)
        pusher.push(2, only=[syncer.links[0]])
        assert [lk.holds for lk in syncer.links] == [2, 1]
        nudge(h.model, seed=3, share=0.02)
        syncer.snap.take(3)
        pusher.push(3)
    finally:
        pusher.release()
    h.pump_until(lambda: all(lk.acked >= 3 for lk in syncer.links), 30, "both engines acked version 3")
    m = syncer.metrics()
    assert [lk.holds for lk in syncer.links] == [3, 3] and not syncer.stats.failures, syncer.stats.failures
    assert syncer.stats.resyncs == resyncs
    assert m["weight_patched_buckets"] > 0  # engine 0 was patched ...
    assert dense_bytes < m["weight_push_bytes"] < 1.3 * dense_bytes, m  # ... and engine 1 got every byte
    for i in (0, 1):
        in_sync(h, 3, i)


def test_coalesced_async_pushes_carry_the_union_of_changes(harness_factory):
    """Async: versions coalesced while a push is in flight are never patched one by one; each push patches the
    version the engine holds to the staged one, so the engine ends bit-exact on the newest."""
    h = harness_factory(async_mode=True, bucket_size_mb=0.01, timeout_s=10.0, wire_dtype="bfloat16",
                        method="sparse")
    syncer = h.syncer
    syncer.flush(0)
    for v in range(1, 13):
        nudge(h.model, seed=v, share=0.01)
        syncer.after_optimizer_step(v)
        h.rollouts.pump.pump(0.001)
    syncer.flush(12)
    assert syncer.stats.coalesced >= 1, "no push was coalesced: the test did not test coalescing"
    assert syncer.metrics()["weight_patched_buckets"] > 0
    in_sync(h, 12)


# --------------------------------------------------------------------------------------- the receiver alone


def _send(pg, tensors) -> None:
    works = [compat.broadcast(pg, t) for t in tensors]
    for w in works:
        w.wait()


def test_the_receiver_refuses_a_patch_of_a_version_it_does_not_hold():
    """The engine-side check behind ``EngineLink.holds``: a patch applies only to the version it was made
    against; any other is an error (the trainer then resyncs the engine dense), never a silent mix."""
    specs = [transport.TensorSpec("a", (6,), "bfloat16"), transport.TensorSpec("b", (4,), "bfloat16")]
    plan = transport.plan_buckets(specs, 1 << 20)
    pg0, pg1 = gloo_pair("sparse")
    got, errors = [], []
    rx = transport.WeightReceiver(plan, "cpu", got.append, errors.append)
    rx.start(lambda: pg1, patches=True)
    v1 = torch.arange(10, dtype=torch.bfloat16)
    _send(pg0, [transport.encode_header(plan, 1), v1])
    deadline = time.monotonic() + 10
    while got != [1] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == [1]
    # version 2 = version 1 with elements 3 and 7 changed: only they travel
    v2 = v1.clone()
    v2[[3, 7]] = torch.tensor([-1.0, -2.0], dtype=torch.bfloat16)
    idx = transport.changed(v2, v1)
    _send(pg0, [transport.encode_header(plan, 2, [2], base=1), idx, v2[idx.long()]])
    while got != [1, 2] and time.monotonic() < deadline:
        time.sleep(0.01)
    version, buf = rx.newest()
    assert version == 2 and torch.equal(buf.flats[0].view(torch.int16), v2.view(torch.int16))
    # a patch of version 5, which this engine never held
    compat.broadcast(pg0, transport.encode_header(plan, 6, [1], base=5))
    while not errors and time.monotonic() < deadline:
        time.sleep(0.01)
    assert errors and "needs a dense push" in str(errors[0]) and rx.newest()[0] == 2
    # the engine rejoins (a new group): even a patch of the version it holds is refused until a dense push
    pg0, pg1 = gloo_pair("sparse-rejoin")
    rx.start(lambda: pg1, patches=True)
    compat.broadcast(pg0, transport.encode_header(plan, 7, [1], base=2))
    while len(errors) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(errors) == 2 and "no version it may patch" in str(errors[1])
    # and the refusals took no buffer: after another rejoin a dense push lands in one of the two it had
    pg0, pg1 = gloo_pair("sparse-dense")
    rx.start(lambda: pg1, patches=True)
    _send(pg0, [transport.encode_header(plan, 8), v2])
    while got[-1] != 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got[-1] == 8 and rx.swap() == 8
    assert len(rx._free) + len(rx._pending) + 1 == 2  # + the live one: no replacement buffer was allocated
    rx.stop()


# ------------------------------------------------------------------------------------------- whole runs


@pytest.mark.slow  # three debug runs (~1 min): CI's slow stage
def test_a_sparse_run_learns_exactly_like_a_dense_run_of_the_same_wire_dtype(tmp_path):
    """Blocking mode: the same losses bit for bit as dense (the engines hold the same bits, so they sample the
    same tokens); async: checksums equal at the end. At lr 1e-5 most bf16 elements do not change per step, so
    buckets really travel as patches."""
    import json

    from conftest import read_metrics, run_train

    common = ["--training.steps", "8", "--optimizer.lr", "1e-5", "--weight_sync.wire_dtype", "bfloat16"]
    run_train(tmp_path / "dense", *common)
    run_train(tmp_path / "sparse", *common, "--weight_sync.method", "sparse")
    a, b = read_metrics(tmp_path / "dense"), read_metrics(tmp_path / "sparse")
    assert len(a) == len(b) == 8
    for key in ("loss", "reward_mean", "grad_norm"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert max(r["weight_patched_buckets"] for r in b) > 0 and max(r["weight_patched_buckets"] for r in a) == 0
    assert sum(r["weight_push_bytes"] for r in b) < 0.8 * sum(r["weight_push_bytes"] for r in a)
    run_train(tmp_path / "async", *common, "--weight_sync.method", "sparse", "--weight_sync.async_weight_update",
              "true", "--off_policy.async_ratio", "1")
    summary = json.loads((tmp_path / "async" / "summary.json").read_text())
    assert summary["checksums_match"] and summary["all_engines_verified"]
    assert max(r["weight_patched_buckets"] for r in read_metrics(tmp_path / "async")) > 0
