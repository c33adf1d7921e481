"""A task that finishes early (``Task.finished``) and gives prompts their own budgets (``Prompt.max_new_tokens``),
end to end: ``examples/length_curriculum.py:growing`` (phases of 16, 48 and 128 new tokens) on the debug config,
the workload of ``benchmarks/controller.py --workload growing``. The run ends at the step whose reward ended the
last phase, long before ``training.steps``, with its summary, final checkpoint and weights on the engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _procs import complete_ckpts
from conftest import ROOT, read_metrics, run_train

CURRICULUM = ("--rollout.task", "examples.length_curriculum:growing", "--rollout.max_new_tokens", "128",
              "--training.seq_len", "144", "--optimizer.lr", "1e-2", "--training.steps", "300")


@pytest.mark.parametrize("mode", ["sync", "async", "two ranks"])
def test_a_finished_curriculum_ends_the_run_at_its_last_phase(tmp_path, mode):
    """With two trainer ranks, rank 0's decision reaches rank 1 with the batch (``StepInput.last``): both stop
    after the same step (else one would wait in a collective the other never joins, and the run would hang)."""
    extra = (("--weight_sync.async_weight_update", "true", "--off_policy.async_ratio", "1",
              "--off_policy.max_version_gap", "2", "--checkpoint.enable", "true", "--checkpoint.interval", "1000")
             if mode == "async" else ())
    proc = run_train(tmp_path, *CURRICULUM, *extra, nproc=2 if mode == "two ranks" else 1, timeout=300)
    ends = [json.loads(x) for x in (tmp_path / "curriculum.jsonl").read_text().splitlines()]
    assert [e["length"] for e in ends] == [16, 48, 128] and not any(e["capped"] for e in ends)
    rows = read_metrics(tmp_path)
    last = ends[-1]["end_step"]
    assert rows[-1]["step"] == last < 300  # ended by the task, not by training.steps
    assert f"the task finished at step {last}" in proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_engine_version"] == last and summary["checksums_match"]
    # every step's completions fit its phase's budget (a step after a change may still be of the phase before,
    # dispatched before it: shorter here), and the engines used the longer budgets once they came
    e0, e1 = ends[0]["end_step"], ends[1]["end_step"]
    budget = {r["step"]: 16 if r["step"] <= e0 else 48 if r["step"] <= e1 else 128 for r in rows}
    assert all(r["completion_len_mean"] <= budget[r["step"]] for r in rows)
    assert max(r["completion_len_mean"] for r in rows if r["step"] <= e1) > 16
    assert max(r["completion_len_mean"] for r in rows) > 48
    if mode == "async":  # the final checkpoint is the last step's, as at training.steps
        assert complete_ckpts(tmp_path) == [last]


def test_the_throughput_law_sees_a_longer_budget_coming_and_plots(tmp_path):
    """``adaptive_async.controller = "throughput"`` on the batching engine: the lookahead stays within [1,
    max_version_gap], the budget ratio the feed measures exceeds 1 while the next phase's longer prompts are admitted
    ahead of the steps trained (and not before the first phase ends), and ``scripts/plot_controller.py``
    draws the law's panels from the run."""
    run_train(tmp_path, *CURRICULUM, "--weight_sync.async_weight_update", "true", "--adaptive_async.enabled", "true",
              "--adaptive_async.controller", "throughput", "--off_policy.max_version_gap", "4",
              "--rollout.continuous_batching", "true", "--rollout.in_flight_weight_updates", "true", timeout=300)
    rows = read_metrics(tmp_path)
    assert all(1 <= r["lookahead_target"] <= 4 for r in rows)
    ends = [json.loads(x)["end_step"] for x in (tmp_path / "curriculum.jsonl").read_text().splitlines()]
    ahead = [r["step"] for r in rows if r["budget_ratio"] > 1.0]
    # a phase ends on a step's reward; the steps admitted after it draw the longer budget while the steps trained
    # next were drawn before it: the ratio shows within max_version_gap steps after each of the first two ends
    trace = [(r["step"], r["budget_ratio"], r["lookahead_target"]) for r in rows]
    assert any(0 < s - ends[0] <= 4 for s in ahead) and any(0 < s - ends[1] <= 4 for s in ahead), (ends, trace)
    assert all(r["budget_ratio"] == 1.0 for r in rows if r["step"] <= ends[0]), (ends, trace)
    out = tmp_path / "law.png"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_controller.py"), str(tmp_path), "-o", str(out)],
                   check=True, capture_output=True)
    assert out.stat().st_size > 10_000
