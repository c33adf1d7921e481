"""The adaptive controller against fixed staleness bounds and sync mode, same config and loss, in one run.

Modes (each for ``--seeds`` rollout seeds, interleaved):
  sync        weight_sync.async_weight_update = false (on-policy)
  fixed-gN    async, async_ratio 1, off_policy.max_version_gap = N  (N in --gaps)
  adaptive    async, controller on with --law (pid; throughput with --suite), max_version_gap = --adaptive-gap,
              target --target (pid)
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

``--suite`` runs every workload of ``SUITE`` -- ``sensitive``,
``growing``, ``shifting``, ``heavy_tail`` (``benchmarks/streaming.py``'s Pareto-distributed budgets, 40 steps),
``environment`` (``benchmarks/environments.py``'s three-turn episodes with a 50 ms environment, the chat model, 40
steps, reward target 0.4: its learning takes off anywhere from step 12 to past step 30, whatever the mode) and
``debug`` (the debug config, 40 steps; ``sensitive`` 40 too) -- with sync, fixed gaps 1 2 4 8 (debug: 1 2 4) and
adaptive (``--law``, default ``throughput``: ``adaptive_async.controller``), every run on the batching engine with
in-flight updates, ``--seeds`` paired seeds (default 10; the seed loop outermost, so every mode of every
workload runs under the same drift). Per workload the table above with its key lines suffixed ``_<workload>``
(``adaptive_vs_best_fixed_<workload>``: the best fixed mode's median time to target, sync included, over
adaptive's), then ``seeds=``, ``adaptive_worst_vs_best_fixed=`` (the minimum over workloads),
``worst_fixed_gap_ratio_<g>=`` (each fixed gap's minimum over workloads against that workload's best),
``adaptive_final_reward_in_sync_spread=`` (1 when inside on every workload), ``suite_seconds=`` and the pair
efficiency; each ``--variant`` adds ``<name>_worst_vs_best_fixed=``, and ``variant_seconds=`` their runs' share of
``suite_seconds``. Runs are forked from a process that imported the trainer once (``common.WarmStarter``).
``--suite --quick``: every workload, one seed, one fixed gap, a few steps (CI's smoke run).

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
    adaptive: list[str]  # adaptive's own overrides with the staleness law (``--law pid``)
    steps: int = 60  # default of --steps
    curriculum: bool = False  # examples/length_curriculum.py: the run ends with its last phase
    suite_steps: int = 0  # the steps of its runs in --suite (0: ``steps``)
    reward_target: float = 0.0  # its time-to-target reward (0: --reward-target)


_CURRICULUM = ["--optimizer.lr", "1e-2", "--rollout.max_new_tokens", "128", "--training.seq_len", "144"]
_FF = ["--off_policy.feedforward", "true"]
WORKLOADS = {
    "debug": Workload([], [1, 2, 4], 4, [], suite_steps=40),
    "sensitive": Workload(["--optimizer.lr", "1e-2"], [1, 2, 4, 8], 8, _FF, suite_steps=40),
    # the curriculum ends the run (Task.finished); 620 steps: every phase at its cap (200), plus the steps in
    # flight at each change (at most the largest gap, 8), which count for no phase
    "growing": Workload([*_CURRICULUM, "--rollout.task", "examples.length_curriculum:growing"], [1, 2, 4, 8], 8,
                        _FF, steps=620, curriculum=True),
    "shifting": Workload([*_CURRICULUM, "--rollout.task", "examples.length_curriculum:shifting"], [1, 2, 4, 8], 8,
                         _FF, steps=620, curriculum=True),
    # benchmarks/streaming.py's: Pareto-distributed budgets (4-96 tokens, median 8), rewarded on the whole answer
    "heavy_tail": Workload(["--rollout.task", "benchmarks.workloads:heavy_tail", "--rollout.max_new_tokens", "96",
                            "--training.seq_len", "112"], [1, 2, 4, 8], 8, _FF, steps=40),
    # benchmarks/environments.py's: three turns an episode, the environment answering each after 50 ms; its
    # learning takes off anywhere from step 12 to past step 30 (3 paired seeds of sync and gap 1, serial engine: sync
    # ahead on one, gap 1 on two; an earlier single pair had read as "async learns slower"), so its target is 0.4
    "environment": Workload(["--model.hf_assets_path", os.path.join(ROOT, "assets", "tiny-chat"),
                             "--rollout.environment", "benchmarks.workloads:LatencyEnv", "--rollout.environment_args",
                             "delay_ms=50,turns=3", "--rollout.max_turns", "3", "--rollout.max_new_tokens", "16",
                             "--training.seq_len", "128", "--eval.every_steps", "0",
                             "--rollout.borrow_idle_engine_cores", "false"], [1, 2, 4, 8], 8, _FF, steps=40,
                            reward_target=0.4),
}
SUITE = ["sensitive", "growing", "shifting", "heavy_tail", "environment", "debug"]
# --suite runs every mode on the batching engine, pushes landing mid-generation
SUITE_ENGINE = ["--rollout.continuous_batching", "true", "--rollout.in_flight_weight_updates", "true"]
LAWS = ("throughput", "pid")  # --law: adaptive_async.controller of the adaptive mode


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


def law(text: str) -> str:
    """An argparse type: one of ``LAWS``."""
    if text not in LAWS:
        raise argparse.ArgumentTypeError(f"got {text!r}; allowed: {' | '.join(LAWS)}")
    return text


def variant(text: str) -> str:
    """An argparse type: ``NAME=OVERRIDES`` with a name."""
    if "=" not in text or not text.partition("=")[0].strip():
        raise argparse.ArgumentTypeError(
            f"got {text!r}; allowed: NAME=OVERRIDES, e.g. \"fast-ema=--adaptive_async.ema_alpha 0.3\"")
    return text


def modes_for(w: Workload, args, law: str) -> tuple[dict[str, list[str]], list[str]]:
    """Mode -> overrides (sync, the fixed gaps, adaptive with ``law``, the variants) and the adaptive modes; with
    ``--suite --quick``, one fixed gap (CI's smoke run)."""
    modes: dict[str, list[str]] = {"sync": ["--weight_sync.async_weight_update", "false"]}
    for g in (w.gaps[:1] if args.suite and args.quick else args.gaps or w.gaps):
        modes[f"fixed-g{g}"] = ["--weight_sync.async_weight_update", "true", "--off_policy.async_ratio", "1",
                              "--off_policy.max_version_gap", str(g)]
    own = [*w.adaptive, "--adaptive_async.controller", "pid"] if law == "pid" else ["--adaptive_async.controller", law]
    modes["adaptive"] = [
        "--weight_sync.async_weight_update", "true", "--adaptive_async.enabled", "true",
        "--off_policy.max_version_gap", str(args.adaptive_gap or w.adaptive_gap), "--adaptive_async.target_staleness",
        str(args.target), "--adaptive_async.phase_schedule.warmup.steps", str(args.warmup), *own,
    ]
    adaptive_modes = ["adaptive"]
    for v in args.variant:
        name, _, overrides = v.partition("=")
        modes[name] = modes["adaptive"] + overrides.split()
        adaptive_modes.append(name)
    return modes, adaptive_modes


@dataclass
class Measured:
    """One workload's runs, summarised: per mode the median time to target and each seed's final reward."""

    ttt: dict[str, float]
    final: dict[str, list[float]]
    fixed: dict[str, float]  # the fixed modes' ttt (sync is gap 0)
    best: str  # the fixed mode with the least median time to target


def report(name: str, w: Workload, results: dict[str, list[tuple[list[dict], dict]]], out: str, args,
           adaptive_modes: list[str], steps: int) -> Measured:
    """Print one workload's table (and a curriculum's phase table) and its key=value lines; returns its summary."""
    print(f"-- workload {name}: {len(next(iter(results.values())))} seeds x {steps} steps; reward target "
          f"{w.reward_target or args.reward_target}")
    print(f"{'mode':<11} {'steps/s':>8} {'final reward (per seed)':>30} {'gap':>5} {'in band':>8} "
          f"{'to target s (per seed)':>34} {'steps':>6}")
    sps, fin, band, ttt, ends = {}, {}, {}, {}, {}
    for mode, runs in results.items():
        sps[mode] = statistics.median(s["steps_per_s"] for _, s in runs)
        fin[mode] = [final_reward(rows) for rows, _ in runs]
        if w.curriculum:  # the target: the end of the last phase
            ends[mode] = [phase_ends(rows, os.path.join(out, mode, f"seed{i}")) for i, (rows, _) in enumerate(runs)]
            hits = [e[-1] for e in ends[mode]]
        else:
            hits = [time_to_target(rows, w.reward_target or args.reward_target) for rows, _ in runs]
        ttt[mode] = statistics.median(t for t, _ in hits)
        gap = statistics.mean(r["version_gap_mean"] for rows, _ in runs for r in rows)
        inb = ""
        post = [r for rows, _ in runs for r in rows if r["step"] > args.warmup and "staleness" in r]
        if mode in adaptive_modes and post:  # the staleness law's tracking (the throughput law has no target)
            band[mode] = sum(abs(r["staleness"] - r["target_staleness"]) <= 0.05 for r in post) / len(post)
            inb = f"{band[mode]:.2f}"
        per_seed = " ".join(f"{x:.3f}" for x in fin[mode])
        times = " ".join(f"{t:.2f}" for t, _ in hits)
        n = statistics.median(k for _, k in hits)
        print(f"{mode:<11} {sps[mode]:>8.2f} {per_seed:>30} {gap:>5.2f} {inb:>8} {times:>34} {n:>6.0f}")
    full = f"fixed-g{args.adaptive_gap or w.adaptive_gap}"
    if args.plot and not w.curriculum:
        run_child([sys.executable, os.path.join(ROOT, "scripts", "plot_controller.py"),
                   os.path.join(out, "adaptive", "seed0"), "-o", args.plot], check=True)
    fixed = {m: t for m, t in ttt.items() if m.startswith("fixed-g") or m == "sync"}  # sync: gap 0
    best = min(fixed, key=fixed.get)
    oracle = math.nan
    if w.curriculum:
        for mode in results:
            spans = [phase_spans(e) for e in ends[mode]]
            per_phase = [statistics.median(sp[k][0] for sp in spans) for k in range(3)]
            n_steps = [statistics.median(sp[k][1] for sp in spans) for k in range(3)]
            print(f"{mode:<11} phase times (s) " + " ".join(f"{t:7.2f}" for t in per_phase)
                  + "   steps " + " ".join(f"{n:4.0f}" for n in n_steps))
        oracle, chosen = phase_oracle({m: ends[m] for m in fixed})
        print(f"phase oracle: {' '.join(chosen)} -> {oracle:.2f} s")
        if args.plot:
            gaps = [0 if m == "sync" else int(m.removeprefix("fixed-g")) for m in chosen]
            shown = dict.fromkeys(["sync", best, *chosen, "adaptive"])
            plot_curriculum(args.plot, f"--workload {name}, seed 0",
                            {m: (results[m][0][0], ends[m][0]) for m in shown}, gaps,
                            args.adaptive_gap or w.adaptive_gap)
    for mode in adaptive_modes[1:]:
        vs_full = f", throughput vs full async {sps[mode] / sps[full]:.3f}" if full in sps else ""
        print(f"{mode}: in band {band.get(mode, math.nan):.3f}{vs_full}, vs best fixed time to target "
              f"{fixed[best] / ttt[mode]:.3f}, vs sync {ttt['sync'] / ttt[mode]:.3f}")
    sfx = f"_{name}" if args.suite else ""
    if "adaptive" in band:
        print(f"in_band_fraction{sfx}={band['adaptive']:.3f}")
    if full in sps:
        print(f"throughput_vs_full_async{sfx}={sps['adaptive'] / sps[full]:.3f}")
    print(f"adaptive_final_reward{sfx}={statistics.mean(fin['adaptive']):.3f}")
    print(f"sync_final_reward_min{sfx}={min(fin['sync']):.3f}")
    print(f"sync_final_reward_max{sfx}={max(fin['sync']):.3f}")
    print(f"best_fixed{sfx}={best}")
    key = f"adaptive_vs_best_fixed_{name}" if args.suite else "adaptive_vs_best_fixed_time_to_target"
    print(f"{key}={fixed[best] / ttt['adaptive']:.3f}")
    print(f"adaptive_vs_sync_time_to_target{sfx}={ttt['sync'] / ttt['adaptive']:.3f}")
    if w.curriculum:
        print(f"adaptive_vs_phase_oracle_time_to_target{sfx}={oracle / ttt['adaptive']:.3f}")
    if not args.suite:
        print(f"adaptive_final_reward_in_sync_spread={int(in_sync_spread(fin))}")
    return Measured(ttt, fin, fixed, best)


def in_sync_spread(fin: dict[str, list[float]]) -> bool:
    """Every adaptive seed's final reward lies in sync's range or above it (above every sync seed's is no loss)."""
    return all(x >= min(fin["sync"]) for x in fin["adaptive"])


def suite_lines(measured: dict[str, Measured], gaps: list[int], variants: list[str], seeds: int,
                seconds: float, variant_seconds: float) -> list[str]:
    """The suite's key=value lines (module docstring) from each workload's ``Measured``; ``variant_seconds``: the
    variants' runs' share of ``seconds``."""
    def worst(mode: str) -> float:  # over the workloads that run it, where some fixed mode reached the target
        ratios = [m.fixed[m.best] / m.ttt[mode] for m in measured.values()
                  if mode in m.ttt and math.isfinite(m.fixed[m.best])]
        return min(ratios, default=math.nan)

    lines = [f"seeds={seeds}", f"adaptive_worst_vs_best_fixed={worst('adaptive'):.3f}"]
    lines += [f"worst_fixed_gap_ratio_{g}={worst(f'fixed-g{g}'):.3f}" for g in gaps]
    lines += [f"{v}_worst_vs_best_fixed={worst(v):.3f}" for v in variants]
    lines.append(f"adaptive_final_reward_in_sync_spread={int(all(in_sync_spread(m.final) for m in measured.values()))}")
    lines.append(f"suite_seconds={seconds:.0f}")
    if variants:  # the suite's own time is the rest
        lines.append(f"variant_seconds={variant_seconds:.0f}")
    return lines


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=count(), default=None, help="default: the workload's")
    ap.add_argument("--seeds", type=count(), default=None,
                    help="default: 3, and 10 with --suite (fewer with --suite: exploration only)")
    ap.add_argument("--suite", action="store_true", help="every workload of SUITE, paired seeds (module docstring)")
    ap.add_argument("--reread", action="store_true",
                    help="run nothing: report on the finished seeds under --out (a suite stopped early, say)")
    ap.add_argument("--law", type=law, default=None, metavar="{" + ",".join(LAWS) + "}",
                    help="adaptive_async.controller of the adaptive mode; default: throughput with --suite, else pid")
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
    t_start = time.perf_counter()
    args.seeds = args.seeds or (10 if args.suite else 3)
    names = SUITE if args.suite else [args.workload]
    args.law = args.law or ("throughput" if args.suite else "pid")
    if args.suite and (args.gaps or args.adaptive_gap or args.steps or args.plot):
        ap.error("argument --suite: got it with --gaps, --adaptive-gap, --steps or --plot; allowed: --seeds, --quick, "
                 "--law, --variant, --out and overrides (every workload has its own gaps, steps and modes)")
    if args.quick:
        args.seeds, args.warmup = 1, 4
    runs: dict[str, tuple[Workload, int, dict, list[str]]] = {}
    for name in names:
        w = WORKLOADS[name]
        steps = args.steps or (w.suite_steps if args.suite and w.suite_steps else w.steps)
        if args.quick and not w.curriculum:  # a curriculum run ends with its phases
            steps = 12 if not args.suite else w.adaptive_gap + 1  # the max gap needs as many steps
        if steps <= args.warmup:
            ap.error(f"argument --steps: got {steps}; allowed: more than --warmup ({args.warmup})")
        modes, adaptive_modes = modes_for(w, args, args.law)
        runs[name] = (w, steps, modes, adaptive_modes)
    pair = pair_efficiency()  # before any run of ours: what this machine allows two processes side by side
    results = {name: {m: [] for m in runs[name][2]} for name in names}

    def folder(name: str, mode: str, seed: int) -> str:
        return os.path.join(args.out, *([name] if args.suite else []), mode, f"seed{seed}")

    if args.reread:  # the seeds whose every run finished (``summary.json`` written), in order
        done = [s for s in range(args.seeds) if all(os.path.exists(os.path.join(folder(n, m, s), "summary.json"))
                                                     for n in names for m in runs[n][2])]
        for seed in done:
            for name, (_, _, modes, _) in runs.items():
                for mode in modes:
                    with open(os.path.join(folder(name, mode, seed), "metrics.jsonl")) as f:
                        rows = [json.loads(x) for x in f]
                    with open(os.path.join(folder(name, mode, seed), "summary.json")) as f:
                        results[name][mode].append((rows, json.load(f)))
        if not done:
            ap.error(f"argument --reread: got {args.out} with no seed whose every run finished; allowed: the --out "
                     "of a suite that finished at least one seed")
        print(f"reread {len(done)} finished seeds of {args.out}; pair efficiency measured now, not during those runs")
        args.seeds = len(done)
        firsts = [os.path.getctime(folder(n, m, s)) for n in names for m in runs[n][2] for s in done]
        lasts = [os.path.getmtime(os.path.join(folder(n, m, s), "summary.json")) for n in names for m in runs[n][2]
                 for s in done]
        t_start -= max(lasts) - min(firsts)  # suite_seconds: the finished seeds' span
    variant_s = 0.0  # the variants' runs' share of suite_seconds
    for seed in range(0 if args.reread else args.seeds):  # seeds outermost: every mode of every workload sees
        for name, (w, steps, modes, adaptive_modes) in runs.items():  # the same machine drift
            for mode, overrides in modes.items():
                out = folder(name, mode, seed)
                shutil.rmtree(out, ignore_errors=True)  # metrics.jsonl appends
                extra = [*w.overrides, *(SUITE_ENGINE if args.suite else []), *args.extra]
                t0 = time.perf_counter()
                results[name][mode].append(run_training(out, "--training.steps", str(steps), "--rollout.seed",
                                                        str(seed), *overrides, *extra, warm=True))
                variant_s += (time.perf_counter() - t0) if mode in adaptive_modes[1:] else 0.0

    print(f"machine: {platform.machine()} {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}; {args.seeds} seeds; "
          f"adaptive law {args.law}" + (" (suite: batching engine, in-flight updates)" if args.suite else ""))
    measured = {}
    for name, (w, steps, _, adaptive_modes) in runs.items():
        out = os.path.join(args.out, name) if args.suite else args.out
        measured[name] = report(name, w, results[name], out, args, adaptive_modes, steps)
    if args.suite:
        gaps = sorted({int(m.removeprefix("fixed-g")) for n in names for m in runs[n][2] if m.startswith("fixed")})
        variants = runs[names[0]][3][1:]
        print("\n".join(suite_lines(measured, gaps, variants, args.seeds, time.perf_counter() - t_start, variant_s)))
    print("\n".join(pair_lines(pair)))


if __name__ == "__main__":
    main()
