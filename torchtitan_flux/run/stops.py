"""How a training run stops early: the trainer's signal handling, and the exceptions the entry point prints as one
``stopped: ...`` line (``train.py``).

A signal before the training loop starts (the trainer's set-up: user code, engines) stops at once: there is
nothing to finish or checkpoint. The first SIGTERM/SIGINT/SIGHUP/SIGUSR1 after: stop at the next step boundary (no trained
step is half-applied), or, single process, at once while waiting for a step's rollouts (most of a long GRPO step,
and torchrun SIGKILLs after its grace period). A second one, 2 s or more later: stop now, writing no checkpoint (the
step may be incomplete).

Concurrency: the handler runs on the main thread between bytecodes; it only sets fields and calls
``Rollouts.interrupt`` (which sets a flag), or raises ``TrainingInterrupted`` (before the loop, or on a
second signal).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any, Callable

from torchtitan_flux.engine.forkserver import die_with_parent
from torchtitan_flux.errors import NoEngineLeft, TrainingInterrupted

logger = logging.getLogger("torchtitan_flux")

SIGNAL_STOP_WAIT_S = 10.0  # on a signal: the most a stop (or a save) waits for a push, and for rollouts in flight
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)  # SIGUSR1: a pre-emption warning
DUPLICATE_WINDOW_S = 2.0  # one signal delivered twice (to torchrun's process group and forwarded by torchrun)


class StopRequests:
    """The trainer process's SIGTERM/SIGINT/SIGHUP/SIGUSR1 handler (see the module docstring; SIGUSR1 is SLURM's
    pre-emption warning: torchrun forwards it with ``--signals-to-handle ...,SIGUSR1``). ``signal`` is the name of the
    first signal received, or None."""

    def __init__(self):
        self.signal: str | None = None
        self.training = False  # set by the trainer as its loop starts; before, there is nothing to finish or save
        self._at = 0.0
        self._interruptible = None  # a Rollouts whose wait for rollouts a first signal ends
        for sig in STOP_SIGNALS:  # SIGHUP: the terminal was closed
            if sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN:  # nohup: the user asked to go on
                continue
            signal.signal(sig, self._on_signal)

    def interrupt_rollout_waits_of(self, scheduler) -> None:
        """Single-process runs: a first signal also ends ``scheduler``'s wait for rollouts (with several ranks
        the others would be left waiting in the batch broadcast, so they finish the step instead)."""
        self._interruptible = scheduler

    def wait_s(self, timeout_s: float) -> float:
        """How long to wait for a push or for rollouts in flight: ``timeout_s``, at most ``SIGNAL_STOP_WAIT_S``
        once a signal came."""
        return min(timeout_s, SIGNAL_STOP_WAIT_S) if self.signal is not None else timeout_s

    def raise_if_requested(self) -> None:
        """At a step boundary: stop if a signal came."""
        if self.signal is not None:
            raise TrainingInterrupted(f"received {self.signal}", at_step_boundary=True)

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None:
            if time.monotonic() - self._at < DUPLICATE_WINDOW_S:
                return
            raise TrainingInterrupted(f"received {name} twice", at_step_boundary=False)
        self.signal, self._at = name, time.monotonic()
        if not self.training:  # a start that hangs (a task factory, an engine) must not wait for a second signal
            raise TrainingInterrupted(f"received {name} while starting (nothing trained yet)", at_step_boundary=False)
        if self._interruptible is not None:
            self._interruptible.interrupt()
        logger.warning(f"received {name}: stopping after the current step (send it again to stop at once)")


def settle_and_checkpoint(syncer, wait_s: float, save: Callable[[], Any] | None, step: int) -> None:
    """Graceful stop: let an in-flight push finish or time out within ``wait_s``, then ``save()`` a checkpoint of
    the last completed step. The caller passes no ``save`` with several ranks (a collective save after a signal
    could hang), after a second signal, or with checkpoints off. What does not finish is redone on resume (the
    checkpoint's weights are pushed first; unfinished rollouts are generated afresh)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            settled = syncer.wait_idle(max(0.0, deadline - time.monotonic()))
            break
        except NoEngineLeft:  # the last engine's death noticed while waiting (a signal to the process group
            continue  # reaches the engines too): its push fails at once; keep waiting for the push thread
    if not settled:
        logger.warning("weight push did not settle within weight_sync.timeout_seconds: abandoned (a resume "
                       "pushes the checkpoint's weights to every engine first)")
    if save is not None:
        written = save()
        logger.warning(f"checkpoint of step {step} written" if written is not False else
                       f"checkpoint of step {step} kept (it was complete already)")


def die_with_launcher() -> None:
    """Under torchrun, ask the kernel to SIGKILL this process when the agent dies (``PR_SET_PDEATHSIG``): each
    worker runs in a session of its own, so a SIGKILL to torchrun's process group would leave it training on as
    an orphan. The engines then die with it the same way."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not die_with_parent():
        return
    if os.getppid() == 1:  # the agent died before the prctl
        os.kill(os.getpid(), signal.SIGKILL)
