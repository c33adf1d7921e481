"""Waiting for rollouts: ``WaitNotes`` (one ``pump`` at a time, an interrupt or a kept failure raised, a note every
``WAIT_NOTE_S`` without a result) and the note itself. Main thread only."""

from __future__ import annotations

import logging
import time
from typing import Callable, Protocol

from torchtitan_flux.errors import RolloutWaitInterrupted
from torchtitan_flux.rollout.pump import EnginePump, InFlight, RolloutEngine

logger = logging.getLogger("torchtitan_flux")

WAIT_NOTE_S = 30.0  # a wait with no result for this long logs who holds what


class Episodes(Protocol):
    """What the note reads of ``episode_groups.EpisodeGroups``."""

    running: int  # episodes started and not ended


class WaitNotes:
    """A wait for step ``step``'s rollouts, one ``pump`` at a time: ``check()`` first (it raises an interrupt or a
    failure kept for the next wait), then a note every ``WAIT_NOTE_S`` without a result (``waiting_note``).
    ``waited_s``: the time spent in ``pump``, waiting on the engines (the batch's ``generation_wait_s``)."""

    def __init__(self, pump: EnginePump, step: int, check: Callable[[], None], episodes: Episodes | None = None):
        """``episodes``: the multi-turn episodes (``rollout.environment``), whose count the note gives."""
        self.engine_pump, self.step, self.check, self.episodes = pump, step, check, episodes
        self.start = self.noted = time.monotonic()
        self.waited_s = 0.0

    def pump(self) -> None:
        self.check()
        p, start = self.engine_pump, time.monotonic()
        p.pump(0.05)
        now = time.monotonic()
        self.waited_s += now - start
        if now - max(p.last_result, self.start) >= WAIT_NOTE_S and now - self.noted >= WAIT_NOTE_S:
            logger.warning(waiting_note(self.step, now - self.start, p.engines, p.in_flight(), p.last_result,
                                        self.episodes.running if self.episodes is not None else 0))
            self.noted = now


def interrupted_wait(step: int) -> RolloutWaitInterrupted:
    return RolloutWaitInterrupted(f"interrupted while waiting for the rollouts of step {step}")


def waiting_note(step: int, waited: float, engines: list[RolloutEngine], in_flight: list[InFlight],
                 last_result: float, episodes_running: int = 0) -> str:
    """One line: how long step ``step`` has waited, what each engine holds of the requests in flight, and how many
    of the ``episodes_running`` have no turn at an engine: they wait on their environment."""
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
    on_environment = episodes_running - sum(f.turn is not None for f in in_flight)
    if on_environment > 0:
        held.append(f"{on_environment} of {episodes_running} episodes waiting on their environment (each call "
                    "bounded by rollout.environment_timeout_seconds)")
    return (f"step {step}: waiting {waited:.0f} s for rollouts, none arrived for {now - last_result:.0f} s; "
            + "; ".join(held))
