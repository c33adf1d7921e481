"""Weight sync at component level: a real ``EmbeddedEngine`` child process, a ``WeightSyncer(is_sender=True)`` on
gloo/loopback and ``Rollouts`` pumping the events (see ``_sync_harness``). No torchrun.

What "in sync" means everywhere below: the engine's newest complete version has the sha256 of the trainer's
staging buffer (``EmbeddedEngine.checksum()`` == ``WeightSyncer.staging.checksum()``), and the staging buffer
holds the model's parameters bitwise.
"""

from __future__ import annotations

import logging
import time

import torch
from _sync_harness import Harness, assert_in_sync, params_snapshot, perturb

from torchtitan_flux.models import inference
from torchtitan_flux.sync.links import LinkState
from torchtitan_flux.wire.transport import _DTYPES

LOG = "torchtitan_flux"


def staging_holds(h: Harness, params: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(h.syncer.staging.views[n], p) for n, p in h.wire(params).items())




# ------------------------------------------------------------------------------------------ blocking push


def test_blocking_push_versions_acks_and_bitwise_equal_buckets(harness_factory):
    h = harness_factory(async_mode=False, bucket_size_mb=0.01, timeout_s=5.0)
    plan, syncer = h.syncer.plan, h.syncer

    # the plan: many buckets, in parameter order, each within the budget unless it holds one big tensor
    assert len(plan.buckets) > 1
    assert plan.buckets[0].start == 0 and plan.buckets[-1].end == len(plan.specs)
    assert all(a.end == b.start for a, b in zip(plan.buckets, plan.buckets[1:]))
    for b in plan.buckets:
        nbytes = b.numel * _DTYPES[b.dtype].itemsize
        assert nbytes <= syncer.bucket_bytes or b.end - b.start == 1
    assert [s.name for s in plan.specs] == [n for n, _ in h.model.named_parameters()]

    syncer.flush(0)  # the trainer's first sync: version 0 = the initial weights
    assert (h.link.sent, h.link.acked) == (0, 0)
    assert_in_sync(h, 0)

    sums = {h.staging_checksum()}
    for v in (1, 2, 3):
        perturb(h.model, seed=v)
        t0 = time.perf_counter()
        syncer.after_optimizer_step(v)
        dt = time.perf_counter() - t0
        assert (h.link.sent, h.link.acked) == (v, v)  # blocking: returns once the engine acked v
        assert syncer.version == v
        assert_in_sync(h, v)
        sums.add(h.staging_checksum())
        assert dt < 2.0, f"blocking push of {plan.nbytes} B in {len(plan.buckets)} buckets took {dt:.3f}s"
    assert len(sums) == 4  # every version really changed the weights

    m = syncer.metrics()
    assert m["weight_pushes"] == 4 and m["engine_min_version"] == 3
    assert m["weight_sync_timeouts"] == m["weight_sync_errors"] == m["engines_lagging"] == 0
    assert syncer.stats.bytes_sent == 4 * plan.nbytes
    assert not syncer.stats.failures
    print(f"\nblocking push: {len(plan.buckets)} buckets, {plan.nbytes} B, last push {syncer.stats.last_push_s:.4f}s, "
          f"after_optimizer_step (snapshot + push + ack) {dt:.4f}s")


# ---------------------------------------------------------------------------------------------- async push


def test_async_push_returns_at_once_and_coalesces_while_busy(harness_factory):
    h = harness_factory(async_mode=True, bucket_size_mb=0.01, timeout_s=3.0)
    syncer, eng = h.syncer, h.engines[0]
    syncer.flush(0)
    assert_in_sync(h, 0)

    stall = 1.5  # < timeout: a slow engine, not a lagging one
    eng.inject_fault("stall_receive", stall)
    eng.checksum()  # round trip: the fault is in place

    perturb(h.model, seed=1)
    t0 = time.perf_counter()
    syncer.after_optimizer_step(1)
    dt1 = time.perf_counter() - t0
    pushed_at = t0
    assert dt1 < 0.25, dt1  # snapshot only; the push runs on the push thread
    v1_sum = h.staging_checksum()
    assert syncer.busy() and h.link.acked == 0  # v1 is still in flight

    dts = []
    for v in (2, 3):  # due while v1 is in flight: coalesced, nothing copied
        perturb(h.model, seed=v)
        t0 = time.perf_counter()
        syncer.after_optimizer_step(v)
        dts.append(time.perf_counter() - t0)
        assert syncer.stats.coalesced == v - 1
        assert h.staging_checksum() == v1_sum
    assert max(dts) < 0.05, dts
    assert syncer.metrics()["weight_coalesced"] == 2

    eng.inject_fault("stall_receive", 0.0)  # the stall in progress finishes; later pushes are fast
    assert syncer.wait_idle(stall + 3.0)
    h.pump_until(lambda: h.link.acked == 1, 5.0, "ack of v1")
    # v1 landed only after the engine's stall. (Not asserted on the push thread's own time: once in a full CI run
    # it recorded 21 ms for this push although the engine stalled; not reproduced in 9 runs alone or under CPU load,
    # cause not established — gloo's sends completing into socket buffers before the receiver posts is a guess.)
    landed_s = time.perf_counter() - pushed_at
    assert landed_s >= stall * 0.9
    assert h.engine_checksum() == (1, v1_sum)

    syncer.flush(3)  # the newest (coalesced) version goes out at the next idle boundary
    assert (h.link.sent, h.link.acked) == (3, 3)
    assert_in_sync(h, 3)
    assert syncer.stats.pushes == 3  # v0, v1, v3: v2 was never sent
    assert syncer.stats.timeouts == 0 and h.link.state is LinkState.READY
    print(f"\nasync: after_optimizer_step {dt1 * 1e3:.2f} ms with the engine stalled {stall}s; coalesced calls "
          f"{max(dts) * 1e3:.2f} ms; v1 landed after {landed_s:.2f}s")


