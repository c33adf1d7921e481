"""Parts ``sparse`` (b), ``stream`` (c) and ``ipc`` (d): rank 0's real ``Rollouts`` with embedded engines.

``sparse``: a GPU trainer pushes to an embedded engine on the CPU (gloo from pinned staging) with
``weight_sync.method = "sparse"`` and a bfloat16 wire; one dense push, then 4 steps that change about 1% of the
elements, pushed as patches. Keys: ``sparse_checksums_equal`` (the engine's sha256 equals staging's: must be 1),
``weight_patched_buckets`` (the most buckets one push patched: must be > 0), ``sparse_push_bytes`` /
``sparse_dense_bytes`` (the last push's bytes against the model's), and on GPU the pinned (host) allocator's stats
before and after the sparse pushes (``host_pinned_bytes_before/after``, ``host_pinned_blocks_before/after``: torch
rounds each pinned block up to a power of two, docs/gpu.md finding 8; the whole dicts go to the part's log). CPU twin:
the same run with the trainer on CPU (no pinned memory, no host allocator stats).

``stream``: the default-stream coupling (fourth review, finding 4). GPU: an async push to a CPU engine is started
(snapshot on the side stream, the push thread's gloo sends) and the main stream is then given a queue of matmuls of
about 1.5 s; ``push_waited_for_main`` is 1 if the push completed only after that queue had drained (must be 0),
``push_s`` / ``main_queue_s`` the two times. Then the mechanism vLLM's ``send_weights`` relies on:
``current_stream().synchronize()`` on a thread under ``cuda_rules.on_stream`` with a side stream current, while the
main queue runs: ``sidestream_sync_waited_for_main`` must be 0, and the same call with the default stream current
(the control) ``default_stream_sync_waited_for_main`` must be 1 (else the queue was too short to show anything).
``sidestream_cold_sync_waited_for_main`` (reported): the same side-stream call the first time the thread's kernels
run in the process (CUDA lazy loading of their module: on the H200 of 2026-11-27 it waited for the main queue).
CPU twin: the same async push with no streams (``push_s``): it shows the code path runs, not that nothing waits on
the default stream (CPU has none).

``ipc``: (1) 10 rounds (CPU: 4) of two colocated engines with one stalled past a 1 s deadline, cut and rejoined (a
new export of staging each time): ``ipc_rounds_rejoined`` (must equal the rounds), the trainer's and each engine's RSS
and the device's used memory after the first and the last round (``*_growth_bytes``: must stay under 64 MiB; on GPU
also per process from nvidia-smi where it lists processes); (2) then 1,200 ``ForkingPickler.dumps`` of one staging
flat (on GPU a CUDA IPC export each, as every colocated (re)join sends staging), a short matmul queued on the default
stream before each of the first and last 100: ``ipc_export_first100_us`` / ``ipc_export_last100_us`` (mean per
export; past 1,000 exports torch synchronizes the current stream per export instead of recording an event, so the
last 100 wait for the queued matmul: compare with ``ipc_matmul_us``). CPU twin: the same rounds and shared-memory
exports (each loaded back, else the duplicated file descriptors pile up); it shows no CUDA IPC event or mapping.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import torch

from gpu_checks.common import (RESULTS, check, gpu_process_bytes, perturb, pump_until, report, rollouts, rss_bytes,
                               tiny_model_dir)

GROWTH_LIMIT = 64 * 2**20


def _host_stats(device: torch.device) -> dict:
    return dict(torch.cuda.host_memory_stats()) if device.type == "cuda" else {}


def sparse(out: Path, device: torch.device) -> None:
    r, model = rollouts(tiny_model_dir(out), device, num_engines=1, timeout_s=30.0, async_mode=False, colocated=False,
                        engine_devices=("cpu",), method="sparse", bucket_size_mb=0.25)
    try:
        s = r.syncer
        s.flush(0)  # dense: the engine holds no base yet
        before = _host_stats(device)
        patched = 0
        for v in range(1, 5):
            perturb(model, v, fraction=0.01)
            s.after_optimizer_step(v)  # blocking: pushed and acked
            patched = max(patched, int(s.metrics()["weight_patched_buckets"]))
        after = _host_stats(device)
        m = s.metrics()
        same = r.engines[0].checksum(timeout=60) == (4, s.staging.checksum())
        report("sparse_checksums_equal", int(same))
        report("weight_patched_buckets", patched)
        report("sparse_buckets", len(s.plan.buckets))
        report("sparse_push_bytes", int(m["weight_push_bytes"]))
        report("sparse_dense_bytes", s.plan.nbytes)
        if device.type == "cuda":
            for when, st in (("before", before), ("after", after)):
                report(f"host_pinned_bytes_{when}", st.get("allocated_bytes.current", "n/a"))
                report(f"host_pinned_blocks_{when}", st.get("allocations.current", "n/a"))
                print(f"# host_memory_stats {when}: {json.dumps(st, sort_keys=True)}", flush=True)
        check(same, "sparse_checksums_equal")
        check(patched > 0, "weight_patched_buckets > 0")
    finally:
        r.close()


def _matmul_queue(device: torch.device, seconds: float):
    """Calibrated ``a @ a`` matmuls on the default stream lasting about ``seconds``: returns a function that queues
    them and gives back (start event, end event)."""
    a = torch.randn(8192, 8192, device=device) / 100
    a @ a  # cuBLAS's first call (handle, workspace) is not timed
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        a @ a
    end.record()
    end.synchronize()
    n = max(10, min(400, int(seconds * 1000 / (start.elapsed_time(end) / 3))))

    def queue():
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            a @ a
        e.record()
        return s, e

    return queue


def stream(out: Path, device: torch.device) -> None:
    from torchtitan_flux.wire import cuda_rules

    gpu = device.type == "cuda"
    r, model = rollouts(tiny_model_dir(out), device, num_engines=1, timeout_s=30.0, async_mode=True, colocated=False,
                        engine_devices=("cpu",))
    try:
        s = r.syncer
        s.flush(0)
        queue = _matmul_queue(device, 1.5) if gpu else None
        perturb(model, 1)
        if gpu:
            torch.cuda.synchronize()
        s.before_optimizer_step()
        t0 = time.monotonic()
        s.after_optimizer_step(1)  # async: the snapshot on the side stream, then the push thread's sends
        main = queue() if gpu else None  # the next step's kernels, queued after the snapshot's ready event
        push_s = main_done_at_push = None
        deadline = t0 + 60.0
        while time.monotonic() < deadline and (push_s is None or (gpu and not main[1].query())):
            if push_s is None and not s.busy():
                push_s = time.monotonic() - t0
                main_done_at_push = bool(main[1].query()) if gpu else False
            r.pump.pump(0.001)
        pump_until(r, lambda: s.links[0].acked >= 1, 30.0, "the engine acked push 1")
        check(push_s is not None, "the async push completed")
        report("push_s", round(push_s or -1, 4))
        if gpu:
            main[1].synchronize()
            report("main_queue_s", round(main[0].elapsed_time(main[1]) / 1000, 3))
            report("push_waited_for_main", int(bool(main_done_at_push)))
            check(not main_done_at_push, "push_waited_for_main == 0")
            check(r.engines[0].checksum(timeout=60) == (1, s.staging.checksum()), "stream part: checksums equal")
            side = cuda_rules.group_stream(device)
            # the first launch of a kernel the process never ran loads its module (CUDA lazy loading), which can
            # wait for the whole device: measured first, "cold", and reported; the check is on the warm run
            for name, strm in (("sidestream_cold", side), ("sidestream", side),
                               ("default_stream", torch.cuda.default_stream(device))):
                got = {}

                def sender():  # what vLLM's send_weights does last, on the thread that pushes
                    cuda_rules.bind_thread(device)
                    with cuda_rules.on_stream(strm):
                        torch.ones(1024, device=device).sum()
                        torch.cuda.current_stream().synchronize()
                    got["main_done"] = bool(ev[1].query())

                torch.cuda.synchronize()
                ev = queue()
                th = threading.Thread(target=sender)
                th.start()
                th.join(60)
                ev[1].synchronize()
                report(f"{name}_sync_waited_for_main", int(got.get("main_done", True)))
            report("cuda_module_loading", os.environ.get("CUDA_MODULE_LOADING", "unset (LAZY)"))
            check(RESULTS.get("sidestream_sync_waited_for_main") == 0, "sidestream_sync_waited_for_main == 0")
            check(RESULTS.get("default_stream_sync_waited_for_main") == 1,
                  "default_stream_sync_waited_for_main == 1 (the control: the queue outlasts a thread's sync)")
    finally:
        r.close()


def _exports(device: torch.device) -> None:
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler

    from torchtitan_flux.wire import transport

    gpu = device.type == "cuda"
    flat = transport.plan_buckets([transport.TensorSpec("w", (2**22,), "bfloat16")], 2**23).allocate(device).flats[0]
    if not gpu:
        flat.share_memory_()
    a = torch.randn(2048, 2048, device=device)
    n, times = 1200, []
    ms = 0.0
    if gpu:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ a
        e.record()
        e.synchronize()
        ms = s.elapsed_time(e)
    for i in range(n):
        timed = i < 100 or i >= n - 100
        if gpu and timed:
            a @ a  # queued on the default stream (the joiner thread's current stream when it sends a join)
        t0 = time.perf_counter()
        data = ForkingPickler.dumps(flat)
        times.append(time.perf_counter() - t0)
        if not gpu:
            ForkingPickler.loads(data)  # takes the duplicated descriptor back (an export without a reader leaks it)
        if gpu and i == 99:
            torch.cuda.synchronize()
    report("ipc_exports", n)
    report("ipc_export_first100_us", round(sum(times[:100]) / 100 * 1e6, 1))
    report("ipc_export_last100_us", round(sum(times[-100:]) / 100 * 1e6, 1))
    if gpu:
        report("ipc_matmul_us", round(ms * 1000, 1))
        torch.cuda.synchronize()


def ipc(out: Path, device: torch.device) -> None:
    gpu = device.type == "cuda"
    rounds = 10 if gpu else 4
    timeout_s = 1.0
    r, model = rollouts(tiny_model_dir(out), device, num_engines=2, timeout_s=timeout_s, async_mode=False)
    try:
        s = r.syncer
        s.flush(0)
        ok, stalled = s.links
        rejoined, marks = 0, []
        for k in range(1, rounds + 1):
            r.engines[1].inject_fault("stall_receive", 3 * timeout_s)
            r.engines[1].checksum(timeout=60)  # served after the fault, in pipe order: the stall is in place
            perturb(model, k)
            s.after_optimizer_step(k)  # engine1 is cut at the deadline
            cut = stalled.state.value != "ready" and ok.acked == k
            r.engines[1].inject_fault("stall_receive", 0.0)
            s.deliver_staged()  # rejoin: a fresh join message, staging exported again
            back = pump_until(r, lambda: stalled.state.value == "ready" and stalled.acked >= k, 30.0,
                              f"round {k}: the stalled engine rejoined and acked")
            rejoined += int(cut and back)
            if k in (1, rounds):
                if gpu:
                    torch.cuda.synchronize()
                free, total = torch.cuda.mem_get_info(device) if gpu else (0, 0)
                marks.append({"trainer": rss_bytes(os.getpid()),
                              **{e.name: rss_bytes(e.pid) for e in r.engines}, "device_used": total - free,
                              **{f"gpu_{e.name}": gpu_process_bytes().get(e.pid, 0) for e in r.engines if gpu}})
            if not back:
                break
        report("ipc_rounds", rounds)
        report("ipc_rounds_rejoined", rejoined)
        check(rejoined == rounds, "ipc_rounds_rejoined == rounds")
        if len(marks) == 2:
            for key in marks[0]:
                report(f"{key}_first_round_bytes", marks[0][key])
                report(f"{key}_growth_bytes", marks[1][key] - marks[0][key])
                check(marks[1][key] - marks[0][key] < GROWTH_LIMIT, f"{key}_growth_bytes < 64 MiB")
        check(r.engines[0].checksum(timeout=60) == (rounds, s.staging.checksum())
              and r.engines[1].checksum(timeout=60) == (rounds, s.staging.checksum()), "ipc part: checksums equal")
    finally:
        r.close()
    _exports(device)  # after the rounds: past its 1,000th export this process syncs a stream per export
