"""Fault tests of async weight sync: an engine stalled past ``timeout_seconds``, an engine killed during a push,
and the trainer interrupted (SIGTERM / SIGKILL) mid-run.

The engine faults run at component level (``_sync_harness``: the trainer's rank-0 rollout side ``Rollouts`` with a
real engine process, its ``WeightSyncer`` and its restarts); the trainer interruption runs the real trainer under
torchrun. After every sync the engine's checksum equals the trainer's staging checksum.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from _procs import Run, complete_ckpts, gone, wait_gone
from _sync_harness import assert_in_sync, perturb
from conftest import read_metrics, run_train

from torchtitan_flux.engine.base import EngineError
from torchtitan_flux.engine.forkserver import START_METHOD_ENV
from torchtitan_flux.sync.links import LinkState

LOG = "torchtitan_flux"
pytestmark = pytest.mark.faults


# ---------------------------------------------------------------------------------- engine stalled


def test_engine_stalled_past_timeout_lags_keeps_serving_then_resyncs(harness_factory, caplog):
    caplog.set_level(logging.INFO, logger=LOG)
    timeout = 2.0
    h = harness_factory(async_mode=True, timeout_s=timeout, bucket_size_mb=0.01)
    syncer, sched, eng = h.syncer, h.rollouts, h.engines[0]
    syncer.flush(0)
    assert_in_sync(h, 0)

    eng.inject_fault("stall_receive", 60.0)  # stuck in the middle of every push
    eng.checksum()

    perturb(h.model, seed=1)
    t0 = time.perf_counter()
    syncer.after_optimizer_step(1)
    dt1 = time.perf_counter() - t0
    assert dt1 < 0.2, dt1  # the trainer does not wait for the stalled engine

    # meanwhile the engine keeps generating, with the version it has
    b1 = sched.collect(1, trainer_version=1)
    assert set(b1.versions.tolist()) == {0} and b1.dispatch_version == 1 and b1.newest_seen == 0

    perturb(h.model, seed=2)
    t0 = time.perf_counter()
    syncer.after_optimizer_step(2)  # the v1 push is still waiting on the engine: coalesced
    dt2 = time.perf_counter() - t0
    assert dt2 < 0.2 and syncer.stats.coalesced == 1

    t_idle = h.pump_until(lambda: not syncer.busy(), timeout + 3.0, "push thread to give up")
    push_s = syncer.stats.last_push_s
    assert timeout * 0.9 <= push_s <= timeout + 1.0, push_s  # the push thread gave up at the deadline
    assert h.link.state is LinkState.BROKEN and h.link.acked == 0  # its group must be rebuilt
    m = syncer.metrics()
    assert m["engines_lagging"] == 1 and m["weight_sync_timeouts"] == 1 and m["weight_sync_errors"] >= 1
    assert m["engine_min_version"] == 0
    assert any("push 1 did not complete" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert any("push 1 did not complete" in f for f in syncer.stats.failures)
    syncer.check_timeouts()
    assert syncer.stats.timeouts == 1  # counted once

    b2 = sched.collect(2, trainer_version=2)  # lagging: still serving v0, and its rollouts say so
    assert set(b2.versions.tolist()) == {0} and b2.dispatch_version == 2

    # it answers again: the abandoned push's sends have ended (their group's timeout closed them moments after the
    # deadline; the next snapshot would wait for them: test_the_sends_of_a_push_abandoned_at_its_deadline_end_...),
    # the next push rejoins it on a fresh group and it gets the newest weights
    eng.inject_fault("stall_receive", 0.0)
    h.pump_until(lambda: all(w.is_completed() for a in syncer.pusher.abandoned for w in a.works), 10.0,
                 "the abandoned push's sends to end")
    resyncs = syncer.stats.resyncs
    perturb(h.model, seed=3)
    t0 = time.perf_counter()
    syncer.after_optimizer_step(3)
    dt3 = time.perf_counter() - t0
    assert dt3 < 0.2
    t_resync = h.pump_until(lambda: h.link.acked == 3, 10.0, "resync to v3")
    assert syncer.stats.resyncs > resyncs and h.link.epoch == 2
    assert h.link.state is LinkState.READY
    assert_in_sync(h, 3)
    b3 = sched.collect(3, trainer_version=3)
    assert set(b3.versions.tolist()) == {3}
    m = syncer.metrics()
    assert m["engines_lagging"] == 0 and m["engine_min_version"] == 3
    print(f"\nstall: after_optimizer_step {dt1 * 1e3:.2f} / {dt2 * 1e3:.2f} / {dt3 * 1e3:.2f} ms (timeout {timeout}s); "
          f"push thread gave up after {push_s:.2f}s ({t_idle:.2f}s of waiting here); resynced to v3 {t_resync:.2f}s "
          "after the next step")


def test_a_stalled_engine_times_out_alone_while_the_other_stays_in_sync(harness_factory, caplog):
    """Two engines, one stalled in the middle of every push: the push gives up on that one alone at the deadline
    (lagging, one timeout counted, it keeps serving its old version), while the other acks the same push, holds
    the trainer's bytes, serves rollouts of the new version and takes the next push at once."""
    caplog.set_level(logging.INFO, logger=LOG)
    timeout = 2.0
    h = harness_factory(async_mode=True, timeout_s=timeout, bucket_size_mb=0.01, num_engines=2)
    syncer, sched = h.syncer, h.rollouts
    syncer.flush(0)
    assert_in_sync(h, 0, 0)
    assert_in_sync(h, 0, 1)
    slow, fast = h.engines
    links = {lk.handler.name: lk for lk in syncer.links}
    slow.inject_fault("stall_receive", 60.0)
    slow.checksum()

    perturb(h.model, seed=1)
    syncer.after_optimizer_step(1)
    h.pump_until(lambda: links[fast.name].acked == 1, timeout / 2, "the fast engine's ack of v1")  # before the deadline
    h.pump_until(lambda: not syncer.busy(), timeout + 3.0, "push 1 to give up on the slow engine")
    assert links[slow.name].state is LinkState.BROKEN and links[slow.name].acked == 0
    assert links[fast.name].state is LinkState.READY and links[fast.name].acked == 1
    assert_in_sync(h, 1, 1)
    assert h.engine_checksum(0)[0] == 0  # the slow one still holds v0
    m = syncer.metrics()
    assert m["engines_lagging"] == 1 and m["weight_sync_timeouts"] == 1 and m["engine_min_version"] == 0
    assert any(f"weight sync to {slow.name}: push 1 did not complete" in f for f in syncer.stats.failures)
    assert not any(fast.name in f for f in syncer.stats.failures), syncer.stats.failures

    # the next push reaches the fast engine at once (it is not held back by the slow one's deadline)
    perturb(h.model, seed=2)
    t0 = time.perf_counter()
    syncer.after_optimizer_step(2)
    took = h.pump_until(lambda: links[fast.name].acked == 2, timeout, "the fast engine's ack of v2")
    assert time.perf_counter() - t0 < timeout / 2, took
    assert_in_sync(h, 2, 1)
    batch = sched.collect(2, trainer_version=2)  # both engines serve: the fast one's rollouts are of v2
    assert 2 in set(batch.versions.tolist()), batch.versions


