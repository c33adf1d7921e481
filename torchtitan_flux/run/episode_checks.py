"""Multi-turn episodes per step (``rollout.environment``): the ``episode/*`` metrics of ``metrics.jsonl`` and the
warnings about episodes that end before their environment is ever stepped (docs/running.md).

Concurrency: rank 0's main thread, once per step (``GRPOTrainer._log``).
"""

from __future__ import annotations

import logging

from torchtitan_flux.rollout.episode import EpisodeEnd

logger = logging.getLogger("torchtitan_flux")

WARN_EVERY_STEPS = 50  # a warning that still holds is repeated this many steps after the last one


def episode_metrics(episodes: list[dict]) -> dict[str, float]:
    """Means over a step's episodes (``episode_groups.episode_record``'s dicts): assistant turns, environment steps
    (one ``env_rewards`` dict each), and the share of each way an episode ends."""
    n = len(episodes)
    out = {"episode/turns_mean": sum(e["turns"] for e in episodes) / n,
           "episode/env_steps_mean": sum(len(e["env_rewards"]) for e in episodes) / n}
    for end in EpisodeEnd:
        out[f"episode/end_{end.value}_frac"] = sum(e["end"] == end.value for e in episodes) / n
    return out


class EpisodeWarnings:
    """Warns when most of a step's episodes end before their environment is stepped (once, then every
    ``WARN_EVERY_STEPS`` steps while it holds), and once when some openings do not fit ``training.seq_len``."""

    def __init__(self, max_new_tokens: int, seq_len: int, stop_ids: list[int]):
        self.max_new_tokens, self.seq_len, self.stop_ids = max_new_tokens, seq_len, stop_ids
        self._never_stepped_at: int | None = None  # the step of the last such warning
        self._opening_warned = False

    def check(self, step: int, episodes: list[dict], m: dict[str, float]) -> None:
        """``episodes``: the step's (``episode_record``'s dicts); ``m``: their ``episode_metrics``."""
        never = sum(e["end"] == EpisodeEnd.MAX_TOKENS.value and not e["env_rewards"] for e in episodes) / len(episodes)
        if never > 0.5 and (self._never_stepped_at is None or step - self._never_stepped_at >= WARN_EVERY_STEPS):
            self._never_stepped_at = step
            logger.warning(
                f"step {step}: {never:.0%} of the episodes ended before their environment was ever stepped (a first "
                f"turn that runs to its token budget without a stop token ends the episode unstepped); raise "
                f"rollout.max_new_tokens (now {self.max_new_tokens}, per turn) or training.seq_len (now "
                f"{self.seq_len}, the whole episode), or give the model stop tokens that end its turns (eos_token_id "
                f"in the model folder's config.json, now {self.stop_ids})")
        too_long = m["episode/end_opening_too_long_frac"]
        if too_long > 0 and not self._opening_warned:
            self._opening_warned = True
            logger.warning(f"step {step}: {too_long:.0%} of the episodes opened with more tokens than "
                           f"training.seq_len = {self.seq_len}: they end at once (episode/end_opening_too_long_frac); "
                           "raise training.seq_len or shorten the environment's opening")
