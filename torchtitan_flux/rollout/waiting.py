"""Waiting for rollouts: ``WaitNotes`` (one ``pump`` at a time, an interrupt or a kept failure raised, a note every
``WAIT_NOTE_S`` without a result) and the note itself. Main thread only."""

from __future__ import annotations

import logging
import time
from typing import Callable

from torchtitan_flux.errors import RolloutWaitInterrupted
from torchtitan_flux.rollout.pump import EnginePump, InFlight, RolloutEngine

logger = logging.getLogger("torchtitan_flux")

WAIT_NOTE_S = 30.0  # a wait with no result for this long logs who holds what


class WaitNotes:
    """A wait for step ``step``'s rollouts, one ``pump`` at a time: ``check()`` first (it raises an interrupt or a
    failure kept for the next wait), then a note every ``WAIT_NOTE_S`` without a result (``waiting_note``)."""

    def __init__(self, pump: EnginePump, step: int, check: Callable[[], None]):
        self.engine_pump, self.step, self.check = pump, step, check
        self.start = self.noted = time.monotonic()

    def pump(self) -> None:
        self.check()
        p = self.engine_pump
        p.pump(0.05)
        now = time.monotonic()
        if now - max(p.last_result, self.start) >= WAIT_NOTE_S and now - self.noted >= WAIT_NOTE_S:
            logger.warning(waiting_note(self.step, now - self.start, p.engines, p.in_flight(), p.last_result))
            self.noted = now


def interrupted_wait(step: int) -> RolloutWaitInterrupted:
    return RolloutWaitInterrupted(f"interrupted while waiting for the rollouts of step {step}")


def waiting_note(step: int, waited: float, engines: list[RolloutEngine], in_flight: list[InFlight],
                 last_result: float) -> str:
    """One line: how long step ``step`` has waited, and what each engine holds of the requests in flight."""
    now = time.monotonic()
    held = []
    for e in engines:
        mine = [f for f in in_flight if f.engine is e]
        state = "alive" if e.alive() else "dead"
        if not mine:
            held.append(f"{e.name} ({state}): nothing in flight")
            continue
        steps = sorted({f.request.step for f in mine})
        n = sum(len(f.request.prompt_ids) * f.request.group_size for f in mine)
        versions = sorted({str(r.pin_version) if r.pin_version >= 0 else f">= {r.min_version}"
                           for r in (f.request for f in mine)})
        turns = sum(f.turn is not None for f in mine)
        held.append(f"{e.name} ({state}): {len(mine)} requests{f' ({turns} episode turns)' if turns else ''}, {n} "
                    f"completions of steps {', '.join(map(str, steps))} on weight version {', '.join(versions)}, the "
                    f"oldest sent {now - min(f.sent for f in mine):.0f} s ago")
    return (f"step {step}: waiting {waited:.0f} s for rollouts, none arrived for {now - last_result:.0f} s; "
            + "; ".join(held))
