"""``TrainerThreads``: how many CPU threads this trainer rank computes on, and when it borrows an idle engine's;
``OtherLoad``: how many cores the machine's other processes keep busy (an idle engine's core is then not free)."""

from __future__ import annotations

import math
import os
import time
from typing import Protocol

import torch

from torchtitan_flux.engine.kinds import engine_kind


class HasEngines(Protocol):
    """What ``TrainerThreads`` reads of rank 0's rollout side: its current engines (replacements included)."""

    engines: list


CONTENTION_WINDOW_S = 0.5  # OtherLoad measures over windows at least this long
CONTENTION_CORES = 0.5  # other processes using this much of a core: no engine core is borrowed


class OtherLoad:
    """Cores kept busy by processes other than this trainer and its engines, from Linux's ``/proc`` over windows of
    ``CONTENTION_WINDOW_S``: the machine's busy CPU time (``/proc/stat``) minus this process's (every thread) and
    its engines'; infinite until the first window ends (nothing is borrowed unmeasured). Measured on a loaded machine (2026-11-27): with another job on the cores, the trainer's borrowed
    threads and the engine slowed each other down (a step from 0.06 s to 2.2 s). Main thread only. 0 where
    ``/proc`` cannot be read (no back-off there)."""

    def __init__(self):
        self.cores = math.inf  # not measured yet: nothing is borrowed before the first window ends
        self._last: tuple[float, float, float, dict[int, float]] | None = None  # wall, machine, own, engines

    def update(self, engine_pids: list[int]) -> float:
        """The other processes' cores over the last completed window (at most one ``/proc`` read per window)."""
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < CONTENTION_WINDOW_S:
            return self.cores
        machine, own = machine_busy_s(), time.process_time()
        engines = {pid: s for pid in engine_pids if (s := process_busy_s(pid)) is not None}
        if machine is None:  # no /proc: no back-off
            self.cores = 0.0
            return self.cores
        if self._last is not None and set(engines) == set(self._last[3]):  # a restarted engine: start over
            wall0, machine0, own0, engines0 = self._last
            ours = own - own0 + sum(engines[p] - engines0[p] for p in engines)
            self.cores = max(0.0, (machine - machine0 - ours) / (now - wall0))
        self._last = (now, machine, own, engines)
        return self.cores


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine spent busy since boot (``/proc/stat``'s first line, all but idle and iowait)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # idle, iowait
    return busy / os.sysconf("SC_CLK_TCK")


def process_busy_s(pid: int) -> float | None:
    """CPU seconds process ``pid`` spent (user + system, every thread), or None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


class TrainerThreads:
    """This trainer rank's CPU threads, and the cores it borrows from idle embedded engines.

    At construction (before torchtitan builds the model) the rank takes its share of the machine: on CPU with
    engines on this machine (``EngineKind.local``: embedded engines or servers we launch), (cores - engine threads) /
    local ranks; remote servers leave it every core; on GPU nothing is set. With ``rollout.borrow_idle_engine_cores``
    (CPU, one local rank, a kind with ``EngineKind.borrowable_cores``, no compiled model), ``before_compute`` adds
    the threads of each engine that holds no request (its handler's ``idle()``) and gives them back once it holds
    one. The trainer calls it before every transformer block's forward and backward (``every_block``: so a step's
    training takes the engine's core within one block of the engine finishing its generation), once the step's
    batch is in and before the optimizer step. It borrows nothing while other processes keep
    ``CONTENTION_CORES`` or more busy (``OtherLoad``): then the engine's idle core is not free, and borrowing it
    slows both jobs down.

    Invariant (no core does two jobs in a forward or backward pass): an engine gets work only through ``submit``,
    which only the trainer's main thread calls, between computations (multi-turn episodes send their own turns from
    their thread, so validation refuses borrowing with ``rollout.environment``); ``before_compute`` runs on that
    thread (CPU autograd runs the backward on the thread that called it) before each block, so a block computes on a
    borrowed core only while its engine has nothing to generate. Between a submit and the next check the main thread runs
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
        self._threads_sum = self._computes = self._contended = 0
        self.others = OtherLoad()

    def before_compute(self, rollouts: HasEngines | None) -> None:
        """Set the threads of the computation about to run: own + those of the engines idle now (main thread)."""
        if not self.borrowing or rollouts is None:
            return
        contended = self.others.update([e.pid for e in rollouts.engines if e.pid is not None]) >= CONTENTION_CORES
        n = self.own + (0 if contended else sum(e.threads for e in rollouts.engines if e.idle()))  # borrowable_cores
        self._contended += contended
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        self._threads_sum += n
        self._computes += 1

    def step_metrics(self) -> dict[str, float]:
        """``trainer_threads``: mean threads over the checks since the last call (one per block's forward and
        backward, one per optimizer step; borrowing only); ``borrow_contended``: the share of those checks that
        borrowed nothing because other processes kept the machine busy (``other_cores``: their cores, last window)."""
        if not self._computes:
            return {}
        m = {"trainer_threads": self._threads_sum / self._computes,
             "borrow_contended": self._contended / self._computes, "other_cores": self.others.cores}
        self._threads_sum = self._computes = self._contended = 0
        return m


def every_block(model: torch.nn.Module, fn) -> None:
    """``fn()`` before each of ``model``'s transformer blocks (``model.layers``) computes its forward and, through a
    gradient hook on the block's output, its backward: on the main thread (borrowing runs on CPU only, where autograd
    runs the backward on its caller). Only ``TrainerThreads.before_compute`` is registered: no rollout work runs in
    a forward or backward pass."""

    def check(*_):
        fn()

    def on_output(_module, _args, out):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(check)  # returns None: the gradient is unchanged

    for block in model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers:
        block.register_forward_pre_hook(check)
        block.register_forward_hook(on_output)
