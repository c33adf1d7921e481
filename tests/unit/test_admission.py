"""``OffPolicyControl``: whole steps admitted with error diffusion (the admitted lookahead averages
``async_ratio * max_version_gap``, never strays half a step from it, and is 0 at lookahead 0), the lookahead's cap
under ``weight_sync.interval``, which steps push, the staleness bound, rank 0's decision adopted by the other
ranks, and its checkpointed state."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from torchtitan_flux.rl.controller import StalenessSample
from torchtitan_flux.rl.off_policy import STALE_BAND, OffPolicyControl
from torchtitan_flux.config import AdaptiveAsync, OffPolicy, WeightSync

GAP = 8


def admission(ratio: float = 0.0, **ws) -> OffPolicyControl:
    return OffPolicyControl(OffPolicy(max_version_gap=GAP, async_ratio=ratio), AdaptiveAsync(), WeightSync(**ws),
                            total_steps=100)


def admitted(lookaheads, carry: float = 0.0) -> tuple[list[int], float]:
    a = admission()
    a.carry = carry
    out = []
    for x in lookaheads:
        a.async_ratio = x / GAP
        out.append(a.admit())
    return out, a.carry


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


def test_interval_caps_the_lookahead_and_picks_the_pushing_steps():
    """Engines may hold weights up to interval - 1 steps old, so generation runs at most gap - (interval - 1)
    steps ahead; a forced sync step admits nothing ahead and is on-policy."""
    a = admission(1.0, async_weight_update=True, interval=3)
    assert a.async_ratio == 1.0 and a.lookahead == GAP - 2
    assert [s for s in range(1, 10) if a.push_due(s)] == [3, 6, 9]
    a.force_sync = True
    assert a.lookahead == 0.0 and a.on_policy and a.admit() == 0
    blocking = admission(async_weight_update=False)
    assert blocking.on_policy and blocking.lookahead == 0.0


def test_state_round_trips_in_one_dict():
    a = admission(1.0, async_weight_update=True)
    a.async_ratio, a.force_sync, a.carry, a.discarded_rollouts = 0.35, True, -0.25, 12
    state = a.state_dict()
    assert set(state) == {"async_ratio", "force_sync", "admit_carry", "discarded_rollouts", "controller", "cadence",
                          "pipeline_depth", "throughput"}
    b = admission(1.0, async_weight_update=True)
    b.load_state_dict(state)
    assert (b.async_ratio, b.force_sync, b.carry, b.discarded_rollouts) == (0.35, True, -0.25, 12)


def test_staleness_is_bounded_in_one_place_and_a_stale_batch_is_counted():
    """``oldest``: the engines' ``min_version`` and the feed's catch-up; ``accept``: the feed's discard."""
    a = admission(1.0)
    assert a.oldest(10) == 10 - GAP
    fresh = SimpleNamespace(versions=torch.tensor([10 - GAP, 10]), tokens=torch.zeros(2, 3))
    stale = SimpleNamespace(versions=torch.tensor([9 - GAP, 10, 10]), tokens=torch.zeros(3, 3))
    assert a.accept(11, 10, fresh) and a.discarded_rollouts == 0
    assert not a.accept(11, 10, stale) and a.discarded_rollouts == 3


def test_other_ranks_adopt_rank_0s_decision_and_replay_its_admission():
    ws = dict(async_weight_update=True, interval="auto")
    rank0, rank1 = admission(0.3, **ws), admission(0.3, **ws)
    rank0.cadence.interval = 4
    for _ in range(7):
        rank0.admit()
        rank1.adopt(rank0.decision())
    assert rank1.sync_interval == 4 and rank1.carry == rank0.carry


