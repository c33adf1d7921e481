"""A task's own code (``prompts``, ``eval_prompts``, ``finished``) is user code: whatever it raises, returns wrongly
or how long it hangs ends in one ``UserCodeError`` line naming the task and the call. Before 2026-11-27 only
``finished`` was wrapped (and only for ``Exception``): ``prompts`` raising, returning ``[]``, a ``str`` or ``None``
were tracebacks, ``Prompt("")`` or a wrong count were trained on silently, ``sys.exit(0)`` in ``finished`` ended the
run with exit code 0 and nothing written, and a ``finished`` that never returned had no deadline."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from torchtitan_flux.data.tasks import DigitsTask, Prompt, check_prompts, task_eval_prompts, task_finished, \
    task_prompts
from torchtitan_flux.errors import RolloutWaitInterrupted, UserCodeError
from torchtitan_flux.user_code import describe_exception


class Unprintable(Exception):
    def __str__(self):
        raise ValueError("no")


def _task(prompts=None, finished=None):
    class T(DigitsTask):
        name = "mine"

        def prompts(self, seed, step, n):
            return prompts(n) if prompts else super().prompts(seed, step, n)

        def finished(self, step):
            return finished() if finished else False

    return T()


def _raise(e):
    raise e


PROMPT_CASES = [
    (lambda n: _raise(RuntimeError("no data")), "prompts(seed=0, step=3, n=4) raised RuntimeError: no data"),
    (lambda n: sys.exit("why"), "prompts(seed=0, step=3, n=4) raised SystemExit: why"),
    (lambda n: _raise(KeyboardInterrupt()), "prompts(seed=0, step=3, n=4) raised KeyboardInterrupt"),
    (lambda n: _raise(Unprintable()), "raised Unprintable: (its message cannot be read)"),
    (lambda n: [], "returned 0 prompts; allowed: 4"),
    (lambda n: [Prompt("a")] * (n - 1), "returned 3 prompts; allowed: 4"),
    (lambda n: [Prompt("a")] * (2 * n), "returned 8 prompts; allowed: 4"),
    (lambda n: "abc", "returned str 'abc'; allowed: a list of 4 Prompt objects"),
    (lambda n: None, "returned NoneType None; allowed: a list of 4 Prompt objects"),
    (lambda n: ["a"] * n, "item 0 is str 'a'; allowed: a Prompt"),
    (lambda n: [Prompt("")] * n, "prompt 0 has text ''; allowed: a non-empty string"),
    (lambda n: [Prompt(None)] * n, "prompt 0 has text None; allowed: a non-empty string"),
    (lambda n: [Prompt("a", max_new_tokens="8")] * n, "prompt 0 has max_new_tokens '8'; allowed: an integer from 0"),
    (lambda n: [Prompt("a", max_new_tokens=2.5)] * n, "prompt 0 has max_new_tokens 2.5; allowed: an integer from 0"),
    (lambda n: [Prompt("a", max_new_tokens=True)] * n, "prompt 0 has max_new_tokens True; allowed"),
    (lambda n: [Prompt("a", max_new_tokens=33)] * n, "max_new_tokens 33; allowed: an integer from 0 "
                                                     "(rollout.max_new_tokens) to rollout.max_new_tokens = 32"),
    (lambda n: [Prompt("a", max_new_tokens=-1)] * n, "max_new_tokens -1"),
    (lambda n: [Prompt("a", answer=7)] * n, "prompt 0 has answer 7, columns dict, add_bos True; allowed: a string"),
    (lambda n: [Prompt("a", columns=[1])] * n, "prompt 0 has answer '', columns list"),
    (lambda n: [Prompt("a", add_bos="no")] * n, "add_bos 'no'; allowed: a string, a dict and a bool"),
]


@pytest.mark.parametrize("make,message", PROMPT_CASES)
def test_bad_prompts_are_one_line_naming_the_task_and_the_call(make, message):
    with pytest.raises(UserCodeError) as e:
        task_prompts(_task(prompts=make), 0, 3, 4, 32, timeout_s=10)
    assert str(e.value).startswith("task 'mine': prompts(seed=0, step=3, n=4)") and message in str(e.value), e.value
    assert "\n" not in str(e.value)


def test_good_prompts_pass_unchanged():
    good = [Prompt("a", max_new_tokens=0), Prompt("b", max_new_tokens=32)]
    assert task_prompts(_task(prompts=lambda n: good), 0, 1, 2, 32, timeout_s=10) is good
    assert len(task_prompts(DigitsTask(), 0, 1, 4, 32, timeout_s=10)) == 4
    assert check_prompts("x", good, None, 32) is good  # eval: any count of one or more


def test_eval_prompts_are_checked_too():
    with pytest.raises(UserCodeError, match=r"^task 'mine': eval_prompts\(seed=0, n=0\) returned 0 prompts; "
                                            r"allowed: one or more$"):
        task_eval_prompts(_task(prompts=lambda n: []), 0, 0, 32, timeout_s=10)


@pytest.mark.parametrize("finished,message", [
    (lambda: sys.exit(0), "finished(5) raised SystemExit"),
    (lambda: _raise(KeyboardInterrupt()), "finished(5) raised KeyboardInterrupt"),
    (lambda: "yes", "finished(5) returned str 'yes'; allowed: True or False"),
    (lambda: None, "finished(5) returned NoneType None; allowed: True or False"),
])
def test_a_bad_finished_is_one_line(finished, message):
    with pytest.raises(UserCodeError) as e:
        task_finished(_task(finished=finished), 5, timeout_s=10)
    assert str(e.value).startswith(f"task 'mine': {message}"), e.value


def test_a_finished_that_never_returns_stops_at_its_deadline():
    release = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(UserCodeError, match=r"^task 'mine': finished\(2\) did not return within "
                                            r"rollout.task_timeout_seconds = 0.3 s"):
        task_finished(_task(finished=release.wait), 2, timeout_s=0.3)
    assert time.monotonic() - t0 < 10  # a bound that tells "ended" from "hung" under any load
    release.set()


def test_a_signal_ends_the_wait_for_hanging_task_code():
    """The first signal sets the scheduler's ``interrupted`` flag: the wait ends at once (within a slice)."""
    release, flag = threading.Event(), []
    threading.Timer(0.2, flag.append, args=(True,)).start()
    t0 = time.monotonic()
    with pytest.raises(RolloutWaitInterrupted, match="interrupted while waiting for task 'mine': prompts"):
        task_prompts(_task(prompts=lambda n: release.wait()), 0, 1, 4, 32, timeout_s=60, interrupted=lambda: bool(flag))
    assert time.monotonic() - t0 < 10  # a bound that tells "ended" from "hung" under any load
    release.set()


