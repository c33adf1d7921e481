#!/usr/bin/env python
"""Learning curves of several runs in one PNG: ``python scripts/plot_runs.py RUN[:LABEL] ... -o out.png``.

Each RUN is
* a torchtitan_flux run folder: its ``metrics.jsonl`` is read; or
* a JSONL file (a TRL run's log from ``benchmarks/trl_runner.py``, a ``curve.jsonl`` of ``benchmarks/vs_trl.py``,
  or a ``metrics.jsonl`` named directly).

Records need ``step`` and ``reward_mean``; lines without ``step`` (TRL's start event) and lines that are not JSON
objects (a half-written last line) are skipped. Wall-clock time is ``time_s`` (seconds since the first step's
start) when the records have it, else the cumulative sum of ``step_time_s`` (what torchtitan_flux logs), so runs of
both systems share the x axis "seconds of training" (process startup excluded). A resumed run's repeated steps:
the last record wins.

Two panels: mean reward vs step, and mean reward vs wall-clock seconds. ``LABEL`` defaults to the folder name
(or the file name without extension, or its parent folder's name for ``metrics.jsonl`` / ``curve.jsonl``).
``--target X`` draws a dashed line at reward X; ``--smooth N`` plots the trailing N-step mean.

Exit status 2, with a message naming the path, if a RUN does not exist or holds no usable records.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import NoReturn


def _fail(msg: str) -> NoReturn:
    print(f"plot_runs: error: {msg}", file=sys.stderr)
    sys.exit(2)


def split_spec(spec: str) -> tuple[str, str | None]:
    """``path[:label]``; a colon that is part of an existing path is kept in the path."""
    if os.path.exists(spec) or ":" not in spec:
        return spec, None
    path, label = spec.rsplit(":", 1)
    return path, (label or None)


def default_label(path: str) -> str:
    p = os.path.normpath(path)
    if os.path.isdir(p):
        return os.path.basename(p)
    base = os.path.basename(p)
    if base in ("metrics.jsonl", "curve.jsonl", "trl.jsonl"):
        parent = os.path.basename(os.path.dirname(os.path.abspath(p)))
        grand = os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(p))))
        return f"{grand}/{parent}" if parent.startswith("seed") else parent
    return os.path.splitext(base)[0]


def load_run(path: str) -> list[dict]:
    """Rows {step, reward, time} sorted by step."""
    if os.path.isdir(path):
        f = os.path.join(path, "metrics.jsonl")
        if not os.path.isfile(f):
            _fail(f"{path} is a folder without metrics.jsonl (expected a torchtitan_flux run folder)")
        path = f
    if not os.path.isfile(path):
        _fail(f"{path} not found (expected a run folder or a JSONL file)")
    rows: dict[int, dict] = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if not isinstance(d, dict) or "step" not in d or d.get("reward_mean") is None:
                continue
            try:
                rows[int(d["step"])] = d
            except (TypeError, ValueError):
                continue
    if not rows:
        _fail(f"{path} holds no records with 'step' and 'reward_mean'")
    out, cum = [], 0.0
    for step in sorted(rows):
        d = rows[step]
        cum += float(d.get("step_time_s") or 0.0)
        t = float(d["time_s"]) if d.get("time_s") is not None else cum
        out.append({"step": step, "reward": float(d["reward_mean"]), "time": t})
    return out


def smooth(ys: list[float], n: int) -> list[float]:
    if n <= 1:
        return ys
    return [sum(ys[max(0, i - n + 1): i + 1]) / (i + 1 - max(0, i - n + 1)) for i in range(len(ys))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("runs", nargs="+", metavar="RUN[:LABEL]")
    ap.add_argument("-o", "--output", required=True, help="PNG to write")
    ap.add_argument("--title", default="reward")
    ap.add_argument("--target", type=float, default=None, help="draw a dashed line at this reward")
    ap.add_argument("--smooth", type=int, default=1, help="trailing mean over N steps (default 1: raw)")
    args = ap.parse_args(argv)

    runs = []
    for spec in args.runs:
        path, label = split_spec(spec)
        runs.append((label or default_label(path), load_run(path)))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, rows in runs:
        ys = smooth([r["reward"] for r in rows], args.smooth)
        ls = "--" if "trl" in label.lower() else "-"
        (line,) = ax1.plot([r["step"] for r in rows], ys, ls, label=label, linewidth=1.6)
        ax2.plot([r["time"] for r in rows], ys, ls, color=line.get_color(), label=label, linewidth=1.6)
    for ax, xl in ((ax1, "training step"), (ax2, "wall-clock seconds since the first step's start")):
        if args.target is not None:
            ax.axhline(args.target, color="grey", linestyle=":", linewidth=1, label=f"target {args.target}")
        ax.set_xlabel(xl)
        ax.set_ylabel("mean reward" + (f" (trailing {args.smooth}-step mean)" if args.smooth > 1 else ""))
        ax.grid(alpha=0.3)
    ax1.set_title("reward vs step")
    ax2.set_title("reward vs wall clock")
    ax2.legend(loc="best", fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    out_dir = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(out_dir, exist_ok=True)
    fig.savefig(args.output, dpi=110)
    plt.close(fig)
    print(f"wrote {args.output} ({len(runs)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
