"""Per-step metrics (rank 0 only): ``<dump_folder>/metrics.jsonl``, TensorBoard / W&B, a console line, and the
completions table (what each holds: docs/data.md, Logging).

``metrics.jsonl`` is appended and flushed every step, so a killed run keeps every completed step's line and a
resumed run appends after them. TensorBoard and W&B (torchtitan's own loggers) get every ``metrics.log_freq``-th
step and every step carrying evaluation metrics (feeding them every step costs ~8%: docs/benchmarks.md).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time

from torchtitan_flux.errors import MetricsWriteError
from torchtitan_flux.run.resume import os_error_fix

logger = logging.getLogger("torchtitan_flux")


class MetricsWriter:
    def __init__(self, dump_folder: str, total_steps: int, loggers=None, log_every: int = 1):
        """``loggers``: torchtitan's logger (``metrics_processor.logger``: TensorBoard and/or W&B), or None."""
        os.makedirs(dump_folder, exist_ok=True)
        self.path = os.path.join(dump_folder, "metrics.jsonl")
        self._f = open(self.path, "a", buffering=1)
        self._completions_path = os.path.join(dump_folder, "completions.jsonl")
        self._completions = None
        self.total_steps = total_steps
        self._t0 = time.perf_counter()
        self._first_step: int | None = None
        self._loggers = loggers
        self._every = max(1, log_every)
        self._wandb = next((lg.wandb for lg in getattr(loggers, "_loggers", []) if hasattr(lg, "wandb")), None)

    def log(self, step: int, metrics: dict[str, float], progress: bool = True) -> None:
        """One record; ``progress=False`` for a record that is not a training step (the ``eval.at_start`` one)."""
        record = {"step": step, "time": round(time.time(), 3), **{k: _plain(v) for k, v in metrics.items()}}
        _write(self._f, json.dumps(record) + "\n", step)
        if self._loggers is not None and (step % self._every == 0 or not progress or "eval/version" in record):
            self._loggers.log({k: v for k, v in record.items() if k not in ("step", "time") and _scalar(v)}, step)
        if progress:
            logger.info(self.progress_line(step, record))
        if "eval/reward_mean" in record:  # every evaluation, when it finishes (async: in a later step's row)
            logger.info(f"eval of version {record['eval/version']}: reward {record['eval/reward_mean']:.3f}  "
                        f"pass@1 {record['eval/pass@1']:.3f}")

    def log_completions(self, step: int, batch, group_size: int) -> None:
        """The completions table of ``step`` from its ``RolloutBatch`` (``group_size`` completions per prompt)."""
        prompts = [p for p in batch.prompts for _ in range(group_size)]
        versions, total, per_func = batch.versions.tolist(), batch.rewards.tolist(), batch.reward_values
        if self._completions is None:
            self._completions = open(self._completions_path, "a", buffering=1)
        rows = []
        for i, (p, c, v, t) in enumerate(zip(prompts, batch.completions, versions, total)):
            rewards = {name: values[i] for name, values in per_func.items()}
            row = {"step": step, "version": v, "prompt": p, "completion": c, "reward": t, "rewards": rewards}
            if batch.episodes:  # multi-turn: the whole episode (messages after the opening, its end, env_rewards)
                row["episode"] = batch.episodes[i]
            _write(self._completions, json.dumps(row, default=str) + "\n", step)
            rows.append([step, v, p, c, t, *rewards.values()])
        if self._wandb is not None:
            columns = ["step", "version", "prompt", "completion", "reward", *per_func]
            self._wandb.log({"completions": self._wandb.Table(columns=columns, data=rows)}, step=step)

    def progress_line(self, step: int, m: dict) -> str:
        """step, reward, staleness, async ratio, (multi-turn) turns and environment steps per episode, steps/s and
        ETA, on one line."""
        if self._first_step is None:
            self._first_step, self._t0 = step, time.perf_counter() - m.get("step_time_s", 0.0)
        done = step - self._first_step + 1
        rate = done / max(time.perf_counter() - self._t0, 1e-9)
        eta = (self.total_steps - step) / rate if rate > 0 else math.inf
        def num(key: str) -> float:  # a value the row left out, or a None (non-finite) one, shows as nan
            v = m.get(key, 0.0)
            return float(v) if isinstance(v, (int, float)) else math.nan

        parts = [
            f"step {step:>5}/{self.total_steps}",
            f"reward {num('reward_mean'):.3f}",
            f"loss {num('loss'):+.4f}",
            f"staleness {num('staleness'):.3f}" if "staleness" in m else f"gap {num('version_gap_mean'):.2f}",
            f"async {num('async_ratio'):.2f}" if "async_ratio" in m else None,
            f"turns {num('episode/turns_mean'):.2f}" if "episode/turns_mean" in m else None,
            f"env steps {num('episode/env_steps_mean'):.2f}" if "episode/env_steps_mean" in m else None,
            f"{rate:.2f} steps/s",
            f"eta {eta:.0f}s",
        ]
        return "  ".join(p for p in parts if p)

    def close(self) -> None:
        """Flush and close the files (the trainer's ``close`` then closes torchtitan's loggers). A file that cannot be
        flushed (a full disk: the run is already stopping on it) is a warning: closing must not hide why it stops."""
        for f in (self._f, self._completions):
            if f is None:
                continue
            try:
                f.close()
            except OSError as e:
                logger.warning(f"could not flush {f.name} while closing: {e.strerror or e}; its last rows may be lost")


def _write(f, line: str, step: int) -> None:
    try:
        f.write(line)
    except OSError as e:
        raise MetricsWriteError(f"cannot write {f.name} at step {step}: {e.strerror or e}; "
                                f"{os_error_fix(e, f.name)}, then resume") from None


def _plain(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _scalar(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
