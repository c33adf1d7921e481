"""Reward functions with TRL's signature, scored off the trainer's main loop (the contract: docs/data.md).

    f(prompts, completions, completion_ids=..., **columns) -> list[float | None]

Every argument holds one entry per completion; ``None`` means "not applicable" and counts as 0 in the weighted
total (TRL's ``nansum``). A function that raises, returns a bad value or runs past
``rollout.reward_timeout_seconds`` fails the batch with a ``RewardError`` naming it; the run stops with that line.

Concurrency: ``RewardScorer.submit`` hands a batch to a thread pool (``rollout.reward_workers`` threads) and returns
a ``Future`` that the main thread waits on only when it needs that step's batch, so scoring overlaps training in
async mode. Async functions of one batch run concurrently on one event loop in the worker thread. A reward function
must be thread-safe when ``reward_workers > 1``. A timed-out function's thread cannot be killed: the run ends
instead of waiting on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import re
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable

from torchtitan_flux.errors import RewardError
from torchtitan_flux.user_code import describe_exception


@dataclass(frozen=True)
class RewardFunc:
    name: str  # "package.module:function", or the built-in's name
    fn: Callable[..., Any]  # TRL's batched signature
    weight: float = 1.0


@dataclass
class Scores:
    """One batch's rewards: ``total[i]`` = sum over functions of weight * value (``None`` -> 0)."""

    total: list[float]
    per_func: dict[str, list[float | None]]

    @staticmethod
    def concat(parts: list["Scores"]) -> "Scores":
        """The scores of several batches (each with the same functions), one after the other."""
        names = list(parts[0].per_func) if parts else []
        return Scores([t for p in parts for t in p.total], {n: [v for p in parts for v in p.per_func[n]] for n in names})

    def metrics(self) -> dict[str, float]:
        out = {}
        for name, values in self.per_func.items():
            present = [v for v in values if v is not None]
            mean = sum(present) / len(present) if present else math.nan
            var = sum((v - mean) ** 2 for v in present) / len(present) if present else math.nan
            out[f"rewards/{name}/mean"] = mean
            out[f"rewards/{name}/std"] = math.sqrt(var)
        return out


def reward_inputs(task, prompts: list, completions: list[str], group_size: int):
    """TRL's reward arguments for ``completions`` (``group_size`` per prompt, in order) of ``prompts``
    (``data.tasks.Prompt``s of ``task``): (prompts, completions, columns), conversational for chat tasks."""
    rows = [p for p in prompts for _ in range(group_size)]
    if task.chat:
        p_in = [p.messages for p in rows]
        c_in = [[{"role": "assistant", "content": c}] for c in completions]
    else:
        p_in, c_in = [p.text for p in rows], list(completions)
    keys = list(dict.fromkeys(k for p in prompts for k in p.columns))
    columns = {k: [p.columns.get(k) for p in rows] for k in keys}
    return p_in, c_in, columns


class RewardScorer:
    """Scores batches with a list of ``RewardFunc`` on a thread pool (see the module docstring)."""

    def __init__(self, funcs: list[RewardFunc], workers: int = 1, timeout_s: float = 300.0):
        if not funcs:
            raise ValueError("a task needs at least one reward function")
        self.funcs = list(funcs)
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="flux-reward")
        self._lock = threading.Lock()
        self._running: dict[int, tuple[str, float]] = {}  # worker thread id -> (function(s) it runs, since when)

    def submit(self, prompts: list, completions: list, completion_ids: list[list[int]], columns: dict[str, list]) -> Future:
        return self._pool.submit(self.score, prompts, completions, completion_ids, columns)

    def wait(self, future: Future, interrupted=lambda: False) -> Scores:
        """``future``'s scores (any thread). Raises ``RewardError`` naming a reward function that has been running
        for more than ``timeout_s`` (on this batch or another: the pool is stuck either way), and returns None at
        once when ``interrupted()`` (a stop was asked for; the caller stops)."""
        while True:
            try:
                return future.result(timeout=0.1)
            except FutureTimeout:
                pass
            if interrupted():
                return None
            now = time.monotonic()
            with self._lock:
                late = [(name, now - t0) for name, t0 in self._running.values() if now - t0 > self.timeout_s]
            if late:
                name, took = late[0]
                raise RewardError(f"reward function {name!r} did not return within rollout.reward_timeout_seconds = "
                                  f"{self.timeout_s:g} ({took:.0f} s); the run stops (the function's thread cannot "
                                  "be interrupted)")

    @contextlib.contextmanager
    def _calling(self, name: str):
        """Marks this worker thread as running ``name`` (for ``wait``'s deadline)."""
        with self._lock:
            self._running[threading.get_ident()] = (name, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                self._running.pop(threading.get_ident(), None)

    def score(self, prompts: list, completions: list, completion_ids: list[list[int]], columns: dict[str, list]) -> Scores:
        kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns}
        results: dict[str, Any] = {}
        coros = {}
        for f in self.funcs:
            try:
                with self._calling(f.name):  # lists of its own: a function that edits one misleads no other
                    out = f.fn(**{k: list(v) for k, v in kwargs.items()})
            except BaseException as e:  # noqa: BLE001 - sys.exit() would end the run silently, KeyboardInterrupt
                # (raised by the function: a signal goes to the main thread) with a traceback
                raise RewardError(f"reward function {f.name!r} raised {describe_exception(e)}") from e
            if sys.stdout.closed or sys.stderr.closed:  # every later log line would fail far from here
                raise RewardError(f"reward function {f.name!r} closed sys.{'stdout' if sys.stdout.closed else 'stderr'}"
                                  "; allowed: leave the process's standard streams open")
            if inspect.isawaitable(out):
                coros[f.name] = out
            else:
                results[f.name] = out
        if coros:
            with self._calling(", ".join(coros)):
                results.update(asyncio.run(_gather(coros)))
        n = len(completions)
        per_func = {f.name: _check(f.name, results[f.name], n) for f in self.funcs}
        total = [
            sum(f.weight * v for f in self.funcs if (v := per_func[f.name][i]) is not None) for i in range(n)
        ]
        for i, t in enumerate(total):
            if not abs(t) <= FLOAT32_MAX:
                parts = ", ".join(f"{f.name!r} {per_func[f.name][i]!r} x weight {f.weight:g}" for f in self.funcs)
                raise RewardError(f"the weighted reward of sample {i} is {t!r} ({parts}): beyond float32, which "
                                  "the batch trains in; allowed: rollout.reward_weights and reward values whose "
                                  f"weighted sum is within +-{FLOAT32_MAX:.3g}")
        return Scores([float(t) for t in total], per_func)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


