"""``OffPolicyControl``: the one owner of the off-policy decision: how far generation runs ahead of training,
which samples are too stale to train on, which steps push weights, and the pipeline depth.

* ``async_ratio``: ``off_policy.async_ratio``, or the controller's output (``control``; it may force a sync step);
* ``lookahead = async_ratio * max_version_gap`` steps, at most ``max_version_gap - (interval - 1)`` (engines may
  hold weights ``interval - 1`` steps old) and, with ``feedforward``, the ``PipelineDepth``; ``admit`` makes whole
  steps of it. With ``adaptive_async.controller = "throughput"`` the ``ThroughputLaw`` sets the lookahead (whole
  steps, under the same cap) and the async ratio is 1;
* staleness: a step trained at ``version`` takes samples of ``oldest(version)`` or newer; the engines wait for it
  (``GenerationRequest.min_version``) and ``accept`` discards, and counts, a batch with an older sample;
* the push cadence: every ``weight_sync.interval`` steps, or ``SyncCadence`` with ``interval = "auto"``.

Concurrency: main thread only; every trainer rank holds one. Rank 0 decides what depends on its measurements
(cadence, depth, the throughput law's lookahead); the feed broadcasts ``decision()`` and the other ranks ``adopt``
it. The controller's inputs are all-reduced, so its state is the same on every rank.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from torchtitan_flux.errors import ConfigError
from torchtitan_flux.rl.controller import AdaptiveAsyncController, StalenessSample
from torchtitan_flux.rl.throughput import ThroughputLaw

logger = logging.getLogger("torchtitan_flux")

STALE_BAND = 0.05  # staleness this far above its target counts as out of band (as in benchmarks/controller.py)
DEPTH_EMA = 0.2  # EMA weight of the newest step's generation and training times (PipelineDepth)


class PipelineDepth:
    """The feedforward term: ``ceil(g / t)`` steps in flight hide generation behind training (Little's law), with
    ``g`` and ``t`` EMAs of a batch's generation time and the trainer's compute time, at most ``max_depth``; 1
    before any measurement. Little's law holds for engines that batch the steps in flight (vLLM, SGLang); an engine
    serving one request at a time is kept busy by one queued step, and more only ages the samples (``max_depth``
    1, measured in docs/controller.md)."""

    def __init__(self, max_depth: int | None = None):
        self.max_depth = max_depth
        self.gen_s: float | None = None
        self.train_s: float | None = None
        self.depth = 1

    def observe(self, gen_s: float, train_s: float) -> None:
        if not (math.isfinite(gen_s) and math.isfinite(train_s) and gen_s >= 0 and train_s > 0):
            return
        self.gen_s, self.train_s = _ema(self.gen_s, gen_s, DEPTH_EMA), _ema(self.train_s, train_s, DEPTH_EMA)
        self.depth = max(1, math.ceil(self.gen_s / self.train_s))
        if self.max_depth is not None:
            self.depth = min(self.depth, self.max_depth)

    def state_dict(self) -> dict[str, Any]:
        return {"gen_s": self.gen_s, "train_s": self.train_s, "depth": self.depth}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.gen_s, self.train_s, self.depth = state["gen_s"], state["train_s"], int(state["depth"])


def fixed_async_ratio(off_policy, weight_sync) -> float:
    """The async ratio without the controller: ``off_policy.async_ratio`` when set, else what the one toggle says
    (``weight_sync.async_weight_update``: 1 when true, 0 when false)."""
    if off_policy.async_ratio is not None:
        return float(off_policy.async_ratio)
    return 1.0 if weight_sync.async_weight_update else 0.0


class OffPolicyControl:
    """The off-policy decision of the module docstring. Main thread only; every trainer rank holds one."""

    def __init__(self, off_policy, adaptive_async, weight_sync, total_steps: int, serial_engines: bool = False):
        """``serial_engines``: the engines serve one request at a time (the embedded engine), which sets the auto
        ``off_policy.max_pipeline_depth`` to 1."""
        op, aa, ws = off_policy, adaptive_async, weight_sync
        self.max_version_gap, self.async_push = op.max_version_gap, ws.async_weight_update
        self.fixed_interval = ws.interval
        by_throughput = aa.enabled and aa.controller == "throughput"
        self.throughput = ThroughputLaw(aa, op.max_version_gap) if by_throughput else None
        self.controller = AdaptiveAsyncController(aa, total_steps) if aa.enabled and not by_throughput else None
        self.ess_fraction = math.nan  # the trained batch's, for the throughput law's guard (``control``)
        # the one copy
        self.async_ratio = 1.0 if by_throughput else aa.initial_async_ratio if aa.enabled else fixed_async_ratio(op, ws)
        self.force_sync = False
        self.stale = False  # the controller's staleness is above its target by more than STALE_BAND (``control``)
        self.carry = 0.0  # error-diffusion residual of the fractional lookahead, in [-0.5, 0.5)
        self.discarded_rollouts = 0  # samples thrown away as too stale
        max_interval = min(ws.max_interval, op.max_version_gap + 1)
        self.cadence = SyncCadence(1, ws.overhead_target, max_interval) if ws.interval == "auto" else None
        self._push_s_seen = 0.0  # the push thread's total push time at the last cadence update
        max_depth = op.max_pipeline_depth or (1 if serial_engines else None)
        self.depth = PipelineDepth(max_depth) if op.feedforward else None

    @property
    def sync_interval(self) -> int:
        """Every how many steps weights are pushed now (``weight_sync.interval``, or the cadence's choice)."""
        return self.cadence.interval if self.cadence is not None else self.fixed_interval

    @property
    def lookahead(self) -> float:
        """How many steps ahead of training generation may run (see the module docstring)."""
        if self.force_sync:
            return 0.0
        gap = self.max_version_gap
        cap = gap - (self.sync_interval - 1)
        if self.depth is not None:
            cap = min(cap, self.depth.depth)
        if self.throughput is not None:
            return float(max(1, min(self.throughput.lookahead, cap)))
        return min(self.async_ratio * gap, cap)

    @property
    def on_policy(self) -> bool:
        """The next step is synchronous: in async mode the engines must first get the newest weights."""
        return self.force_sync or self.async_ratio == 0

    def oldest(self, version: int) -> int:
        """The oldest policy version a step trained at ``version`` may take samples from."""
        return version - self.max_version_gap

    def accept(self, step: int, version: int, batch) -> bool:
        """Whether step ``step``'s ``batch`` may be trained on at policy ``version``; a stale one is counted."""
        gap = version - int(batch.versions.min())
        if gap <= self.max_version_gap:
            return True
        self.discarded_rollouts += batch.tokens.shape[0]
        logger.warning(f"step {step}: rollouts {gap} versions old exceed max_version_gap; regenerating")
        return False

    def push_due(self, step: int) -> bool:
        """Whether ``step`` pushes its weights (rank 0's answer; other ranks get it with the batch)."""
        return self.cadence.due() if self.cadence is not None else step % self.fixed_interval == 0

    def admit(self) -> int:
        """How many steps ahead to admit now: ``floor(lookahead)``, plus one on its fractional share of calls (error
        diffusion: deterministic, the running error within half a step; whole steps, see docs/architecture.md)."""
        lookahead = self.lookahead
        whole = int(lookahead)
        self.carry += lookahead - whole
        if self.carry >= 0.5:
            self.carry -= 1.0
            return whole + 1
        return whole

    def decision(self) -> tuple[int, int]:
        """Rank 0's measured choices, broadcast with each batch: the push interval and the pipeline depth."""
        depth = self.throughput.lookahead if self.throughput is not None else self.depth.depth if self.depth else 0
        return self.sync_interval, depth

    def adopt(self, decision: tuple[int, int]) -> None:
        """Ranks > 0: take rank 0's ``decision()`` and replay its admission (so every rank has the same carry)."""
        interval, depth = decision
        if self.cadence is not None:
            self.cadence.interval = interval
        if self.depth is not None:
            self.depth.depth = depth
        if self.throughput is not None:
            self.throughput.lookahead = depth
        self.admit()

    def control(self, step: int, sample: StalenessSample) -> dict[str, float]:
        """The staleness ``sample`` of the batch step ``step`` just trained -> the controller -> ``async_ratio`` of the
        next admission, and whether the staleness is out of band (``stale``). Returns the controller's metrics."""
        out = {"async_ratio": self.async_ratio}
        self.ess_fraction = sample.ess_fraction
        if self.controller is None:
            return out
        decision = self.controller.step(step, sample)
        self.async_ratio, self.force_sync = decision.async_ratio, decision.force_sync
        self.stale = decision.staleness > decision.target + STALE_BAND
        return decision.metrics

    def after_push(self, fed, compute_s: float, sync_s: float, push_s_total: float) -> dict:
        """Rank 0, after a step's push: the depth and the auto cadence learn from its times; returns their metrics."""
        out: dict[str, Any] = {}
        if self.depth is not None:
            out.update(self.observe_times(fed.batch.gen_time_s, compute_s))
        if self.throughput is not None:
            self.throughput.observe(fed.batch.gen_time_s, compute_s, fed.batch.generation_wait_s, self.ess_fraction,
                                    fed.budgets)
            out.update(self.throughput.metrics())
        if self.cadence is not None:
            out.update(self.tune_cadence(fed.push_due, compute_s, sync_s, fed.wait_s, fed.flush_s, push_s_total))
        return out

    def observe_times(self, gen_s: float, train_s: float) -> dict[str, float]:
        """Rank 0, ``off_policy.feedforward``: a batch's generation and compute times -> the pipeline depth."""
        self.depth.observe(gen_s, train_s)
        return {"pipeline_depth": float(self.depth.depth)}

    def tune_cadence(self, pushed: bool, compute_s: float, sync_s: float, rollout_wait: float, flush_s: float,
                     push_s_total: float) -> dict[str, Any]:
        """Rank 0, ``interval = "auto"``: the step's time lost to weight sync (the main thread's push or snapshot,
        a flush, and in async mode the rollout wait the push thread's work explains) -> ``SyncCadence``.
        The controller's staleness out of band (``stale``) halves the interval."""
        lost = sync_s + flush_s
        if self.async_push:
            lost += min(max(rollout_wait - flush_s, 0.0), push_s_total - self._push_s_seen)
            self._push_s_seen = push_s_total
        before = self.cadence.interval
        d = self.cadence.observe_step(compute_s, lost, pushed, stale=self.stale)
        out: dict[str, Any] = {"sync_interval": self.cadence.interval, "sync_lost_s": lost,
                               "sync_overhead_target": self.cadence.target}
        if d is not None:
            out.update(sync_overhead=d.overhead, sync_interval_reason=d.reason)
            if d.interval != before:
                logger.info(f"weight_sync.interval {before} -> {d.interval} ({d.reason}: overhead "
                            f"{d.overhead:.3f}, target {self.cadence.target})")
        return out

    def state_dict(self) -> dict[str, Any]:
        """Everything above, in one dict (a part switched off is None)."""
        parts = {"controller": self.controller, "cadence": self.cadence, "pipeline_depth": self.depth,
                 "throughput": self.throughput}
        return {"async_ratio": self.async_ratio, "force_sync": self.force_sync, "admit_carry": self.carry,
                "discarded_rollouts": self.discarded_rollouts,
                **{k: p.state_dict() if p is not None else None for k, p in parts.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``ConfigError`` for a checkpoint of the other adaptive law (its ratio and forced-sync state would outlive
        it: the throughput law never clears them)."""
        laws = {"controller": "a staleness law (\"pid\" or a ControlLaw class)", "throughput": "\"throughput\""}
        saved = next((laws[k] for k in laws if state[k] is not None), None)
        now = laws["controller"] if self.controller is not None else laws["throughput"] if self.throughput else None
        if saved and now and saved != now:
            raise ConfigError(f"adaptive_async.controller: the checkpoint was saved by {saved} and this run has {now}; "
                              "allowed: the law the checkpoint was saved with, or a new job.dump_folder")
        self.async_ratio, self.force_sync = float(state["async_ratio"]), bool(state["force_sync"])
        self.carry, self.discarded_rollouts = float(state["admit_carry"]), int(state["discarded_rollouts"])
        parts = ((self.controller, "controller"), (self.cadence, "cadence"), (self.depth, "pipeline_depth"),
                 (self.throughput, "throughput"))
        for part, key in parts:
            if part is not None and state[key] is not None:  # None: saved with that part off
                part.load_state_dict(state[key])


@dataclass
class CadenceDecision:
    """What ``SyncCadence.observe_step`` decided, for metrics and logs."""

    interval: int
    overhead: float  # smoothed lost time per push / (smoothed compute per step * the interval in force when measured)
    reason: str  # "hold", "raise", "lower", "stale" (halved for staleness), "cap" (a raise clipped at max_interval)


class SyncCadence:
    """``weight_sync.interval = "auto"``: every how many steps weights are pushed, so that the trainer's time lost
    to weight sync stays under a target (flodl's ``ElChe``). Main thread only. A push closes a window; on EMAs of
    the lost time per window and the compute per step, the overhead at interval ``k`` is ``lost / (k * compute)``:
      * above ``target``: raise ``k`` straight to ``ceil(lost / (target * compute))``, capped at ``max_interval``;
      * below ``lower_fraction * target`` and ``k > min_interval``: lower ``k`` by one (the dead zone stops flapping);
      * ``stale`` (the controller's staleness out of band) wins: ``k`` is halved (ceil, >= 1) and may not rise.
    In async mode a push's cost shows in the next steps' rollout waits, so windows are shifted by one step."""

    def __init__(self, start_interval: int, overhead_target: float, max_interval: int, ema_alpha: float = 0.5,
                 lower_fraction: float = 0.5):
        if not 1 <= start_interval <= max_interval:
            raise ValueError(f"need 1 <= start_interval ({start_interval}) <= max_interval ({max_interval})")
        self.interval = self.min_interval = start_interval
        self.max_interval, self.target = max_interval, overhead_target
        self.alpha, self.lower_fraction = ema_alpha, lower_fraction
        self.steps_since_push = 0
        self._window_compute = self._window_lost = 0.0
        self._lost_ema: float | None = None  # seconds lost per push window
        self._compute_ema: float | None = None  # seconds of compute per step

    def due(self) -> bool:
        """Whether the step now ending pushes its weights."""
        return self.steps_since_push + 1 >= self.interval

    def observe_step(self, compute_s: float, lost_s: float, pushed: bool,
                     stale: bool = False) -> CadenceDecision | None:
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
