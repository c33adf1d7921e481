"""Sync vs async weight push on one config; checksum equality after the final sync. See verify_grpo_2gpu.sh."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(mode: str, out: str, steps: int, cpu: bool, extra: list[str]) -> dict:
    env = dict(os.environ)
    if not cpu:
        env.setdefault("CUDA_VISIBLE_DEVICES", "0,1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--standalone",
        "-m", "torchtitan_flux.train", "--job.config_file", os.path.join(ROOT, "train_configs/debug_cpu.toml"),
        "--job.dump_folder", out, "--training.steps", str(steps),
        "--weight_sync.async_weight_update", "true" if mode == "async" else "false",
        *([] if cpu else ["--rollout.engine_device", "cuda:1"]),
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"verify: the {mode} run failed (exit {proc.returncode})")
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    summary["rows"] = rows
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cpu", action="store_true", help="run on CPU with gloo instead of 2 GPUs with NCCL")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("extra", nargs="*", help="extra --section.field value overrides for both runs")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="flux_verify_") as tmp:
        for mode in ("sync", "async"):
            results[mode] = run(mode, os.path.join(tmp, mode), args.steps, args.cpu, args.extra)
    ok = True
    print(f"{'mode':<6} {'steps/s':>8} {'sync s/step':>12} {'blocked s/step':>15} {'final ver':>9} {'checksums':>10}")
    for mode, s in results.items():
        rows = s["rows"][2:] or s["rows"]  # skip warm-up steps
        sync = sum(r["weight_push_s"] for r in rows) / len(rows)
        blocked = sum(r["weight_sync_s"] for r in rows) / len(rows)
        match = s["checksums_match"] and s["final_engine_version"] == s["final_version"]
        ok &= match
        print(f"{mode:<6} {s['steps_per_s']:>8.2f} {sync:>12.4f} {blocked:>15.4f} {s['final_version']:>9} "
              f"{'equal' if match else 'MISMATCH':>10}")
    speedup = results["async"]["steps_per_s"] / results["sync"]["steps_per_s"]
    print(f"async_speedup={speedup:.3f}")
    print(f"checksums_equal={int(ok)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
