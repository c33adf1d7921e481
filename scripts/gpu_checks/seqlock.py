"""Part ``seqlock`` (a): the colocated hand-over under torture, over real CUDA IPC (CPU twin: shared memory).

The writer (this process) owns a staging buffer (1 GiB of float32 in 4 buckets on GPU; 4 MiB on CPU) and the real
``transport.Seqlock``; a spawned reader process maps both (CUDA IPC / shared memory, as a colocated engine does from
its join message) and receives with the real ``WeightReceiver.start_shared`` (the engine's read path). The writer
stages version v as the snapshot does: ``begin_write``, fill every bucket with the value v on its own stream with
random delays queued before each bucket (``torch.cuda._sleep``; CPU: host sleeps between buckets), wait for the
stream, ``publish(v)``, sometimes a short host pause (so that reader copies start and are then torn). Every version
the reader accepts (its ``on_received``) is checked whole: every element of every bucket equals v.

Keys: ``seqlock_versions`` (published), ``seqlock_accepted``, ``dropped`` (published, never accepted: must be > 0, the
reader skips versions), ``torn_rejected`` (copies the seqlock dropped as torn: expected > 0, not required),
``torn_published`` (accepted versions whose bytes are not that version: must be 0), ``seqlock_nonmonotonic`` (must be
0), ``seqlock_reader_errors`` (must be 0). The CPU twin shows the protocol and the receiver's loop on shared memory
with two processes; it cannot show CUDA IPC mappings, stream ordering of the copy (``landed``) or device memory.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from gpu_checks.common import check, report


def _reader(flats, seq_t, device: str, stop, conn) -> None:
    """The spawned reader: the receiver's colocated loop over the shared ``flats``, each accepted version checked."""
    from torchtitan_flux.wire import transport

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    stats = {"accepted": 0, "torn_published": 0, "torn_rejected": 0, "nonmonotonic": 0, "errors": [], "last": -1,
             "bad": []}

    class CountingSeqlock(transport.Seqlock):  # the real seqlock; only counts the copies it rejects
        def stable(self, seq: int) -> bool:
            ok = super().stable(seq)
            stats["torn_rejected"] += not ok
            return ok

    plan = transport.BucketPlan(
        tuple(transport.TensorSpec(f"w{i}", (f.numel(),), "float32") for i, f in enumerate(flats)),
        tuple(transport.Bucket(i, i + 1, "float32", f.numel()) for i, f in enumerate(flats)))

    def on_received(version: int) -> None:  # the receiver thread, right after it published ``version``
        v, buf = rx.newest()
        whole = v == version and all(bool((f == float(version)).all()) for f in buf.flats)
        if not whole:
            stats["torn_published"] += 1
            if len(stats["bad"]) < 3:
                stats["bad"].append((version, [(float(f.min()), float(f.max())) for f in buf.flats]))
        stats["nonmonotonic"] += version <= stats["last"]
        stats["last"] = version
        stats["accepted"] += 1

    rx = transport.WeightReceiver(plan, dev, on_received, lambda e: stats["errors"].append(repr(e)), buffers=2)
    rx.start_shared(list(flats), CountingSeqlock(seq_t))
    stop.wait()
    rx.stop()
    time.sleep(0.1)  # the loop sees its stop event (a copy in flight ends first)
    conn.send(stats)
    conn.close()


def part(out: Path, device: torch.device) -> None:
    import torch.multiprocessing as tmp

    from torchtitan_flux.wire import transport

    gpu = device.type == "cuda"
    seconds = 60.0 if gpu else 5.0
    numel = (2**30 if gpu else 4 * 2**20) // 4 // 4  # 4 float32 buckets: 1 GiB on GPU, 4 MiB on CPU
    specs = [transport.TensorSpec(f"w{i}", (numel,), "float32") for i in range(4)]
    staging = transport.plan_buckets(specs, numel * 4).allocate(device)  # GPU: device memory, as colocated staging
    if gpu:
        torch.cuda.synchronize()  # the zero-fill (default stream) is done before the writer's stream touches staging
    else:
        for f in staging.flats:
            f.share_memory_()
    seq = transport.Seqlock()
    ctx = tmp.get_context("spawn")
    stop = ctx.Event()
    mine, theirs = ctx.Pipe(duplex=False)
    reader = ctx.Process(target=_reader, args=(staging.flats, seq.t, str(device), stop, theirs), daemon=True)
    reader.start()  # the flats travel as CUDA IPC handles (shared-memory file descriptors on CPU)
    theirs.close()
    rng = random.Random(0)
    stream = torch.cuda.Stream(device) if gpu else None
    delay_cycles = 2_000_000  # about 1 ms at 2 GHz: up to this much queued before a bucket's fill
    time.sleep(1.0 if not gpu else 3.0)  # the reader imports torch and maps the staging meanwhile
    v, t0 = 0, time.monotonic()
    try:
        while time.monotonic() - t0 < seconds and reader.is_alive():
            v += 1
            seq.begin_write()
            if gpu:
                with torch.cuda.stream(stream):
                    for f in staging.flats:
                        if rng.random() < 0.5 and hasattr(torch.cuda, "_sleep"):  # a spin kernel (private API)
                            torch.cuda._sleep(rng.randrange(delay_cycles))
                        f.fill_(float(v))
                stream.synchronize()  # the push thread's ``synchronize_copy`` before ``publish``
            else:
                for f in staging.flats:
                    f.fill_(float(v))
                    if rng.random() < 0.3:
                        time.sleep(rng.uniform(0, 0.001))
            seq.publish(v)
            if rng.random() < 0.3:  # a gap: the reader starts a copy that the next begin_write may tear
                time.sleep(rng.uniform(0, 0.003))
        alive = reader.is_alive()
        stop.set()
        stats = mine.recv() if mine.poll(30.0) else None
    finally:
        stop.set()
        reader.join(15)
        if reader.is_alive():
            reader.kill()
            reader.join(5)
    check(alive, "the seqlock reader process stayed alive")
    check(stats is not None, "the seqlock reader reported its counts")
    if stats is None:
        return
    report("seqlock_staging_bytes", sum(f.numel() * 4 for f in staging.flats))
    report("seqlock_seconds", round(time.monotonic() - t0, 1))
    report("seqlock_versions", v)
    report("seqlock_accepted", stats["accepted"])
    report("dropped", v - stats["accepted"])
    report("torn_rejected", stats["torn_rejected"])
    report("torn_published", stats["torn_published"])
    report("seqlock_nonmonotonic", stats["nonmonotonic"])
    report("seqlock_reader_errors", len(stats["errors"]))
    for e in stats["errors"][:3]:
        print(f"# reader error: {e}", flush=True)
    for bad in stats["bad"]:
        print(f"# torn version accepted: {bad}", flush=True)
    check(stats["accepted"] > 0, "the reader accepted some versions")
    check(stats["torn_published"] == 0, "torn_published == 0")
    check(v - stats["accepted"] > 0, "dropped > 0")
    check(stats["nonmonotonic"] == 0 and not stats["errors"], "accepted versions increase, no reader error")
