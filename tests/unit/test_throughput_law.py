"""The throughput law (``rl/throughput.py``) on a simulated plant: it raises the lookahead while the trainer starves
and stops where it is fed, lowers it when the learning-quality guard trips (and does not rise while it holds),
lowers it when fed with room, anticipates a known longer budget before its batches arrive (and not a heavy tail's
longest prompt), counts neither a one-step spike nor the first step's wait, and takes a trainer that waits every other step for a starved one. Each rule's
mutation fails one of these scenarios (``test_each_rule_is_needed``). Then its place in ``OffPolicyControl``: the
lookahead it sets, rank 0's decision adopted by the other ranks, and the checkpointed state (the config's refusals:
``test_config.py``)."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from torchtitan_flux.config import AdaptiveAsync, OffPolicy, WeightSync
from torchtitan_flux.rl.controller import StalenessSample
from torchtitan_flux.rl.off_policy import OffPolicyControl
from torchtitan_flux.rl.throughput import ThroughputLaw, budget_ratio, nearest

TRAIN_S = 0.1


def plant(law: ThroughputLaw, steps: int, gen_s, ess=lambda lookahead, step: 1.0,
          budgets=lambda step: (0.0, 0, 0), spike=lambda step: 0.0) -> list[int]:
    """A trainer that trains ``TRAIN_S`` a step and an engine whose batches take ``gen_s(step)`` each, in flight
    side by side: at lookahead ``L`` a batch had ``L`` training steps to be generated, so the trainer waits
    ``max(0, gen - L * TRAIN_S)`` on the engines (the first step waits for its whole batch), plus ``spike(step)``
    (another process's burst). Returns the lookahead in force at each step."""
    seen = []
    for step in range(1, steps + 1):
        lookahead = law.lookahead
        seen.append(lookahead)
        g = gen_s(step)
        wait = g if step == 1 else max(0.0, g - lookahead * TRAIN_S) + spike(step)
        law.observe(g, TRAIN_S, wait, ess(lookahead, step), budgets(step))
    return seen


def law(**kw) -> ThroughputLaw:
    return ThroughputLaw(AdaptiveAsync(controller="throughput", **kw), max_lookahead=8)


# ------------------------------------------------------------------------------------------------ scenarios
# Each takes a law factory and returns (passed, what it saw), so that the mutation test can run it on mutants.


def raises_while_starved(make) -> tuple[bool, list[int]]:
    """Generation 2.6x training: lookahead 3 hides it (2 leaves 0.06 s of 0.1 waiting). The law must get there
    and stop there (not run to the max gap)."""
    seen = plant(make(), 60, lambda s: 2.6 * TRAIN_S)
    return seen[-1] == 3 and max(seen) <= 4 and seen[20:] == [3] * 40, seen


def guard_lowers_and_blocks_the_rise(make) -> tuple[bool, list[int]]:
    """Starved as above, but from step 20 to 40 the batches' ESS fraction is 0.2 (a learning spike): the lookahead
    falls to 1 and does not rise while the guard holds; after it, starvation brings it back to 3."""
    spike = lambda lookahead, step: 0.2 if 20 <= step < 40 else 1.0  # noqa: E731
    seen = plant(make(), 80, lambda s: 2.6 * TRAIN_S, ess=spike)
    during = seen[32:41]
    return seen[19] == 3 and during == [1] * len(during) and seen[-1] == 3, seen


def lowers_when_fed_with_room(make) -> tuple[bool, list[int]]:
    """Generation 2.6x training for 30 steps (lookahead 3), then 0.6x (one step hides it): it comes back to 1."""
    seen = plant(make(), 70, lambda s: (2.6 if s <= 30 else 0.6) * TRAIN_S)
    return seen[29] == 3 and seen[-1] == 1, seen


def anticipates_a_longer_budget(make) -> tuple[bool, list[int]]:
    """Generation 0.8x training (lookahead 1) with budgets of 8 tokens until step 30, then 128 (30-token prompts:
    Little's depth 3.85x); the longer ones are admitted from step 29 on (one step ahead). The law must raise the
    lookahead at step 30, before any starvation could be measured."""
    gen = lambda s: (0.8 if s < 31 else 2.0) * TRAIN_S  # noqa: E731
    budgets = lambda s: (30.0, 8 if s < 31 else 128, 8 if s < 29 else 128)  # noqa: E731
    seen = plant(make(), 40, gen, budgets=budgets)
    return seen[28] == 1 and seen[29] == 2, seen


def heavy_tailed_budgets_anticipate_nothing(make) -> tuple[bool, list[int]]:
    """Generation 0.5x training, each step's longest prompt drawn from a heavy tail (4 to 96 tokens): one step's
    budget above the last's is no change of workload, and the lookahead stays 1."""
    rng = random.Random(0)
    draws = [min(96, int(4 / rng.random() ** 0.8)) for _ in range(80)]
    seen = plant(make(), 60, lambda s: 0.5 * TRAIN_S, budgets=lambda s: (12.0, draws[s], draws[s + 1]))
    return seen == [1] * 60, seen


def a_spike_raises_nothing(make) -> tuple[bool, list[int]]:
    """Generation 0.5x training (one step ahead hides it) and one step that waits 0.2 s (a burst of another process
    on shared cores, 67 % of that step): the lookahead stays 1."""
    seen = plant(make(), 40, lambda s: 0.5 * TRAIN_S, spike=lambda s: 0.2 if s == 20 else 0.0)
    return seen == [1] * 40, seen


def alternating_starvation_raises(make) -> tuple[bool, list[int]]:
    """Generation 0.5x training, but every other step waits 0.15 s (60 % of it: steps admitted in pairs, seen on the
    batching engine at lookahead 1): that is starvation, and the lookahead rises within a few steps."""
    seen = plant(make(), 12, lambda s: 0.5 * TRAIN_S, spike=lambda s: 0.15 if s % 2 == 0 else 0.0)
    return max(seen[:8]) >= 2, seen


SCENARIOS = [raises_while_starved, guard_lowers_and_blocks_the_rise, lowers_when_fed_with_room,
             anticipates_a_longer_budget, heavy_tailed_budgets_anticipate_nothing, a_spike_raises_nothing,
             alternating_starvation_raises]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_the_law_on_a_simulated_plant(scenario):
    ok, seen = scenario(law)
    assert ok, seen


class NoGuard(ThroughputLaw):
    guarded = property(lambda self: False)


class NoStarvation(ThroughputLaw):
    def __init__(self, cfg, max_lookahead):
        super().__init__(cfg, max_lookahead)
        self.starve_fraction = 1.0


class NoAnticipation(ThroughputLaw):
    def observe(self, gen_s, train_s, wait_s, ess_fraction, budgets=(0.0, 0, 0)):
        return super().observe(gen_s, train_s, wait_s, ess_fraction, (0.0, 0, 0))


class AnticipatesFromTheTrainedStep(ThroughputLaw):  # its own budget the baseline (the rule before the suite)
    def observe(self, gen_s, train_s, wait_s, ess_fraction, budgets=(0.0, 0, 0)):
        self.budgets = []
        return super().observe(gen_s, train_s, wait_s, ess_fraction, budgets)


class RaisesOnTheEMA(ThroughputLaw):  # the smoothed starvation alone
    def _move(self):
        self.starved_last = (1.0, 1.0, 1.0)
        return super()._move()


class RaisesOnTwoInARow(ThroughputLaw):  # the last two steps both starved (the rule before 2026-11-29's suite)
    def _move(self):
        last = self.starved_last
        if not (last[1] > self.starve_fraction and last[2] > self.starve_fraction):
            self.starved_last = (0.0, 0.0, 0.0)
        move = super()._move()
        self.starved_last = last
        return move


class NoLowering(ThroughputLaw):
    def _move(self):
        before = self.lookahead
        move = super()._move()
        if self.lookahead < before and move == "fed":
            self.lookahead, self.hold = before, 0
            return "hold"
        return move


class RaisesOnLittleAlone(ThroughputLaw):  # Little's law as the depth itself (our PipelineDepth's ceil)
    def _move(self):
        move = super()._move()
        if self.little > 0 and not self.guarded:
            self.lookahead = min(self.max_lookahead, max(1, math.ceil(self.little)) + 1)
        return move


MUTANTS = {NoGuard: guard_lowers_and_blocks_the_rise, NoStarvation: raises_while_starved,
           NoAnticipation: anticipates_a_longer_budget,
           AnticipatesFromTheTrainedStep: heavy_tailed_budgets_anticipate_nothing, RaisesOnTheEMA: a_spike_raises_nothing,
           RaisesOnTwoInARow: alternating_starvation_raises,
           NoLowering: lowers_when_fed_with_room, RaisesOnLittleAlone: raises_while_starved}


@pytest.mark.parametrize("mutant", list(MUTANTS), ids=lambda c: c.__name__)
def test_each_rule_is_needed(mutant):
    ok, seen = MUTANTS[mutant](lambda: mutant(AdaptiveAsync(controller="throughput"), 8))
    assert not ok, f"{mutant.__name__} passes {MUTANTS[mutant].__name__}: {seen}"


def test_budget_ratio_follows_decode_steps_over_the_sequence():
    # generation ~ b decode steps, training ~ p + b tokens: Little's depth ~ b / (p + b)
    assert budget_ratio(14, 16, 128) == pytest.approx((128 / 142) / (16 / 30))
    assert budget_ratio(14, 48, 48) == 1.0
    assert budget_ratio(0, 16, 0) == 1.0 and budget_ratio(10, 0, 16) == 1.0  # unknown: no anticipation
    assert [nearest(x) for x in (0.5, 1.5, 2.5, 2.49)] == [1, 2, 3, 2]


def test_the_first_steps_wait_and_bad_times_are_not_measurements():
    a = law()
    a.observe(5.0, TRAIN_S, 5.0, 1.0)  # step 1: waited for its whole batch
    assert a.starved is None and a.lookahead == 1
    a.observe(math.nan, TRAIN_S, 0.0, math.nan)
    assert a.gen_s == 5.0 and a.ess == 1.0 and a.starved is None


# ------------------------------------------------------------------------------------------ in OffPolicyControl


def control(**aa) -> OffPolicyControl:
    return OffPolicyControl(OffPolicy(max_version_gap=4), AdaptiveAsync(enabled=True, controller="throughput", **aa),
                            WeightSync(async_weight_update=True), total_steps=100)


def fed(gen_s: float, wait_s: float):
    return SimpleNamespace(batch=SimpleNamespace(gen_time_s=gen_s, generation_wait_s=wait_s), wait_s=wait_s + 0.01,
                           flush_s=0.0, push_due=True, budgets=(10.0, 16, 16))


def test_the_law_sets_the_lookahead_and_its_decision_travels_to_the_other_ranks():
    rank0, rank1 = control(), control()
    assert rank0.lookahead == 1 and rank0.async_ratio == 1.0 and not rank0.on_policy
    for step in range(1, 30):
        for c in (rank0, rank1):
            c.control(step, StalenessSample(ess_fraction=1.0))
        m = rank0.after_push(fed(0.35, 0.35 if step == 1 else max(0.0, 0.35 - rank0.lookahead * TRAIN_S)),
                             TRAIN_S, 0.0, 0.0)
        rank0.admit()
        rank1.adopt(rank0.decision())
        assert rank1.lookahead == rank0.lookahead and rank1.carry == rank0.carry
    assert rank0.lookahead == 4 == m["lookahead_target"]  # 3.5x: capped at max_version_gap 4
    assert m["rollout_starved"] > 0 and "ess_guard" in m
    restored = control()
    restored.load_state_dict(rank0.state_dict())
    assert restored.throughput.state_dict() == rank0.throughput.state_dict()


def test_the_guard_reads_the_trained_batchs_ess_fraction():
    c = control()
    c.throughput.lookahead = 3
    for step in range(1, 10):
        c.control(step, StalenessSample(ess_fraction=0.1))
        c.after_push(fed(0.05, 0.0), TRAIN_S, 0.0, 0.0)
    assert c.lookahead == 1



def test_a_checkpoint_of_the_other_law_is_refused_in_one_line():
    """The staleness law's ratio and forced sync would outlive it under the throughput law, which never clears them."""
    from torchtitan_flux.errors import ConfigError

    def of(law: str) -> OffPolicyControl:
        return OffPolicyControl(OffPolicy(max_version_gap=4), AdaptiveAsync(enabled=True, controller=law),
                                WeightSync(async_weight_update=True), 100)

    for saved, now in (("pid", "throughput"), ("throughput", "pid")):
        with pytest.raises(ConfigError, match=r"^adaptive_async.controller: the checkpoint was saved by"):
            of(now).load_state_dict(of(saved).state_dict())
    for law in ("pid", "throughput"):  # the same law resumes
        of(law).load_state_dict(of(law).state_dict())
    off = OffPolicyControl(OffPolicy(max_version_gap=4), AdaptiveAsync(), WeightSync(async_weight_update=True), 100)
    of("throughput").load_state_dict(off.state_dict())  # saved with no law: the law starts afresh
