"""The async livelock (issue 24): a push in flight long enough that two due steps in a row are coalesced left the
staged version older than the next step may train on; that step's rollouts, pinned to the staged version, were
discarded and generated again on it forever, since no optimizer step -- hence no snapshot -- could come.

The invariant (``feed.py``): no step waits on a version that no snapshot or push will deliver. Before a step's
rollouts are dispatched the staged version is at least ``version - max_version_gap`` (``WeightSyncer.catch_up``),
and before each wait for them every engine that lacks the staged version is sent it (``deliver_staged``).

* component level (default suite): the real ``BatchFeed`` / ``OffPolicyControl`` / ``WeightSyncer`` /
  ``Rollouts`` over an embedded engine process, with a push held in flight in-process, and with an engine
  whose push broke;
* end to end (slow): torchrun with the ``FLUX_FAULT_PUSH_HOLD`` fault hook (``tests/fault_inject``) on 1 and 2
  trainer processes with the embedded engine, and against the SGLang contract server; the real vLLM CPU server's
  run is in ``test_vllm.py`` (``test_coalesced_pushes_never_livelock_with_vllm``).

On the code before the fix each of these waits forever (the component tests are interrupted by a watchdog and
fail; the end-to-end runs hit their timeout).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest
from _procs import run_held
from fault_inject import push_hold
from _sync_harness import assert_in_sync, perturb

from torchtitan_flux.rl.off_policy import OffPolicyControl
from torchtitan_flux.config import AdaptiveAsync, OffPolicy
from torchtitan_flux.rl.feed import BatchFeed
from torchtitan_flux.errors import RolloutWaitInterrupted
from torchtitan_flux.sync import pusher
from torchtitan_flux.sync.links import LinkState

WATCHDOG_S = 40.0  # a livelocked feed is interrupted after this long (the healthy runs take a few seconds)


@contextmanager
def held_push(version: int, seconds: float):
    """In-process ``FLUX_FAULT_PUSH_HOLD`` (``fault_inject.push_hold``); yields the held versions."""
    original, held = pusher.Pusher.push, []
    pusher.Pusher.push = push_hold.held_push(original, version, seconds, held)
    try:
        yield held
    finally:
        pusher.Pusher.push = original


@contextmanager
def watchdog(scheduler, seconds: float = WATCHDOG_S):
    """Interrupt the scheduler's wait for rollouts after ``seconds``: a livelock fails the test instead of hanging."""
    t = threading.Timer(seconds, scheduler.interrupt)
    t.start()
    try:
        yield
    except RolloutWaitInterrupted as e:
        raise AssertionError(f"livelock: the feed still waited for rollouts after {seconds} s ({e})") from None
    finally:
        t.cancel()


def _feed(h, steps: int, gap: int = 1) -> BatchFeed:
    off_policy = OffPolicyControl(OffPolicy(max_version_gap=gap, async_ratio=1.0), AdaptiveAsync(), h.syncer.cfg, steps)
    return BatchFeed(off_policy, h.rollouts, h.syncer, async_push=True, last_step=steps, rank=0, world=1)


def test_two_coalesced_pushes_are_caught_up_not_regenerated_forever(harness_factory):
    """The first push of a version >= 2 (v) is held until the two steps after it are coalesced, so staging still
    holds v when step v + 3 (trained at version v + 2, gap 1) needs rollouts of version >= v + 1. The feed stages
    version v + 2 first (a catch-up), the engine gets it, and every step trains on rollouts within the gap, none
    discarded."""
    h = harness_factory(async_mode=True)
    syncer, steps = h.syncer, 8
    feed = _feed(h, steps)
    syncer.flush(0)
    gaps = []
    with held_push(2, 10.0) as held, watchdog(h.rollouts):
        for step in range(1, steps + 1):
            fed = feed.next(step, step - 1)
            gaps.append(step - 1 - int(fed.batch.versions.min()))
            perturb(h.model, seed=step)
            syncer.after_optimizer_step(step, due=fed.push_due)
    assert held and syncer.stats.coalesced >= 2, (held, syncer.stats)
    assert syncer.stats.catch_ups >= 1 and syncer.metrics()["weight_catch_ups"] == syncer.stats.catch_ups
    assert max(gaps) <= 1, gaps
    assert feed.off_policy.discarded_rollouts == 0  # the catch-up came before dispatch: nothing was generated in vain
    syncer.flush(steps)
    assert_in_sync(h, steps)


