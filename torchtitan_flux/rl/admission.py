"""``Admission``: how far generation may run ahead of training, and which steps push weights.

The one owner of the async settings' run-time state:

* ``async_ratio``: ``off_policy.async_ratio`` (fixed; by default 1 with ``weight_sync.async_weight_update`` and
  0 without), or the controller's output with ``adaptive_async.enabled`` (``control`` feeds it the staleness of
  each trained batch; it may also force the next step synchronous);
* ``lookahead = async_ratio * max_version_gap`` steps, at most ``max_version_gap - (interval - 1)`` since
  engines may hold weights up to ``interval - 1`` steps old, and with ``off_policy.feedforward`` at most
  the pipeline depth that hides generation (``PipelineDepth``, fed by ``observe_times``); ``admit`` turns it
  into whole steps (error diffusion, see its docstring);
* the push cadence: every ``weight_sync.interval`` steps, or the self-tuning ``SyncCadence`` with
  ``interval = "auto"`` (``tune_cadence``).

Concurrency: main thread only. Every trainer rank holds one and feeds it identical inputs (the controller's
inputs are all-reduced, the cadence's interval is broadcast from rank 0 with the batch), so every rank admits the
same and checkpoints the same state. The feedforward depth is measured on rank 0 and broadcast with the batch,
like the cadence's interval.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from torchtitan_flux.rl.controller import AdaptiveAsyncController, StalenessSample
from torchtitan_flux.rl.cadence import SyncCadence

logger = logging.getLogger("torchtitan_flux")

STALE_BAND = 0.05  # staleness this far above its target counts as out of band (as in benchmarks/controller.py)
DEPTH_EMA = 0.2  # EMA weight of the newest step's generation and training times (PipelineDepth)


class PipelineDepth:
    """The feedforward term: how many steps must be in flight for generation to hide behind training.

    With a step's generation taking ``g`` seconds (engine-side, for the whole batch) and its training ``t``,
    an engine that serves the in-flight steps concurrently keeps the trainer busy with ``ceil(g / t)`` steps
    ahead (Little's law: in flight = latency x rate); fewer leave the trainer waiting, more only add staleness.
    ``g`` and ``t`` are EMAs (weight ``DEPTH_EMA``) of each trained batch's ``gen_time_s`` and the trainer's
    compute time. Before the first measurement the depth is 1. Rank 0 measures; other ranks are told ``depth``.
    """

    def __init__(self):
        self.gen_s: float | None = None
        self.train_s: float | None = None
        self.depth = 1

    def observe(self, gen_s: float, train_s: float) -> None:
        if not (math.isfinite(gen_s) and math.isfinite(train_s) and gen_s >= 0 and train_s > 0):
            return
        a = DEPTH_EMA
        self.gen_s = gen_s if self.gen_s is None else a * gen_s + (1 - a) * self.gen_s
        self.train_s = train_s if self.train_s is None else a * train_s + (1 - a) * self.train_s
        self.depth = max(1, math.ceil(self.gen_s / self.train_s))

    def state_dict(self) -> dict[str, Any]:
        return {"gen_s": self.gen_s, "train_s": self.train_s, "depth": self.depth}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.gen_s, self.train_s, self.depth = state["gen_s"], state["train_s"], int(state["depth"])


class Admission:
    def __init__(self, off_policy, adaptive_async, weight_sync, total_steps: int):
        op, aa, ws = off_policy, adaptive_async, weight_sync
        self.max_version_gap, self.async_push, self.fixed_interval = op.max_version_gap, ws.async_weight_update, ws.interval
        self.controller = AdaptiveAsyncController(aa, total_steps) if aa.enabled else None
        self.async_ratio = self.controller.async_ratio if self.controller else op.fixed_ratio(ws.async_weight_update)
        self.force_sync = False
        self.carry = 0.0  # error-diffusion residual of the fractional lookahead, in [-0.5, 0.5)
        # weight_sync.interval = "auto": rank 0's cadence decides which steps push (broadcast with the batch)
        max_interval = min(ws.max_interval, op.max_version_gap + 1)
        self.cadence = SyncCadence(1, ws.overhead_target, max_interval) if ws.interval == "auto" else None
        self._push_s_seen = 0.0  # the push thread's total push time at the last cadence update
        self.depth = PipelineDepth() if op.feedforward else None  # off_policy.feedforward

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
        return min(self.async_ratio * gap, cap)

    @property
    def on_policy(self) -> bool:
        """The next step is synchronous: in async mode the engines must first get the newest weights."""
        return self.force_sync or self.async_ratio == 0

    def push_due(self, step: int) -> bool:
        """Whether ``step`` pushes its weights (rank 0's answer; other ranks get it with the batch)."""
        return self.cadence.due() if self.cadence is not None else step % self.fixed_interval == 0

    def admit(self) -> int:
        """How many steps ahead to admit now: ``floor(lookahead)``, plus one on the fraction ``lookahead -
        floor(lookahead)`` of calls (error diffusion: the residual carries over, so the admitted lookahead
        averages ``lookahead`` and its running error stays within half a step).

        Why whole steps: an earlier design sent that fraction of the next step's prompts early and the rest
        later, which made every step two engine requests and two decode passes over smaller batches; on the CPU
        debug config that costs ~10% of throughput at the same mean lookahead (measured: 24.4 vs 27.3 steps/s at
        lookahead 2.4 vs 2.0). Deterministic (a function of the controller's outputs and ``carry``, which is
        checkpointed), and ``lookahead = 0`` never admits ahead (the residual stays below one half)."""
        lookahead = self.lookahead
        whole = int(lookahead)
        self.carry += lookahead - whole
        if self.carry >= 0.5:
            self.carry -= 1.0
            return whole + 1
        return whole

    def control(self, step: int, versions: torch.Tensor, m: dict[str, float]) -> dict[str, float]:
        """Staleness of the batch just trained (its samples' ``versions``, the step's metrics ``m``) -> the
        controller -> ``async_ratio`` of the next admission. Returns the controller's metrics."""
        out = {"async_ratio": self.async_ratio}
        if self.controller is None:
            return out
        gap = (step - 1 - versions).float()
        sample = StalenessSample(
            kl=m["behaviour_kl"], iw_var=m["iw_var"], version_gap_mean=gap.mean().item(),
            version_gap_max=gap.max().item(), ess_fraction=m["ess_fraction"],
        )
        decision = self.controller.step(step, sample)
        self.async_ratio, self.force_sync = decision.async_ratio, decision.force_sync
        return decision.metrics

    def after_push(self, fed, compute_s: float, sync_s: float, push_s_total: float, m: dict[str, float]) -> dict:
        """Rank 0, after a step's ``after_optimizer_step``: what the feedforward depth and the auto cadence learn
        from the step's times (``fed``: its ``feed.StepInput``). Returns their metrics (none when both are off)."""
        out: dict[str, Any] = {}
        if self.depth is not None:
            out.update(self.observe_times(fed.batch.gen_time_s, compute_s))
        if self.cadence is not None:
            out.update(self.tune_cadence(fed.push_due, compute_s, sync_s, fed.wait_s, fed.flush_s, push_s_total, m))
        return out

    def observe_times(self, gen_s: float, train_s: float) -> dict[str, float]:
        """Rank 0, ``off_policy.feedforward``: a trained batch's generation time and the step's compute time
        -> the pipeline depth that caps the next admissions. Returns its metrics."""
        self.depth.observe(gen_s, train_s)
        return {"pipeline_depth": float(self.depth.depth)}

    def tune_cadence(self, pushed: bool, compute_s: float, sync_s: float, rollout_wait: float, flush_s: float,
                     push_s_total: float, m: dict[str, float]) -> dict[str, Any]:
        """Rank 0, ``weight_sync.interval = "auto"``: account this step's time lost to weight sync and, when it
        pushed, let the cadence pick the next interval (``sync_cadence.py``). Lost time: blocking mode, the main
        thread's time in the push (``sync_s``); async mode, that (the snapshot) plus an on-policy flush, plus the
        part of the rollout wait the push thread's work can explain (at most the push time spent since the last
        step; ``push_s_total`` is the push thread's running total). Staleness wins: with the controller on,
        staleness above its target by more than ``STALE_BAND`` halves the interval and blocks raises."""
        lost = sync_s + flush_s
        if self.async_push:
            lost += min(max(rollout_wait - flush_s, 0.0), push_s_total - self._push_s_seen)
            self._push_s_seen = push_s_total
        stale = "staleness" in m and m["staleness"] > m["target_staleness"] + STALE_BAND
        before = self.cadence.interval
        d = self.cadence.observe_step(compute_s, lost, pushed, stale=stale)
        out: dict[str, Any] = {"sync_interval": self.cadence.interval, "sync_lost_s": lost,
                               "sync_overhead_target": self.cadence.target}
        if d is not None:
            out.update(sync_overhead=d.overhead, sync_interval_reason=d.reason)
            if d.interval != before:
                logger.info(f"weight_sync.interval {before} -> {d.interval} ({d.reason}: overhead "
                            f"{d.overhead:.3f}, target {self.cadence.target})")
        return out

    def state_dict(self) -> dict[str, Any]:
        """The checkpointed state (the trainer's keys of old; the cadence's travels with rank 0's rollouts)."""
        state = {"async_ratio": self.async_ratio, "force_sync": self.force_sync, "admit_carry": self.carry,
                 "controller": self.controller.state_dict() if self.controller else {}}
        if self.depth is not None:
            state["pipeline_depth"] = self.depth.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.async_ratio, self.force_sync = float(state["async_ratio"]), bool(state["force_sync"])
        self.carry = float(state.get("admit_carry", 0.0))  # absent in checkpoints before it existed
        if self.controller is not None and state["controller"]:
            self.controller.load_state_dict(state["controller"])
        if self.depth is not None and state.get("pipeline_depth"):  # absent when saved with it off
            self.depth.load_state_dict(state["pipeline_depth"])
