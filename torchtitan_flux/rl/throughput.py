"""The throughput law (``adaptive_async.controller = "throughput"``): run as far ahead as keeps the trainer fed,
and no further. Objective: time to reward = steps to reward x seconds per step. Seconds per step fall with the
lookahead only while the trainer waits for rollouts; steps to reward rise with every version of staleness
(docs/controller.md: 12 steps on-policy, 13 at gap 1, 26 at gap 8 on ``sensitive``). So the best lookahead is the
smallest one at which the trainer no longer starves, and the law looks for it instead of steering a staleness
setpoint. Once per step, on rank 0 (its decision travels with the batch, ``OffPolicyControl.decision``)::

    little  = generation latency / training time (EMAs)     # Little's law: batches in flight that hide generation
    starved = wait on the engines / (that wait + training time) (EMA)  # the trainer's starvation (not its
              wait for rewards or bookkeeping, which no lookahead hides: ``RolloutBatch.generation_wait_s``)
    guard   = ESS fraction (EMA) < ess_floor                # learning quality: the importance weights' sample size
    after a change, hold for ``lookahead`` steps (the batches admitted before it are still being trained), then:
      guard                                                  -> lookahead - 1 (and no rise while it holds)
      starved and two of the last three steps' own fractions > starve_fraction, or
        nearest(little x budget ratio) > nearest(little)     -> lookahead + 1 (the trainer waits, or a longer
                                                                               budget is on its way)
      starved < starve_fraction / 2 and nearest(little) < lookahead -> lookahead - 1 (fed, with room)

Little's law sets no depth by itself: on engines that share cores with the trainer the measured latency grows with
the steps in flight, so the law moves one step at a time on the measured wait and uses Little's law to lower only
with room to spare and to anticipate. A spike of one step (another process's burst on shared cores) raises nothing:
the EMA may stay above the threshold for steps after it, the steps' own fractions do not; a trainer that waits
every other step (steps admitted in pairs, seen on the batching engine at lookahead 1) is starved. The first step's wait is
not starvation (nothing could run ahead of it).
``budget ratio`` anticipates a known budget (``Prompt.max_new_tokens``): generation time scales with the decode
steps ``b``, training time with the sequence ``p + b`` (``p`` prompt tokens), so Little's depth at budget ``b`` scales
with ``b / (p + b)``; the ratio of that at the newest admitted step's budget to the largest of the last
``BUDGET_WINDOW`` trained steps' (``budget_ratio``) raises the depth before a longer budget's batches arrive. The
largest, not the trained step's own: with heavy-tailed budgets one step's longest prompt varies by 10x from step to
step, which is no change of workload (seen on ``heavy_tail``: the step's own budget ratcheted the lookahead to 6).

Anchors (docs/controller.md): verl's starvation-driven scheduling (the trainer's wait), Little's law (in flight =
latency x rate, our ``PipelineDepth``), VCPO (the effective sample size as the measure of what a stale batch is
worth). The lookahead is whole steps in ``[1, max_version_gap]``; the law never forces a synchronous step (a
learning spike lowers the lookahead by one step at a time). Main thread, rank 0; the state is plain numbers.
"""

from __future__ import annotations

import math
from typing import Any

from torchtitan_flux.config import AdaptiveAsync

TIME_EMA = 0.3  # EMA weight of the newest step's generation, training and wait times
BUDGET_WINDOW = 10  # trained steps whose largest budget is the baseline of ``budget_ratio``


def budget_ratio(prompt_tokens: float, budget_now: int, budget_next: int) -> float:
    """Little's depth at ``budget_next`` over that at ``budget_now`` (module docstring); 1 if either is unknown (0)."""
    if budget_now <= 0 or budget_next <= 0:
        return 1.0
    return (budget_next / (prompt_tokens + budget_next)) / (budget_now / (prompt_tokens + budget_now))


def nearest(x: float) -> int:
    """``x`` rounded half up (``round`` rounds half to even)."""
    return math.floor(x + 0.5)


