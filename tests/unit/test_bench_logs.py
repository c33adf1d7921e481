"""What the benchmarks read: start-up stamps from the trainer's log lines (``benchmarks/common.flux_log_times``), and
step times and time to target from the metrics rows' wall-clock ``time`` (``benchmarks/controller.time_to_target``,
``benchmarks/vs_trl._our_curve``)."""

from __future__ import annotations

import datetime as dt
import json
import re
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from common import flux_log_times  # noqa: E402


def test_flux_log_times_reads_stamps_and_messages():
    log = "\n".join([
        "[titan] 2026-11-23 17:41:12,817 - torchtitan_flux - INFO - Training starts at step 1",
        "[titan] 2026-11-23 17:41:14,495 - torchtitan_flux - INFO - step     1/40  reward 0.023",
        "[titan] 2026-11-23 17:41:14,496 - root - INFO - step     1/40  (another logger: ignored)",
        "[titan] 2026-11-23 17:41:14,538 - torchtitan_flux - WARNING - step     2/40  (not INFO: ignored)",
        "noise step 3/40",
        "[titan] 2026-11-23 17:41:14,579 - torchtitan_flux - INFO - step    12/40  reward 0.026",
    ])
    got = flux_log_times(log, re.compile(r"step\s+(\d+)/"))
    assert [int(m.group(1)) for _, m in got] == [1, 12]
    t1 = dt.datetime(2026, 11, 23, 17, 41, 14, 495000).timestamp()
    assert abs(got[0][0] - t1) < 1e-6 and abs(got[1][0] - got[0][0] - 0.084) < 1e-6
    assert [t for t, _ in flux_log_times(log, re.compile("Training starts"))] == [
        dt.datetime(2026, 11, 23, 17, 41, 12, 817000).timestamp()]


def test_controller_benchmark_time_to_target_reads_the_rows_wall_clock():
    """``benchmarks/controller.py``: time to the target reward is measured from the start of step 1 (its row's
    ``time`` minus its ``step_time_s``) to the first step whose last-5-steps mean reward reaches the target."""
    from controller import time_to_target

    rewards = [0.0, 0.2, 0.5, 0.9, 1.0, 1.0, 1.0, 1.0]
    rows = [{"step": i + 1, "time": 100.0 + 0.5 * (i + 1), "step_time_s": 0.5, "reward_mean": r}
            for i, r in enumerate(rewards)]
    assert time_to_target(rows, 0.8) == (3.5, 7)  # steps 3..7 average 0.88; steps 2..6 average 0.72
    assert time_to_target(rows, 0.5, window=1) == (1.5, 3)
    assert time_to_target(rows, 1.1) == (float("inf"), 0)


def test_controller_benchmark_phase_ends_and_the_per_phase_oracle(tmp_path):
    """``--workload growing / shifting``: each phase's end is the wall clock of the step ``curriculum.jsonl`` names
    (from the start of step 1; a phase that never ended is inf), and the per-phase oracle sums, phase by phase, the
    smallest median phase time over the fixed modes (here a different mode wins each phase)."""
    from controller import phase_ends, phase_oracle, phase_spans

    rows = [{"step": i, "time": 10.0 + i, "step_time_s": 1.0} for i in range(1, 9)]
    (tmp_path / "curriculum.jsonl").write_text('{"phase": 0, "end_step": 3}\n{"phase": 1, "end_step": 6}\n')
    ends = phase_ends(rows, str(tmp_path))
    assert ends == [(3.0, 3), (6.0, 6), (float("inf"), 0)]
    inf = float("inf")
    assert phase_spans(ends) == [(3.0, 3.0), (3.0, 3.0), (inf, inf)]
    assert phase_spans([(2.0, 2), (inf, 0), (inf, 0)]) == [(2.0, 2.0), (inf, inf), (inf, inf)]  # no nan, no < 0
    a = [[(1.0, 4), (5.0, 9), (6.0, 12)], [(1.2, 4), (4.0, 9), (5.0, 12)], [(3.0, 4), (5.0, 9), (6.0, 12)]]
    b = [[(2.0, 4), (3.0, 9), (6.0, 12)], [(2.0, 4), (3.0, 9), (4.0, 12)], [(2.0, 4), (3.0, 9), (5.0, 12)]]
    # medians per phase: a 1.2, 2.8, 1.0; b 2.0, 1.0, 2.0
    total, chosen = phase_oracle({"a": a, "b": b})
    assert chosen == ["a", "b", "a"] and abs(total - (1.2 + 1.0 + 1.0)) < 1e-9
    never = [[(1.0, 4), (inf, 0), (inf, 0)]] * 3  # a mode that never left its second phase is never the oracle's
    total, chosen = phase_oracle({"a": a, "b": b, "never": never})
    assert chosen == ["never", "b", "a"] and abs(total - (1.0 + 1.0 + 1.0)) < 1e-9


def test_vs_trl_curve_reads_the_rows_wall_clock(tmp_path):
    """``benchmarks/vs_trl.py``: our curve's ``time_s`` of step k is row k's ``time`` minus the start of step 1
    (row 1's ``time`` minus its ``step_time_s``), so time between steps counts; a row without ``reward_mean`` (the
    ``eval.at_start`` row) and a torn last line are skipped."""
    from vs_trl import _our_curve

    rows = [{"step": 0, "time": 99.0, "eval/reward_mean": 0.1},
            {"step": 1, "time": 100.5, "step_time_s": 0.4, "reward_mean": 0.2},
            {"step": 2, "time": 101.0, "step_time_s": 0.3, "reward_mean": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + '\n{"step": 3, "ti')
    curve, start = _our_curve(tmp_path)
    assert start == 100.1
    assert [(p["step"], p["reward_mean"]) for p in curve] == [(1, 0.2), (2, 0.5)]
    assert [round(p["time_s"], 6) for p in curve] == [0.4, 0.9]
    assert [round(p["step_time_s"], 6) for p in curve] == [0.4, 0.5]  # the wall period, not the row's step_time_s


def test_vs_trl_real_limit_and_phase_times(tmp_path):
    """``benchmarks/vs_trl.py``'s real workload: ``_our_phase_times`` takes the medians of train and generation
    seconds without step 1; ``speedup_limit`` is TRL's s/step over the fixed split's (train + generation) / 2, and
    names what it needs when a run is missing."""
    from vs_trl import _our_phase_times, speedup_limit

    rows = [{"step": 1, "train_time_s": 99.0, "gen_time_s": 99.0},
            {"step": 2, "train_time_s": 12.0, "gen_time_s": 3.0},
            {"step": 3, "train_time_s": 14.0, "gen_time_s": 2.0},
            {"step": 4, "train_time_s": 13.0, "gen_time_s": 2.5}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert _our_phase_times(tmp_path) == (13.0, 2.5)
    agg = {"async_fixed": {"train_s": 13.0, "gen_s": 2.5, "median_step_s": 13.1},
           "trl": {"median_step_s": 15.5, "train_s": None, "gen_s": None}}
    lim, why = speedup_limit(agg)
    assert lim == 15.5 / 7.75 and "7.75" in why
    assert speedup_limit({"trl": agg["trl"]}) == (None, "needs async_fixed and trl runs")
