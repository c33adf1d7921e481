"""What a run reports (rank 0): the per-step row of ``metrics.jsonl`` and ``summary.json`` at the end, which
checks every engine's final weights (a byte checksum where the engine offers one, else the logprob probe's
verdict; a missing checksum is "not verified", never a match).
"""

from __future__ import annotations

import json
import logging
import os
import resource
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from torchtitan_flux.rollout.batch import RolloutBatch

logger = logging.getLogger("torchtitan_flux")


@dataclass
class StepTimes:
    """``time.perf_counter()`` at the step's start, after its batch arrived, after ``optimizer.step()`` and
    after the weight sync; ``rollout_wait`` is the part of start -> batch spent waiting for rollouts."""

    start: float
    batch: float
    trained: float
    synced: float
    rollout_wait: float


def step_row(step: int, batch: RolloutBatch, t: StepTimes, counters: dict[str, int], m: dict[str, Any]) -> dict:
    """The ``metrics.jsonl`` row of ``step``: ``m`` (loss, controller, probe, sync metrics) plus rewards,
    timings, throughput, version gaps and ``counters`` (discarded rollouts, engine restarts, ...)."""
    gap = (step - 1 - batch.versions).float()  # per sample: its oldest token
    token_gap = batch.token_version_gaps(step - 1)
    ntok = batch.num_completion_tokens
    step_time = t.synced - t.start
    return {
        **m,
        "reward_mean": batch.rewards.double().mean().item(),  # float64: 32 rewards of 1e38 sum past float32
        "reward_std": batch.rewards.double().std(unbiased=False).item(),
        "policy_version": step,
        "step_time_s": step_time,
        "rollout_time_s": t.rollout_wait,
        "engine_wait_s": batch.generation_wait_s,  # of which on the engines (not rewards, not bookkeeping)
        "gen_time_s": batch.gen_time_s,
        "train_time_s": t.trained - t.batch,
        "weight_sync_s": t.synced - t.trained,
        "tokens_per_s": ntok / max(step_time, 1e-9),
        "samples_per_s": batch.tokens.shape[0] / max(step_time, 1e-9),
        "completion_len_mean": ntok / batch.tokens.shape[0],
        "version_gap_mean": gap.mean().item(),
        "version_gap_max": gap.max().item(),
        "token_version_gap_mean": token_gap.mean().item(),
        "token_version_gap_max": token_gap.max().item(),
        "rollout_version_min": int(batch.versions.min()),
        **counters,
        **batch.reward_metrics,
    }


def summary(step: int, syncer, engines: list, probed_version: int, step_ends: list[float],
            memory: list[dict]) -> dict[str, Any]:
    """``summary.json``'s content: final versions and checks of trainer vs every engine, throughput (steps/s
    after two warm-up steps), the weight layout and per-rank memory."""
    trainer_sum, final = syncer.staging.checksum(), syncer.version
    per_engine = {}
    for e in engines:
        version, checksum = e.checksum()
        if checksum is not None and version == final:
            check = "checksum match" if checksum == trainer_sum else "checksum differs"
        elif probed_version == final and e.alive():
            check = "probe"  # no byte checksum of the final version; the logprob probe passed on it
        else:
            check = "not verified"
        per_engine[e.name] = {"version": version, "checksum": checksum, "check": check}
    warm = min(2, len(step_ends) - 1)
    checks = [v["check"] for v in per_engine.values()]
    return {
        "final_version": step,
        "trainer_checksum": trainer_sum,
        "engines": per_engine,
        "final_engine_version": min((v["version"] for v in per_engine.values()), default=-1),
        # every engine's bytes compared and equal (a missing checksum is not a match)
        "checksums_match": bool(checks) and all(c == "checksum match" for c in checks),
        "checksums_compared": [n for n, v in per_engine.items() if v["check"].startswith("checksum")],
        # every engine shown to serve the final weights, by checksum or by the logprob probe
        "all_engines_verified": bool(checks) and all(c in ("checksum match", "probe") for c in checks),
        "steps_per_s": ((len(step_ends) - 1 - warm) / (step_ends[-1] - step_ends[warm])
                        if len(step_ends) > warm + 1 else 0.0),
        "weight_bytes": syncer.plan.nbytes,
        "weight_buckets": len(syncer.plan.buckets),
        "bucket_bytes": syncer.bucket_bytes,
        "memory_per_rank": memory,
        "weight_sync": syncer.metrics(),
    }


def write_summary(dump_folder: str, content: dict[str, Any]) -> None:
    """Write ``summary.json`` and say in the log when an engine's final weights differ or are unverified."""
    with open(os.path.join(dump_folder, "summary.json"), "w") as f:
        json.dump(content, f, indent=2)
    checks = [v["check"] for v in content["engines"].values()]
    if "checksum differs" in checks:
        logger.error(f"engine weights differ from the trainer's after the final sync: {content['engines']}")
    elif not content["all_engines_verified"]:
        logger.warning(f"not every engine's final weights could be verified (no checksum, no probe): "
                       f"{content['engines']}")


def rss_mb() -> float:
    """This process's resident memory now (Linux)."""
    with open("/proc/self/statm") as f:  # resident pages are the second field
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory_per_rank(memory: dict[str, float], world: int) -> list[dict]:
    """``memory`` plus this rank's peak RSS, gathered from every rank (all ranks call it; index = rank)."""
    mine = {**memory, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if world == 1:
        return [mine]
    out: list = [None] * world
    dist.all_gather_object(out, mine)
    return out
