"""What a first run on a GPU machine executes (``scripts/gpu_smoke.sh``), and its CPU twin (``--cpu``, run by CI).

Parts, in this order (the order they are cut in when time runs out), each in a process of its own under its own
wall-clock limit and all of them within ``--budget`` seconds (default 470: the whole GPU run fits in about 8 minutes);
each prints its ``key=value`` lines when it ends, and ``part_<name>=ok|failed|timeout|not_run`` (``timeout``: it
ran past its own limit, a failure; ``not_run``: the budget was spent before it started, or ended while it ran):

* ``train``: ``torchrun`` 20 GRPO steps of the debug config on the device, with colocated embedded engines
  (``rollout.colocated``: on one GPU the engine shares it), async weight updates and selective activation
  checkpointing; prints ``checksums_equal`` (every engine's final sha256 equals the trainer's), ``reward_gain``
  (mean reward of the last 5 steps minus the first 5) and ``push_overlap_fraction`` (1 - the main thread's
  waits on weight sync beyond the snapshot / the push thread's time);
* ``seqlock``, ``sparse``, ``stream``, ``ipc``, ``fsdp``: ``scripts/gpu_checks/`` (each module's docstring says
  what it checks, its keys and what its CPU twin does not show);
* ``one_gpu``: the one-GPU number, Qwen3-0.6B's shape trained colocated (``gpu_checks/one_gpu.py``):
  ``one_gpu_blocked_ms_p50/p99``, ``one_gpu_push_ms_p50/p99``, ``one_gpu_checksums_equal``;
* ``memory``: rank 0's real ``Rollouts`` on the device with two colocated engines:
  ``sync_peak_bytes_<flavor>`` <= ``sync_budget_bytes_<flavor>`` (``sync.memory.SyncMemory``) for two models 80x
  apart, and on GPU ``allocator_peak_bytes_<flavor>`` (the CUDA allocator's peak growth over one snapshot and
  push: what the ledger must bound);
* ``stall``: ``stalled_engine_cut`` (one engine stalls past the deadline: the push ends at it, the other engine is
  in sync, the next push goes on);
* GPU only: ``profile``: ``default_stream_sync_kernels`` (from the PyTorch profiler: kernels and copies launched
  inside the snapshot that ran on the default stream; must be 0) and ``sync_kernels`` (how many ran in all: not
  0); ``train_cpu_engine`` (``cpu_engine_*``): the training of ``train`` (10 steps) with the engine on the CPU, over
  gloo from pinned staging; ``train_medium_bf16`` (``medium_bf16_*``): 20 steps of the 24M-parameter model with
  bf16 mixed precision and a bf16 wire (checksums only: its learning rate is the tiny model's).
* ``decode``: the embedded engine's decode step on Qwen3-0.6B's shape (``gpu_checks/decode.py``:
  ``benchmarks/engine.py --device cuda``): ms per step for the serial loop, the batcher (eager and with CUDA graphs:
  ``graph_vs_eager_rows<R>``) and HF ``generate``, the batcher's kernel launches, GPU-busy fraction and CUDA
  synchronisations per step, each eager and with graphs (run it alone first: ``--only decode``).
* GPU only: ``train_graphs`` (``graphs_*``): ``train``'s run with ``rollout.decode_graphs`` and in-flight weight
  updates (the engine process's captured steps beside its receiver thread, a swap's copy into the static weights).
The last line is ``smoke_ok=1`` when every part that ran held. Simplification: one device, rank 0 only (FSDP and
NCCL between GPUs are ``scripts/verify_grpo_2gpu.sh``'s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # model_assets, gpu_checks; the package itself is installed (gpu_smoke.sh)
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import ArgumentParser, count, free_port, number, run_child, stop_children_on_signals  # noqa: E402

# the parts that start embedded engines: their fork server is started first, so its imports overlap the part's
ENGINE_PARTS = ("sparse", "stream", "ipc", "memory", "stall", "profile", "colocated")
_PART = sys.argv[sys.argv.index("--part") + 1] if "--part" in sys.argv[:-1] else ""
if __name__ == "__main__" and _PART in ENGINE_PARTS:
    from torchtitan_flux.engine.forkserver import prestart_engine_server  # imports no torch

    prestart_engine_server()

import torch  # noqa: E402

from gpu_checks.common import FAILED, RESULTS, check, perturb, report, rollouts  # noqa: E402


def train(out: Path, steps: int, timeout: float, *extra: str, prefix: str = "", learns: bool = True) -> None:
    from model_assets import build_model_dir

    build_model_dir(ROOT / "assets" / "tiny-llama", flavor="tiny", seed=0)  # the debug config's model
    dump = out / f"{prefix}run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "torchtitan_flux.train",
           "--job.config_file", str(ROOT / "train_configs/debug_cpu.toml"), "--job.dump_folder", str(dump),
           "--training.steps", str(steps), "--rollout.colocated", "true", "--activation_checkpoint.mode", "selective",
           "--weight_sync.async_weight_update", "true", "--off_policy.async_ratio", "1", *extra]
    t0 = time.monotonic()
    proc = run_child(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    (out / f"{prefix}train.log").write_text(proc.stdout + proc.stderr)
    report(f"{prefix}train_rc", proc.returncode)
    report(f"{prefix}train_s", round(time.monotonic() - t0, 1))
    if proc.returncode != 0:
        print((proc.stdout + proc.stderr)[-4000:])
        check(False, "training run exited non-zero")
        return
    summary = json.loads((dump / "summary.json").read_text())
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in rows]
    report(f"{prefix}checksums_equal", int(bool(summary["checksums_match"]) and summary["all_engines_verified"]))
    report(f"{prefix}reward_gain", round(sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5, 4))
    waited = sum(max(0.0, r["weight_sync_s"] - r["weight_snapshot_s"]) for r in rows)
    pushed = sum(r["weight_push_s"] for r in rows)
    report(f"{prefix}push_overlap_fraction", round(max(0.0, 1 - waited / pushed), 3) if pushed > 0 else 0.0)
    report(f"{prefix}steps_per_s", round(summary["steps_per_s"], 2))
    check(RESULTS[f"{prefix}checksums_equal"] == 1, f"{prefix}checksums_equal")
    if learns:
        check(RESULTS[f"{prefix}reward_gain"] > 0, f"{prefix}reward_gain > 0")


def memory(out: Path, device: torch.device) -> None:
    from model_assets import build_model_dir

    for flavor in ("tiny", "medium"):
        model_dir = build_model_dir(out / f"{flavor}-llama", flavor=flavor, seed=0)
        r, model = rollouts(model_dir, device, num_engines=2, timeout_s=60.0, async_mode=False)
        try:
            s = r.syncer
            s.flush(0)
            perturb(model, 1)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            s.after_optimizer_step(1)
            if device.type == "cuda":
                torch.cuda.synchronize()
                report(f"allocator_peak_bytes_{flavor}", torch.cuda.max_memory_allocated(device) - base)
            m = s.metrics()
            same = all(e.checksum(timeout=60) == (1, s.staging.checksum()) for e in r.engines)
            report(f"model_wire_bytes_{flavor}", s.plan.nbytes)
            report(f"sync_peak_bytes_{flavor}", m["sync_peak_bytes"])
            report(f"sync_budget_bytes_{flavor}", m["sync_budget_bytes"])
            report(f"checksums_equal_{flavor}", int(same))
            check(same, f"checksums_equal_{flavor}")
            check(0 < m["sync_peak_bytes"] <= m["sync_budget_bytes"], f"sync_peak_bytes_{flavor} <= budget")
            if device.type == "cuda":
                check(RESULTS[f"allocator_peak_bytes_{flavor}"] <= m["sync_budget_bytes"],
                      f"allocator_peak_bytes_{flavor} <= sync_budget_bytes_{flavor}")
        finally:
            r.close()
    report("sync_peak_bytes", RESULTS["sync_peak_bytes_medium"])
    report("sync_budget_bytes", RESULTS["sync_budget_bytes_medium"])


def stall(out: Path, device: torch.device) -> None:
    from model_assets import build_model_dir

    timeout_s = 2.0
    r, model = rollouts(build_model_dir(out / "tiny-llama", flavor="tiny", seed=0), device, num_engines=2,
                        timeout_s=timeout_s, async_mode=False)
    try:
        s = r.syncer
        s.flush(0)
        r.engines[1].inject_fault("stall_receive", 4 * timeout_s)
        r.engines[1].checksum(timeout=60)  # served after the fault, in pipe order: the stall is in place
        perturb(model, 1)
        t0 = time.monotonic()
        s.after_optimizer_step(1)
        took = time.monotonic() - t0
        ok, stalled = s.links
        report("stalled_state", stalled.state.value)  # broken: its copy missed the deadline (lagging: acked late)
        was_cut = stalled.state.value in ("broken", "lagging") and ok.acked == 1
        perturb(model, 2)
        s.after_optimizer_step(2)
        cut = (took < 3 * timeout_s and was_cut and ok.acked == 2
               and r.engines[0].checksum(timeout=60) == (2, s.staging.checksum()))
        report("stalled_push_s", round(took, 2))
        report("stalled_engine_cut", int(cut))
        check(cut, "stalled_engine_cut")
    finally:
        r.close()


def profile(out: Path, device: torch.device) -> None:
    """Kernels and copies launched inside the snapshot (``flux_weight_sync.snapshot``) and the stream each ran on."""
    from model_assets import build_model_dir
    from torch.profiler import ProfilerActivity, profile as torch_profile

    r, model = rollouts(build_model_dir(out / "medium-llama", flavor="medium", seed=0), device, num_engines=1,
                        timeout_s=60.0, async_mode=True)
    try:
        s = r.syncer
        s.flush(0)
        a = torch.randn(4096, 4096, device=device)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for v in range(1, 4):
                for _ in range(4):
                    a = torch.tanh(a @ a)  # "training" on the default stream
                s.before_optimizer_step()
                perturb(model, v)
                s.after_optimizer_step(v)
            s.flush(3)
            torch.cuda.synchronize()
        trace = out / "sync_trace.json"
        prof.export_chrome_trace(str(trace))
    finally:
        r.close()
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [(e["tid"], e["ts"], e["ts"] + e["dur"]) for e in events
             if e.get("cat") == "user_annotation" and e.get("name") == "flux_weight_sync.snapshot"]
    inside = {e["args"]["correlation"] for e in events if e.get("cat") == "cuda_runtime" and "correlation" in
              e.get("args", {}) and any(t == e["tid"] and a0 <= e["ts"] <= a1 for t, a0, a1 in spans)}
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    streams: dict[int, int] = {}
    for e in gpu:
        if e["args"].get("correlation") not in inside:
            streams[e["args"]["stream"]] = streams.get(e["args"]["stream"], 0) + 1
    default = torch.cuda.default_stream(device).stream_id  # kineto reports the default stream as 7
    default = 7 if 7 in streams or default == 0 else default
    sync = [e for e in gpu if e["args"].get("correlation") in inside]
    report("snapshot_spans", len(spans))
    report("sync_kernels", len(sync))
    report("default_stream_sync_kernels", sum(e["args"]["stream"] == default for e in sync))
    report("sync_streams", sorted({e["args"]["stream"] for e in sync}))
    check(len(spans) >= 3 and len(sync) > 0, "the profiler saw the snapshot's kernels")
    check(RESULTS["default_stream_sync_kernels"] == 0, "default_stream_sync_kernels == 0")


def _parts(args, out: Path, device: torch.device) -> dict:
    """name -> (limit on GPU s, limit on CPU s, the least time worth starting it with s, the part)."""
    from gpu_checks import colocated, decode, fsdp, pushes, seqlock

    inner = max(30.0, args.limit - 15)  # a torchrun child ends (and says why) before its part is killed
    return {
        "train": (90, 150, 30, lambda: train(out, args.steps, inner)),
        "seqlock": (110, 60, 75, lambda: seqlock.part(out, device)),
        "sparse": (60, 90, 25, lambda: pushes.sparse(out, device)),
        "stream": (60, 90, 25, lambda: pushes.stream(out, device)),
        "ipc": (75, 120, 35, lambda: pushes.ipc(out, device)),
        "fsdp": (60, 90, 20, lambda: fsdp.part(out, device)),
        "one_gpu": (150, 120, 60, lambda: one_gpu_number(out, device, inner)),
        "memory": (60, 120, 20, lambda: memory(out, device)),
        "stall": (45, 90, 15, lambda: stall(out, device)),
        "profile": (60, 0, 20, lambda: profile(out, device)),
        # a GPU trainer with an embedded engine on the CPU: gloo from pinned staging (finding N12)
        "train_cpu_engine": (75, 0, 30, lambda: train(out, 10, inner, "--rollout.colocated", "false",
                                                      "--rollout.engine_devices", "cpu", prefix="cpu_engine_")),
        # the medium model (24M) in bf16, as GPU runs train: mixed precision and a bf16 wire
        "train_medium_bf16": (90, 0, 40, lambda: train(
            out, 20, inner, "--model.hf_assets_path", str(_medium(out)), "--training.mixed_precision_param",
            "bfloat16", "--weight_sync.wire_dtype", "bfloat16", "--training.seq_len", "64",
            prefix="medium_bf16_", learns=False)),
        "colocated": (100, 60, 40, lambda: colocated.part(out, device)),
        # train's run with the engine's decode steps replayed from CUDA graphs, pushes landing mid-generation (a
        # static weight copy at each swap, captures while the receiver thread copies staging): never run yet
        "train_graphs": (90, 0, 35, lambda: train(out, 20, inner, "--rollout.continuous_batching", "true",
                                                  "--rollout.decode_graphs", "true",
                                                  "--rollout.in_flight_weight_updates", "true", prefix="graphs_")),
        # the embedded engine's decode step (last: cut first; docs/gpu.md runs it first, with --only decode)
        "decode": (300, 90, 120, lambda: decode.part(out, device, inner)),
    }


def one_gpu_number(out: Path, device: torch.device, timeout: float) -> None:
    """Qwen3-0.6B's shape trained colocated (``gpu_checks/one_gpu.py``): 30 steps on a GPU, 4 on CPU."""
    from gpu_checks import one_gpu

    t0 = time.monotonic()
    model_dir = one_gpu.build_model_dir(out / "qwen3-0.6b-shape", device)
    timeout = max(30.0, timeout - (time.monotonic() - t0))  # writing 1.2 GB of weights comes out of the part's time
    train(out, 30 if device.type == "cuda" else 4, timeout, "--model.hf_assets_path", str(model_dir),
          "--training.mixed_precision_param", "bfloat16", "--weight_sync.wire_dtype", "bfloat16",
          "--optimizer.lr", "1e-5", "--weight_sync.probe_tolerance", "2.0", prefix="one_gpu_", learns=False)
    if RESULTS.get("one_gpu_train_rc") == 0:
        one_gpu.report_pushes(out / "one_gpu_run")