async def _gather(coros: dict[str, Any]) -> dict[str, Any]:
    outs = await asyncio.gather(*(_guarded(name, c) for name, c in coros.items()), return_exceptions=True)
    for out in outs:
        if isinstance(out, BaseException):
            raise out
    return dict(zip(coros, outs))


async def _guarded(name: str, coro: Any) -> Any:
    """``coro``'s value; its exception (``SystemExit`` and ``KeyboardInterrupt`` included) as a ``RewardError``."""
    try:
        return await coro
    except BaseException as e:  # noqa: BLE001
        raise RewardError(f"reward function {name!r} raised {describe_exception(e)}") from e


def _check(name: str, values: Any, n: int) -> list[float | None]:
    if getattr(values, "ndim", None) == 1 and hasattr(values, "tolist"):  # a numpy array or torch tensor
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardError(f"reward function {name!r} returned {type(values).__name__}; it must return a list of "
                          f"{n} floats (or None for 'not applicable')")
    if len(values) != n:
        raise RewardError(f"reward function {name!r} returned {len(values)} values for {n} completions")
    out: list[float | None] = []
    for i, v in enumerate(values):
        if v is None:
            out.append(None)
            continue
        if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:  # numpy / torch scalars
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not _within_float32(v):
            raise RewardError(f"reward function {name!r} returned {_short(v)} for sample {i}; allowed: a finite "
                              f"number within +-{FLOAT32_MAX:.3g} (float32, which the batch trains in: float, int, "
                              "numpy scalar, 0-d tensor) or None")
        out.append(float(v))
    return out


FLOAT32_MAX = 3.4028234663852886e38  # rewards become a float32 tensor (RolloutBatch.rewards)


def _within_float32(v: int | float) -> bool:
    try:
        return abs(float(v)) <= FLOAT32_MAX  # False for nan and inf; float(10**400) raises
    except OverflowError:
        return False


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


# --------------------------------------------------------------------------------------------- answers

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _normalize(ans: str) -> str:
    s = ans.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    try:
        x = float(s)
    except ValueError:
        return s
    return str(int(x)) if x.is_integer() else repr(x)


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a completion or a GSM8K solution: the text after the last ``####``, else the last
    ``\\boxed{...}``, else the last number, normalised (``_normalize``); None when there is none."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1]
        m = _NUMBER.search(tail)
        return _normalize(m.group(0)) if m else (_normalize(tail) or None)
    boxed = _last_boxed(text)
    if boxed is not None:
        return _normalize(boxed)
    nums = _NUMBER.findall(text)
    return _normalize(nums[-1]) if nums else None


def gold_answer(answer: str) -> str | None:
    """The reference answer of a GSM8K record: the part after ``####`` (or the whole string when absent)."""
    return extract_answer(str(answer)) if "####" in str(answer) else _normalize(str(answer))


ENV_REWARDS_COLUMN = "env_rewards"  # multi-turn: each episode's env_rewards, one dict per environment step
EPISODE_END_COLUMN = "episode_end"  # multi-turn: how each episode ended ("done", "max_turns", "max_tokens")
ENV_REWARD_NAME = "environment"  # the reward that sums env_rewards (rollout.environment_reward_weight)


def environment_reward(completions, env_rewards=None, **_) -> list[float | None]:
    """Multi-turn episodes: the sum of every value of every ``env_rewards`` dict the environment returned in the
    episode (0.0 when it returned none, a truncated episode's usual case); None for samples that are no episodes."""
    if env_rewards is None:
        return [None] * len(completions)
    return [float(sum(sum(step.values()) for step in steps)) for steps in env_rewards]


def _text(completion: Any) -> str:
    """A completion's text: a conversation's last message (none: an episode that generated no turn), or the text."""
    if isinstance(completion, list):
        return completion[-1]["content"] if completion else ""
    return completion


def answer_match_reward(completions, answer, **_) -> list[float]:
    """1.0 when the completion's final answer (``extract_answer``) equals the record's (``gold_answer``), else 0.0."""
    return [float(extract_answer(_text(c)) == gold_answer(a)) for c, a in zip(completions, answer)]


def math_verify_reward(completions, answer, **_) -> list[float]:
    """1.0 when ``math_verify`` (``pip install math-verify``) finds the completion equivalent to the gold answer."""
    from math_verify import parse, verify

    out = []
    for c, a in zip(completions, answer):
        gold = parse(gold_answer(a) or "")
        pred = parse(_text(c))
        out.append(float(bool(gold) and bool(pred) and verify(gold, pred)))
    return out


def digits_reward(completions, **_) -> list[float]:
    """Fraction of the completion's characters that are ASCII digits (0 for an empty completion)."""
    return [sum(ch.isdigit() for ch in c) / len(c) if c else 0.0 for c in map(_text, completions)]
