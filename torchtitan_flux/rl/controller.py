"""The adaptive async controller: sets ``async_ratio`` every training step from the staleness of the batch just
trained (``adaptive_async.enabled``; ``OffPolicyControl`` holds it and stores its output). Each step::

    raw    = staleness_value(sample, cfg)                  # weighted KL, IW variance and version gap, in [0, 1]
    ema    = ema_alpha * raw + (1 - ema_alpha) * ema        # the first sample initialises it; NaN leaves it
    target = the step's phase target (PHASES)
    ratio  = clamp(law.update(ema, target), min_async_ratio, max_async_ratio)
    force_sync = ema > sync_threshold                       # then the ratio is min_async_ratio

The law is a ``ControlLaw``: ``PIDController``, or the class ``adaptive_async.controller`` names, built as
``Class(cfg)``. Tuning: docs/controller.md. Main thread only; the state is plain numbers (a resume is bit-identical).
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from torchtitan_flux.config import AdaptiveAsync
from torchtitan_flux.user_code import import_spec

logger = logging.getLogger("torchtitan_flux.rl.controller")

PHASES = ("warmup", "main", "cooldown")  # the ``phase`` metric is the index; ``adaptive_async.phase_schedule``


def clamp(x: float, lo: float, hi: float) -> float:
    return lo if x < lo else hi if x > hi else x


@dataclass(frozen=True)
class StalenessSample:
    """The staleness of one trained batch, what the controller reads: built once per step on every rank, where the
    loss's figures are all-reduced (``rl/gradient.py``'s ``BatchGradient.reduce``), so every rank's controller sees
    the same numbers."""

    behaviour_kl: float = 0.0
    """The loss's ``behaviour_kl``: the k3 estimate of KL(behaviour policy || trainer), token mean."""
    iw_var: float = 0.0
    """The variance of the per-token importance weights (token mean)."""
    ess_fraction: float = 1.0
    """The importance weights' effective sample size over N (reported by the loss only; the controller ignores it)."""
    version_gap_mean: float = 0.0
    """The trainer's version minus each completion token's policy version, mean over the batch's tokens (a token
    generated after an in-flight weight update is younger than its sample's first token)."""
    version_gap_max: float = 0.0
    """The same, max over the batch's tokens."""


def staleness_value(sample: StalenessSample, cfg: AdaptiveAsync) -> tuple[float, dict[str, float]]:
    """``(w_kl * min(1, behaviour_kl / kl_norm) + w_iw * min(1, iw_var / iw_var_norm) + w_gap * min(1, gap_mean /
    version_gap_norm)) / (w_kl + w_iw + w_gap)``, each term floored at 0, and the three terms; NaN if an input is."""
    raw = (float(sample.behaviour_kl), float(sample.iw_var), float(sample.version_gap_mean))
    names = ("staleness_kl", "staleness_iw_var", "staleness_version_gap")
    if not all(math.isfinite(v) for v in raw):
        return math.nan, dict.fromkeys(names, math.nan)
    norms = (cfg.kl_norm, cfg.iw_var_norm, cfg.version_gap_norm)
    weights = (cfg.kl_weight, cfg.iw_var_weight, cfg.version_gap_weight)
    terms = [clamp(v / n, 0.0, 1.0) for v, n in zip(raw, norms)]
    value = sum(w * t for w, t in zip(weights, terms)) / sum(weights)
    return clamp(value, 0.0, 1.0), dict(zip(names, terms))


@runtime_checkable
class ControlLaw(Protocol):
    """``update(smoothed staleness, target)`` once per step -> the async ratio (clamped; a non-finite one keeps the
    previous). ``metrics`` are logged; the state dict holds everything ``update`` depends on."""

    def update(self, staleness: float, target: float) -> float: ...

    def metrics(self) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class PIDController:
    """Positional PID around ``bias = initial_async_ratio``, with ``y`` the smoothed staleness and ``e = target -
    y``: ``ratio = clamp(bias + kp * e + I - kd * (y - y_prev))``, ``I += ki * e``.

    Derivative on the measurement (a target step gives no kick); anti-windup: the integral grows only as far as
    puts the output on the bound (``anti_windup=False``: the naive one); frozen while ``|e| > integral_band``.
    """

    STATE = ("async_ratio", "bias", "i_term", "prev_measurement", "error", "p_term", "d_term", "saturated")

    def __init__(self, cfg: AdaptiveAsync, *, anti_windup: bool = True) -> None:
        self.kp, self.ki, self.kd, self.band = cfg.kp, cfg.ki, cfg.kd, cfg.integral_band
        self.lo, self.hi, self.anti_windup = cfg.min_async_ratio, cfg.max_async_ratio, anti_windup
        self.async_ratio = self.bias = cfg.initial_async_ratio
        self.i_term = self.error = self.p_term = self.d_term = 0.0
        self.saturated = 0.0  # +1 on (or beyond) max, -1 on (or below) min, 0 strictly inside
        self.prev_measurement: float | None = None

    def update(self, staleness: float, target: float) -> float:
        y = float(staleness)
        e = target - y
        p = self.kp * e
        d = 0.0 if self.prev_measurement is None else -self.kd * (y - self.prev_measurement)
        i_new = self.i_term + (self.ki * e if abs(e) <= self.band else 0.0)
        u_new = self.bias + p + i_new + d
        if self.anti_windup and u_new > self.hi and e > 0:  # up to the bound only; never unwind here
            i_new = max(self.i_term, self.hi - (self.bias + p + d))
        elif self.anti_windup and u_new < self.lo and e < 0:
            i_new = min(self.i_term, self.lo - (self.bias + p + d))
        self.i_term = i_new
        u = self.bias + p + self.i_term + d
        self.async_ratio = clamp(u, self.lo, self.hi)
        self.saturated = 1.0 if u >= self.hi else -1.0 if u <= self.lo else 0.0
        self.error, self.p_term, self.d_term, self.prev_measurement = e, p, d, y
        return self.async_ratio

    def metrics(self) -> dict[str, float]:
        return {"pid_error": self.error, "pid_p": self.p_term, "pid_i": self.i_term, "pid_d": self.d_term,
                "pid_saturated": self.saturated}

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.STATE}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in self.STATE:
            setattr(self, k, state[k])


