"""Colocated engines (``rollout.colocated``): the engine copies rank 0's staging by reference (shared memory here,
CUDA IPC on GPU) under a seqlock, instead of a broadcast on a group. Also the sync path's memory ledger and the
per-engine backend (a CPU engine beside a GPU trainer gets gloo, not NCCL)."""

from __future__ import annotations

import math
import time

import pytest
import torch
from _sync_harness import Harness, assert_in_sync, params_snapshot, perturb

from torchtitan_flux.engine.embedded import EmbeddedEngine
from torchtitan_flux.sync.links import LinkState
from torchtitan_flux.wire import transport


def test_colocated_blocking_and_async_pushes_are_bitwise_equal(harness_factory):
    h = harness_factory(async_mode=False, colocated=True, bucket_size_mb=0.01, num_engines=2)
    assert all(lk.backend == transport.COLOCATED and lk.pg == transport.COLOCATED for lk in h.syncer.links)
    assert all(f.is_shared() for f in h.syncer.staging.flats)
    h.syncer.flush(0)
    for v in (1, 2):
        perturb(h.model, seed=v)
        h.syncer.after_optimizer_step(v)
        for i in range(2):
            assert_in_sync(h, v, i)
    assert h.syncer.stats.bytes_sent == 3 * 2 * h.syncer.plan.nbytes and not h.syncer.stats.failures

    a = harness_factory(async_mode=True, colocated=True, bucket_size_mb=0.01)
    a.syncer.flush(0)
    for v in range(1, 6):
        perturb(a.model, seed=v)
        a.syncer.after_optimizer_step(v)  # returns at once; pushes in flight are coalesced
    perturb(a.model, seed=9)
    a.syncer.flush(6)
    assert_in_sync(a, 6)


