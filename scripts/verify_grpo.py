"""Blocking vs async weight push on one config, plus an FSDP + activation-checkpointing variant: after the final
sync every engine must hold the trainer's weights bitwise (sha256 over the pushed buckets, where the engine can
hash them). See verify_grpo_2gpu.sh for the device layout.

Every run is a child process under ``--timeout`` seconds (killed, and reported, past it). Output: a table, then
``key=value`` lines: per run ``<run>_checksum=`` / ``<run>_checksums_equal=`` and the sync time split
``<run>_sync_pause_s=`` (main thread blocked per step) / ``<run>_sync_transfer_s=`` (push, per step) /
``<run>_snapshot_s=``; then ``async_speedup=`` and ``checksums_equal=`` (all runs). ``checksums_equal=1`` means
every engine's sha256 equals the trainer's, nothing else; an engine that keeps no hash (vLLM/SGLang on GPU) but
passed the post-sync logprob probe on the final version is ``<run>_verified_by_probe=1`` (the run passes, the
checksums are not "equal"). The probe itself is printed as ``<run>_logprob_probe=`` when the summary carries one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from common import ArgumentParser, count, free_port, run_child  # noqa: E402


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch here: CPU
        return 0


def plan(args) -> list[tuple[str, int, list[str]]]:
    """(name, trainer processes, overrides) of each run."""
    sync = ["--weight_sync.async_weight_update", "false"]
    asyn = ["--weight_sync.async_weight_update", "true", "--off_policy.async_ratio", "1"]
    ac = ["--activation_checkpoint.mode", "selective", *asyn]
    if args.cpu:
        return [("sync", 1, sync), ("async", 1, asyn), ("fsdp_ac", 2, ac)]
    if args.engine == "vllm":  # trainer on GPU 0, a vLLM server launched on GPU 1 (CUDA_VISIBLE_DEVICES)
        engine = ["--rollout.engine", "vllm", "--rollout.launch", "true", "--rollout.engine_devices", "cuda:1",
                  "--rollout.launch_timeout_s", str(min(600, args.timeout // 2))]
    else:
        engine = ["--rollout.engine", "embedded", "--rollout.engine_devices", "cuda:1"]
    runs = [("sync", 1, [*engine, *sync]), ("async", 1, [*engine, *asyn])]
    if gpu_count() >= 3:  # FSDP over GPUs 0-1, engine on GPU 2, bf16 compute
        fsdp_engine = [e if e != "cuda:1" else "cuda:2" for e in engine]
        runs.append(("fsdp_ac", 2, [*fsdp_engine, *ac, "--training.mixed_precision_param", "bfloat16"]))
    return runs


def run(name: str, nproc: int, overrides: list[str], out: str, args) -> dict | None:
    env = dict(os.environ)
    if not args.cpu:
        env.setdefault("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(max(2, gpu_count()))))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "-m", "torchtitan_flux.train", "--job.config_file", os.path.join(ROOT, "train_configs/debug_cpu.toml"),
        "--job.dump_folder", out, "--training.steps", str(args.steps), *overrides, *args.extra,
    ]
    try:
        proc = run_child(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as e:  # run_child stopped the child and its process group
        sys.stderr.write(str(e.stdout or "")[-2000:] + str(e.stderr or "")[-4000:])
        print(f"verify: the {name} run did not finish within {args.timeout} s (killed)", file=sys.stderr)
        return None
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        print(f"verify: the {name} run failed (exit {proc.returncode})", file=sys.stderr)
        return None
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        summary["rows"] = [json.loads(line) for line in f]
    return summary


def main() -> int:
    ap = ArgumentParser(description=__doc__)
    ap.add_argument("--cpu", action="store_true", help="run on CPU with gloo (embedded engine) instead of GPUs")
    ap.add_argument("--engine", choices=("vllm", "embedded"), default="vllm",
                    help="GPU only: the rollout engine on GPU 1 (default: a vLLM server launched there)")
    ap.add_argument("--steps", type=count(), default=12)
    ap.add_argument("--timeout", type=count(), default=900, help="seconds per run before it is killed")
    ap.add_argument("extra", nargs="*", help="extra --section.field value overrides for every run")
    args = ap.parse_args()
    gpus = 0 if args.cpu else gpu_count()
    if not args.cpu and gpus < 2:  # before anything that would fail for want of a GPU (the vLLM venv, CUDA)
        print(f"verify: error: {'no GPU is' if gpus == 0 else 'only 1 GPU is'} visible (this check needs 2: trainer "
              "on GPU 0, engine on GPU 1); --cpu runs the CPU mode", file=sys.stderr)
        return 2
    results: dict[str, dict | None] = {}
    with tempfile.TemporaryDirectory(prefix="flux_verify_") as tmp:
        for name, nproc, overrides in plan(args):
            results[name] = run(name, nproc, overrides, os.path.join(tmp, name), args)
    ok, table, lines = report_lines(results)
    for line in table + lines:
        print(line)
    return 0 if ok else 1


def checksums_equal(s: dict) -> bool:
    """Every engine's sha256 of its final weights equals the trainer's, at the final version (and there is at
    least one engine). Nothing else counts: a passed logprob probe is reported as ``<run>_verified_by_probe``,
    never as equal checksums."""
    engines = s.get("engines") or {}
    return bool(engines) and s.get("trainer_checksum") is not None and all(
        e.get("checksum") == s["trainer_checksum"] and e.get("version") == s["final_version"]
        for e in engines.values())


def report_lines(results: dict[str, dict | None]) -> tuple[bool, list[str], list[str]]:
    """(every run passed, the table, the ``key=value`` lines) for the runs' summaries (None: the run failed).
    A run passes when every engine holds the final version, verified: by equal checksums, or, where the engine
    keeps no hash (vLLM/SGLang on GPU), by the post-sync logprob probe on it; ``checksums_equal`` says only the
    former."""
    ok, all_equal, lines = True, True, []
    table = [f"{'run':<8} {'steps/s':>8} {'pause s/step':>13} {'push s/step':>12} {'final ver':>9} {'checksums':>10}"]
    for name, s in results.items():
        if s is None:
            ok = all_equal = False
            table.append(f"{name:<8} {'FAILED':>8}")
            lines.append(f"{name}_checksums_equal=0")
            continue
        rows = s["rows"][2:] or s["rows"]  # skip warm-up steps
        pause = sum(r["weight_sync_s"] for r in rows) / len(rows)
        push = sum(r["weight_push_s"] for r in rows) / len(rows)
        snap = sum(r.get("weight_snapshot_s", 0.0) for r in rows) / len(rows)
        equal = checksums_equal(s)
        by_probe = not equal and s["all_engines_verified"] and s["final_engine_version"] == s["final_version"]
        ok &= equal or by_probe
        all_equal &= equal
        verdict = "equal" if equal else "probe only" if by_probe else "MISMATCH"
        table.append(f"{name:<8} {s['steps_per_s']:>8.2f} {pause:>13.4f} {push:>12.4f} {s['final_version']:>9} "
                     f"{verdict:>10}")
        lines += [f"{name}_checksum={s.get('trainer_checksum')}", f"{name}_checksums_equal={int(equal)}",
                  f"{name}_verified_by_probe={int(by_probe)}", f"{name}_sync_pause_s={pause:.4f}",
                  f"{name}_sync_transfer_s={push:.4f}", f"{name}_snapshot_s={snap:.4f}"]
        if "logprob_probe" in s:
            lines.append(f"{name}_logprob_probe={json.dumps(s['logprob_probe'])}")
    if results.get("sync") and results.get("async"):
        lines.append(f"async_speedup={results['async']['steps_per_s'] / results['sync']['steps_per_s']:.3f}")
    lines.append(f"checksums_equal={int(all_equal)}")
    return ok, table, lines


if __name__ == "__main__":
    sys.exit(main())