def test_an_exception_whose_str_raises_is_still_described():
    assert describe_exception(Unprintable()) == "Unprintable: (its message cannot be read)"
    assert describe_exception(ValueError("two\nlines")) == "ValueError: two"


def test_a_step_callback_that_never_returns_stops_at_its_deadline():
    """Step callbacks are user code too: before 2026-11-27 one that hung had no deadline."""
    from torchtitan_flux.user_code import step_callback

    release = threading.Event()
    guarded = step_callback(lambda step, metrics: release.wait(), "step callback 'mine:cb'", timeout_s=0.3)
    with pytest.raises(UserCodeError, match=r"^step callback 'mine:cb' did not return within "
                                            r"metrics.step_callback_timeout_seconds = 0.3 s"):
        guarded(1, {})
    release.set()
    with pytest.raises(UserCodeError, match=r"^step callback 'mine:cb' raised KeyboardInterrupt \(test_task_user_code.py:40\)$"):
        step_callback(lambda step, metrics: _raise(KeyboardInterrupt()), "step callback 'mine:cb'")(1, {})


def test_a_task_factory_that_never_returns_is_refused_at_its_deadline(tmp_path):
    """A user's task factory runs under ``rollout.task_timeout_seconds`` too (before: only a signal ended it)."""
    from types import SimpleNamespace

    from torchtitan_flux.data.tasks import build_task
    from torchtitan_flux.errors import ConfigError

    release = threading.Event()
    sys.modules["_hanging_factory"] = SimpleNamespace(make=lambda *a: release.wait())
    try:
        job = SimpleNamespace(rollout=SimpleNamespace(task="_hanging_factory:make", dataset_path="", dataset_split="",
                                                      reward_funcs=[], reward_weights=[], task_timeout_seconds=0.3))
        with pytest.raises(ConfigError, match=r"^rollout.task = '_hanging_factory:make' did not return within "
                                              r"rollout.task_timeout_seconds = 0.3 s"):
            build_task(job, tokenizer=None)
    finally:
        release.set()
        del sys.modules["_hanging_factory"]
