"""Tasks: where prompts come from and how completions are scored.

A task yields ``Prompt(text, answer)`` records for a training step from a generator seeded by (seed, step), so
the prompts of every step are reproducible after a resume without any dataloader state. Rewards are floats;
the trainer rejects a reward that is not a finite number with an error naming the task.

* ``digits`` — dense sanity task: reward = fraction of the completion's characters (before EOS) that are
  ASCII digits; an empty completion scores 0. A random-init byte-level model starts near 10/259 and learns it in
  minutes on CPU.
* ``arithmetic`` — "a+b=" with a, b in [0, 50): reward 1 if the first integer in the completion equals a+b.
* ``jsonl`` — the user's ``{"prompt", "answer"}`` records (sampled uniformly with replacement), scored by the
  user's ``reward_fn(prompt, completion, answer) -> float`` named "package.module:function".
"""

from __future__ import annotations

import importlib
import json
import math
import random
import re
import string
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Prompt:
    text: str
    answer: str = ""


RewardFn = Callable[[str, str, str], float]


class Task:
    """A prompt source and a reward function."""

    name: str

    def prompts(self, seed: int, step: int, n: int) -> list[Prompt]:
        raise NotImplementedError

    def reward(self, prompt: Prompt, completion: str) -> float:
        raise NotImplementedError


def _rng(seed: int, step: int) -> random.Random:
    return random.Random(seed * 1_000_003 + step)


class DigitsTask(Task):
    name = "digits"

    def prompts(self, seed: int, step: int, n: int) -> list[Prompt]:
        rng = _rng(seed, step)
        return [Prompt("".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8))) + ":") for _ in range(n)]

    def reward(self, prompt: Prompt, completion: str) -> float:
        return sum(c.isdigit() for c in completion) / len(completion) if completion else 0.0


class ArithmeticTask(Task):
    name = "arithmetic"
    _INT = re.compile(r"-?\d+")

    def prompts(self, seed: int, step: int, n: int) -> list[Prompt]:
        rng = _rng(seed, step)
        out = []
        for _ in range(n):
            a, b = rng.randrange(50), rng.randrange(50)
            out.append(Prompt(f"{a}+{b}=", str(a + b)))
        return out

    def reward(self, prompt: Prompt, completion: str) -> float:
        m = self._INT.search(completion)
        return 1.0 if m is not None and m.group(0) == prompt.answer else 0.0


class JsonlTask(Task):
    name = "jsonl"

    def __init__(self, path: str, reward_fn: RewardFn):
        self.records = []
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    self.records.append(Prompt(str(rec["prompt"]), str(rec.get("answer", ""))))
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(
                        f"rollout.dataset_path = {path!r} line {lineno}: expected a JSON object with a 'prompt' "
                        f"(and optional 'answer') field: {e}"
                    ) from e
        if not self.records:
            raise ValueError(f"rollout.dataset_path = {path!r} holds no records")
        self.reward_fn = reward_fn

    def prompts(self, seed: int, step: int, n: int) -> list[Prompt]:
        rng = _rng(seed, step)
        return [self.records[rng.randrange(len(self.records))] for _ in range(n)]

    def reward(self, prompt: Prompt, completion: str) -> float:
        return self.reward_fn(prompt.text, completion, prompt.answer)


def load_reward_fn(spec: str) -> RewardFn:
    mod, _, attr = spec.partition(":")
    return getattr(importlib.import_module(mod), attr)


def build_task(rollout_cfg) -> Task:
    if rollout_cfg.task == "digits":
        return DigitsTask()
    if rollout_cfg.task == "arithmetic":
        return ArithmeticTask()
    return JsonlTask(rollout_cfg.dataset_path, load_reward_fn(rollout_cfg.reward_fn))


def check_reward(task: Task, value: object) -> float:
    """Rewards must be finite real numbers; anything else is the user's bug and stops the run."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(
            f"reward function of task {task.name!r} returned {value!r}; it must return a finite float"
        )
    return float(value)