def test_feedforward_caps_the_lookahead_at_the_pipeline_depth_that_hides_generation():
    """adaptive_async.feedforward: lookahead <= ceil(generation time / training time) of a step (EMAs), >= 1;
    the controller's (or fixed ratio's) lookahead stays the ceiling; the depth round-trips in the state."""
    ff = OffPolicyControl(OffPolicy(max_version_gap=GAP, async_ratio=1.0, feedforward=True), AdaptiveAsync(),
                          WeightSync(async_weight_update=True), 100)
    assert ff.lookahead == 1.0  # nothing measured yet: one step ahead
    for _ in range(3):
        assert ff.observe_times(gen_s=0.03, train_s=0.05) == {"pipeline_depth": 1.0}
    assert ff.lookahead == 1.0 and [ff.admit() for _ in range(5)] == [1] * 5  # generation hides at depth 1
    for _ in range(40):  # generation becomes 2.5x slower than training: 3 steps in flight keep the trainer busy
        ff.observe_times(gen_s=0.125, train_s=0.05)
    assert ff.depth.depth == 3 and ff.lookahead == 3.0
    ff.async_ratio = 1 / GAP  # the controller's lookahead (1) below the depth wins
    assert ff.lookahead == 1.0
    ff.observe_times(gen_s=float("nan"), train_s=0.05)  # a bad measurement changes nothing
    assert ff.depth.depth == 3
    state = ff.state_dict()
    again = OffPolicyControl(OffPolicy(max_version_gap=GAP, async_ratio=1.0, feedforward=True), AdaptiveAsync(),
                             WeightSync(async_weight_update=True), 100)
    again.load_state_dict(state)
    assert again.depth.state_dict() == ff.depth.state_dict()
    off = admission(1.0, async_weight_update=True)  # off: the cap is the gap alone
    assert off.depth is None and off.lookahead == GAP and off.state_dict()["pipeline_depth"] is None


def test_feedforward_depth_is_one_for_serial_engines_unless_max_pipeline_depth_says_otherwise():
    """An engine serving one request at a time (the embedded engine: ``serial_engines``) is kept busy by one queued
    step, so the auto ``off_policy.max_pipeline_depth`` caps the feedforward's depth at 1 however slow generation
    is; an explicit cap replaces it; servers (continuous batching) get Little's law uncapped."""
    def ff(serial: bool, cap: int = 0) -> OffPolicyControl:
        c = OffPolicyControl(OffPolicy(max_version_gap=GAP, async_ratio=1.0, feedforward=True, max_pipeline_depth=cap),
                             AdaptiveAsync(), WeightSync(async_weight_update=True), 100, serial_engines=serial)
        for _ in range(40):  # generation 2.5x slower than training
            c.observe_times(gen_s=0.125, train_s=0.05)
        return c

    assert ff(serial=True).depth.depth == 1 and ff(serial=True).lookahead == 1.0
    assert ff(serial=True, cap=2).depth.depth == 2
    assert ff(serial=False).depth.depth == 3 and ff(serial=False).lookahead == 3.0
    assert ff(serial=False, cap=2).depth.depth == 2


def test_the_controller_reads_a_staleness_sample_and_out_of_band_halves_the_auto_cadence():
    """``control`` takes the batch's ``StalenessSample`` (the metrics dict is for the logs only); staleness above
    its target by more than ``STALE_BAND`` halves the auto push interval at the next push."""
    def control(sample: StalenessSample) -> OffPolicyControl:
        op = OffPolicyControl(OffPolicy(max_version_gap=GAP), AdaptiveAsync(enabled=True, controller="pid"),
                              WeightSync(interval="auto"), total_steps=100)
        op.cadence.interval = 4
        m = op.control(1, sample)
        assert op.stale == (m["staleness"] > m["target_staleness"] + STALE_BAND)
        return op

    fresh = control(StalenessSample())
    assert not fresh.stale and fresh.tune_cadence(True, 1.0, 0.0, 0.0, 0.0, 0.0)["sync_interval_reason"] != "stale"
    stale = control(StalenessSample(behaviour_kl=0.1, iw_var=2.0, version_gap_mean=5.0))  # staleness 1
    assert stale.stale and stale.tune_cadence(True, 1.0, 0.0, 0.0, 0.0, 0.0)["sync_interval_reason"] == "stale"
    assert stale.sync_interval == 2