def _ema(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else alpha * new + (1 - alpha) * old


class ThroughputLaw:
    """The law of the module docstring: ``observe`` once per step (rank 0), ``lookahead`` the whole steps to admit."""

    STATE = ("lookahead", "gen_s", "train_s", "starved", "starved_last", "ess", "hold", "budget_ratio", "last_move",
             "steps", "budgets")

    def __init__(self, cfg: AdaptiveAsync, max_lookahead: int) -> None:
        self.starve_fraction, self.ess_floor, self.ess_alpha = cfg.starve_fraction, cfg.ess_floor, cfg.ema_alpha
        self.max_lookahead = max(1, max_lookahead)
        self.lookahead = 1
        self.gen_s: float | None = None
        self.train_s: float | None = None
        self.starved: float | None = None
        self.starved_last = (0.0, 0.0, 0.0)  # the last three steps' own fractions
        self.ess: float | None = None
        self.hold = 0  # steps left before the next change may be made
        self.budget_ratio = 1.0
        self.last_move = "hold"
        self.steps = 0  # observed
        self.budgets: list[int] = []  # the last BUDGET_WINDOW trained steps' budgets

    @property
    def little(self) -> float:
        """Little's law's depth at the anticipated budget (0 before any measurement)."""
        if self.gen_s is None or not self.train_s:
            return 0.0
        return self.gen_s / self.train_s * self.budget_ratio

    @property
    def guarded(self) -> bool:
        return self.ess is not None and self.ess < self.ess_floor

    def observe(self, gen_s: float, train_s: float, wait_s: float, ess_fraction: float,
                budgets: tuple[float, int, int] = (0.0, 0, 0)) -> int:
        """One trained step: its batch's generation latency, the trainer's compute, its wait on the engines, the
        batch's ESS fraction, and ``budgets`` (``StepInput.budgets``: its mean prompt tokens and budget, the newest
        admitted step's budget; 0: unknown) -> the lookahead."""
        times = (gen_s, train_s, wait_s)
        if all(math.isfinite(x) and x >= 0 for x in times) and train_s > 0:
            self.gen_s = _ema(self.gen_s, gen_s, TIME_EMA)
            self.train_s = _ema(self.train_s, train_s, TIME_EMA)
            if self.steps > 0:  # the first step's wait is structural
                now = wait_s / (wait_s + train_s)
                self.starved_last = (*self.starved_last[1:], now)
                self.starved = _ema(self.starved, now, TIME_EMA)
        self.steps += 1
        if math.isfinite(ess_fraction):
            self.ess = _ema(self.ess, ess_fraction, self.ess_alpha)
        prompt_tokens, budget, newest = budgets
        if budget > 0:
            self.budgets = [*self.budgets, budget][-BUDGET_WINDOW:]
        self.budget_ratio = budget_ratio(prompt_tokens, max(self.budgets, default=0), newest)
        self.last_move = self._move()
        return self.lookahead

    def _move(self) -> str:
        if self.hold > 0:
            self.hold -= 1
            return "hold"
        before, depth = self.lookahead, max(1, nearest(self.little))
        often = sum(x > self.starve_fraction for x in self.starved_last) >= 2
        starved = self.starved is not None and self.starved > self.starve_fraction and often
        fed = self.starved is not None and self.starved < self.starve_fraction / 2
        if self.guarded:
            self.lookahead, move = max(1, before - 1), "guard"
        elif starved:
            self.lookahead, move = min(self.max_lookahead, before + 1), "starved"
        elif depth > max(1, nearest(self.little / self.budget_ratio)):
            self.lookahead, move = min(self.max_lookahead, before + 1), "anticipate"
        elif fed and depth < before:
            self.lookahead, move = before - 1, "fed"
        else:
            return "hold"
        if self.lookahead == before:
            return "hold"
        self.hold = self.lookahead
        return move

    def metrics(self) -> dict[str, float]:
        nan = math.nan
        moves = {"hold": 0.0, "starved": 1.0, "anticipate": 2.0, "fed": -1.0, "guard": -2.0}
        return {"lookahead_target": float(self.lookahead), "little_depth": self.little,
                "rollout_starved": nan if self.starved is None else self.starved,
                "ess_smoothed": nan if self.ess is None else self.ess, "ess_guard": float(self.guarded),
                "budget_ratio": self.budget_ratio, "lookahead_move": moves[self.last_move],
                "starve_fraction": self.starve_fraction, "ess_floor": self.ess_floor}

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.STATE}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in self.STATE:
            setattr(self, k, state[k])
        self.lookahead = min(max(1, int(self.lookahead)), self.max_lookahead)
