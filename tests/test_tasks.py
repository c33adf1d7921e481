"""Tasks: reproducible prompts per (seed, step) and the reward functions' semantics."""

from __future__ import annotations

import pytest

from torchtitan_flux.tasks import ArithmeticTask, DigitsTask, JsonlTask, Prompt, check_reward


def test_prompts_depend_only_on_seed_and_step():
    t = DigitsTask()
    assert t.prompts(0, 5, 4) == t.prompts(0, 5, 4)
    assert t.prompts(0, 5, 4) != t.prompts(0, 6, 4)
    assert t.prompts(0, 5, 4) != t.prompts(1, 5, 4)


def test_digits_reward_is_dense_fraction():
    t = DigitsTask()
    p = Prompt("abc:")
    assert t.reward(p, "") == 0.0
    assert t.reward(p, "12ab") == 0.5
    assert t.reward(p, "0123456789") == 1.0


def test_arithmetic_extracts_first_integer():
    t = ArithmeticTask()
    p = t.prompts(3, 1, 1)[0]
    a, b = p.text.rstrip("=").split("+")
    assert p.answer == str(int(a) + int(b))
    assert t.reward(p, f" {p.answer} and 7") == 1.0
    assert t.reward(p, f"x{int(p.answer) + 1}") == 0.0
    assert t.reward(p, "no number") == 0.0


def test_jsonl_task(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "hi", "answer": "yo"}\n\n{"prompt": "2", "answer": 3}\n')
    t = JsonlTask(str(path), lambda prompt, completion, answer: float(completion == answer))
    assert {p.text for p in t.prompts(0, 1, 20)} == {"hi", "2"}
    assert t.reward(Prompt("hi", "yo"), "yo") == 1.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1", None, True])
def test_check_reward_rejects_non_numbers(bad):
    with pytest.raises(ValueError, match="finite float"):
        check_reward(DigitsTask(), bad)
