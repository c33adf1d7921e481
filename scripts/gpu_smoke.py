"""What a first run on a GPU machine executes (``scripts/gpu_smoke.sh``), and its CPU twin (``--cpu``, run by CI).

Three parts, each under its own time limit, each printing what it measured even when another part fails:

1. training: ``torchrun`` 20 GRPO steps of the debug config on the device, with colocated embedded engines
   (``rollout.colocated``: on one GPU the engine shares it), async weight updates and selective activation
   checkpointing; prints ``checksums_equal`` (every engine's final sha256 equals the trainer's), ``reward_gain``
   (mean reward of the last 5 steps minus the first 5) and ``push_overlap_fraction`` (1 - the main thread's
   waits on weight sync beyond the snapshot / the push thread's time);
2. components, in this process, rank 0's real ``Rollouts`` on the device with two colocated engines:
   ``sync_peak_bytes_<flavor>`` <= ``sync_budget_bytes_<flavor>`` (``sync.memory.SyncMemory``) for two models 80x
   apart, and on GPU ``allocator_peak_bytes_<flavor>`` (the CUDA allocator's peak growth over one snapshot and
   push: what the ledger must bound); ``stalled_engine_cut`` (one engine stalls past the deadline: the push ends
   at it, the other engine is in sync, the next push goes on);
3. GPU only: ``cpu_engine_*``: the training of part 1 (10 steps) with the engine on the CPU, over gloo from
   pinned staging; ``medium_bf16_*``: 20 steps of the 24M-parameter model with bf16 mixed precision and a bf16
   wire (checksums only: its learning rate is the tiny model's); ``default_stream_sync_kernels`` (from the PyTorch profiler: kernels and copies launched inside the
   snapshot that ran on the default stream; must be 0) and ``sync_kernels`` (how many ran in all: not 0).
The last line is ``smoke_ok=1`` when every check held. Simplification: one device, rank 0 only (FSDP and NCCL
between GPUs are ``scripts/verify_grpo_2gpu.sh``'s).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # model_assets; the package itself is installed (gpu_smoke.sh)
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import ArgumentParser, count, free_port, run_child, stop_children_on_signals  # noqa: E402

import torch  # noqa: E402

RESULTS: dict[str, object] = {}
FAILED: list[str] = []


def report(key: str, value) -> None:
    RESULTS[key] = value
    print(f"{key}={value}", flush=True)


def check(ok: bool, what: str) -> None:
    if not ok:
        FAILED.append(what)
        print(f"CHECK FAILED: {what}", flush=True)


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


def rollouts(model_dir: Path, device: torch.device, *, num_engines: int, timeout_s: float, async_mode: bool):
    """Rank 0's real rollout side on ``device`` with colocated engines, as the trainer builds it."""
    from torchtitan_flux.config import OffPolicy, Rollout, WeightSync
    from torchtitan_flux.data.tasks import DigitsTask
    from torchtitan_flux.models import families, hf_weights
    from torchtitan_flux.rollout.rollouts import Rollouts

    args = families.args_from_hf_dir(model_dir)  # the trainer's model: torchtitan names, pushed as HF's
    model = (families.FluxQwenModel if isinstance(args, families.Qwen3ModelArgs) else families.FluxLlamaModel)(args)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    hf_weights.load_hf_weights(model, model_dir, args)
    model.to(device)
    jc = SimpleNamespace(
        rollout=Rollout(num_engines=num_engines, engine_threads=1, colocated=True, prompts_per_step=2, max_new_tokens=8),
        grpo=SimpleNamespace(group_size=2, temperature=1.0),
        weight_sync=WeightSync(async_weight_update=async_mode, timeout_seconds=timeout_s, bucket_size_mb=1.0,
                               master_port=0, wire_dtype="bfloat16"),
        off_policy=OffPolicy(max_version_gap=1), model=SimpleNamespace(hf_assets_path=str(model_dir)),
        job=SimpleNamespace(dump_folder=""), training=SimpleNamespace(steps=0),
    )
    # no generation here, so no tokenizer
    r = Rollouts(jc, DigitsTask(), SimpleNamespace(), model, device=device, stops=SimpleNamespace(signal=None))
    for e in r.engines:
        e.checksum(timeout=120)  # serving its pipe
    r.syncer.connect()
    return r, model


@torch.no_grad()
def perturb(model, seed: int) -> None:
    g = torch.Generator(device="cpu").manual_seed(seed)
    for p in model.parameters():
        p.add_((torch.randn(p.shape, generator=g) * 0.01).to(p.device))


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
        perturb(model, 1)
        t0 = time.monotonic()
        s.after_optimizer_step(1)
        took = time.monotonic() - t0
        ok, stalled = s.links
        was_cut = stalled.lagging and ok.acked == 1
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


def main() -> int:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="run on CPU (CI); the profiler part is skipped")
    ap.add_argument("--out", default="", help="folder for logs and the trace (default: a temporary one)")
    ap.add_argument("--steps", type=count(), default=20)
    args = ap.parse_args()
    stop_children_on_signals()  # a signal unwinds the in-process parts too (their engines are closed on the way)
    if not args.cpu and not torch.cuda.is_available():
        print("error: no GPU visible; run with --cpu for the CPU twin", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu_smoke_"))
    out.mkdir(parents=True, exist_ok=True)
    report("device", torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu")
    report("torch", torch.__version__)
    parts = [("train", lambda: train(out, args.steps, 240)), ("memory", lambda: memory(out, device)),
             ("stall", lambda: stall(out, device))]
    if device.type == "cuda":
        parts.append(("profile", lambda: profile(out, device)))
        # a GPU trainer with an embedded engine on the CPU: gloo from pinned staging (finding N12)
        parts.append(("train_cpu_engine", lambda: train(out, 10, 180, "--rollout.colocated", "false",
                                                        "--rollout.engine_devices", "cpu", prefix="cpu_engine_")))
        # the medium model (24M) in bf16, as GPU runs train: mixed precision and a bf16 wire (built by "memory")
        parts.append(("train_medium_bf16", lambda: train(
            out, 20, 240, "--model.hf_assets_path", str(out / "medium-llama"), "--training.mixed_precision_param",
            "bfloat16", "--weight_sync.wire_dtype", "bfloat16", "--training.seq_len", "64",
            prefix="medium_bf16_", learns=False)))
    for name, part in parts:
        t0 = time.monotonic()
        try:
            part()
        except Exception:  # noqa: BLE001 - every part reports, whatever the others do
            traceback.print_exc()
            check(False, f"part {name} raised")
        print(f"# part {name}: {time.monotonic() - t0:.1f} s", flush=True)
    report("smoke_ok", int(not FAILED))
    if FAILED:
        print("failed: " + "; ".join(FAILED))
    return 0 if not FAILED else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
