"""Reward functions that misbehave, for the real command (tests/ on ``PYTHONPATH``)."""

from __future__ import annotations

import sys


def closes_stdout(completions, **_):
    """Closes ``sys.stdout`` (a library that "cleans up"), then scores every completion 0."""
    sys.stdout.close()
    return [0.0] * len(completions)