@dataclass
class ControlDecision:
    """One step's decision: the ratio from now on, whether the next step is synchronous, and its metrics."""

    async_ratio: float
    """The async ratio from now on."""
    force_sync: bool
    """Whether the next step is synchronous (the smoothed staleness is above ``sync_threshold``)."""
    staleness: float
    """The smoothed staleness (EMA) the decision was made on."""
    target: float
    """The step's target staleness."""
    metrics: dict[str, float] = field(default_factory=dict)
    """What the controller logs (the loss logs ``ess_fraction``, the step row the version gaps)."""


class AdaptiveAsyncController:
    """The loop of the module docstring around a law (``law``, or the one ``cfg.controller`` names). Phases of
    1-based step ``s``: warmup if ``s <= warmup.steps``, else cooldown if ``s > total_steps - cooldown.steps``, else
    main; a phase's negative target means ``adaptive_async.target_staleness``."""

    def __init__(self, cfg: AdaptiveAsync, total_steps: int, law: ControlLaw | None = None) -> None:
        self.cfg, self.total_steps = cfg, total_steps
        spec = cfg.controller
        self.law = law or (PIDController if spec == "pid" else import_spec("adaptive_async.controller", spec))(cfg)
        self.ema: float | None = None
        self.law_ratio = cfg.initial_async_ratio  # the law's last (clamped) output
        self.forced_syncs = 0
        self._warned_clamp = False

    def phase_of(self, step: int) -> int:
        sched = self.cfg.phase_schedule
        if step <= sched.warmup.steps:
            return 0
        return 2 if sched.cooldown.steps > 0 and step > self.total_steps - sched.cooldown.steps else 1

    def target_for(self, step: int) -> float:
        spec = getattr(self.cfg.phase_schedule, PHASES[self.phase_of(step)])
        return spec.target_staleness if spec.target_staleness >= 0 else self.cfg.target_staleness

    def step(self, step: int, sample: StalenessSample) -> ControlDecision:
        cfg, (lo, hi) = self.cfg, (self.cfg.min_async_ratio, self.cfg.max_async_ratio)
        raw, terms = staleness_value(sample, cfg)
        if math.isfinite(raw):
            self.ema = raw if self.ema is None else cfg.ema_alpha * raw + (1.0 - cfg.ema_alpha) * self.ema
        else:
            logger.warning(f"adaptive_async: non-finite staleness at step {step}; the EMA is left as it was")
            self.ema = 0.0 if self.ema is None else self.ema
        target = self.target_for(step)
        out = self.law.update(self.ema, target)
        out = float(out) if hasattr(out, "__float__") else math.nan
        if not math.isfinite(out):
            logger.warning(f"adaptive_async: the controller returned {out!r} at step {step}; keeping {self.law_ratio}")
            out = self.law_ratio
        if not lo <= out <= hi and not self._warned_clamp:
            logger.warning(f"adaptive_async: the controller returned async_ratio {out:.4f} outside [{lo:g}, {hi:g}] "
                           f"at step {step}; clamping (further occurrences are not reported)")
            self._warned_clamp = True
        self.law_ratio = out = clamp(out, lo, hi)
        force_sync = self.ema > cfg.sync_threshold
        self.forced_syncs += force_sync
        ratio = lo if force_sync else out
        m = {"pid_p": 0.0, "pid_i": 0.0, "pid_d": 0.0, **{k: float(v) for k, v in self.law.metrics().items()}}
        m.update(staleness=self.ema, staleness_raw=raw, target_staleness=target, async_ratio=ratio,
                 controller_ratio=out, min_async_ratio=lo, max_async_ratio=hi, pid_error=target - self.ema,
                 phase=float(self.phase_of(step)), force_sync=float(force_sync),
                 forced_syncs_total=float(self.forced_syncs), **terms)
        return ControlDecision(ratio, force_sync, self.ema, target, m)

    def state_dict(self) -> dict[str, Any]:
        return {"ema": self.ema, "law_ratio": self.law_ratio, "forced_syncs": self.forced_syncs,
                "law_class": _name(self.law), "law": self.law.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``; a checkpoint of another law class leaves this law's state fresh (warned)."""
        self.ema, self.law_ratio, self.forced_syncs = state["ema"], state["law_ratio"], state["forced_syncs"]
        if state["law_class"] == _name(self.law):
            self.law.load_state_dict(copy.deepcopy(state["law"]))
        else:
            logger.warning(f"adaptive_async: the checkpoint's controller {state['law_class']} is not the configured "
                           f"{_name(self.law)}; its state is not loaded")


def _name(law: ControlLaw) -> str:
    return f"{type(law).__module__}:{type(law).__qualname__}"
