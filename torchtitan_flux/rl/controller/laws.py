"""Control laws: the ``BaseAsyncController`` contract a custom controller implements, and the default PID.

A law maps the smoothed staleness of each step to an async ratio; everything around it (the EMA, phase
targets, bounds, forced syncs) is the loop's (``loop.py``), so a law stays a few lines of arithmetic. Called from
the trainer's main thread only, once per step.
"""

from __future__ import annotations

import abc
import copy
from typing import Any, Optional, Union

from torchtitan_flux.config import AdaptiveAsync, ConfigError
from torchtitan_flux.rl.controller.staleness import clamp
from torchtitan_flux.run.user_code import import_spec


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
        self.bias = clamp(float(cfg.initial_async_ratio), self.min_ratio, self.max_ratio)
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
        self.async_ratio = clamp(u, self.min_ratio, self.max_ratio)
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
            "torchtitan_flux.rl.controller.BaseAsyncController"
        )
    if getattr(cls, "__abstractmethods__", None):
        raise ConfigError(
            f"adaptive_async.controller = {name!r} does not implement {sorted(cls.__abstractmethods__)}"
        )
    return cls