@pytest.mark.slow
def test_the_sends_of_a_push_abandoned_at_its_deadline_end_before_the_next_snapshot(caplog):
    """Review 4, finding 12: gloo cannot cancel a send (its ``abort`` leaves it running), so the sends of a push
    given up at its deadline could read staging while the next snapshot rewrites it, and carry a torn copy to the
    engine. They end on their own: their group's timeout is the push's (``timeout_seconds``), so gloo closes the pair
    moments after the deadline, and the snapshot waits for that (``Pusher.free_staging``; an engine whose sends still
    ran ``FREE_STAGING_S`` later would be stopped: tests/unit/test_pusher.py). A 97 MB push (far more than the
    sockets' buffers hold) to an engine stalled in its middle: the next snapshot neither stops the engine nor waits
    long; the engine's receive failed with the closed pair, it rejoins and is resynced to version 2, bit for bit."""
    from _sync_harness import Harness
    from conftest import ROOT
    from model_assets import build_model_dir

    from torchtitan_flux.sync.pusher import FREE_STAGING_S

    caplog.set_level(logging.INFO, logger=LOG)
    h = Harness(build_model_dir(ROOT / "assets" / "medium-llama", flavor="medium", seed=0), async_mode=True,
                timeout_s=2.0, bucket_size_mb=4.0)
    try:
        syncer, eng = h.syncer, h.engines[0]
        syncer.flush(0)
        h.miss_a_push(1)
        assert len(syncer.pusher.abandoned) == 1  # 24 of 25 buckets unsent
        perturb(h.model, seed=2)
        t0 = time.monotonic()
        syncer.after_optimizer_step(2)
        took = time.monotonic() - t0
        assert took < FREE_STAGING_S, took
        assert syncer.pusher.abandoned == [] and not any("torn copy" in r.getMessage() for r in caplog.records)
        eng.inject_fault("stall_receive", 0.0)
        h.pump_until(lambda: h.link.acked == 2, 60.0, "the engine resynced to version 2")
        assert h.restarts == 0 and h.engines[0] is eng
        assert_in_sync(h, 2)
    finally:
        h.close()


