"""Tasks: reproducible prompts per (seed, step) and the built-in rewards' semantics (datasets: test_data.py)."""

from __future__ import annotations

from torchtitan_flux.data.rewards import RewardScorer
from torchtitan_flux.data.rewards import reward_inputs
from torchtitan_flux.data.tasks import DigitsTask, Prompt


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


def documented_factory(job_config, tokenizer, dataset_path, dataset_split, field_name):
    """A user's task factory as docs/data.md documents it."""
    from torchtitan_flux.data.tasks import DigitsTask

    return DigitsTask()


def not_a_task(job_config, tokenizer, dataset_path, dataset_split, field_name):
    return ["a prompt"]


def exits(job_config, tokenizer, dataset_path, dataset_split, field_name):
    import sys

    sys.exit("no data today")


def test_user_task_factories_are_called_as_documented_and_their_failures_named():
    """Before 2026-11-25 (issue 27) a factory returning a non-Task, raising or calling sys.exit() failed late, with a
    traceback or silently; now one line naming rollout.task."""
    from types import SimpleNamespace

    import pytest

    from torchtitan_flux.errors import ConfigError
    from torchtitan_flux.data.tasks import DigitsTask, build_task

    def job(task):
        return SimpleNamespace(rollout=SimpleNamespace(task=task, dataset_path="", dataset_split="train",
                                                       reward_funcs=[], reward_weights=[], task_timeout_seconds=60.0,
                                                       environment=""))

    assert isinstance(build_task(job("test_tasks:documented_factory"), None), DigitsTask)
    with pytest.raises(ConfigError, match=r"^rollout.task = 'test_tasks:not_a_task' returned list; allowed: a "
                                          r"torchtitan_flux.data.tasks.Task"):
        build_task(job("test_tasks:not_a_task"), None)
    with pytest.raises(ConfigError, match=r"^rollout.task = 'test_tasks:exits' raised SystemExit: no data today "
                                           r"\(test_tasks\.py:42\)$"):
        build_task(job("test_tasks:exits"), None)