def test_a_copy_torn_by_a_new_snapshot_is_never_published(tiny_model_dir):
    """The seqlock: a receiver whose copy overlapped a write drops it and acks only the next whole version."""
    from torchtitan_flux.sync.snapshot import tensor_specs
    from _engine_push import trainer_model

    plan = transport.plan_buckets(tensor_specs(trainer_model(tiny_model_dir)), 2**14)
    staging = plan.allocate("cpu")
    for f in staging.flats:
        f.fill_(1.0)
    seq = transport.Seqlock()
    seq.publish(1)
    acked, errors = [], []
    rx = transport.WeightReceiver(plan, "cpu", acked.append, errors.append)
    rx.fault_stall_s = 0.3  # the receiver saw version 1 stable, then stalls before copying it
    rx.start_shared(staging.flats, seq)
    time.sleep(0.1)
    seq.begin_write()  # a new snapshot starts while the receiver is in its stall: its copy will be torn
    for f in staging.flats[: len(staging.flats) // 2]:
        f.fill_(2.0)
    time.sleep(0.5)  # the receiver copied the half-written staging meanwhile, saw seq move, dropped it
    assert acked == [] and not errors
    for f in staging.flats:
        f.fill_(2.0)
    rx.fault_stall_s = 0.0
    seq.publish(2)
    deadline = time.monotonic() + 5
    while not acked and time.monotonic() < deadline:
        time.sleep(0.01)
    rx.stop()
    assert acked == [2] and not errors
    version, buf = rx.newest()
    assert version == 2 and all(bool((f == 2.0).all()) for f in buf.flats)


def test_an_engine_that_joins_before_the_first_snapshot_waits_for_it():
    """A fresh seqlock says "nothing published": a colocated receiver started before the trainer's first snapshot
    copies nothing and acks nothing until version 0 is published (before the fix it acked the zero-filled staging
    as version 0, so a run's first rollouts came from all-zero weights, 1 run in 2)."""
    plan = transport.plan_buckets([transport.TensorSpec("w", (8,), "float32")], 1024)
    staging = plan.allocate("cpu")
    seq = transport.Seqlock()
    acked, errors = [], []
    rx = transport.WeightReceiver(plan, "cpu", acked.append, errors.append)
    rx.start_shared(staging.flats, seq)
    time.sleep(0.3)
    assert acked == [] and rx.newest()[0] == -1
    seq.begin_write()
    staging.flats[0].fill_(3.0)
    seq.publish(0)
    deadline = time.monotonic() + 5
    while not acked and time.monotonic() < deadline:
        time.sleep(0.01)
    rx.stop()
    assert acked == [0] and not errors and bool((rx.newest()[1].flats[0] == 3.0).all())


def test_a_stalled_colocated_engine_is_cut_at_the_deadline_and_the_others_go_on(harness_factory):
    h = harness_factory(async_mode=False, colocated=True, num_engines=2, timeout_s=1.0)
    h.syncer.flush(0)
    h.engines[1].inject_fault("stall_receive", 30.0)
    perturb(h.model, seed=1)
    t0 = time.monotonic()
    h.syncer.after_optimizer_step(1)  # blocking: the push ends at its deadline, the ack wait skips the lagging one
    assert time.monotonic() - t0 < 10 * 1.0  # the deadlines (1 s each), not the 30 s stall, under any load
    ok, stalled = h.syncer.links
    assert ok.acked == 1 and stalled.state is LinkState.BROKEN and h.syncer.stats.timeouts >= 1
    assert_in_sync(h, 1, 0)
    perturb(h.model, seed=2)
    h.syncer.after_optimizer_step(2)  # training goes on with the healthy engine
    assert ok.acked == 2


def _push_bf16_and_check(h) -> None:
    """Push version 1 (a blocking push to every engine); staging holds the parameters cast to bfloat16 in the
    engines' layout, and every engine holds staging's bytes."""
    h.syncer.flush(0)
    perturb(h.model, seed=1)
    h.syncer.after_optimizer_step(1)
    assert all(h.engine_checksum(i) == (1, h.staging_checksum()) for i in range(len(h.engines)))
    staged = h.wire(params_snapshot(h.model))
    assert all(h.syncer.staging.views[n].equal(p.to(torch.bfloat16)) for n, p in staged.items())


@pytest.mark.parametrize("flavor", ["tiny", "medium"])
def test_the_sync_path_holds_two_buckets_whatever_the_model_size(tmp_path_factory, flavor):
    """Every buffer the sync path allocates besides staging goes through ``SyncMemory``: pushing to two engines,
    its peak stays under two buckets (not the model) for models 80x apart in size."""
    from model_assets import build_model_dir

    from conftest import ROOT

    model_dir = build_model_dir(ROOT / "assets" / f"{flavor}-llama", flavor=flavor, seed=0)
    h = Harness(model_dir, async_mode=False, num_engines=2, bucket_size_mb=1.0, wire_dtype="bfloat16")
    try:
        _push_bf16_and_check(h)
        m = h.syncer.metrics()
        model_bytes = h.syncer.plan.nbytes
        assert 0 < m["sync_peak_bytes"] <= m["sync_budget_bytes"] <= 2 * 2**20 + 4096 + 2 * 2**20
        # the only temporaries: Llama's q/k rows rewritten in the wire dtype (cast first), two buckets' at most
        plan = h.syncer.plan
        qk = [sum(math.prod(s.shape) * 2 for s in plan.specs[b.start : b.end]
                  if s.name.endswith(("attention.qkv_linear.wq.weight", "attention.qkv_linear.wk.weight"))) for b in plan.buckets]
        assert m["sync_peak_bytes"] == max(a + b for a, b in zip([0] + qk, qk)), (m["sync_peak_bytes"], qk)
        print(f"\n{flavor}: wire bytes {model_bytes}, sync peak {m['sync_peak_bytes']}, budget {m['sync_budget_bytes']}")
        if flavor == "medium":
            assert model_bytes > 8 * m["sync_budget_bytes"]
    finally:
        h.close()


def test_plain_parameters_are_cast_by_the_copy_into_staging_with_no_temporary(tmp_path):
    """``Snapshot.take`` copies float32 parameters into bfloat16 staging directly (the copy casts: one kernel per
    tensor, no temporary into CPU or device staging; on an H200 it halved the snapshot's kernels and host time,
    docs/gpu.md); only a layout rewrite (Llama's q/k rows, cast first) allocates. Qwen3's layout rewrites nothing, so
    the ledger holds nothing at all."""
    from hf_families import build_hf_model

    h = Harness(build_hf_model(tmp_path / "qwen3", "qwen3", tied=False), async_mode=False, bucket_size_mb=1.0,
                wire_dtype="bfloat16")
    try:
        _push_bf16_and_check(h)
        assert h.syncer.metrics()["sync_peak_bytes"] == 0
    finally:
        h.close()


def test_a_cpu_engine_beside_a_gpu_trainer_gets_gloo_not_nccl():
    import queue

    cpu = EmbeddedEngine("e", "unused", 1, queue.Queue(), device="cpu")
    gpu = EmbeddedEngine("e", "unused", 1, queue.Queue(), device="cuda:1")
    here = EmbeddedEngine("e", "unused", 1, queue.Queue(), device="cuda:0", colocated=True)
    assert cpu.weight_backend("nccl") == "gloo" and gpu.weight_backend("nccl") == "nccl"
    assert here.weight_backend("nccl") == transport.COLOCATED and cpu.self_push(3, []) is None


@pytest.mark.slow  # moved out of the default suite (its time): CI's slow stage runs it
def test_colocated_debug_run_gives_the_default_losses_bit_for_bit_in_blocking_mode(tmp_path):
    from conftest import read_metrics, run_train

    run_train(tmp_path / "default", "--training.steps", "8")
    run_train(tmp_path / "colocated", "--training.steps", "8", "--rollout.colocated", "true")
    a, b = read_metrics(tmp_path / "default"), read_metrics(tmp_path / "colocated")
    assert len(a) == len(b) == 8
    for key in ("loss", "reward_mean", "grad_norm"):
        assert [r[key] for r in a] == [r[key] for r in b], key


def test_colocated_async_run_learns_and_ends_with_equal_checksums(tmp_path):
    import json

    from conftest import read_metrics, run_train

    run_train(tmp_path, "--training.steps", "30", "--rollout.colocated", "true",
              "--weight_sync.async_weight_update", "true", "--off_policy.async_ratio", "1")
    rows, summary = read_metrics(tmp_path), json.loads((tmp_path / "summary.json").read_text())
    assert summary["checksums_match"] and summary["all_engines_verified"]
    rewards = [r["reward_mean"] for r in rows]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.1
    assert max(r["version_gap_max"] for r in rows) >= 1  # it really ran off-policy


def test_the_device_ring_does_not_wait_on_an_aborted_groups_works(monkeypatch):
    """After a missed deadline the group is aborted; its Works would raise on ``wait``: the ring forgets them, so
    the next push (to another engine) does not fail on them."""
    from torchtitan_flux import compat
    from torchtitan_flux.sync.pusher import DeviceRing

    class Work:
        def __init__(self, ok: bool):
            self.ok = ok

        def wait(self):
            if not self.ok:
                raise RuntimeError("NCCL communicator was aborted")

    dead, alive = object(), object()
    monkeypatch.setattr(compat, "broadcast", lambda pg, t: Work(pg is not dead))
    ring = DeviceRing(torch.device("cpu"), 64, stream=None)
    ring.broadcast(dead, torch.zeros(4))
    ring.broadcast(dead, torch.zeros(4))  # both slots last read by the aborted group
    ring.forget(dead)
    ring.broadcast(alive, torch.zeros(4))
    ring.broadcast(alive, torch.zeros(4))
    ring.broadcast(alive, torch.zeros(4))  # waits on alive's Work: fine
    assert all(g is alive for slot in ring.readers for g, _ in slot)


def test_the_snapshot_keeps_no_bucket_alive_past_the_next_and_never_records_streams():
    """Review 4, finding 11: the ledger counts holds in program order, so it cannot see a return of N5 (each bucket's
    temporaries kept alive until its copy ended, by ``record_stream``: the whole model on the GPU). This can: every
    temporary the snapshot makes (here a layout rewrite of every tensor, as Llama's q/k rows) is dead once the bucket
    after next starts, and none outlives ``take``; and nothing in the package calls ``record_stream``."""
    import gc
    import weakref
    from pathlib import Path

    from torch import nn

    from torchtitan_flux.sync.snapshot import Snapshot

    bucket_of: dict[str, int] = {}
    refs: list[tuple[int, weakref.ref]] = []

    def rewrite(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # a new tensor per parameter
        b = bucket_of[name]
        gc.collect()
        alive = [i for i, r in refs if r() is not None and i <= b - 2]
        assert not alive, f"bucket {b}: temporaries of buckets {alive} still alive"
        out = t.to(dtype) * 1  # as a layout rewrite does (``HFLayout.wire_tensor``)
        refs.append((b, weakref.ref(out)))
        return out

    model = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(6)])  # 6 buckets of 2 KiB (bfloat16)
    snap = Snapshot(model, device=torch.device("cpu"), is_sender=True, bucket_bytes=2048,
                    wire_dtype=torch.bfloat16, wire_tensor=rewrite)
    bucket_of.update({s.name: i for i, b in enumerate(snap.plan.buckets) for s in snap.plan.specs[b.start : b.end]})
    assert len(snap.plan.buckets) == 6
    snap.take(1)
    gc.collect()
    assert len(refs) == 6 and all(r() is None for _, r in refs)
    root = Path(__file__).resolve().parents[2] / "torchtitan_flux"
    calls = [f"{p.relative_to(root)}:{n}" for p in root.rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if "record_stream(" in line and not line.lstrip().startswith("#")]
    assert not calls, calls
