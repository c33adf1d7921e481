"""``weight_sync.interval = "auto"``: a push cadence that keeps the trainer's time lost to weight sync under a target.

The idea is flodl's ``ElChe`` (``shared/seeds/002_*``): measure what synchronisation costs against the compute it
interrupts and space synchronisations out until that share is below a target, within a staleness limit, never
below the starting cadence, and nudged back down when the run must be fresher.

Plant. A push makes the trainer lose ``lost_s`` seconds (the caller measures it: see ``FluxTrainer`` — blocking
mode: the time the main thread waits for the push; async mode: the snapshot's time plus the part of the rollout
wait the push can explain, at most the push's own duration). A training step computes for ``compute_s``. Pushing
every ``k`` steps, the overhead is ``lost / (k * compute)`` per push window, so with a steady plant
``k = ceil(lost / (target * compute))`` is the smallest interval under the target.

Rule, evaluated once per push over the steps since the previous push (``observe_step`` accumulates them), on
EMA-smoothed lost time per push window and compute per step (``ema_alpha``; the first push is taken raw):
  * overhead above ``target``: raise ``k`` straight to the smallest interval that meets the target (ElChe's
    aggressive raise), capped at ``max_interval``;
  * overhead below ``lower_fraction * target`` (0.5, ElChe's) and ``k`` above ``min_interval``: lower ``k`` by one;
  * otherwise hold. The dead zone ``[lower_fraction * target, target]`` is what stops flapping: lowering from an
    overhead ``o < target/2`` at ``k >= 2`` gives ``o * k / (k - 1) <= 2 * o < target``, so a steady plant never
    moves back up after a step down.
  * staleness wins over overhead: while the caller reports staleness above its target (``stale=True``; the
    adaptive controller's EMA staleness over ``target + band``), ``k`` is halved (ceil, never below 1, which may be
    below ``min_interval``: ElChe's ``nudge_anchor_down``) and may not rise until staleness is back in band; the
    overhead rule then brings it back up if the cost requires. So the two loops never pull in opposite
    directions at once: the controller only ever lowers the interval, and only while it is out of band.

Bounds: ``min_interval <= k <= max_interval`` (staleness nudges aside). ``max_interval`` is the caller's: the
smaller of ``weight_sync.max_interval`` and what ``max_version_gap`` allows.

Simplification: one cost for all engines (the push's slowest engine); a per-engine cadence would need per-engine
versions in admission.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class CadenceDecision:
    """What ``SyncCadence.after_push`` decided, for metrics (``sync_interval``, ``sync_overhead``) and logs."""

    interval: int
    overhead: float  # smoothed lost time per push / (smoothed compute per step * the interval in force when measured)
    reason: str  # "hold", "raise", "lower", "stale" (halved for staleness), "cap" (a raise clipped at max_interval)


class SyncCadence:
    """Decides every how many optimizer steps weights are pushed. Main thread only (not thread-safe).

    Protocol per optimizer step: ``due()`` says whether this step's weights are pushed; once the step is over,
    ``observe_step(compute_s, lost_s, pushed, stale)`` reports its compute time and the time it lost to weight
    sync. A push closes a window: the decision is taken over the steps since the previous push. (In async mode a
    push's cost shows up in the following steps' rollout waits, so it is counted in the next window: the windows
    are shifted by one, which a steady plant does not notice.)"""

    def __init__(self, start_interval: int, overhead_target: float, max_interval: int, ema_alpha: float = 0.5,
                 lower_fraction: float = 0.5):
        if not 1 <= start_interval <= max_interval:
            raise ValueError(f"need 1 <= start_interval ({start_interval}) <= max_interval ({max_interval})")
        self.interval = start_interval
        self.min_interval = start_interval
        self.max_interval = max_interval
        self.target = overhead_target
        self.alpha = ema_alpha
        self.lower_fraction = lower_fraction
        self.steps_since_push = 0
        self._window_compute = 0.0
        self._window_lost = 0.0
        self._lost_ema: float | None = None  # seconds lost per push window
        self._compute_ema: float | None = None  # seconds of compute per step

    def due(self) -> bool:
        """Whether the step now ending pushes its weights."""
        return self.steps_since_push + 1 >= self.interval

    def observe_step(self, compute_s: float, lost_s: float, pushed: bool, stale: bool = False) -> CadenceDecision | None:
        """Account one step; when it pushed, decide the next interval (returned) from the window it closes."""
        self.steps_since_push += 1
        self._window_compute += compute_s
        self._window_lost += lost_s
        if not pushed:
            return None
        per_step = self._window_compute / self.steps_since_push
        self._lost_ema = _ema(self._lost_ema, self._window_lost, self.alpha)
        self._compute_ema = _ema(self._compute_ema, per_step, self.alpha)
        self.steps_since_push, self._window_compute, self._window_lost = 0, 0.0, 0.0
        overhead = self._lost_ema / max(self._compute_ema * self.interval, 1e-9)
        reason = "hold"
        if stale:
            halved = max(1, math.ceil(self.interval / 2))
            reason = "stale" if halved < self.interval else "hold"
            self.interval = halved
        elif overhead > self.target:
            need = math.ceil(self._lost_ema / (self.target * max(self._compute_ema, 1e-9)))
            new = min(max(need, self.interval + 1), self.max_interval)
            reason = "raise" if new >= need else "cap"  # "cap": max_interval keeps it above the target
            self.interval = new
        elif overhead < self.lower_fraction * self.target and self.interval > self.min_interval:
            self.interval -= 1
            reason = "lower"
        return CadenceDecision(self.interval, overhead, reason)

    def state_dict(self) -> dict:
        return {"interval": self.interval, "steps_since_push": self.steps_since_push,
                "window_compute": self._window_compute, "window_lost": self._window_lost,
                "lost_ema": self._lost_ema, "compute_ema": self._compute_ema}

    def load_state_dict(self, sd: dict) -> None:
        self.interval = min(max(int(sd["interval"]), 1), self.max_interval)
        self.steps_since_push = int(sd["steps_since_push"])
        self._window_compute, self._window_lost = float(sd["window_compute"]), float(sd["window_lost"])
        self._lost_ema, self._compute_ema = sd["lost_ema"], sd["compute_ema"]


def _ema(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else alpha * new + (1 - alpha) * old
