"""``examples/length_curriculum.py``, the non-stationary workloads of ``benchmarks/controller.py``: phases advance on
the trailing mean reward of their own steps, steps dispatched before a change do not count for the new phase,
every prompt carries its phase's budget, and the task is finished at the step that ended the last phase."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from examples import length_curriculum as C


def curriculum(tmp_path, lengths=(16, 48, 128), max_new_tokens=128):
    cfg = SimpleNamespace(rollout=SimpleNamespace(max_new_tokens=max_new_tokens),
                          dump_folder=str(tmp_path))
    return C._build(cfg, lengths)


def score(task, step: int, tokens: int, digits: bool = True) -> list[float]:
    """Score 4 completions of ``step``'s prompts, each ``tokens`` long, all digits (or all letters)."""
    prompts = task.prompts(0, step, 4)
    text = ("7" if digits else "x") * tokens
    return task.reward(completions=[text] * 4, completion_ids=[[0] * tokens] * 4,
                       step=[p.columns["step"] for p in prompts], phase=[p.columns["phase"] for p in prompts])


def test_phases_advance_on_their_own_trailing_reward_and_the_task_finishes_at_the_last_end(tmp_path):
    task = curriculum(tmp_path)
    assert {p.max_new_tokens for p in task.prompts(0, 1, 4)} == {16}
    assert score(task, 1, 8) == [0.5] * 4  # digits, but half the phase's length
    assert score(task, 2, 16, digits=False) == [0.0] * 4
    for s in range(3, 7):  # steps 2-6: the window's mean is 0.8 at step 6
        score(task, s, 16)
    assert {p.max_new_tokens for p in task.prompts(0, 7, 4)} == {48} and not task.finished(6)
    assert score(task, 7, 16) == pytest.approx([1 / 3] * 4)
    old = task.prompts(0, 8, 4)  # phase 1: dispatched before the next change
    score(task, 9, 48, digits=False)
    for s in range(10, 13):
        score(task, s, 48)
        assert {p.max_new_tokens for p in task.prompts(0, s + 1, 4)} == {48}  # 7, 9-12: mean 0.67 < 0.8
    score(task, 13, 48)  # 9-13: 0.8
    assert {p.max_new_tokens for p in task.prompts(0, 14, 4)} == {128}
    task.reward(completions=["7"] * 4, completion_ids=[[0]] * 4, step=[8] * 4, phase=[p.columns["phase"] for p in old])
    for s in range(14, 19):  # the late step 8 (phase 1) did not count for phase 2
        assert not task.finished(s)
        score(task, s, 128)
    assert not task.finished(17) and task.finished(18) and task.finished(19)
    assert {p.max_new_tokens for p in task.prompts(0, 20, 4)} == {128}  # steps in flight after the end: the last
    ends = [json.loads(x) for x in open(tmp_path / "curriculum.jsonl")]
    assert [(e["phase"], e["length"], e["end_step"], e["steps"], e["capped"]) for e in ends] == [
        (0, 16, 6, 6, False), (1, 48, 13, 6, False), (2, 128, 18, 5, False)]


def test_a_phase_ends_at_its_cap_and_evaluation_prompts_do_not_count(tmp_path, monkeypatch):
    monkeypatch.setattr(C, "CAP", 3)
    task = curriculum(tmp_path, lengths=(128, 16))
    assert {p.max_new_tokens for p in task.prompts(0, 1, 2)} == {128}
    score(task, 0, 128)  # step 0: held-out evaluation prompts
    for s in (1, 2):
        score(task, s, 4, digits=False)
    assert {p.max_new_tokens for p in task.prompts(0, 3, 2)} == {128}
    score(task, 3, 4, digits=False)
    assert {p.max_new_tokens for p in task.prompts(0, 4, 2)} == {16}
    assert json.loads(open(tmp_path / "curriculum.jsonl").read())["capped"] is True


def test_a_budget_above_rollout_max_new_tokens_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"rollout.max_new_tokens = 64 is below the curriculum's longest phase "
                                         r"\(128 tokens\); allowed: >= 128"):
        curriculum(tmp_path, max_new_tokens=64)
