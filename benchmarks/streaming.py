#!/usr/bin/env python
"""Streaming rollouts against today's async pipeline on a heavy-tailed workload, side by side in one run.

    .venv/bin/python benchmarks/streaming.py                    # the debug model, 3 seeds
    .venv/bin/python benchmarks/streaming.py --real             # SmolLM2-135M-Instruct (scripts/get_real_model.sh)
    .venv/bin/python benchmarks/streaming.py --carry-over both  # also streaming without carry-over: the short bias
    .venv/bin/python benchmarks/streaming.py --quick            # CI's smoke run: 1 seed, 5 steps, no measurement

The workload (``benchmarks/workloads.py: heavy_tail``): each prompt asks for its own number of digits, from 4 tokens
to ``rollout.max_new_tokens`` (96 on the debug model, 64 on the real one), Pareto-distributed (median 8, 90th
percentile ~40), which is also its generation budget; the reward is the share of its first ``L`` tokens that are
digits, so it needs the whole answer. Today one request carries a step's four prompts and runs to the longest
one's budget (the debug model almost never stops early), so a step waits for its longest prompt; per-group
requests stop each group at its own length.

Modes (each for ``--seeds`` rollout seeds, interleaved, the order rotated per seed), all with
``weight_sync.async_weight_update`` true, ``off_policy.async_ratio`` 1 and ``off_policy.max_version_gap`` 1:
  async           today's: ``rollout.continuous_batching`` false
  streaming       ``continuous_batching`` + ``in_flight_weight_updates`` + ``streaming_admission``, with
                  ``streaming_carry_over`` (``--carry-over on``, the default, or ``both``)
  streaming_drop  the same without carry-over (``--carry-over off`` or ``both``): groups still generating when
                  their step trains restart from scratch, which biases training toward short completions

Table per mode: median steps/s (``summary.json``), final reward per seed (mean of the last 10 steps), mean
sample-level version gap (``version_gap_mean``: a sample's policy version behind the trainer), mean and max
token-level gap (``token_version_gap_mean`` / ``_max`` of the metrics rows, once the trainer writes them; nan
before), mean length of the trained completions (``completion_len_mean``) and, with ``--real``, the time to the
training-reward target per seed (``--reward-target``: wall clock from the start of step 1 until the mean reward of
the last 5 steps reaches it; ``benchmarks/controller.time_to_target``). Then the short bias, per mode: mean length
and reward of trained completions against all generated ones (trained or not: stale or restarted; the rows'
``generated_completion_len_mean`` / ``generated_reward_mean`` once the trainer writes them; the async mode trains
what it generates), and the mean target length of the trained prompts (from ``completions.jsonl``) against that of
the prompts dispatched for the run's steps (the task's own draws): a ratio below 1 is a bias toward short answers.

Key=value lines: ``streaming_speedup_heavy_tail`` (steps/s streaming / async, per seed, the median),
``streaming_reward_in_spread`` (1 when every streaming seed's final reward is within the async seeds' range or
above it), ``token_version_gap_mean``, ``token_version_gap_max``, ``sample_version_gap_mean`` (streaming's),
``longest_over_mean_length`` (a step's longest target over the mean target: the tokens per sequence that one
request per step generates over one request per group, the most per-group requests can save on the debug model),
per streaming mode ``short_bias_<mode>`` (trained over dispatched mean target length) and
``<mode>_trained_len_mean`` / ``<mode>_generated_len_mean``, ``<mode>_trained_reward_mean`` /
``<mode>_generated_reward_mean``, with ``--real`` ``streaming_speedup_real`` (async's median time to target /
streaming's; nan when either never reaches it), then ``overlap_limit_at_pair_efficiency`` (the async runs' train,
generation and sync times: the most overlapping generation with training speeds a serial step here,
``benchmarks/weight_sync.overlap_limit``) and ``pair_efficiency`` (``benchmarks/common.py``: a WARNING line
below 0.8, where overlap cannot show).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # torchtitan_flux, for workloads
from common import (DEBUG_CONFIG, ROOT, ArgumentParser, count, number, pair_efficiency, pair_lines,  # noqa: E402
                    run_training)
from controller import final_reward, time_to_target  # noqa: E402
from weight_sync import overlap_limit  # noqa: E402

REAL_MODEL = os.path.join(ROOT, "assets", "smollm2-135m-instruct")  # scripts/get_real_model.sh


@dataclass(frozen=True)
class Workload:
    config: str
    max_new_tokens: int
    prompt_room: int  # training.seq_len - max_new_tokens: the longest prompt, in tokens
    steps: int  # default of --steps
    quick_steps: int
    quick_max_new_tokens: int
    overrides: tuple[str, ...] = ()
    target: float = 0.8  # default of --reward-target


WORKLOADS = {
    # "<letters> <L>:" on the byte tokenizer: at most 13 bytes and BOS
    "debug": Workload(DEBUG_CONFIG, 96, 16, steps=60, quick_steps=5, quick_max_new_tokens=32),
    # the chat-templated request (~58 tokens); the capitals config's reward and evaluation replaced
    "real": Workload(os.path.join(ROOT, "train_configs", "smollm2_capitals_cpu.toml"), 64, 64, steps=30,
                     quick_steps=4, quick_max_new_tokens=16, target=0.5,
                     overrides=("--rollout.reward_funcs", "benchmarks.workloads:length_digits_reward",
                                "--eval.at_start", "false", "--eval.every_steps", "0")),
}
QUICK_SEEDS = 1

COMMON = ["--weight_sync.async_weight_update", "true", "--adaptive_async.enabled", "false",
          "--off_policy.async_ratio", "1", "--off_policy.max_version_gap", "1"]
ASYNC = [*COMMON, "--rollout.continuous_batching", "false"]


def streaming(carry_over: bool) -> list[str]:
    return [*COMMON, "--rollout.continuous_batching", "true", "--rollout.in_flight_weight_updates", "true",
            "--rollout.streaming_admission", "true", "--rollout.streaming_carry_over", str(carry_over).lower()]


def modes_for(carry_over: str) -> dict[str, list[str]]:
    modes = {"async": ASYNC}
    if carry_over in ("on", "both"):
        modes["streaming"] = streaming(True)
    if carry_over in ("off", "both"):
        modes["streaming_drop"] = streaming(False)
    return modes


# ------------------------------------------------------------------------------------------ what a run wrote

NAN = float("nan")


def mean_of(rows: list[dict], key: str) -> float:
    """The mean of ``key`` over the rows that carry a number for it; nan when none does."""
    xs = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.mean(xs) if xs else NAN


def max_of(rows: list[dict], key: str) -> float:
    xs = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return max(xs) if xs else NAN


def trained_targets(run_dir: str) -> list[int]:
    """The target length of every trained completion (``completions.jsonl``: one line per completion, with its
    prompt's text)."""
    from workloads import target_of

    path = os.path.join(run_dir, "completions.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [t for line in f if (t := target_of(json.loads(line)["prompt"])) is not None]


@dataclass
class Run:
    mode: str
    seed: int
    rows: list[dict]
    summary: dict
    run_dir: str

    @property
    def steps_per_s(self) -> float:
        return self.summary.get("steps_per_s") or NAN

    def final_reward(self) -> float:
        return final_reward(self.rows)

    def generated(self, key: str, trained_key: str) -> float:
        """The rows' ``key`` (every completion generated, trained or not) where the trainer writes it; else,
        for a mode without streaming admission, ``trained_key`` (it trains what it generates); else nan."""
        if any(key in r for r in self.rows):
            return mean_of(self.rows, key)
        return NAN if self.mode.startswith("streaming") else mean_of(self.rows, trained_key)


def fmt(x: float, spec: str = ".3f") -> str:
    return "nan" if x is None or math.isnan(x) else format(x, spec)


def nanmedian(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else NAN


def nanmax(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return max(xs) if xs else NAN


def nanmean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.mean(xs) if xs else NAN


def report(runs: dict[str, list[Run]], per_step: list[list[int]], pair: float,
           target: float | None = None) -> tuple[list[str], list[str]]:
    """The tables and notes, and the key=value lines (the WARNING of ``pair_lines`` among them), of ``runs`` (mode
    -> its runs, seed by seed; "async" and a streaming mode), ``per_step`` (every dispatched step's target lengths,
    all seeds) and the machine's pair efficiency ``pair``; ``target``: the reward target (--real) or None."""
    dispatched = [L for step in per_step for L in step]
    q = statistics.quantiles(dispatched, n=10) if len(dispatched) > 1 else dispatched * 9
    text = [f"targets: {min(dispatched)}..{max(dispatched)} tokens, p50 {statistics.median(dispatched):.0f}, p90 "
            f"{q[8]:.0f}, mean {statistics.mean(dispatched):.1f}; a step's longest over the mean "
            f"{statistics.mean(max(s) for s in per_step) / statistics.mean(dispatched):.2f}"]
    head = (f"{'mode':<14} {'steps/s':>8} {'final reward (per seed)':>24} {'sample gap':>10} {'token gap':>9} "
            f"{'tok max':>7} {'trained len':>11}")
    text.append(head + (f" {'to target s (per seed)':>26}" if target is not None else ""))
    sps, fin, ttt = {}, {}, {}
    for mode, rs in runs.items():
        sps[mode] = nanmedian([r.steps_per_s for r in rs])
        fin[mode] = [r.final_reward() for r in rs]
        gap = nanmean([mean_of(r.rows, "version_gap_mean") for r in rs])
        tok = nanmean([mean_of(r.rows, "token_version_gap_mean") for r in rs])
        tok_max = nanmax([max_of(r.rows, "token_version_gap_max") for r in rs])
        length = nanmean([mean_of(r.rows, "completion_len_mean") for r in rs])
        line = (f"{mode:<14} {fmt(sps[mode]):>8} {' '.join(fmt(x) for x in fin[mode]):>24} {fmt(gap, '.2f'):>10} "
                f"{fmt(tok, '.2f'):>9} {fmt(tok_max, '.0f'):>7} {fmt(length, '.1f'):>11}")
        if target is not None:
            hits = [time_to_target(r.rows, target)[0] for r in rs]
            ttt[mode] = statistics.median(hits)
            line += f" {' '.join(fmt(t, '.1f') for t in hits):>26}"
        text.append(line)

    text += ["", f"short bias (means over seeds; the dispatched prompts' mean target length: "
                 f"{statistics.mean(dispatched):.1f})",
             f"{'mode':<14} {'trained target':>14} {'trained len':>11} {'generated len':>13} {'trained reward':>14} "
             f"{'generated reward':>16}"]
    bias = {}
    for mode, rs in runs.items():
        targets = [t for r in rs for t in trained_targets(r.run_dir)]
        b = bias[mode] = {
            "trained_target": statistics.mean(targets) if targets else NAN,
            "trained_len": nanmean([mean_of(r.rows, "completion_len_mean") for r in rs]),
            "generated_len": nanmean([r.generated("generated_completion_len_mean", "completion_len_mean") for r in rs]),
            "trained_reward": nanmean([mean_of(r.rows, "reward_mean") for r in rs]),
            "generated_reward": nanmean([r.generated("generated_reward_mean", "reward_mean") for r in rs]),
        }
        text.append(f"{mode:<14} {fmt(b['trained_target'], '.1f'):>14} {fmt(b['trained_len'], '.1f'):>11} "
                    f"{fmt(b['generated_len'], '.1f'):>13} {fmt(b['trained_reward']):>14} "
                    f"{fmt(b['generated_reward']):>16}")

    stream = "streaming" if "streaming" in runs else "streaming_drop"
    rs = runs[stream]
    if not any("token_version_gap_mean" in r for run in rs for r in run.rows):
        text.append(f"NOTE: the {stream} runs' metrics rows carry no token_version_gap_mean: the trainer reports no "
                    "token-level version gaps yet (token_version_gap_* print nan)")
    if not any("generated_completion_len_mean" in r for run in rs for r in run.rows):
        text.append(f"NOTE: the {stream} runs' metrics rows carry no generated_completion_len_mean / "
                    "generated_reward_mean: what streaming generated but did not train is not reported yet (nan)")
    speedups = [s.steps_per_s / a.steps_per_s for s, a in zip(rs, runs["async"])]
    in_spread = all(x >= min(fin["async"]) for x in fin[stream])  # within the async seeds' range, or above it
    keyvals = [
        f"streaming_speedup_heavy_tail={fmt(nanmedian(speedups))}",
        f"streaming_reward_in_spread={int(in_spread)}",
        f"token_version_gap_mean={fmt(nanmean([mean_of(r.rows, 'token_version_gap_mean') for r in rs]))}",
        f"token_version_gap_max={fmt(nanmax([max_of(r.rows, 'token_version_gap_max') for r in rs]), '.0f')}",
        f"sample_version_gap_mean={fmt(nanmean([mean_of(r.rows, 'version_gap_mean') for r in rs]))}",
        f"longest_over_mean_length={statistics.mean(max(s) for s in per_step) / statistics.mean(dispatched):.3f}",
    ]
    for mode in runs:
        if mode == "async":
            continue
        b = bias[mode]
        keyvals.append(f"short_bias_{mode}={fmt(b['trained_target'] / statistics.mean(dispatched))}")
        keyvals += [f"{mode}_{k}_mean={fmt(b[k], '.2f')}" for k in ("trained_len", "generated_len")]
        keyvals += [f"{mode}_{k}_mean={fmt(b[k])}" for k in ("trained_reward", "generated_reward")]
    if target is not None:
        real = ttt["async"] / ttt[stream] if math.isfinite(ttt["async"]) and math.isfinite(ttt[stream]) else NAN
        keyvals.append(f"streaming_speedup_real={fmt(real)}")
    base = [r for run in runs["async"] for r in run.rows[2:]] or [r for run in runs["async"] for r in run.rows]
    limit = overlap_limit(statistics.median(r["train_time_s"] for r in base),
                          statistics.median(r["gen_time_s"] for r in base),
                          statistics.median(r["weight_sync_s"] for r in base), pair)
    keyvals.append(f"overlap_limit_at_pair_efficiency={limit:.2f}")
    return text, keyvals + pair_lines(pair)  # pair_lines: the WARNING where overlap cannot show, pair_efficiency=


# -------------------------------------------------------------------------------------------------- main


def carry_over(text: str) -> str:
    """An argparse type: on, off or both."""
    if text not in ("on", "off", "both"):
        raise argparse.ArgumentTypeError(f"got {text!r}; allowed: on | off | both")
    return text


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real", action="store_true", help="the real model, SmolLM2-135M-Instruct "
                    "(scripts/get_real_model.sh first), with the time to --reward-target")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run for CI: 1 seed, few steps, short answers (its figures are no measurement)")
    ap.add_argument("--seeds", type=count(), default=3, help="rollout seeds 0..N-1 (default 3)")
    ap.add_argument("--steps", type=count(4), default=None,
                    help="default: 60 (debug), 30 (real); at least 4 (steps/s leaves out two warm-up steps)")
    ap.add_argument("--carry-over", type=carry_over, default="on", metavar="{on,off,both}",
                    help="streaming with rollout.streaming_carry_over true (on), false (off), or both modes")
    ap.add_argument("--reward-target", type=number(), default=None,
                    help="the training-reward target of the time to target (default: 0.8 debug, 0.5 real)")
    ap.add_argument("--out", default=os.path.join(ROOT, "outputs", "bench_streaming"))
    ap.add_argument("extra", nargs="*", help="--section.field value overrides for every run")
    args = ap.parse_args(argv)
    if args.real and not os.path.isfile(os.path.join(REAL_MODEL, "config.json")):
        ap.error(f"argument --real: got no model at {REAL_MODEL}; allowed: after scripts/get_real_model.sh has "
                 "built it")
    w = WORKLOADS["real" if args.real else "debug"]
    max_new = w.quick_max_new_tokens if args.quick else w.max_new_tokens
    steps = args.steps or (w.quick_steps if args.quick else w.steps)
    seeds = QUICK_SEEDS if args.quick else args.seeds
    target = w.target if args.reward_target is None else args.reward_target
    overrides = ["--rollout.task", "benchmarks.workloads:heavy_tail", "--rollout.max_new_tokens", str(max_new),
                 "--training.seq_len", str(max_new + w.prompt_room), "--metrics.log_completions_every", "1",
                 *w.overrides, *args.extra]
    modes = modes_for(args.carry_over)

    pair = pair_efficiency()  # before any run of ours: what this machine allows two processes side by side
    t_start = time.perf_counter()
    runs: dict[str, list[Run]] = {m: [] for m in modes}
    names = list(modes)
    for seed in range(seeds):
        for mode in names[seed % len(names):] + names[: seed % len(names)]:  # the order rotated per seed
            out = os.path.join(args.out, "real" if args.real else "debug", mode, f"seed{seed}")
            shutil.rmtree(out, ignore_errors=True)  # metrics.jsonl and completions.jsonl append
            rows, summary = run_training(out, "--training.steps", str(steps), "--rollout.seed", str(seed),
                                         *modes[mode], *overrides, config=w.config, warm=True)
            runs[mode].append(Run(mode, seed, rows, summary, out))
            print(f"[{time.perf_counter() - t_start:7.1f}s] {mode:<14} seed {seed}: {len(rows)} steps, "
                  f"{fmt(runs[mode][-1].steps_per_s)} steps/s, final reward {fmt(runs[mode][-1].final_reward())}",
                  flush=True)

    # the workload: every step's targets as dispatched (the task's own draws, the same for every mode of a seed)
    from workloads import HeavyTailTask

    task = HeavyTailTask(max_new, frozenset({0}))
    per_step = [task.lengths(s, k, 4) for s in range(seeds) for k in range(1, steps + 1)]
    print()
    print(f"machine: {platform.machine()} {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}; "
          f"{'SmolLM2-135M-Instruct' if args.real else 'debug model'}; {seeds} seeds x {steps} steps; "
          f"max_new_tokens {max_new}; max_version_gap 1" + (f"; reward target {target}" if args.real else ""))
    text, keyvals = report(runs, per_step, pair, target if args.real else None)
    print("\n".join(text))
    print(f"total benchmark wall time: {time.perf_counter() - t_start:.0f}s; runs under {args.out}")
    if args.quick:
        print("(--quick: one seed, short runs and answers: a smoke test of every code path, not a measurement)")
    print("\n".join(keyvals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