def test_a_stopped_engine_with_a_full_pipe_blocks_only_its_sender(harness_factory):
    """Review 4, finding 5: an engine stopped with SIGSTOP reads no pipe; the join message of each retry (~44.5 KB
    for a 70B spec list) piles up until the pipe is full, and the next send blocks. Rejoins sent it while holding
    the link table's lock, so ``deliver_staged``, ``pump`` and ``claim`` on the main thread blocked on that lock
    and the stuck-engine kill never ran. Then only the joiner thread blocked, holding no lock; now (GPU review,
    finding 21) only the engine's sender thread does (``engine/sender.py``): the joiner waits for the rendezvous."""
    h = harness_factory(async_mode=True, timeout_s=2.0)
    syncer, eng = h.syncer, h.engines[0]
    syncer.flush(0)
    os.kill(eng.pid, signal.SIGSTOP)
    try:
        # the pipe fills: a message much larger than its buffer stands in for the join messages piled up
        t0 = time.monotonic()
        eng._send(("pad", bytes(16 << 20)))
        eng._send(("pad", b""))  # queued behind it
        assert time.monotonic() - t0 < 1.0, "a send blocked its caller"
        time.sleep(0.5)
        assert eng._sender._queue.qsize() == 1, "the stopped engine's pipe took 16 MiB: the test blocks nothing"
        eng.events.put(EngineError(eng.name, "weight receiver: RuntimeError: test", fatal=False))
        h.pump_until(lambda: h.link.state is LinkState.BROKEN, 5.0, "the link broken")

        done = threading.Event()
        t0 = time.monotonic()
        threading.Thread(target=lambda: (syncer.deliver_staged(), done.set()), daemon=True).start()
        assert done.wait(5.0), "deliver_staged blocked on the stopped engine's pipe"
        took = time.monotonic() - t0
        assert took < 1.0, took
        assert h.link.state is LinkState.JOINING  # its joiner waits for the engine's side of the rendezvous
        assert any(t.name == f"flux-join-{eng.name}" for t in threading.enumerate())
        assert syncer.table.lock.acquire(timeout=1.0), "the link table's lock is held while a send blocks"
        syncer.table.lock.release()
        t0 = time.monotonic()
        h.rollouts.pump.pump(0.05)  # the main thread's pump, claim and timeout check go on
        assert syncer.pusher.claim()
        syncer.pusher.release()
        syncer.check_timeouts()
        assert time.monotonic() - t0 < 10.0  # the engine is stopped for good: returning at all is the point
    finally:
        os.kill(eng.pid, signal.SIGKILL)  # a stopped process dies at once; its pipe closes and the sends end
    # the replacement joins; the old joiner fails its rendezvous at the deadline, is superseded and not retried (and
    # no thread is left inside a store wait when the interpreter exits)
    h.pump_until(lambda: h.restarts == 1 and h.link.state is LinkState.READY and not any(
        t.name.startswith("flux-join-") for t in threading.enumerate()), 10.0, "the replacement joined, joiners ended")
    print(f"\nstopped engine, full pipe: deliver_staged returned in {took * 1e3:.1f} ms")


# ----------------------------------------------------------------------------------- engine killed


