"""Held-out evaluation through the rollout engines (``[eval]``; metrics and timing: docs/data.md).

Rank 0 sends the held-out prompts to the training engines, pinned to the newest policy version sent to them, and
scores the completions with the task's reward functions. With ``rollout.environment`` each held-out prompt is a
group of ``eval.n`` episodes, scored like the training's. A synchronous run waits for the evaluation at its step;
an asynchronous one picks the results up at the first step that ends after they are scored, and waits only when
the next evaluation is due before the previous one finished, and at the last step.

Concurrency: main thread only (``Rollouts.start_eval`` and ``eval_scores``); scoring runs on the reward pool.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Protocol

from torchtitan_flux.data.rewards import Scores
from torchtitan_flux.data.tasks import Prompt, Task, task_eval_prompts


class EvalEngines(Protocol):
    """What evaluation uses of rank 0's rollout side (``rollouts.Rollouts``)."""

    max_new_tokens: int
    task_timeout_s: float

    def start_eval(self, prompts: list[Prompt], prompt_ids: list[list[int]], n: int, temperature: float,
                   version: int) -> None: ...

    def eval_scores(self, version: int, task: Task, wait: bool) -> Scores | None: ...


@dataclass
class _Run:
    version: int
    started: float


class Evaluator:
    def __init__(self, eval_cfg, task: Task, rollouts: EvalEngines, tokenizer, seed: int, dump_folder: str,
                 wait: bool):
        self.cfg, self.task, self.rollouts, self.tokenizer = eval_cfg, task, rollouts, tokenizer
        self.seed, self.wait = seed, wait
        self.prompts: list[Prompt] = task_eval_prompts(task, seed, eval_cfg.num_prompts, rollouts.max_new_tokens,
                                                       rollouts.task_timeout_s)
        self.prompt_ids = [tokenizer.encode(p.text, add_bos=p.add_bos, add_eos=False) for p in self.prompts]
        self.path = os.path.join(dump_folder, "eval.jsonl")
        self._runs: list[_Run] = []

    def due(self, step: int) -> bool:
        return self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0

    def start(self, version: int) -> None:
        """Send the held-out prompts for policy ``version`` (call once the engines can get that version)."""
        self.rollouts.start_eval(self.prompts, self.prompt_ids, self.cfg.n, self.cfg.temperature, version)
        self._runs.append(_Run(version, time.perf_counter()))

    def after_step(self, step: int, version: int, last: bool) -> dict[str, float]:
        """Rank 0, after training step ``step``: start the evaluation of ``version`` (the newest policy the engines
        get) when due, and return the metrics of the newest evaluation finished (waiting when ``wait`` or at the
        ``last`` step). One evaluation is in flight at a time."""
        earlier = None
        if self.due(step):
            if self._runs:
                earlier = self.collect(wait=True)
            self.start(version)
        return self.collect(wait=self.wait or last) or earlier or {}

    def collect(self, wait: bool) -> dict[str, float] | None:
        """Metrics of the newest evaluation finished (waiting for all of them when ``wait``); None when none is."""
        newest = None
        while self._runs:
            run = self._runs[0]
            scores = self.rollouts.eval_scores(run.version, self.task, wait)
            if scores is None:
                break
            self._runs.pop(0)
            newest = self._metrics(run, scores)
            with open(self.path, "a") as f:
                f.write(json.dumps(newest) + "\n")
        return newest

    def _metrics(self, run: _Run, scores: Scores) -> dict[str, float]:
        n = self.cfg.n
        passed = [t >= self.cfg.pass_threshold for t in scores.total]
        per_prompt = [passed[i : i + n] for i in range(0, len(passed), n)]
        out = {
            "eval/version": run.version,
            "eval/reward_mean": sum(scores.total) / len(scores.total),
            "eval/pass@1": sum(sum(g) / n for g in per_prompt) / len(per_prompt),
            "eval/num_prompts": len(per_prompt),
            "eval/time_s": time.perf_counter() - run.started,
        }
        if n > 1:
            out[f"eval/pass@{n}"] = sum(any(g) for g in per_prompt) / len(per_prompt)
        for k, v in scores.metrics().items():
            if k.endswith("/mean"):
                out[f"eval/{k}"] = v
        return out
