"""The adaptive async controller: sets ``async_ratio`` every training step from measured staleness.

``async_ratio`` is the position on the synchronous / asynchronous spectrum that the trainer maps to an
admission limit for rollouts:

* ``0``: synchronous, on-policy. The trainer trains only on rollouts generated with its newest weights and
  waits for them.
* ``1``: fully asynchronous. Generation never waits for training; staleness is bounded only by
  ``adaptive_async.max_version_gap``.
* in between: how far generation may run ahead of training.

The control loop (one iteration per training step)::

    sample = StalenessSample(kl, iw_var, gap_mean, gap_max, ess)     # measured on the batch just trained
    raw    = staleness_value(sample, cfg)                            # weighted, normalised, in [0, 1]
    ema    = ema_alpha * raw + (1 - ema_alpha) * ema                 # first sample initialises it
    target = phase target (warmup / main / cooldown)
    ratio  = clamp(controller.update(ema), min_async_ratio, max_async_ratio)
    force_sync = ema > sync_threshold

:class:`AdaptiveAsyncController` is that loop and is what the trainer holds; the control law itself is a
:class:`BaseAsyncController` (:class:`PIDController` by default, or any subclass named by
``adaptive_async.controller = "package.module:Class"``).

Pure Python (no torch, no torchtitan): the controller runs in one process between training steps and its
state is a dict of plain numbers and lists (JSON-serialisable), so it checkpoints with the run's other
stateful objects.

Gain units and recommended values
---------------------------------
The PID gains are in async-ratio units per unit of staleness error: ``kp = 3`` means an error of 0.05 (a
third of the default target) moves the ratio by 0.15; ``ki`` is per step; ``kd`` multiplies the per-step
change of the smoothed staleness. On the simulated rollout plant of ``tests/test_controller.py`` (staleness
0.45 at ratio 1, lag of 2 steps, 1 step of delay, measurement noise of about 0.02) ``kp = 3.0, ki = 0.3,
kd = 1.5, ema_alpha = 0.1`` settles the smoothed staleness within +-0.02 of the target 8-23 updates after a
target step, and 27-29 updates after a fresh start (whose first, on-policy batch initialises the EMA at 0).
On plants with more delay or a steeper staleness curve, raise ``kd`` towards 3 for damping. The tutorial's
starting point ``kp = 0.1, ki = 0.01, kd = 0.05`` has the same 10 : 1 : 5 proportions but is 30 times weaker
in these units: on the same plant it needs about 380 updates to settle.
"""

from __future__ import annotations

import abc
import copy
import logging
import math
from dataclasses import dataclass
from typing import Any, Optional, Union

from torchtitan_flux.config import AdaptiveAsync, ConfigError
from torchtitan_flux.validation import import_spec

__all__ = [
    "PHASES",
    "AdaptiveAsyncController",
    "BaseAsyncController",
    "PIDController",
    "StalenessSample",
    "load_controller_class",
    "staleness_value",
]

logger = logging.getLogger(__name__)

PHASES = ("warmup", "main", "cooldown")
"""Phase names; the ``phase`` metric is the index into this tuple (0, 1, 2)."""


def _clamp(x: float, lo: float, hi: float) -> float:
    return lo if x < lo else hi if x > hi else x


def _term(value: float, norm: float) -> float:
    """min(1, value / norm), floored at 0 (a k1 KL estimate can be slightly negative)."""
    return _clamp(float(value) / norm, 0.0, 1.0)


# ------------------------------------------------------------------------------------------ staleness signal


@dataclass
class StalenessSample:
    """Staleness measurements of one training batch (all plain floats).

    ``kl``: KL(behaviour || trainer policy) estimated on the batch's tokens (the loss's ``behaviour_kl``).
    ``iw_var``: variance of the per-token importance weights pi_trainer / pi_behaviour (``iw_var``).
    ``version_gap_mean`` / ``version_gap_max``: trainer policy version minus the version that generated each
    sample, averaged / maximised over the batch.
    ``ess_fraction``: effective sample size fraction of the importance weights, 1 = on-policy (reported only;
    not part of the staleness value).
    """

    kl: float = 0.0
    iw_var: float = 0.0
    version_gap_mean: float = 0.0
    version_gap_max: float = 0.0
    ess_fraction: float = 1.0


