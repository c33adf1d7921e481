"""``SpeedSplit``: how a step's prompts are split across the rollout engines (after floDl's ElChe).

Prompts go to engines by group, in proportion to each engine's measured throughput (an EMA of completions/s), with
a dead zone (the previous shares are kept while every engine's new share is within ``dead_zone``, relative, of its
previous one, so timing jitter does not reshuffle work) and an imbalance cap (while more than one engine is alive,
none gets more than ``max_share`` of a dispatch, the excess going to the others by speed, so one slow measurement
cannot starve an engine of the work that would show it has recovered). The caller passes the engines alive.

Concurrency: the scheduler's (main) thread only. Pure bookkeeping: no engine calls.
"""

from __future__ import annotations

SPEED_EMA = 0.2  # weight of the newest completions/s measurement


class SpeedSplit:
    def __init__(self, names: list[str], dead_zone: float, max_share: float):
        self.speed = {nm: 1.0 for nm in names}  # EMA of completions/s per engine (1.0 before any measurement)
        self.dead_zone, self.max_share = dead_zone, max_share
        self.shares: dict[str, float] = {}  # the split in force (engine name -> fraction); see ``_shares``

    def observe(self, name: str, completions: int, gen_time_s: float) -> None:
        """An engine generated ``completions`` in ``gen_time_s`` seconds."""
        rate = completions / max(gen_time_s, 1e-6)
        self.speed[name] = (1 - SPEED_EMA) * self.speed.get(name, 1.0) + SPEED_EMA * rate

    def replace(self, old: str, new: str) -> None:
        """Engine ``old`` was replaced by ``new`` (a restart): the replacement starts from its measured speed."""
        self.speed[new] = self.speed.pop(old, 1.0)

    def fastest(self, names: list[str]) -> str:
        return max(names, key=lambda nm: self.speed.get(nm, 1.0))

    def split(self, n: int, names: list[str]) -> list[int]:
        """Prompts per engine: ``n`` split by ``_shares`` (largest remainder), then no engine above
        ``floor(max_share * n)`` while another one is alive (when that is feasible: a dispatch of fewer prompts
        than engines can still only be split as evenly as possible)."""
        shares = self._shares(names)
        raw = [n * s for s in shares]
        counts = [int(r) for r in raw]
        for i in sorted(range(len(raw)), key=lambda i: raw[i] - counts[i], reverse=True)[: n - sum(counts)]:
            counts[i] += 1
        if len(names) > 1:
            limit = max(int(self.max_share * n + 1e-9), -(-n // len(names)))
            for i in range(len(counts)):
                while counts[i] > limit:  # rounding pushed it over the cap: give one to the most under-served
                    j = max((j for j in range(len(counts)) if counts[j] < limit), key=lambda j: raw[j] - counts[j])
                    counts[i] -= 1
                    counts[j] += 1
        return counts

    def _shares(self, names: list[str]) -> list[float]:
        """Fractions of the prompts per engine (see the module docstring; the cap by water-filling). A change in
        the set of engines always re-splits."""
        speeds = [max(self.speed.get(nm, 1.0), 1e-9) for nm in names]
        shares = [s / sum(speeds) for s in speeds]
        if len(names) > 1:
            cap = max(self.max_share, 1.0 / len(names))  # below 1/n the cap cannot hold: split evenly
            capped: set[int] = set()
            while True:
                over = [i for i in range(len(shares)) if i not in capped and shares[i] > cap + 1e-12]
                if not over:
                    break
                capped.update(over)
                free = [i for i in range(len(shares)) if i not in capped]
                left = 1.0 - cap * len(capped)
                free_speed = sum(speeds[i] for i in free)
                shares = [cap if i in capped else left * speeds[i] / free_speed for i in range(len(shares))]
        prev = self.shares
        if set(prev) == set(names) and all(
            abs(new - prev[nm]) < self.dead_zone * prev[nm] for nm, new in zip(names, shares)
        ):
            return [prev[nm] for nm in names]
        self.shares = dict(zip(names, shares))
        return shares
