"""Admission of whole steps with error diffusion (``FluxTrainer._admit``): the admitted lookahead averages
``async_ratio * max_version_gap``, never strays half a step from it, and is 0 at lookahead 0."""

from __future__ import annotations

import math
import types

import pytest

from torchtitan_flux.patches import apply_patches

apply_patches()  # what torchtitan_flux.train does before torchtitan is imported (CPU-only torch has no triton)
from torchtitan_flux.trainer import FluxTrainer  # noqa: E402


def admitted(lookaheads, carry: float = 0.0) -> tuple[list[int], float]:
    t = types.SimpleNamespace(admit_carry=carry)
    return [FluxTrainer._admit(t, x) for x in lookaheads], t.admit_carry


@pytest.mark.parametrize("lookahead", [0.0, 0.08, 0.4, 0.5, 1.0, 2.4, 3.75, 4.0])
def test_mean_is_the_lookahead_and_each_admission_is_floor_or_ceil(lookahead):
    got, carry = admitted([lookahead] * 200)
    assert set(got) <= {math.floor(lookahead), math.floor(lookahead) + 1}
    running = 0.0
    for i, a in enumerate(got, 1):
        running += a - lookahead
        assert abs(running) <= 0.5 + 1e-9, (i, running)
    assert abs(sum(got) / len(got) - lookahead) <= 0.5 / len(got) + 1e-9
    assert -0.5 <= carry < 0.5


def test_lookahead_zero_never_admits_ahead_whatever_came_before():
    # a controller that goes from fractional lookaheads to 0 (a forced sync) leaves a residual behind
    _, carry = admitted([0.3, 1.7, 2.45, 0.49])
    got, _ = admitted([0.0] * 10, carry)
    assert got == [0] * 10


def test_a_changing_lookahead_is_tracked_in_the_mean():
    ramp = [4 * i / 99 for i in range(100)]
    got, _ = admitted(ramp)
    assert abs(sum(got) - sum(ramp)) <= 0.5 + 1e-9