def staleness_value(sample: StalenessSample, cfg: AdaptiveAsync) -> tuple[float, dict[str, float]]:
    """Combine a sample into one staleness number in [0, 1].

    ``combined = (w_kl * min(1, kl / kl_norm) + w_iw * min(1, iw_var / iw_var_norm)
    + w_gap * min(1, version_gap_mean / version_gap_norm)) / (w_kl + w_iw + w_gap)``.

    Dividing by the weight sum keeps the value in [0, 1] for any weights; with the tutorial's weights
    (0.4, 0.3, 0.3, summing to 1) it is exactly the tutorial's ``0.4*kl + 0.3*iw + 0.3*gap``. Each term is also
    floored at 0. Returns ``(combined, components)`` where ``components`` holds the normalised, unweighted terms
    ``staleness_kl``, ``staleness_iw_var`` and ``staleness_version_gap`` (each in [0, 1]). A non-finite input
    gives a NaN combined value (the wrapper then skips the EMA update).
    """
    wsum = cfg.kl_weight + cfg.iw_var_weight + cfg.version_gap_weight
    if not wsum > 0:
        raise ConfigError("adaptive_async.kl_weight + iw_var_weight + version_gap_weight must be > 0")
    raw = (float(sample.kl), float(sample.iw_var), float(sample.version_gap_mean))
    if not all(math.isfinite(v) for v in raw):
        nan = float("nan")
        return nan, {"staleness_kl": nan, "staleness_iw_var": nan, "staleness_version_gap": nan}
    kl_t = _term(raw[0], cfg.kl_norm)
    iw_t = _term(raw[1], cfg.iw_var_norm)
    gap_t = _term(raw[2], cfg.version_gap_norm)
    combined = (cfg.kl_weight * kl_t + cfg.iw_var_weight * iw_t + cfg.version_gap_weight * gap_t) / wsum
    return _clamp(combined, 0.0, 1.0), {
        "staleness_kl": kl_t,
        "staleness_iw_var": iw_t,
        "staleness_version_gap": gap_t,
    }


# ------------------------------------------------------------------------------------------ controllers


class BaseAsyncController(abc.ABC):
    """Base class of async-ratio control laws; subclass it for a custom controller.

    Name a subclass in the config as ``adaptive_async.controller = "package.module:Class"``; it is built as
    ``Class(cfg)`` with the ``AdaptiveAsync`` section.

    Contract (enforced by :class:`AdaptiveAsyncController`, the caller):

    * ``update(staleness)`` is called exactly once per training step with the **EMA-smoothed** staleness in
      [0, 1] of the batch just trained, and returns the async ratio to use from now on.
    * Before each call the caller sets ``self.target_staleness`` to the current phase's target, so read it
      there rather than from ``cfg``.
    * The return value must be a finite float within ``[self.min_ratio, self.max_ratio]``. The caller clamps it
      anyway (and logs a warning the first time it had to); a non-finite value is replaced by the previous
      ratio. Keep ``self.async_ratio`` equal to what you return.
    * ``state_dict()`` / ``load_state_dict()`` must capture everything ``update`` depends on, so a resumed run
      continues bit-identically. The default implementation deep-copies every instance attribute except
      ``cfg``, which covers controllers whose state is plain numbers, lists and dicts; override both for
      anything else.
    * ``metrics()`` returns extra per-step scalars to log (default: none). Keys named like the wrapper's own
      metrics (``pid_p``, ``pid_i``, ``pid_d``) fill those; the wrapper's ``async_ratio``, ``staleness``,
      ``target_staleness`` and ``pid_error`` always win.
    """

    def __init__(self, cfg: AdaptiveAsync) -> None:
        self.cfg = cfg
        self.min_ratio = float(cfg.min_async_ratio)
        self.max_ratio = float(cfg.max_async_ratio)
        self.target_staleness = float(cfg.target_staleness)
        self.async_ratio = float(cfg.initial_async_ratio)

    @abc.abstractmethod
    def update(self, staleness: float) -> float:
        """Take the smoothed staleness of the step just trained; return the new async ratio (within bounds)."""

    def state_dict(self) -> dict[str, Any]:
        return {k: copy.deepcopy(v) for k, v in vars(self).items() if k != "cfg"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, copy.deepcopy(v))

    def metrics(self) -> dict[str, float]:
        return {}


