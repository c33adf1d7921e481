"""Tasks: reproducible prompts per (seed, step) and the built-in rewards' semantics (datasets: test_data.py)."""

from __future__ import annotations

from torchtitan_flux.rewards import RewardScorer
from torchtitan_flux.tasks import DigitsTask, Prompt, reward_inputs


def test_prompts_depend_only_on_seed_and_step():
    t = DigitsTask()
    assert t.prompts(0, 5, 4) == t.prompts(0, 5, 4)
    assert t.prompts(0, 5, 4) != t.prompts(0, 6, 4)
    assert t.prompts(0, 5, 4) != t.prompts(1, 5, 4)


def test_digits_reward_is_dense_fraction():
    t = DigitsTask()
    prompts, completions, columns = reward_inputs(t, [Prompt("abc:")], ["", "12ab", "0123456789"], 3)
    assert RewardScorer(t.reward_funcs).score(prompts, completions, [[]] * 3, columns).total == [0.0, 0.5, 1.0]


def test_eval_prompts_are_held_out():
    t = DigitsTask()
    assert len(t.eval_prompts(0, 0)) == 64 and t.eval_prompts(0, 5) != t.prompts(0, 0, 5)
