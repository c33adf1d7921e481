"""Step callbacks that the tests name in ``metrics.step_callbacks``: each appends what it got, as a JSON line, to the
file named by ``$FLUX_TEST_CALLBACKS``."""

from __future__ import annotations

import json
import os


def _write(form: str, step: int, metrics: dict) -> None:
    with open(os.environ["FLUX_TEST_CALLBACKS"], "a") as f:
        f.write(json.dumps({"form": form, "step": step, "loss": metrics["loss"], "pid": os.getpid()}) + "\n")


def tutorial_form(result):
    """The seed tutorial's ``@trainer.add_step_callback`` form."""
    _write("result", result.step, result.metrics)


def step_and_metrics(step, metrics):
    _write("pair", step, metrics)


def three_arguments(step, metrics, extra):
    _write("three", step, metrics)


NOT_CALLABLE = 3


def exits_at_step_2(step, metrics):
    """Ends the run the way a user's script might: ``sys.exit("reason")`` (before 2026-11-25: exit 0, no export,
    no message, the reason lost)."""
    import sys

    if step == 2:
        sys.exit("enough for today")


def stop_the_engine_after_step_2(step, metrics):
    """SIGSTOP this trainer's embedded engine processes once step 2 ended (a stopped engine: it reads nothing,
    answers nothing), and write their pids to ``$FLUX_TEST_CALLBACKS``."""
    import signal

    import psutil

    if step != 2:
        return
    engines = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("flux-engine")]
    for p in engines:
        p.send_signal(signal.SIGSTOP)
    with open(os.environ["FLUX_TEST_CALLBACKS"], "a") as f:
        f.write(json.dumps({"stopped": [p.pid for p in engines]}) + "\n")