class PIDController(BaseAsyncController):
    """Positional PID around a bias, with derivative on the measurement and conditional-integration anti-windup.

    With ``y`` the smoothed staleness and ``e = target_staleness - y`` (positive: staleness is below target,
    so there is room for more asynchrony and the ratio goes up)::

        P = kp * e
        I = I + ki * e            (only while |e| <= integral_band, and not while the output is saturated in
                                   the direction of e; see below)
        D = -kd * (y - y_prev)    (0 on the first update)
        async_ratio = clamp(bias + P + I + D, min_async_ratio, max_async_ratio),   bias = initial_async_ratio

    Why this form: the output depends only on the error, the accumulated integral and the measurement's
    slope, not on the previous (clamped) output, so a gain means the same thing at every operating point, and
    the integral term ``I`` is directly the learned offset of the operating point from ``bias`` (it shows in
    the ``pid_i`` metric). The incremental (velocity) form ``u += kp*de + ki*e - kd*d2y`` is the same law
    while unsaturated; the positional form makes the anti-windup rule and the P / I / D metrics explicit.
    (The tutorial-style ``u += kp*e + ki*sum(e)`` would integrate twice, and with any lag in the loop that
    oscillates; it is not used.)

    * Derivative on the measurement: ``D`` uses the change of ``y``, never of ``e``, so a target change
      (a phase switch) gives no derivative kick; only ``P`` steps (by ``kp`` times the target change).
    * Anti-windup (conditional integration, clamped at the limit): when the output with the new integral would
      be beyond ``max_async_ratio`` with ``e > 0`` (or below ``min_async_ratio`` with ``e < 0``), the
      integral grows only as far as needed to put the output exactly on that bound, and not at all if P + D
      alone already saturate it. So the integral never grows while the output is saturated in the direction
      of the error, and the output leaves the bound as soon as the error changes sign. ``anti_windup=False``
      gives the naive integrator (for comparison only).
    * Integral separation: while ``|e| > integral_band`` the integral is frozen. A learning spike pushes the
      smoothed staleness far above target for a while and, through the EMA's lag, keeps it there after the ratio
      has already been cut; integrating that error would drag the learned operating point down and take many
      steps to walk back up once the spike has passed. 1.0 (the default) disables it.
    * ``I`` is stored already multiplied by ``ki`` so that changing ``ki`` on resume does not make it jump.
    """

    def __init__(self, cfg: AdaptiveAsync, *, anti_windup: bool = True) -> None:
        super().__init__(cfg)
        self.kp = float(cfg.kp)
        self.ki = float(cfg.ki)
        self.kd = float(cfg.kd)
        self.integral_band = float(cfg.integral_band)
        self.bias = _clamp(float(cfg.initial_async_ratio), self.min_ratio, self.max_ratio)
        self.anti_windup = anti_windup
        self.async_ratio = self.bias
        self.i_term = 0.0
        self.prev_measurement: Optional[float] = None
        self.error = 0.0
        self.p_term = 0.0
        self.d_term = 0.0
        self.saturated = 0.0  # +1 on (or beyond) max, -1 on (or below) min, 0 strictly inside

    def update(self, staleness: float) -> float:
        y = float(staleness)
        e = self.target_staleness - y
        p = self.kp * e
        d = 0.0 if self.prev_measurement is None else -self.kd * (y - self.prev_measurement)
        i_new = self.i_term + (self.ki * e if abs(e) <= self.integral_band else 0.0)
        u_new = self.bias + p + i_new + d
        if self.anti_windup and u_new > self.max_ratio and e > 0:
            # integrate only up to the amount that brings the output to the bound; never unwind here
            i_new = max(self.i_term, self.max_ratio - (self.bias + p + d))
        elif self.anti_windup and u_new < self.min_ratio and e < 0:
            i_new = min(self.i_term, self.min_ratio - (self.bias + p + d))
        self.i_term = i_new
        u = self.bias + p + self.i_term + d
        self.async_ratio = _clamp(u, self.min_ratio, self.max_ratio)
        self.saturated = 1.0 if u >= self.max_ratio else -1.0 if u <= self.min_ratio else 0.0
        self.error, self.p_term, self.d_term = e, p, d
        self.prev_measurement = y
        return self.async_ratio

    def state_dict(self) -> dict[str, Any]:
        return {
            "async_ratio": self.async_ratio,
            "target_staleness": self.target_staleness,
            "bias": self.bias,
            "i_term": self.i_term,
            "prev_measurement": self.prev_measurement,
            "error": self.error,
            "p_term": self.p_term,
            "d_term": self.d_term,
            "saturated": self.saturated,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.async_ratio = float(state["async_ratio"])
        self.target_staleness = float(state["target_staleness"])
        self.bias = float(state.get("bias", self.bias))
        self.i_term = float(state["i_term"])
        pm = state["prev_measurement"]
        self.prev_measurement = None if pm is None else float(pm)
        self.error = float(state["error"])
        self.p_term = float(state["p_term"])
        self.d_term = float(state["d_term"])
        self.saturated = float(state.get("saturated", 0.0))

    def metrics(self) -> dict[str, float]:
        return {
            "pid_error": self.error,
            "pid_p": self.p_term,
            "pid_i": self.i_term,
            "pid_d": self.d_term,
            "pid_saturated": self.saturated,
            "async_ratio": self.async_ratio,
            "target_staleness": self.target_staleness,
        }


def load_controller_class(spec: Union[str, type]) -> type:
    """Resolve ``adaptive_async.controller``: ``"pid"``, a ``"package.module:Class"`` string, or a class.

    Raises ``ConfigError`` (a ``ValueError``) naming ``adaptive_async.controller`` if it cannot be imported or
    is not a subclass of :class:`BaseAsyncController`.
    """
    if isinstance(spec, type):
        cls = spec
        name = f"{cls.__module__}:{cls.__qualname__}"
    else:
        name = str(spec)
        if name == "pid":
            return PIDController
        if ":" not in name:
            raise ConfigError(
                f"adaptive_async.controller = {name!r} must be 'pid' or of the form 'package.module:Class'"
            )
        cls = import_spec("adaptive_async.controller", name)
    if not (isinstance(cls, type) and issubclass(cls, BaseAsyncController)):
        raise ConfigError(
            f"adaptive_async.controller = {name!r} is not a subclass of "
            "torchtitan_flux.controller.BaseAsyncController"
        )
    if getattr(cls, "__abstractmethods__", None):
        raise ConfigError(
            f"adaptive_async.controller = {name!r} does not implement {sorted(cls.__abstractmethods__)}"
        )
    return cls


# ------------------------------------------------------------------------------------------ the wrapper


class AdaptiveAsyncController:
    """What the trainer holds: staleness signal, EMA, phase schedule, control law, bounds and forced syncs.

    Call :meth:`step` once after every training step with that step's :class:`StalenessSample`; use the
    returned ``async_ratio`` (and ``force_sync``) for the rollouts admitted from then on, and log the returned
    metrics.

    Steps are 1-based as in torchtitan. Phase of step ``s`` (``W = warmup.steps``, ``C = cooldown.steps``,
    ``T = total_steps``): warmup if ``s <= W``; else cooldown if ``s > T - C``; else main (warmup wins where
    they overlap in a short run). A phase's ``target_staleness < 0`` means ``adaptive_async.target_staleness``.
    The phase and target are those of the step passed in.

    Forced syncs: if the smoothed staleness after this step's sample exceeds ``sync_threshold``, the returned
    ``force_sync`` is 1.0: the trainer must run the next step synchronously (wait for rollouts of its newest
    weights, dropping older ones), whatever the ratio says. The ``async_ratio`` returned for that step is
    ``min_async_ratio`` (so the metric stays within bounds and, once the forced sync is over, generation
    resumes from the most conservative setting); the inner controller is still updated with the measurement
    so its state stays continuous, and its own output is logged as ``controller_ratio``. The flag is
    re-evaluated each step, so it stays on for as many steps as the EMA needs to fall back under the
    threshold (each synchronous batch is fresh, which pulls it down).

    A sample whose staleness is not finite (NaN KL, say) leaves the EMA unchanged; the controller still runs.
    """

    def __init__(
        self,
        cfg: AdaptiveAsync,
        total_steps: int,
        controller: Optional[BaseAsyncController] = None,
    ) -> None:
        if total_steps < 1:
            raise ConfigError(f"training.steps = {total_steps!r} is out of range; allowed: an integer >= 1")
        self.cfg = cfg
        self.total_steps = int(total_steps)
        if controller is None:
            cls = load_controller_class(cfg.controller)
            controller = cls(cfg)
        elif not isinstance(controller, BaseAsyncController):
            raise ConfigError(
                f"adaptive_async.controller = {type(controller).__name__!r} is not a subclass of "
                "torchtitan_flux.controller.BaseAsyncController"
            )
        self.controller = controller
        self.controller_name = f"{type(controller).__module__}:{type(controller).__qualname__}"
        self.ema: Optional[float] = None
        self.async_ratio = _clamp(float(cfg.initial_async_ratio), cfg.min_async_ratio, cfg.max_async_ratio)
        self.controller_ratio = self.async_ratio
        self.force_sync = False
        self.phase = self.phase_of(1)
        self.last_step = 0
        self.num_updates = 0
        self.num_forced_syncs = 0
        self._warned_clamp = False

    # -- schedule

    def phase_of(self, step: int) -> int:
        """Phase index (0 warmup, 1 main, 2 cooldown) of 1-based training step ``step``."""
        sched = self.cfg.phase_schedule
        if step <= sched.warmup.steps:
            return 0
        if sched.cooldown.steps > 0 and step > self.total_steps - sched.cooldown.steps:
            return 2
        return 1

    def target_for(self, step: int) -> float:
        """Target staleness of step ``step`` (the phase's, or ``adaptive_async.target_staleness``)."""
        spec = getattr(self.cfg.phase_schedule, PHASES[self.phase_of(step)])
        return float(spec.target_staleness) if spec.target_staleness >= 0 else float(self.cfg.target_staleness)

    # -- the loop

    def step(self, step: int, sample: StalenessSample) -> dict[str, float]:
        """Run one control iteration for training step ``step``; returns the metrics (all floats)."""
        cfg = self.cfg
        raw, comps = staleness_value(sample, cfg)
        if math.isfinite(raw):
            self.ema = raw if self.ema is None else cfg.ema_alpha * raw + (1.0 - cfg.ema_alpha) * self.ema
        elif self.ema is None:
            logger.warning("adaptive_async: non-finite staleness at step %d before any valid sample; using 0", step)
            self.ema = 0.0
        else:
            logger.warning("adaptive_async: non-finite staleness at step %d; EMA left unchanged", step)
        ema = self.ema

        self.phase = self.phase_of(step)
        target = self.target_for(step)
        ctl = self.controller
        ctl.target_staleness = target
        lo, hi = float(cfg.min_async_ratio), float(cfg.max_async_ratio)
        out = ctl.update(ema)
        try:
            out = float(out)
        except (TypeError, ValueError):
            out = float("nan")
        if not math.isfinite(out):
            logger.warning(
                "adaptive_async: controller %s returned %r at step %d; keeping %.4f",
                self.controller_name, out, step, self.controller_ratio,
            )
            out = self.controller_ratio
        if out < lo or out > hi:
            if not self._warned_clamp:
                logger.warning(
                    "adaptive_async: controller %s returned async_ratio %.4f outside [%g, %g] at step %d; "
                    "clamping (further occurrences are not reported)",
                    self.controller_name, out, lo, hi, step,
                )
                self._warned_clamp = True
            out = _clamp(out, lo, hi)
        self.controller_ratio = controller_ratio = out

        self.force_sync = ema > cfg.sync_threshold
        if self.force_sync:
            self.num_forced_syncs += 1
            out = lo
        self.async_ratio = out
        self.last_step = int(step)
        self.num_updates += 1

        m: dict[str, float] = {"pid_p": 0.0, "pid_i": 0.0, "pid_d": 0.0}
        for k, v in ctl.metrics().items():
            try:
                m[k] = float(v)
            except (TypeError, ValueError):
                continue
        m.update(
            {
                "staleness": ema,
                "staleness_raw": raw,
                "target_staleness": target,
                "async_ratio": out,
                "controller_ratio": controller_ratio,
                "min_async_ratio": lo,
                "max_async_ratio": hi,
                "pid_error": target - ema,
                "phase": float(self.phase),
                "force_sync": 1.0 if self.force_sync else 0.0,
                "forced_syncs_total": float(self.num_forced_syncs),
                **comps,
                "ess_fraction": float(sample.ess_fraction),
                "version_gap_mean": float(sample.version_gap_mean),
                "version_gap_max": float(sample.version_gap_max),
            }
        )
        return m

    # -- checkpointing

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "ema": self.ema,
            "async_ratio": self.async_ratio,
            "controller_ratio": self.controller_ratio,
            "force_sync": self.force_sync,
            "phase": self.phase,
            "last_step": self.last_step,
            "num_updates": self.num_updates,
            "num_forced_syncs": self.num_forced_syncs,
            "total_steps": self.total_steps,
            "controller_name": self.controller_name,
            "controller": self.controller.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; continuing afterwards is bit-identical to an uninterrupted run.

        If the checkpoint was written by a different controller class, its inner state is not loaded (a
        warning says so) and the new controller starts from its initial state.
        """
        ema = state["ema"]
        self.ema = None if ema is None else float(ema)
        self.async_ratio = float(state["async_ratio"])
        self.controller_ratio = float(state.get("controller_ratio", self.async_ratio))
        self.force_sync = bool(state["force_sync"])
        self.phase = int(state["phase"])
        self.last_step = int(state["last_step"])
        self.num_updates = int(state["num_updates"])
        self.num_forced_syncs = int(state.get("num_forced_syncs", 0))
        if int(state.get("total_steps", self.total_steps)) != self.total_steps:
            logger.warning(
                "adaptive_async: checkpoint was written for %s total steps, now %d; the cooldown phase moves",
                state.get("total_steps"), self.total_steps,
            )
        if state.get("controller_name") == self.controller_name:
            self.controller.load_state_dict(copy.deepcopy(state["controller"]))
        else:
            logger.warning(
                "adaptive_async: checkpoint controller %r differs from configured %r; its state is not loaded",
                state.get("controller_name"), self.controller_name,
            )

    def __repr__(self) -> str:
        return (
            f"AdaptiveAsyncController(controller={self.controller_name}, total_steps={self.total_steps}, "
            f"async_ratio={self.async_ratio:.4f}, ema={self.ema})"
        )
