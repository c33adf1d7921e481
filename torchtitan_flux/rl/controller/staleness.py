"""The staleness signal: what the controller measures on each trained batch, and how it becomes one number.

Pure Python, no state: ``staleness_value`` is a function of one ``StalenessSample`` and the config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchtitan_flux.config import AdaptiveAsync, ConfigError


def clamp(x: float, lo: float, hi: float) -> float:
    return lo if x < lo else hi if x > hi else x


def _term(value: float, norm: float) -> float:
    """min(1, value / norm), floored at 0 (a k1 KL estimate can be slightly negative)."""
    return clamp(float(value) / norm, 0.0, 1.0)




@dataclass
class StalenessSample:
    """Staleness measurements of one training batch (all plain floats).

    ``kl``: KL(behaviour || trainer policy) estimated on the batch's tokens (the loss's ``behaviour_kl``).
    ``iw_var``: variance of the per-token importance weights pi_trainer / pi_behaviour (``iw_var``).
    ``version_gap_mean`` / ``version_gap_max``: trainer policy version minus the version that generated each
    sample, averaged / maximised over the batch.
    ``ess_fraction``: effective sample size fraction of the importance weights, 1 = on-policy (reported only;
    not part of the staleness value).
    """

    kl: float = 0.0
    iw_var: float = 0.0
    version_gap_mean: float = 0.0
    version_gap_max: float = 0.0
    ess_fraction: float = 1.0


def staleness_value(sample: StalenessSample, cfg: AdaptiveAsync) -> tuple[float, dict[str, float]]:
    """Combine a sample into one staleness number in [0, 1].

    ``combined = (w_kl * min(1, kl / kl_norm) + w_iw * min(1, iw_var / iw_var_norm)
    + w_gap * min(1, version_gap_mean / version_gap_norm)) / (w_kl + w_iw + w_gap)``.

    Dividing by the weight sum keeps the value in [0, 1] for any weights; with the tutorial's weights
    (0.4, 0.3, 0.3, summing to 1) it is exactly the tutorial's ``0.4*kl + 0.3*iw + 0.3*gap``. Each term is also
    floored at 0. Returns ``(combined, components)`` where ``components`` holds the normalised, unweighted terms
    ``staleness_kl``, ``staleness_iw_var`` and ``staleness_version_gap`` (each in [0, 1]). A non-finite input
    gives a NaN combined value (the wrapper then skips the EMA update).
    """
    wsum = cfg.kl_weight + cfg.iw_var_weight + cfg.version_gap_weight
    if not wsum > 0:
        raise ConfigError("adaptive_async.kl_weight + iw_var_weight + version_gap_weight must be > 0")
    raw = (float(sample.kl), float(sample.iw_var), float(sample.version_gap_mean))
    if not all(math.isfinite(v) for v in raw):
        nan = float("nan")
        return nan, {"staleness_kl": nan, "staleness_iw_var": nan, "staleness_version_gap": nan}
    kl_t = _term(raw[0], cfg.kl_norm)
    iw_t = _term(raw[1], cfg.iw_var_norm)
    gap_t = _term(raw[2], cfg.version_gap_norm)
    combined = (cfg.kl_weight * kl_t + cfg.iw_var_weight * iw_t + cfg.version_gap_weight * gap_t) / wsum
    return clamp(combined, 0.0, 1.0), {
        "staleness_kl": kl_t,
        "staleness_iw_var": iw_t,
        "staleness_version_gap": gap_t,
    }
