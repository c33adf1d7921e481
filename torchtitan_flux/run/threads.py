"""``TrainerThreads``: how many CPU threads this trainer rank computes on, and when it borrows an idle engine's."""

from __future__ import annotations

import os
from typing import Protocol

import torch

from torchtitan_flux.engine.kinds import engine_kind


class HasEngines(Protocol):
    """What ``TrainerThreads`` reads of rank 0's rollout side: its current engines (replacements included)."""

    engines: list


class TrainerThreads:
    """This trainer rank's CPU threads, and the cores it borrows from idle embedded engines.

    At construction (before torchtitan builds the model) the rank takes its share of the machine: on CPU with
    engines on this machine (``EngineKind.local``: embedded engines or servers we launch), (cores - engine threads) /
    local ranks; remote servers leave it every core; on GPU nothing is set. With ``rollout.borrow_idle_engine_cores``
    (CPU, one local rank, a kind with ``EngineKind.borrowable_cores``, no compiled model), ``before_compute`` adds
    the threads of each engine that holds no request (its handler's ``idle()``) and gives them back once it holds
    one. ``watch`` calls it before every transformer block's forward and backward (so a step's training takes the
    engine's core within one block of the engine finishing its generation); the trainer calls it once the step's
    batch is in and before the optimizer step.

    Invariant (no core does two jobs in a forward or backward pass): an engine gets work only through ``submit``,
    which only the trainer's main thread calls, between computations; ``before_compute`` runs on that thread (CPU
    autograd runs the backward on the thread that called it) before each block, so a block computes on a borrowed
    core only while its engine has nothing to generate. Between a submit and the next check the main thread runs
    bookkeeping and copies only (the batch's layout, a staging copy), still on the borrowed count; so does the
    engine's receiver thread when it unpacks a push. Compiled models (``compile.enable`` with "model") do not
    borrow: Inductor writes the thread count into the kernels it generates, so later changes would not reach them.
    """

    def __init__(self, job_config):
        r = job_config.rollout
        kind = engine_kind(r.engine)
        cpu_split = not torch.cuda.is_available() and kind.local(r.launch)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.own = max(1, ((os.cpu_count() or 1) - r.engine_threads * r.num_engines) // local)
        compiled = job_config.compile.enable and "model" in job_config.compile.components
        self.borrowing = (cpu_split and r.borrow_idle_engine_cores and kind.borrowable_cores and local == 1
                          and not compiled)
        if cpu_split:
            torch.set_num_threads(self.own)
        self._threads_sum = self._computes = 0

    def before_compute(self, rollouts: HasEngines | None) -> None:
        """Set the threads of the computation about to run: own + those of the engines idle now (main thread)."""
        if not self.borrowing or rollouts is None:
            return
        n = self.own + sum(e.threads for e in rollouts.engines if e.idle())  # EngineKind.borrowable_cores
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        self._threads_sum += n
        self._computes += 1

    def watch(self, model: torch.nn.Module, rollouts: HasEngines | None) -> None:
        """Hooks on ``model``'s transformer blocks (``model.layers``): ``before_compute`` before each block's forward
        and, through a gradient hook on its output, before its backward. Nothing when not borrowing."""
        if not self.borrowing or rollouts is None:
            return

        def check(*_):
            self.before_compute(rollouts)

        def on_output(_module, _args, out):
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(check)  # returns None: the gradient is unchanged

        for block in model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers:
            block.register_forward_pre_hook(check)
            block.register_forward_hook(on_output)

    def step_metrics(self) -> dict[str, float]:
        """``trainer_threads``: mean threads over the checks since the last call (one per block's forward and
        backward, one per optimizer step; borrowing only)."""
        if not self._computes:
            return {}
        m = {"trainer_threads": self._threads_sum / self._computes}
        self._threads_sum = self._computes = 0
        return m