def _medium(out: Path) -> Path:
    from model_assets import build_model_dir

    return build_model_dir(out / "medium-llama", flavor="medium", seed=0)


def run_part(args) -> int:
    """``--part NAME``: one part in this process; exit 1 if one of its checks failed or it raised."""
    stop_children_on_signals()  # a signal unwinds the part too (its engines are closed on the way)
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    out = Path(args.out)
    t0 = time.monotonic()
    try:
        _parts(args, out, device)[args.part][3]()
    except Exception:  # noqa: BLE001 - reported as this part's failure
        traceback.print_exc()
        check(False, f"part {args.part} raised")
    print(f"# part {args.part}: {time.monotonic() - t0:.1f} s", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if FAILED else 0)  # no interpreter teardown: torch's C++ threads (gloo, NCCL, CUDA IPC) race it


# the parts that run GRPOTrainer (torchtitan's Trainer): they need a torch torchtitan 0.3.0 runs on
TRAINING_PARTS = ("train", "one_gpu", "train_cpu_engine", "train_medium_bf16", "train_graphs")
# torchtitan 0.3.0 was built against torch 2.15; its set_pg_timeouts calls torch.distributed.set_timeout (not in
# torch 2.13, in 2.15), and GRPOTrainer.train calls set_pg_timeouts before the first step
TORCHTITAN_IMPORT = ("from torchtitan_flux.patches import apply_patches; apply_patches(); "
                     "import torchtitan.trainer, torchtitan.models.llama3, torchtitan.models.qwen3")


