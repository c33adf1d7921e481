#!/usr/bin/env python
"""Plot the adaptive async controller of a run: ``python scripts/plot_controller.py RUN_DIR -o out.png``.

Reads ``RUN_DIR/metrics.jsonl`` (one JSON object per training step, with ``step`` and, when
``adaptive_async.enabled`` was on, the controller's metrics) and draws three stacked panels over steps:

1. smoothed staleness (and the raw per-batch value, faint, if logged) against the target (dashed); steps
   with a forced sync are marked;
2. async ratio with its bounds (``min_async_ratio`` / ``max_async_ratio``, dotted, if logged); ``reward_mean``
   on a second axis if logged;
3. PID error (target - staleness) with a zero line;
4. only when ``weight_sync.interval = "auto"`` was on (``sync_interval`` logged): the push interval (steps) and
   the measured sync overhead against ``sync_overhead_target`` (dashed), the self-tuning cadence of
   ``torchtitan_flux/rl/off_policy.py``.

A run of the throughput law (``adaptive_async.controller = "throughput"``: ``lookahead_target`` and
``rollout_starved`` logged) gets its own three panels instead:

1. the lookahead the law set (steps), Little's-law depth, and each trained batch's mean version gap (dots);
2. the trainer's starvation (smoothed wait on the engines over the step) against ``starve_fraction`` (dashed), and
   each step's wait on the engines in seconds (``engine_wait_s``, faint, second axis);
3. the smoothed ESS fraction against ``ess_floor`` (dashed), steps where the guard held marked; ``reward_mean`` on a
   second axis.

Keys are matched exactly or as the last ``/``-separated component (``controller/staleness`` works too).
Lines that are not JSON objects (a half-written last line of a running job, say) are skipped with a note.

Exit status 2, with a message naming the file, if ``metrics.jsonl`` is missing or holds no controller metrics.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import NoReturn

REQUIRED = ("staleness", "target_staleness", "async_ratio", "pid_error")
THROUGHPUT = ("lookahead_target", "rollout_starved")  # the throughput law's rows


def _fail(msg: str) -> NoReturn:
    print(f"plot_controller: error: {msg}", file=sys.stderr)
    sys.exit(2)


def _get(row: dict, key: str):
    if key in row:
        return row[key]
    for k, v in row.items():
        if isinstance(k, str) and k.rsplit("/", 1)[-1] == key:
            return v
    return None


def _num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def load_rows(path: str) -> list[dict]:
    """Controller rows of ``path``, sorted by step (a resumed run's repeated steps: the last one wins)."""
    if not os.path.isfile(path):
        _fail(f"{path} not found (expected the run's metrics.jsonl)")
    rows: dict[int, dict] = {}
    skipped = 0
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1
                continue
            if not isinstance(row, dict) or _get(row, "step") is None:
                skipped += 1
                continue
            if any(_get(row, k) is None for k in REQUIRED) and any(_get(row, k) is None for k in THROUGHPUT):
                continue
            rows[int(_num(_get(row, "step")))] = row
    if skipped:
        print(f"plot_controller: note: skipped {skipped} line(s) of {path} that are not step records", file=sys.stderr)
    if not rows:
        _fail(
            f"{path} has no controller metrics (no line has all of {', '.join(REQUIRED)}, or of "
            f"{', '.join(THROUGHPUT)}); "
            "was adaptive_async.enabled on?"
        )
    return [rows[s] for s in sorted(rows)]


def plot(rows: list[dict], out: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [int(_num(_get(r, "step"))) for r in rows]

    def series(key: str) -> list[float] | None:
        vals = [_get(r, key) for r in rows]
        if all(v is None for v in vals):
            return None
        return [_num(v) for v in vals]

    if series("lookahead_target") is not None and series("pid_error") is None:
        fig = plot_throughput(plt, steps, series)
        finish(plt, fig, out, title)
        return
    cadence = series("sync_interval") is not None
    fig, axes = plt.subplots(4 if cadence else 3, 1, figsize=(10, 10.5 if cadence else 8), sharex=True)

    ax = axes[0]
    raw = series("staleness_raw")
    if raw is not None:
        ax.plot(steps, raw, color="tab:blue", alpha=0.25, linewidth=0.8, label="raw")
    ax.plot(steps, series("staleness"), color="tab:blue", label="staleness (EMA)")
    ax.plot(steps, series("target_staleness"), color="tab:red", linestyle="--", label="target")
    fs = series("force_sync")
    if fs is not None:
        sync_steps = [s for s, v in zip(steps, fs) if v > 0.5]
        if sync_steps:
            ax.scatter(sync_steps, [0.0] * len(sync_steps), marker="|", color="black", s=60,
                       label=f"forced sync ({len(sync_steps)})", zorder=3)
    ax.set_ylabel("Staleness")
    ax.legend(loc="upper right", fontsize="small")
    ax.grid(alpha=0.3)

    ax = axes[1]
    ax.plot(steps, series("async_ratio"), color="tab:green", label="async ratio")
    for key, lab in (("min_async_ratio", "min"), ("max_async_ratio", "max")):
        b = series(key)
        if b is not None:
            ax.plot(steps, b, color="gray", linestyle=":", label=lab)
    ax.set_ylabel("Async Ratio")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    twin_legend(ax, steps, "Reward (mean)", [(series("reward_mean"), REWARD)])

    ax = axes[2]
    ax.plot(steps, series("pid_error"), color="tab:orange", label="error = target - staleness")
    ax.axhline(y=0.0, color="tab:red", linestyle="--", linewidth=1)
    ax.set_ylabel("PID Error")
    ax.legend(loc="upper right", fontsize="small")
    ax.grid(alpha=0.3)

    if cadence:
        ax = axes[3]
        ax.step(steps, series("sync_interval"), where="post", color="tab:brown", label="push interval (steps)")
        ax.set_ylabel("Sync interval")
        ax.grid(alpha=0.3)
        overhead = series("sync_overhead")
        twin_legend(ax, steps, "Overhead (lost / compute)", [
            (overhead, dict(color="tab:gray", linewidth=0.9, label="sync overhead")),
            (series("sync_overhead_target") if overhead is not None else None,
             dict(color="tab:red", linestyle="--", linewidth=1, label="overhead target"))])
    axes[-1].set_xlabel("Step")
    finish(plt, fig, out, title)


def plot_throughput(plt, steps: list[int], series):
    """The throughput law's three panels (module docstring)."""
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    ax = axes[0]
    ax.step(steps, series("lookahead_target"), where="post", color="tab:green", label="lookahead (steps)")
    little = series("little_depth")
    if little is not None:
        ax.plot(steps, little, color="tab:gray", linewidth=0.9, label="Little's-law depth")
    gap = series("version_gap_mean")
    if gap is not None:
        ax.plot(steps, gap, ".", color="tab:blue", markersize=3, label="trained batch's mean gap")
    ax.set_ylabel("Steps / versions")
    ax.legend(loc="upper right", fontsize="small")
    ax.grid(alpha=0.3)

    ax = axes[1]
    ax.plot(steps, series("rollout_starved"), color="tab:orange", label="starvation (EMA)")
    limit = series("starve_fraction")
    if limit is not None:
        ax.plot(steps, limit, color="tab:red", linestyle="--", linewidth=1, label="starve_fraction")
    ax.set_ylabel("Wait / step")
    ax.grid(alpha=0.3)
    twin_legend(ax, steps, "Seconds", [(series("engine_wait_s"), dict(color="tab:brown", alpha=0.3, linewidth=0.8,
                                                                       label="wait on the engines (s)"))])

    ax = axes[2]
    ax.plot(steps, series("ess_smoothed"), color="tab:blue", label="ESS fraction (EMA)")
    floor = series("ess_floor")
    if floor is not None:
        ax.plot(steps, floor, color="tab:red", linestyle="--", linewidth=1, label="ess_floor")
    guard = series("ess_guard")
    if guard is not None:
        held = [s for s, v in zip(steps, guard) if v > 0.5]
        if held:
            ax.scatter(held, [0.0] * len(held), marker="|", color="black", s=60, label=f"guard ({len(held)})")
    ax.set_ylabel("ESS / N")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    twin_legend(ax, steps, "Reward (mean)", [(series("reward_mean"), REWARD)])
    axes[-1].set_xlabel("Step")
    return fig


REWARD = dict(color="tab:purple", alpha=0.6, linewidth=0.9, label="reward_mean")


def twin_legend(ax, steps: list[int], ylabel: str, lines: list) -> None:
    """Draw ``lines`` ((values or None, plot style) pairs; None ones skipped) on a second y axis of ``ax`` when any
    has values, then one legend for both axes."""
    handles, labels = ax.get_legend_handles_labels()
    drawn = [(v, style) for v, style in lines if v is not None]
    if drawn:
        ax2 = ax.twinx()
        for values, style in drawn:
            ax2.plot(steps, values, **style)
        ax2.set_ylabel(ylabel)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, loc="upper right", fontsize="small")


def finish(plt, fig, out: str, title: str) -> None:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(out))
    os.makedirs(d, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="run folder holding metrics.jsonl")
    p.add_argument("-o", "--output", default=None, help="PNG to write (default: RUN_DIR/controller.png)")
    p.add_argument("--title", default=None, help="figure title (default: the run folder's name)")
    args = p.parse_args(argv)
    path = os.path.join(args.run_dir, "metrics.jsonl")
    rows = load_rows(path)
    out = args.output or os.path.join(args.run_dir, "controller.png")
    title = args.title if args.title is not None else os.path.basename(os.path.normpath(args.run_dir))
    plot(rows, out, title)
    print(f"wrote {out} ({len(rows)} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
