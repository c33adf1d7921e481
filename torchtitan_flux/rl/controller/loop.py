"""``AdaptiveAsyncController``: the control loop around a law — staleness value, EMA, phase target, the law,
bounds, forced syncs — returning a ``ControlDecision`` each step. Main thread only; its state checkpoints as
plain numbers (a resumed run continues bit-identically).
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from torchtitan_flux.config import AdaptiveAsync, ConfigError
from torchtitan_flux.rl.controller.laws import BaseAsyncController, load_controller_class
from torchtitan_flux.rl.controller.staleness import StalenessSample, clamp, staleness_value

logger = logging.getLogger("torchtitan_flux.rl.controller")

PHASES = ("warmup", "main", "cooldown")
"""Phase names; the ``phase`` metric is the index into this tuple (0, 1, 2)."""


@dataclass
class ControlDecision:
    """One step's decision: the ``async_ratio`` of the admissions from now on, whether the next step must be
    synchronous (``force_sync``), and the step's controller metrics (all floats, for ``metrics.jsonl``)."""

    async_ratio: float
    force_sync: bool
    metrics: dict[str, float] = field(default_factory=dict)


class AdaptiveAsyncController:
    """What the trainer holds: staleness signal, EMA, phase schedule, control law, bounds and forced syncs.

    Call :meth:`step` once after every training step with that step's :class:`StalenessSample`; it returns a
    :class:`ControlDecision`: use its ``async_ratio`` (and ``force_sync``) for the rollouts admitted from then
    on, and log its ``metrics``.

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
                "torchtitan_flux.rl.controller.BaseAsyncController"
            )
        self.controller = controller
        self.controller_name = f"{type(controller).__module__}:{type(controller).__qualname__}"
        self.ema: Optional[float] = None
        self.async_ratio = clamp(float(cfg.initial_async_ratio), cfg.min_async_ratio, cfg.max_async_ratio)
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

    def step(self, step: int, sample: StalenessSample) -> ControlDecision:
        """Run one control iteration for training step ``step``: the decision and its metrics (all floats)."""
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
            out = clamp(out, lo, hi)
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
        return ControlDecision(async_ratio=out, force_sync=self.force_sync, metrics=m)

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