def torch_for_torchtitan(cpu: bool) -> None:
    """Whether this torch runs torchtitan 0.3.0: ``torch_has_set_timeout``, and on a GPU ``torchtitan_import`` (ok,
    failed or timeout: torchtitan's trainer and model modules imported in a child process, about 20 s on 2 CPU cores,
    so not in the CPU twin). Each failure is one plain ``#`` line; neither fails the smoke (the parts that need them
    fail on their own, with their logs)."""
    has = hasattr(torch.distributed, "set_timeout")
    report("torch_has_set_timeout", int(has))
    if not has:
        print(f"# torch {torch.__version__} is too old for torchtitan 0.3.0 (built against torch 2.15): no "
              f"torch.distributed.set_timeout, which GRPOTrainer.train calls (torchtitan's set_pg_timeouts) before "
              f"the first step, so {', '.join(TRAINING_PARTS)} fail there", flush=True)
    if cpu:
        return
    try:
        proc = run_child([sys.executable, "-c", TORCHTITAN_IMPORT], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
        state, why = ("ok", "") if proc.returncode == 0 else ("failed", (_lines(proc.stderr) or ["no output"])[-1])
    except subprocess.TimeoutExpired:
        state, why = "timeout", "no import within 120 s"
    report("torchtitan_import", state)
    if state != "ok":
        print(f"# torchtitan 0.3.0 does not import on torch {torch.__version__}: {why}", flush=True)


def _lines(text: str) -> list[str]:
    return [line for line in (text or "").splitlines() if line.strip()]


def main() -> int:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="run on CPU (CI); the GPU-only parts are skipped")
    ap.add_argument("--out", default="", help="folder for logs and the trace (default: a temporary one)")
    ap.add_argument("--steps", type=count(), default=20)
    ap.add_argument("--budget", type=number(1.0), default=470.0,
                    help="seconds for all parts together (default 470: the GPU run fits in about 8 minutes)")
    ap.add_argument("--only", default="", help="comma-separated part names to run (default: all)")
    ap.add_argument("--part", default="", help=argparse_hidden())
    ap.add_argument("--limit", type=float, default=0.0, help=argparse_hidden())
    args = ap.parse_args()
    if args.part:
        return run_part(args)
    stop_children_on_signals()
    if not args.cpu and not torch.cuda.is_available():
        print("error: no GPU visible; run with --cpu for the CPU twin", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu_smoke_"))
    out.mkdir(parents=True, exist_ok=True)
    report("device", torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu")
    report("torch", torch.__version__)
    torch_for_torchtitan(args.cpu)
    table = _parts(args, out, device)
    only = [n for n in args.only.split(",") if n]
    unknown = [n for n in only if n not in table]
    if unknown:
        print(f"error: unknown parts {unknown}; allowed: {', '.join(table)}", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    for name, (gpu_s, cpu_s, least_s, _) in table.items():
        own = cpu_s if args.cpu else gpu_s
        if not own or (only and name not in only):
            continue
        left = args.budget - (time.monotonic() - t_start)
        if left < least_s:
            report(f"part_{name}", "not_run")
            continue
        limit = min(own, left)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--out", str(out), "--steps",
               str(args.steps), "--limit", str(limit)] + (["--cpu"] if args.cpu else [])
        t0 = time.monotonic()
        try:
            proc = run_child(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit, grace_s=5.0)
            stdout, stderr, state = proc.stdout, proc.stderr, "ok" if proc.returncode == 0 else "failed"
        except subprocess.TimeoutExpired as e:
            stdout, stderr = (x.decode(errors="replace") if isinstance(x, bytes) else x for x in (e.stdout, e.stderr))
            state = "timeout" if limit >= own else "not_run"
        (out / f"part_{name}.log").write_text((stdout or "") + "\n--- stderr ---\n" + (stderr or ""))
        for line in _lines(stdout):
            key, sep, value = line.partition("=")
            if sep and not line.startswith("#") and " " not in key:
                RESULTS[key] = value
            print(line, flush=True)
        if state != "ok":
            print("\n".join(_lines(stderr)[-40:]), flush=True)
        if state == "timeout":
            print(f"# part {name}: killed at its limit of {limit:.0f} s (log: {out / f'part_{name}.log'})", flush=True)
        report(f"part_{name}", state)
        check(state in ("ok", "not_run"), f"part {name} {state} ({time.monotonic() - t0:.0f} s)")
    report("smoke_s", round(time.monotonic() - t_start, 1))
    report("smoke_ok", int(not FAILED))
    if FAILED:
        print("failed: " + "; ".join(FAILED))
    return 0 if not FAILED else 1


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
