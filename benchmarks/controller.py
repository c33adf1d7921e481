"""The adaptive controller against fixed staleness bounds and sync mode, same config and loss, in one run.

Modes (each for ``--seeds`` rollout seeds, interleaved):
  sync        weight_sync.async_weight_update = false (on-policy)
  fixed-gN    async, async_ratio 1, off_policy.max_version_gap = N  (N in --gaps)
  adaptive    async, controller on (config defaults), max_version_gap = --adaptive-gap, target --target
  NAME        the same with extra overrides, for each --variant NAME=OVERRIDES (e.g. another ema_alpha)

Reports per mode: median steps/s, final reward (mean of the last 10 steps), mean version gap, median time to
the target reward (wall clock from the start of step 1 until the mean reward of the last 5 steps first reaches
``--reward-target``, read from the rows' ``time``) and the steps it took; for adaptive, the fraction of
post-warmup steps whose EMA staleness is within +-0.05 of the target. Key=value lines: ``in_band_fraction``,
``throughput_vs_full_async`` (adaptive / fixed with the same max gap), ``adaptive_final_reward``,
``sync_final_reward_min``, ``sync_final_reward_max``, ``adaptive_vs_best_fixed_time_to_target`` (the best fixed
gap's median time to target / adaptive's: > 1 means adaptive is sooner), ``adaptive_vs_sync_time_to_target``,
``adaptive_final_reward_in_sync_spread`` (1 when every adaptive seed's final reward lies in sync's range).

``--workload sensitive`` is the staleness-sensitive setting found on 2026-11-24 (docs/controller.md): the digits
task at learning rate 1e-2, where a stale policy needs twice the steps to the target (gap 8: ~27 steps, sync:
~12), fixed gaps 1 2 4 8 and the controller with max gap 8 and ``off_policy.feedforward`` on (lookahead capped
at the measured pipeline depth). Compare with ``--variant "no-ff=--off_policy.feedforward false"`` (the
controller alone) and ``--variant "ff-discount=--grpo.staleness_discount 1"`` (the step of each sample scaled by
1 / (1 + its version gap), the seeds' staleness-adaptive learning rate).
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


WORKLOADS = {  # name -> (overrides for every run, defaults of --gaps and --adaptive-gap, adaptive's own overrides)
    "debug": ([], [1, 2, 4], 4, []),
    "sensitive": (["--optimizer.lr", "1e-2"], [1, 2, 4, 8], 8, ["--off_policy.feedforward", "true"]),
}


def final_reward(rows: list[dict]) -> float:
    return statistics.mean(r["reward_mean"] for r in rows[-10:])


def time_to_target(rows: list[dict], target: float, window: int = 5) -> tuple[float, int]:
    """(seconds from the start of step 1, step) when the mean reward of the last ``window`` steps first reaches
    ``target``; (inf, 0) if it never does."""
    start = rows[0]["time"] - rows[0]["step_time_s"]
    for i in range(len(rows)):
        recent = rows[max(0, i - window + 1) : i + 1]
        if statistics.mean(r["reward_mean"] for r in recent) >= target:
            return rows[i]["time"] - start, rows[i]["step"]
    return float("inf"), 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="debug")
    ap.add_argument("--gaps", type=int, nargs="+", default=None, help="default: the workload's")
    ap.add_argument("--adaptive-gap", type=int, default=None, help="default: the workload's")
    ap.add_argument("--reward-target", type=float, default=0.8)
    ap.add_argument("--target", type=float, default=0.15)
    ap.add_argument("--warmup", type=int, default=10, help="controller warmup steps (excluded from the band check)")
    ap.add_argument("--out", default=os.path.join(ROOT, "outputs", "bench_controller"))
    ap.add_argument("--plot", default="", help="write the first adaptive run's controller plot here")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=OVERRIDES",
                    help='another adaptive mode: e.g. "fast-ema=--adaptive_async.ema_alpha 0.3" (repeatable)')
    ap.add_argument("--quick", action="store_true", help="smoke run for CI (the cheapest that exercises every code path; its figures are no measurement)")
    ap.add_argument("extra", nargs="*", help="--section.field value overrides for every run")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.seeds, args.warmup = 12, 1, 4
    workload, default_gaps, default_gap, adaptive_overrides = WORKLOADS[args.workload]
    args.gaps = args.gaps or default_gaps
    args.adaptive_gap = args.adaptive_gap or default_gap
    args.extra = [*workload, *args.extra]

    modes: dict[str, list[str]] = {"sync": ["--weight_sync.async_weight_update", "false"]}
    for g in args.gaps:
        modes[f"fixed-g{g}"] = ["--weight_sync.async_weight_update", "true", "--off_policy.async_ratio", "1",
                              "--off_policy.max_version_gap", str(g)]
    modes["adaptive"] = [
        "--weight_sync.async_weight_update", "true", "--adaptive_async.enabled", "true",
        "--off_policy.max_version_gap", str(args.adaptive_gap), "--adaptive_async.target_staleness",
        str(args.target), "--adaptive_async.phase_schedule.warmup.steps", str(args.warmup), *adaptive_overrides,
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
          f"{args.seeds} seeds x {args.steps} steps; workload {args.workload}; reward target {args.reward_target}")
    print(f"{'mode':<11} {'steps/s':>8} {'final reward (per seed)':>30} {'gap':>5} {'in band':>8} "
          f"{'to target s (per seed)':>34} {'steps':>6}")
    sps, fin, band, ttt = {}, {}, {}, {}
    for mode, runs in results.items():
        sps[mode] = statistics.median(s["steps_per_s"] for _, s in runs)
        fin[mode] = [final_reward(rows) for rows, _ in runs]
        hits = [time_to_target(rows, args.reward_target) for rows, _ in runs]
        ttt[mode] = statistics.median(t for t, _ in hits)
        gap = statistics.mean(r["version_gap_mean"] for rows, _ in runs for r in rows)
        inb = ""
        if mode in adaptive_modes:
            post = [r for rows, _ in runs for r in rows if r["step"] > args.warmup]
            band[mode] = sum(abs(r["staleness"] - r["target_staleness"]) <= 0.05 for r in post) / len(post)
            inb = f"{band[mode]:.2f}"
        per_seed = " ".join(f"{x:.3f}" for x in fin[mode])
        times = " ".join(f"{t:.2f}" for t, _ in hits)
        steps = statistics.median(n for _, n in hits)
        print(f"{mode:<11} {sps[mode]:>8.2f} {per_seed:>30} {gap:>5.2f} {inb:>8} {times:>34} {steps:>6.0f}")
    full = f"fixed-g{args.adaptive_gap}"
    if args.plot:
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plot_controller.py"),
                        os.path.join(args.out, "adaptive", "seed0"), "-o", args.plot], check=True)
    fixed = {m: t for m, t in ttt.items() if m.startswith("fixed-g")}
    best = min(fixed, key=fixed.get)
    for mode in adaptive_modes[1:]:
        vs_full = f", throughput vs full async {sps[mode] / sps[full]:.3f}" if full in sps else ""
        print(f"{mode}: in band {band[mode]:.3f}{vs_full}, vs best fixed time to target "
              f"{fixed[best] / ttt[mode]:.3f}, vs sync {ttt['sync'] / ttt[mode]:.3f}")
    print(f"in_band_fraction={band['adaptive']:.3f}")
    if full in sps:
        print(f"throughput_vs_full_async={sps['adaptive'] / sps[full]:.3f}")
    print(f"adaptive_final_reward={statistics.mean(fin['adaptive']):.3f}")
    print(f"sync_final_reward_min={min(fin['sync']):.3f}")
    print(f"sync_final_reward_max={max(fin['sync']):.3f}")
    print(f"best_fixed={best}")
    print(f"adaptive_vs_best_fixed_time_to_target={fixed[best] / ttt['adaptive']:.3f}")
    print(f"adaptive_vs_sync_time_to_target={ttt['sync'] / ttt['adaptive']:.3f}")
    in_spread = all(min(fin["sync"]) <= x <= max(fin["sync"]) for x in fin["adaptive"])
    print(f"adaptive_final_reward_in_sync_spread={int(in_spread)}")


if __name__ == "__main__":
    main()
