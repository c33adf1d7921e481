"""The adaptive controller against fixed staleness bounds and sync mode, same config and loss, in one run.

Modes (each for ``--seeds`` rollout seeds, interleaved):
  sync        weight_sync.async_weight_update = false (on-policy)
  fixed-gN    async, async_ratio 1, adaptive_async.max_version_gap = N  (N in --gaps)
  adaptive    async, controller on (config defaults), max_version_gap = --adaptive-gap, target --target
  NAME        the same with extra overrides, for each --variant NAME=OVERRIDES (e.g. another ema_alpha)

Reports per mode: median steps/s, final reward (mean of the last 10 steps), mean version gap; for adaptive,
the fraction of post-warmup steps whose EMA staleness is within +-0.05 of the target. Key=value lines:
``in_band_fraction``, ``throughput_vs_full_async`` (adaptive / fixed with the same max gap),
``adaptive_final_reward``, ``sync_final_reward_min``, ``sync_final_reward_max``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, run_training  # noqa: E402


def final_reward(rows: list[dict]) -> float:
    return statistics.mean(r["reward_mean"] for r in rows[-10:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--gaps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--adaptive-gap", type=int, default=4)
    ap.add_argument("--target", type=float, default=0.15)
    ap.add_argument("--warmup", type=int, default=10, help="controller warmup steps (excluded from the band check)")
    ap.add_argument("--out", default=os.path.join(ROOT, "outputs", "bench_controller"))
    ap.add_argument("--plot", default="", help="write the first adaptive run's controller plot here")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=OVERRIDES",
                    help='another adaptive mode: e.g. "fast-ema=--adaptive_async.ema_alpha 0.3" (repeatable)')
    ap.add_argument("extra", nargs="*", help="--section.field value overrides for every run")
    args = ap.parse_args()

    modes: dict[str, list[str]] = {"sync": ["--weight_sync.async_weight_update", "false"]}
    for g in args.gaps:
        modes[f"fixed-g{g}"] = ["--weight_sync.async_weight_update", "true", "--adaptive_async.max_version_gap", str(g)]
    modes["adaptive"] = [
        "--weight_sync.async_weight_update", "true", "--adaptive_async.enabled", "true",
        "--adaptive_async.max_version_gap", str(args.adaptive_gap), "--adaptive_async.target_staleness",
        str(args.target), "--adaptive_async.phase_schedule.warmup.steps", str(args.warmup),
    ]
    adaptive_modes = ["adaptive"]
    for v in args.variant:
        name, _, overrides = v.partition("=")
        modes[name] = modes["adaptive"] + overrides.split()
        adaptive_modes.append(name)
    results: dict[str, list[tuple[list[dict], dict]]] = {m: [] for m in modes}
    for seed in range(args.seeds):
        for mode, overrides in modes.items():
            out = os.path.join(args.out, mode, f"seed{seed}")
            shutil.rmtree(out, ignore_errors=True)  # metrics.jsonl appends
            results[mode].append(run_training(out, "--training.steps", str(args.steps), "--rollout.seed",
                                              str(seed), *overrides, *args.extra))

    print(f"machine: {platform.machine()} {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}; "
          f"{args.seeds} seeds x {args.steps} steps")
    print(f"{'mode':<11} {'steps/s':>8} {'final reward (per seed)':>30} {'gap':>5} {'in band':>8}")
    sps, fin, band = {}, {}, {}
    for mode, runs in results.items():
        sps[mode] = statistics.median(s["steps_per_s"] for _, s in runs)
        fin[mode] = [final_reward(rows) for rows, _ in runs]
        gap = statistics.mean(r["version_gap_mean"] for rows, _ in runs for r in rows)
        inb = ""
        if mode in adaptive_modes:
            post = [r for rows, _ in runs for r in rows if r["step"] > args.warmup]
            band[mode] = sum(abs(r["staleness"] - r["target_staleness"]) <= 0.05 for r in post) / len(post)
            inb = f"{band[mode]:.2f}"
        per_seed = " ".join(f"{x:.3f}" for x in fin[mode])
        print(f"{mode:<11} {sps[mode]:>8.2f} {per_seed:>30} {gap:>5.2f} {inb:>8}")
    full = f"fixed-g{args.adaptive_gap}"
    if args.plot:
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plot_controller.py"),
                        os.path.join(args.out, "adaptive", "seed0"), "-o", args.plot], check=True)
    if full in sps:
        for mode in adaptive_modes[1:]:
            print(f"{mode}: in band {band[mode]:.3f}, throughput vs full async {sps[mode] / sps[full]:.3f}")
    print(f"in_band_fraction={band['adaptive']:.3f}")
    if full in sps:
        print(f"throughput_vs_full_async={sps['adaptive'] / sps[full]:.3f}")
    print(f"adaptive_final_reward={statistics.mean(fin['adaptive']):.3f}")
    print(f"sync_final_reward_min={min(fin['sync']):.3f}")
    print(f"sync_final_reward_max={max(fin['sync']):.3f}")


if __name__ == "__main__":
    main()
