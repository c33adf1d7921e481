"""The test helpers that count reliability figures must fail when they cannot count (``tests/_procs.py``)."""

from __future__ import annotations

import pytest
from _procs import count_steps_lost, start_step_of


def test_steps_lost_after_a_kill_cannot_be_counted_without_the_checkpoint_line():
    """After a kill, "steps lost" is counted from the newest "checkpoint of step k saved" line; a log without
    one used to count 0 lost (a pass), whatever the resume did."""
    with pytest.raises(AssertionError, match="cannot be counted"):
        count_steps_lost("step 5/40 ...\nstep 6/40 ...\n", trained=6, resumed_at=1, graceful=False)


def test_start_step_is_read_from_the_run_not_assumed():
    assert start_step_of("x\n[titan] INFO - Training starts at step 5\n") == 5
    with pytest.raises(AssertionError, match="no 'Training starts at step k' line"):
        start_step_of("a run that never said where it started")
    with pytest.raises(AssertionError, match="different steps"):
        start_step_of("Training starts at step 5\nTraining starts at step 1\n")
