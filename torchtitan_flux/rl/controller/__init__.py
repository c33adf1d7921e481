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
change of the smoothed staleness. On the simulated rollout plant of ``tests/unit/test_controller.py`` (staleness
0.45 at ratio 1, lag of 2 steps, 1 step of delay, measurement noise of about 0.02) ``kp = 3.0, ki = 0.3,
kd = 1.5, ema_alpha = 0.1`` settles the smoothed staleness within +-0.02 of the target 8-23 updates after a
target step, and 27-29 updates after a fresh start (whose first, on-policy batch initialises the EMA at 0).
On plants with more delay or a steeper staleness curve, raise ``kd`` towards 3 for damping. The tutorial's
starting point ``kp = 0.1, ki = 0.01, kd = 0.05`` has the same 10 : 1 : 5 proportions but is 30 times weaker
in these units: on the same plant it needs about 380 updates to settle.

The package: ``signal.py`` (the staleness sample and its value), ``laws.py`` (the control-law contract and the
PID), ``loop.py`` (what ``Admission`` holds: EMA, phases, bounds and forced syncs around the law, returning a
``ControlDecision``). Custom controllers subclass ``torchtitan_flux.rl.controller.BaseAsyncController``.
"""

from torchtitan_flux.rl.controller.laws import BaseAsyncController, PIDController, load_controller_class
from torchtitan_flux.rl.controller.loop import PHASES, AdaptiveAsyncController, ControlDecision
from torchtitan_flux.rl.controller.staleness import StalenessSample, staleness_value

__all__ = [
    "PHASES",
    "AdaptiveAsyncController",
    "BaseAsyncController",
    "ControlDecision",
    "PIDController",
    "StalenessSample",
    "load_controller_class",
    "staleness_value",
]
