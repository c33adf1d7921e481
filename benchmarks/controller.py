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
``adaptive_final_reward_in_sync_spread`` (1 when every adaptive seed's final reward lies in sync's range or above
it: a final reward above every sync seed's is no loss), and ``pair_efficiency`` (``benchmarks/common.py``: what the
machine allows two processes side by side, measured before the runs; a WARNING line below 0.8, where the async
modes cannot show their overlap).

``--workload sensitive`` is the staleness-sensitive setting found on 2026-11-24 (docs/controller.md): the digits
task at learning rate 1e-2, where a stale policy needs twice the steps to the target (gap 8: ~27 steps, sync:
~12), fixed gaps 1 2 4 8 and the controller with max gap 8 and ``off_policy.feedforward`` on (lookahead capped
at the measured pipeline depth). Compare with ``--variant "no-ff=--off_policy.feedforward false"`` (the
controller alone) and ``--variant "ff-discount=--grpo.staleness_discount 1"`` (the step of each sample scaled by
1 / (1 + its version gap), the seeds' staleness-adaptive learning rate).

``--workload growing`` and ``--workload shifting`` are non-stationary (fixed before any measurement):
the length curriculum of ``examples/length_curriculum.py`` at the sensitive learning rate, phases of 16, 48 and
128 new tokens (``shifting``: 128, 48, 16), each ending when the mean reward of its last 5 steps reaches 0.8 (cap
200 steps); the run ends with the last phase (``Task.finished``), so time to target is the wall clock from the
start of step 1 to the end of the last phase. The fixed gaps include 0 (sync); the per-phase oracle takes, for
each phase, the fixed mode with the smallest median phase time, summed over the phases (same seeds). Extra lines:
a per-phase table, ``adaptive_vs_phase_oracle_time_to_target`` (oracle / adaptive), and ``--plot`` draws seed 0's
reward against wall clock (sync, the best fixed, the oracle's and adaptive) and adaptive's lookahead against the
oracle's gap.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (ROOT, ArgumentParser, count, number, pair_efficiency, pair_lines, run_child,  # noqa: E402
                    run_training)


@dataclass(frozen=True)
class Workload:
    overrides: list[str]  # for every run
    gaps: list[int]  # default of --gaps
    adaptive_gap: int  # default of --adaptive-gap
    adaptive: list[str]  # adaptive's own overrides
    steps: int = 60  # default of --steps
    curriculum: bool = False  # examples/length_curriculum.py: the run ends with its last phase


_CURRICULUM = ["--optimizer.lr", "1e-2", "--rollout.max_new_tokens", "128", "--training.seq_len", "144"]
WORKLOADS = {
    "debug": Workload([], [1, 2, 4], 4, []),
    "sensitive": Workload(["--optimizer.lr", "1e-2"], [1, 2, 4, 8], 8, ["--off_policy.feedforward", "true"]),
    # the curriculum ends the run (Task.finished); 620 steps: every phase at its cap (200), plus the steps in
    # flight at each change (at most the largest gap, 8), which count for no phase
    "growing": Workload([*_CURRICULUM, "--rollout.task", "examples.length_curriculum:growing"], [1, 2, 4, 8], 8,
                        ["--off_policy.feedforward", "true"], steps=620, curriculum=True),
    "shifting": Workload([*_CURRICULUM, "--rollout.task", "examples.length_curriculum:shifting"], [1, 2, 4, 8], 8,
                         ["--off_policy.feedforward", "true"], steps=620, curriculum=True),
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


def phase_ends(rows: list[dict], run_dir: str) -> list[tuple[float, int]]:
    """A curriculum run's (seconds from the start of step 1, step) at the end of each phase (``curriculum.jsonl``);
    a phase that never ended is (inf, 0)."""
    start, at = rows[0]["time"] - rows[0]["step_time_s"], {r["step"]: r["time"] for r in rows}
    path = os.path.join(run_dir, "curriculum.jsonl")
    ends = [json.loads(x) for x in open(path)] if os.path.exists(path) else []
    out = [(at[e["end_step"]] - start, e["end_step"]) for e in ends if e["end_step"] in at]
    return out + [(float("inf"), 0)] * (3 - len(out))


def phase_spans(ends: list[tuple[float, int]]) -> list[tuple[float, float]]:
    """(seconds, steps) of each phase from one run's ``phase_ends``; a phase that (or whose predecessor) never
    ended is (inf, inf)."""
    out, (t0, s0) = [], (0.0, 0)
    for t, s in ends:
        out.append((t - t0, float(s - s0)) if math.isfinite(t) else (math.inf, math.inf))
        t0, s0 = t, s
    return out


def phase_oracle(ends: dict[str, list[list[tuple[float, int]]]]) -> tuple[float, list[str]]:
    """The per-phase oracle: for each phase, the fixed mode (sync included) with the smallest median phase time
    (over seeds); returns the sum of those medians and the chosen modes. ``ends``: mode -> per seed ``phase_ends``."""
    total, chosen = 0.0, []
    for k in range(3):
        med = {m: statistics.median(phase_spans(e)[k][0] for e in runs) for m, runs in ends.items()}
        best = min(med, key=med.get)
        total += med[best]
        chosen.append(best)
    return total, chosen


def lookahead(row: dict, max_gap: int) -> float:
    """The lookahead the adaptive run admitted after a step: ``async_ratio * max_version_gap``, capped at the
    feedforward's ``pipeline_depth`` (logged when it is on)."""
    return min(row["async_ratio"] * max_gap, row.get("pipeline_depth", math.inf))


def plot_curriculum(path: str, title: str, runs: dict[str, tuple[list[dict], list[tuple[float, int]]]],
                    oracle: list[int], max_gap: int) -> None:
    """Seed 0 of ``runs`` (mode -> (rows, phase_ends)): reward against wall clock with each run's phase ends, and
    the adaptive run's lookahead and trained version gap against the per-phase oracle's gap (``oracle``: one gap
    per phase, drawn over the adaptive run's own phases)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for mode, (rows, ends) in runs.items():
        start = rows[0]["time"] - rows[0]["step_time_s"]
        t = [r["time"] - start for r in rows]
        line, = top.plot(t, [r["reward_mean"] for r in rows], label=mode, lw=1.6 if mode == "adaptive" else 1.0)
        for end, _ in ends:
            top.axvline(end, color=line.get_color(), ls=":", lw=0.8)
    top.set_ylabel("reward (step mean)")
    top.set_title(title)
    top.legend(fontsize=8, loc="lower right")
    rows, ends = runs["adaptive"]
    start = rows[0]["time"] - rows[0]["step_time_s"]
    t = [r["time"] - start for r in rows]
    bottom.step(t, [lookahead(r, max_gap) for r in rows], where="post", label="adaptive: admitted lookahead")
    bottom.plot(t, [r["version_gap_mean"] for r in rows], ".", ms=3, label="adaptive: trained batch's mean gap")
    edges = [0.0] + [e for e, _ in ends]
    for k, g in enumerate(oracle):
        bottom.hlines(g, edges[k], edges[k + 1], colors="k", linestyles="--", lw=1.2,
                      label="per-phase oracle's gap" if k == 0 else None)
    bottom.set_xlabel("wall clock from the start of step 1 (s)")
    bottom.set_ylabel("steps / versions")
    bottom.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def variant(text: str) -> str:
    """An argparse type: ``NAME=OVERRIDES`` with a name."""
    if "=" not in text or not text.partition("=")[0].strip():
        raise argparse.ArgumentTypeError(
            f"got {text!r}; allowed: NAME=OVERRIDES, e.g. \"fast-ema=--adaptive_async.ema_alpha 0.3\"")
    return text


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=count(), default=None, help="default: the workload's")
    ap.add_argument("--seeds", type=count(), default=3)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="debug")
    ap.add_argument("--gaps", type=count(), nargs="+", default=None, help="default: the workload's")
    ap.add_argument("--adaptive-gap", type=count(), default=None, help="default: the workload's")
    ap.add_argument("--reward-target", type=number(), default=0.8)
    ap.add_argument("--target", type=number(), default=0.15)
    ap.add_argument("--warmup", type=count(0), default=10,
                    help="controller warmup steps (excluded from the band check; fewer than --steps)")
    ap.add_argument("--out", default=os.path.join(ROOT, "outputs", "bench_controller"))
    ap.add_argument("--plot", default="", help="write the first adaptive run's controller plot here")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=OVERRIDES",
                    type=variant,
                    help='another adaptive mode: e.g. "fast-ema=--adaptive_async.ema_alpha 0.3" (repeatable)')
    ap.add_argument("--quick", action="store_true", help="smoke run for CI (the cheapest that exercises every code path; its figures are no measurement)")
    ap.add_argument("extra", nargs="*", help="--section.field value overrides for every run")
    args = ap.parse_args()
    w = WORKLOADS[args.workload]
    args.steps, args.gaps, args.adaptive_gap = args.steps or w.steps, args.gaps or w.gaps, args.adaptive_gap or w.adaptive_gap
    if args.quick:
        args.seeds, args.warmup = 1, 4
        args.steps = args.steps if w.curriculum else 12  # a curriculum run ends with its phases
    if args.steps <= args.warmup:
        ap.error(f"argument --steps: got {args.steps}; allowed: more than --warmup ({args.warmup})")
    pair = pair_efficiency()  # before any run of ours: what this machine allows two processes side by side
    adaptive_overrides, args.extra = w.adaptive, [*w.overrides, *args.extra]

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
    sps, fin, band, ttt, ends = {}, {}, {}, {}, {}
    for mode, runs in results.items():
        sps[mode] = statistics.median(s["steps_per_s"] for _, s in runs)
        fin[mode] = [final_reward(rows) for rows, _ in runs]
        if w.curriculum:  # the target: the end of the last phase
            ends[mode] = [phase_ends(rows, os.path.join(args.out, mode, f"seed{i}")) for i, (rows, _) in enumerate(runs)]
            hits = [e[-1] for e in ends[mode]]
        else:
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
    if args.plot and not w.curriculum:
        run_child([sys.executable, os.path.join(ROOT, "scripts", "plot_controller.py"),
                   os.path.join(args.out, "adaptive", "seed0"), "-o", args.plot], check=True)
    # a curriculum's fixed gaps include 0 (sync)
    fixed = {m: t for m, t in ttt.items() if m.startswith("fixed-g") or (w.curriculum and m == "sync")}
    best = min(fixed, key=fixed.get)
    if w.curriculum:
        for mode in results:
            spans = [phase_spans(e) for e in ends[mode]]
            per_phase = [statistics.median(s[k][0] for s in spans) for k in range(3)]
            steps = [statistics.median(s[k][1] for s in spans) for k in range(3)]
            print(f"{mode:<11} phase times (s) " + " ".join(f"{t:7.2f}" for t in per_phase)
                  + "   steps " + " ".join(f"{n:4.0f}" for n in steps))
        oracle, chosen = phase_oracle({m: ends[m] for m in fixed})
        print(f"phase oracle: {' '.join(chosen)} -> {oracle:.2f} s")
        if args.plot:
            gaps = [0 if m == "sync" else int(m.removeprefix("fixed-g")) for m in chosen]
            shown = dict.fromkeys(["sync", best, *chosen, "adaptive"])
            plot_curriculum(args.plot, f"--workload {args.workload}, seed 0",
                            {m: (results[m][0][0], ends[m][0]) for m in shown}, gaps, args.adaptive_gap)
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
    if w.curriculum:
        print(f"adaptive_vs_phase_oracle_time_to_target={oracle / ttt['adaptive']:.3f}")
    in_spread = all(x >= min(fin["sync"]) for x in fin["adaptive"])  # within sync's spread, or above it
    print(f"adaptive_final_reward_in_sync_spread={int(in_spread)}")
    print("\n".join(pair_lines(pair)))


if __name__ == "__main__":
    main()