@pytest.mark.parametrize("async_mode", [True, False], ids=["async", "blocking"])
def test_engine_killed_during_push_is_restarted_resynced_and_its_requests_redispatched(harness_factory, async_mode):
    timeout = 3.0
    h = harness_factory(async_mode=async_mode, timeout_s=timeout, bucket_size_mb=0.01)
    syncer, sched, eng = h.syncer, h.rollouts, h.engines[0]
    syncer.flush(0)
    old_pid = eng.pid
    old_ct = psutil.Process(old_pid).create_time()

    eng.inject_fault("stall_receive", 60.0)  # the push will be in flight when the engine dies
    eng.inject_fault("stall_generate", 60.0)  # and so will this step's request
    eng.checksum()
    sched.dispatch(1, trainer_version=0)

    perturb(h.model, seed=1)
    killer = threading.Timer(0.5, os.kill, (old_pid, signal.SIGKILL))
    killer.start()
    t0 = time.perf_counter()
    syncer.after_optimizer_step(1)
    dt = time.perf_counter() - t0
    killer.join()
    if async_mode:
        assert dt < 0.2, dt
    else:  # blocking: bounded by the push deadline, not by the dead engine
        assert dt < timeout + 1.0, dt

    t_dead = h.pump_until(lambda: sched.pump.engine_deaths == 1, 10.0, "the fatal event")
    assert syncer.wait_idle(timeout + 2.0)  # the push thread did not hang on the dead engine
    assert h.restarts == 1  # the one engine, ``eng`` (``old_pid``), was restarted
    new = h.engines[0]
    assert new is not eng and new.pid != old_pid and h.link.handler is new
    assert gone(old_pid, old_ct)
    assert any("exited" in f or "pipe closed" in f for f in syncer.stats.failures)  # counted and logged

    # the dead engine's request was re-dispatched to the replacement and completes there, on the newest weights
    t0 = time.perf_counter()
    batch = sched.collect(1, trainer_version=1)
    t_collect = time.perf_counter() - t0
    assert sched.pump.redispatched == 1
    assert set(batch.versions.tolist()) == {1} and batch.dispatch_version == 0
    assert h.link.epoch == 2 and h.link.state is LinkState.READY
    assert_in_sync(h, 1)

    # the next push reaches the replacement
    perturb(h.model, seed=2)
    syncer.after_optimizer_step(2)
    h.pump_until(lambda: h.link.acked == 2, 10.0, "v2 on the replacement")
    assert_in_sync(h, 2)
    h.drain(0.5)
    assert sched.pump.engine_deaths == 1 and h.restarts == 1  # one death, one restart
    print(f"\nkill ({'async' if async_mode else 'blocking'}): after_optimizer_step {dt:.3f}s; death delivered "
          f"{t_dead:.2f}s later; re-dispatched request done {t_collect:.2f}s after that")


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_engine_does_not_outlive_a_killed_parent(tiny_model_dir, tmp_path, method, stopped):
    """SIGKILL only the process that started the engine: the engine goes too, and so do the fork server it was
    forked from and the resource tracker (the server exits when its starter's pipe closes; the engine by
    PR_SET_PDEATHSIG). ``stopped``: the engine is SIGSTOPped first, so it cannot notice anything itself (it used
    to keep the server, itself and the tracker alive: the server's liveness pipe was open in the engine too)."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import queue, sys, time
        from torchtitan_flux.engine.embedded import EmbeddedEngine
        if __name__ == "__main__":
            e = EmbeddedEngine("engine0", sys.argv[1], 1, queue.Queue())
            e.start()
            e.checksum(timeout=60)
            print(e.pid, flush=True)
            time.sleep(600)
    """))
    env = {**os.environ, START_METHOD_ENV: method}
    p = subprocess.Popen([sys.executable, str(script), str(tiny_model_dir)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pid = int(p.stdout.readline())
        engine = psutil.Process(pid)
        assert engine.name() == "flux-engine0"
        helpers = {c.pid: (c.create_time(), " ".join(c.cmdline()))
                   for c in psutil.Process(p.pid).children(recursive=True)}
        assert pid in helpers and not gone(pid, engine.create_time())
        if method == "forkserver":
            assert engine.parent().pid != p.pid and engine.parent().pid in helpers  # forked by the server
        else:
            assert engine.parent().pid == p.pid
        if stopped:
            os.kill(pid, signal.SIGSTOP)
            deadline = time.monotonic() + 5
            while engine.status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engine.status() == psutil.STATUS_STOPPED
        p.kill()
        p.wait(10)
        assert not wait_gone(helpers, 5.0)
    finally:
        p.kill()
        p.wait(10)


# --------------------------------------------------------------------------------- trainer interrupted


@pytest.mark.slow
def test_trainer_interrupted_leaves_no_orphans_and_a_loadable_checkpoint(tiny_model_dir, tmp_path):
    dump = tmp_path / "run"
    args = ("--checkpoint.enable", "true", "--checkpoint.interval", "2", "--weight_sync.async_weight_update", "true",
            "--off_policy.async_ratio", "1")

    # 1) SIGTERM to torchrun (what a job scheduler sends), mid-run, right after a checkpoint
    run = Run(dump, tmp_path / "run1.log", *args, "--training.steps", "40")
    run.wait_for(lambda: complete_ckpts(dump) and run.engines, 120, "a first checkpoint")
    os.kill(run.proc.pid, signal.SIGTERM)
    rc = run.proc.wait(60)
    assert rc != 0
    assert not wait_gone(run.seen, 10.0), "processes outlived a SIGTERMed trainer"
    k1 = complete_ckpts(dump)[-1]

    # 2) resume: the newest complete checkpoint loads; then SIGKILL the whole process group mid-run
    run = Run(dump, tmp_path / "run2.log", *args, "--training.steps", "40")
    run.wait_for(lambda: complete_ckpts(dump)[-1] >= k1 + 2 and run.engines, 120, "a checkpoint after the resume")
    assert run.start_step() == k1 + 1
    os.killpg(run.proc.pid, signal.SIGKILL)
    run.proc.wait(60)
    assert not wait_gone(run.seen, 10.0), "processes outlived a SIGKILLed trainer"
    k2 = complete_ckpts(dump)[-1]
    assert k2 > k1

    # 3) the checkpoint written before the SIGKILL loads, and training goes on from the step after it
    before = len((dump / "metrics.jsonl").read_text().splitlines())
    proc = run_train(dump, *args, "--training.steps", str(k2 + 2))
    assert f"Training starts at step {k2 + 1}" in proc.stdout + proc.stderr
    new_rows = [json.loads(x) for x in (dump / "metrics.jsonl").read_text().splitlines()[before:]]
    assert [r["step"] for r in new_rows] == [k2 + 1, k2 + 2]
    assert read_metrics(dump)[-1]["step"] == k2 + 2
    summary = json.loads((dump / "summary.json").read_text())
    assert summary["checksums_match"] and summary["final_engine_version"] == k2 + 2
    print(f"\ninterrupts: SIGTERM after checkpoint {k1} (torchrun rc {rc}), SIGKILL after checkpoint {k2}; "
          f"engines seen {len(run.engines)}; resumed at {k2 + 1}")


@pytest.mark.slow
def test_trainer_killed_alone_takes_stopped_engines_fork_server_and_tracker(tiny_model_dir, tmp_path):
    """A crash or an OOM kill of the trainer process alone (not its process group), with every engine SIGSTOPped
    so none can notice: torchrun ends, and no engine, fork server or resource tracker outlives the trainer."""
    dump = tmp_path / "run"
    run = Run(dump, tmp_path / "run.log", "--training.steps", "400")
    run.wait_for(lambda: run.engines and (dump / "metrics.jsonl").is_file() and len(read_metrics(dump)) >= 2, 120,
                 "two trained steps")
    workers = [c for c in psutil.Process(run.proc.pid).children()
               if "torchtitan_flux.train" in " ".join(c.cmdline()) and "forkserver" not in " ".join(c.cmdline())]
    assert len(workers) == 1, workers
    for pid in run.engines:
        os.kill(pid, signal.SIGSTOP)
    workers[0].kill()
    rc = run.proc.wait(60)
    assert rc != 0
    assert not wait_gone(run.seen, 10.0), "processes outlived a SIGKILLed trainer"
    kinds = " ".join(cmd for _, cmd in run.seen.values())
    assert run.engines and set(run.engines) <= set(run.seen)
    for kind in ("multiprocessing.forkserver", "multiprocessing.resource_tracker"):
        assert kind in kinds, f"{kind} was never seen, so never checked: {kinds}"