def test_an_engine_whose_push_broke_gets_the_staged_version_without_a_new_step(harness_factory):
    """The push of version 1 times out on a stalled engine (its group broken, the engine lagging on version 0).
    Version 2 is trained but not pushed (a step the cadence skips), so staging holds version 1 -- fresh enough for
    step 3 (trained at 2, gap 1) -- but the engine lacks it and no regular push comes before step 3 trains. The
    feed has the staged version delivered (rejoin + push) instead of regenerating on version 0 forever."""
    h = harness_factory(async_mode=True, timeout_s=2.0, bucket_size_mb=0.01)
    syncer, eng = h.syncer, h.engines[0]
    feed = _feed(h, 3)
    syncer.flush(0)
    h.miss_a_push(1)
    assert h.link.acked == 0
    eng.inject_fault("stall_receive", 0.0)
    perturb(h.model, seed=2)  # version 2: not pushed
    with watchdog(h.rollouts):
        fed = feed.next(3, 2)
    assert set(fed.batch.versions.tolist()) == {1}
    assert syncer.stats.catch_ups == 0 and h.link.acked == 1 and h.link.state is LinkState.READY
    assert h.engine_checksum() == (1, h.staging_checksum())  # the staged version 1, bit for bit


def test_a_stuck_push_thread_ends_the_wait_for_the_claim_with_an_error(harness_factory):
    """A catch-up waits for the push in flight; a push thread that never lets go (an abort that hangs) must stop the
    run with an error after ``(engines + 2) * timeout_seconds``, not hang it."""
    h = harness_factory(async_mode=True, timeout_s=1.0)
    h.syncer.flush(0)
    original, release = pusher.Pusher.push, threading.Event()

    def stuck(self, v, only=None):
        out = original(self, v, only)
        release.wait(60)
        return out

    pusher.Pusher.push = stuck
    try:
        perturb(h.model, seed=1)
        h.syncer.after_optimizer_step(1)  # handed to the push thread, which then never lets go
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"the weight push in flight did not end within 3 s"):
            h.syncer.stage(2)
        assert time.monotonic() - t0 < 30  # 3 s expected; the bound tells "ended" from "hung" (60 s) under any load
    finally:
        release.set()
        pusher.Pusher.push = original


# ------------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_coalesced_pushes_never_livelock_the_trainer(tiny_model_dir, tmp_path, nproc):
    rows, summary = run_held(tmp_path / "run", nproc=nproc)
    assert summary["checksums_match"]
    assert rows[-1]["discarded_rollouts"] == 0  # the pin gave way to min_version: no rollout generated in vain


@pytest.mark.slow
def test_coalesced_pushes_never_livelock_with_the_sglang_contract_server(tiny_model_dir, tmp_path):
    """An HTTP engine's push also waits for the generation in progress, so every other push is coalesced anyway;
    the hold still coalesces the two due steps after the held push."""
    from fakes.sglang_server import ContractServer

    s = ContractServer(tiny_model_dir, tmp_path, deadline_s=600, max_requests=20000)
    try:
        rows, summary = run_held(tmp_path / "run", "--rollout.engine", "sglang", "--rollout.urls", s.url,
                                 "--model.hf_assets_path", str(tiny_model_dir), timeout=400)
        assert summary["all_engines_verified"]  # SGLang keeps no checksum: the final probe verifies it
    finally:
        s.stop()