def test_lagging_by_missed_ack_then_resynced_when_the_ack_arrives(harness_factory, caplog):
    """The other lagging path: the push's Works completed but the ack was not seen within timeout_seconds."""
    h = harness_factory(async_mode=True, timeout_s=1.0)
    syncer = h.syncer
    syncer.flush(0)
    perturb(h.model, seed=1)
    syncer.after_optimizer_step(1)
    deadline = time.monotonic() + 5.0
    while syncer.busy():  # Works done; the ack waits, unpumped, in the event queue
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(1.2)
    with caplog.at_level(logging.WARNING, logger=LOG):
        syncer.check_timeouts()
    assert h.link.state is LinkState.LAGGING and syncer.stats.timeouts == 1
    assert syncer.metrics()["engines_lagging"] == 1
    assert any("not acked within" in r.getMessage() for r in caplog.records)

    resyncs, pushes = syncer.stats.resyncs, syncer.stats.pushes
    h.pump_until(lambda: h.link.state is LinkState.READY, 5.0, "late ack")  # it answers again -> full resync of v1
    assert syncer.stats.resyncs == resyncs + 1
    # the push thread resends the staged version right away (no optimizer step needed)
    h.pump_until(lambda: syncer.stats.pushes == pushes + 1 and not syncer.busy(), 5.0, "resync push")
    h.pump_until(lambda: h.link.sent == 1 and h.link.acked == 1, 5.0, "resync ack")
    h.drain(0.2)
    assert_in_sync(h, 1)
    assert syncer.metrics()["engines_lagging"] == 0


# ---------------------------------------------------------------------------------------------- atomic swap


def _reference_tokens(weights: dict[str, torch.Tensor], shape, req) -> torch.Tensor:
    """What ``_EngineProcess.generate`` computes for ``req`` with ``weights`` (1 thread, like the engine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prompts = [p for p in req.prompt_ids for _ in range(req.group_size)]
        gen = torch.Generator().manual_seed(req.seed)
        tokens, _, _ = inference.generate(
            weights, shape, prompts, max_new_tokens=req.max_new_tokens, temperature=req.temperature,
            top_k=req.top_k, eos_id=2, pad_id=0, generator=gen,
        )
        return tokens
    finally:
        torch.set_num_threads(threads)


def test_push_landing_mid_request_is_swapped_in_only_between_requests(harness_factory):
    # one request of 256 completions x 96 tokens: ~0.7 s of generation on one thread
    h = harness_factory(async_mode=False, prompts_per_step=16, group_size=16, max_new_tokens=96, timeout_s=5.0)
    syncer, sched, eng = h.syncer, h.rollouts, h.engines[0]
    syncer.flush(0)
    w0 = params_snapshot(h.model)
    # the push completes on the engine 0.3 s after its header arrives: well after the engine took the request
    # below (and swapped at its start), well before that request ends
    eng.inject_fault("stall_receive", 0.3)
    eng.checksum()

    sched.dispatch(1, trainer_version=0)
    groups = sched.table.of_step(1)  # one request: both groups' rows
    request = groups[0].request
    perturb(h.model, seed=1, scale=0.5)
    w1 = params_snapshot(h.model)
    syncer.after_optimizer_step(1)  # blocking: returns once the engine acked v1 ...
    assert h.link.acked == 1
    assert all(g.result is None for g in groups)  # ... while the request is still running
    eng.inject_fault("stall_receive", 0.0)

    batch = sched.collect(1, trainer_version=1)
    res = groups[0].result
    tokens = torch.cat([g.result.tokens for g in groups])
    assert res.version == 0 and res.newest_seen == 1  # stamped with the version live at its start
    assert batch.versions.tolist() == [0] * batch.tokens.shape[0]
    assert batch.dispatch_version == 0 and batch.newest_seen == 1
    # one version throughout: bit-identical to generating the whole request with v0
    ref0 = _reference_tokens(h.engine_weights(w0), h.shape, request)
    assert torch.equal(tokens, ref0)
    assert not torch.equal(_reference_tokens(h.engine_weights(w1), h.shape, request), ref0)  # (v1 would differ)

    sched.dispatch(2, trainer_version=1)  # the next request runs on v1
    groups2 = sched.table.of_step(2)
    batch2 = sched.collect(2, trainer_version=1)
    assert groups2[0].result.version == groups2[0].result.newest_seen == 1
    assert batch2.versions.tolist() == [1] * batch2.tokens.shape[0] and batch2.dispatch_version == 1
    assert torch.equal(torch.cat([g.result.tokens for g in groups2]),
                       _reference_tokens(h.engine_weights(w1), h.shape, groups2[0].request))
    assert_in_sync(h, 1)
    print(f"\natomic swap: request took {res.gen_time_s:.2f}s; push of v1 (blocking, acked, receiver stalled 0.3s) "
          "landed during it")
