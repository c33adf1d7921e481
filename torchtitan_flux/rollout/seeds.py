"""Every sampling seed of the rollout side, derived in one place from ``rollout.seed``.

A group's seed follows from the run's seed, its step and its prompt's index. A request of several groups (per-step
dispatch) carries its first group's seed, and the engine derives each sequence's stream from the request's (the
serial engine: one generator per request; ``engine.batcher.sequence_key``: the request's seed and the
sequence's index, hashed with each token's position), so a group's samples depend on how its step is split over the engines: the same split (one
engine, or the same measured speeds), the same samples. Streaming and multi-turn groups have a request of their own:
sampled alike whichever engine generates them. An evaluation group's "step" is the policy version it evaluates. A
multi-turn turn's seed follows from its group's, the episode and the turn.
"""

from __future__ import annotations


def group_seed(run_seed: int, step: int, index: int) -> int:
    """The seed of prompt ``index`` of step ``step`` (evaluation: of version ``step``)."""
    return (run_seed * 1_000_003 + step) * 131 + index


def turn_seed(group: int, episode: int, turn: int) -> int:
    """Turn ``turn`` of episode ``episode`` of a group seeded ``group``."""
    return ((group * 1009 + episode) * 101 + turn) % 2**62
