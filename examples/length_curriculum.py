"""A length curriculum on the digits task: the non-stationary workloads of ``benchmarks/controller.py``
(``--workload growing`` and ``shifting``; docs/controller.md). Use as ``rollout.task =
"examples.length_curriculum:growing"`` (phases of 16, 48, 128 new tokens, like DeepScaleR's 8k -> 16k -> 24k
context schedule) or ``"...:shifting"`` (the same phases reversed), with ``rollout.max_new_tokens`` >= 128.

Phase ``k`` gives every prompt a generation budget of ``L_k`` tokens (``Prompt.max_new_tokens``) and scores a
completion by its digit share times ``min(1, tokens / L_k)``, so it needs about ``L_k`` tokens of digits. A phase
ends when the mean reward of its last ``WINDOW`` scored steps reaches ``TARGET`` (or after ``CAP`` steps); the next
step dispatched gets the next phase. Steps dispatched before the change (in flight in an async run) keep their
phase and do not count for the new one: that is the pipeline's cost at a curriculum change. After the last phase
the task is finished (``Task.finished``) at the step whose reward ended it, and the run ends there.
``DIR/curriculum.jsonl`` (the run's dump folder) gets one line per phase end: ``{"phase", "length", "end_step",
"steps", "capped"}``.

Concurrency: ``prompts`` and ``finished`` run on the trainer's main thread, the reward on the reward pool's
thread; the phase state is under one lock. Simplifications: the state is not checkpointed (a resumed run starts
again at phase 0, and a run resumed from its early end trains the curriculum again); held-out evaluation
(``[eval]``) gets phase 0's prompts, made once at start; a step's reward is the mean over its samples; the
preflight's single scored empty completion of step 1 is overwritten when step 1 is scored.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading

from torchtitan_flux.data import rewards as R
from torchtitan_flux.data.tasks import DigitsTask, Prompt

TARGET = 0.8  # a phase ends when its last WINDOW steps' mean reward reaches this
WINDOW = 5
CAP = 200  # steps of one phase at most


class LengthCurriculum(DigitsTask):
    name = "length_curriculum"

    def __init__(self, lengths: tuple[int, ...], log_path: str):
        super().__init__([R.RewardFunc("length_digits", self.reward)])
        self.lengths, self.log_path = lengths, log_path
        self._lock = threading.Lock()
        self._phase = 0  # the phase of prompts made now
        self._scored: dict[int, float] = {}  # step -> its mean reward, steps of the current phase only
        self._ends: list[int] = []  # the step that ended each finished phase

    def prompts(self, seed: int, step: int, n: int) -> list[Prompt]:
        with self._lock:
            k = min(self._phase, len(self.lengths) - 1)  # after the last phase: more of it (steps in flight)
        L = self.lengths[k]
        return [Prompt(p.text, columns={"step": step, "phase": k}, max_new_tokens=L)
                for p in super().prompts(seed, step, n)]

    def reward(self, completions, completion_ids, step, phase, **_) -> list[float]:
        L = self.lengths[phase[0]]
        values = [share * min(1.0, len(ids) / L)
                  for share, ids in zip(R.digits_reward(completions), completion_ids)]
        if step[0] >= 1:  # step 0: held-out evaluation prompts
            self._record(step[0], phase[0], sum(values) / len(values))
        return values

    def _record(self, step: int, phase: int, mean: float) -> None:
        with self._lock:
            if phase != self._phase:  # dispatched before the last change
                return
            self._scored[step] = mean
            recent = [self._scored[s] for s in sorted(self._scored)[-WINDOW:]]
            capped = len(self._scored) >= CAP
            if not capped and (len(recent) < WINDOW or sum(recent) / WINDOW < TARGET):
                return
            self._ends.append(step)
            self._phase += 1
            end = {"phase": phase, "length": self.lengths[phase], "end_step": step, "steps": len(self._scored),
                   "capped": capped}
            self._scored = {}
        with open(self.log_path, "a") as f:
            f.write(json.dumps(end) + "\n")

    def finished(self, step: int) -> bool:
        with self._lock:
            return len(self._ends) == len(self.lengths) and step >= self._ends[-1]


def _build(job_config, lengths: tuple[int, ...]) -> LengthCurriculum:
    if job_config.rollout.max_new_tokens < max(lengths):
        raise ValueError(f"rollout.max_new_tokens = {job_config.rollout.max_new_tokens} is below the curriculum's "
                         f"longest phase ({max(lengths)} tokens); allowed: >= {max(lengths)}")
    os.makedirs(job_config.dump_folder, exist_ok=True)
    log = os.path.join(job_config.dump_folder, "curriculum.jsonl")
    with contextlib.suppress(FileNotFoundError):  # every rank builds the task; only rank 0's scores write
        os.remove(log)  # a new run's phases (a resume starts the curriculum again)
    return LengthCurriculum(lengths, log)


def growing(job_config, tokenizer, dataset_path, dataset_split, field_name) -> LengthCurriculum:
    """Phases of 16, 48 and 128 new tokens."""
    return _build(job_config, (16, 48, 128))


def shifting(job_config, tokenizer, dataset_path, dataset_split, field_name) -> LengthCurriculum:
    """Phases of 128, 48 and 16 new tokens."""
    return _build(job_config, (128, 48, 16))
