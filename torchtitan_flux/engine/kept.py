"""K/V the continuous batcher keeps after a multi-turn episode's turn ends (``GenerationRequest.keep_kv``), so that
the episode's next turn prefills only its new tokens: its prompt extends the ended turn's prompt and tokens exactly
(``rollout/episode.py`` never re-renders an earlier turn), and the kept K/V covers all of them but the last sampled
token (sampled, never run). Everything here runs on the engine's main thread."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable

from torchtitan_flux.models import inference


@dataclass(frozen=True)
class Kept:
    """One ended sequence's K/V."""

    tokens: tuple[int, ...]
    """The tokens it covers: the sequence's prompt and sampled tokens but the last."""

    version: int
    """The oldest version any of those tokens' K/V was computed on: a sequence built on it stamps its tokens no
    newer (``rollout.in_flight_weight_updates``'s rule for K/V from an older version)."""

    kv: inference.KeptRows
    """Per layer K and V [n_kv, len(tokens), hd]."""


class KeptSequences:
    """At most ``capacity`` kept sequences (the batch's rows: a turn's K/V is at most a row's), the least recently
    kept or used dropped first. One per token sequence: episodes whose turns sampled the same tokens (common: a group
    shares its opening) share it, each copying it into its own row (``inference.join_rows``)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._kept: collections.OrderedDict[tuple[int, ...], Kept] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, kept: Kept) -> None:
        self._kept[kept.tokens] = kept
        self._kept.move_to_end(kept.tokens)
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def take(self, prompt: list[int], usable: Callable[[int], bool]) -> Kept | None:
        """The longest kept sequence that is a proper prefix of ``prompt`` and whose version is ``usable`` (kept, as
        the most recently used); None if there is none."""
        best = None
        for tokens, kept in self._kept.items():
            n = len(tokens)
            if n < len(prompt) and (best is None or n > len(best.tokens)) and tokens[-1] == prompt[n - 1] \
                    and usable(kept.version) and tuple(prompt[:n]) == tokens:  # the cheap tests first
                best = kept
        if best is not None:
            self._kept.move_to_end(best.tokens)
        return best
