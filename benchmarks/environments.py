#!/usr/bin/env python
"""Environment latency against none, side by side in one run: is a slow environment hidden behind training?

    .venv/bin/python benchmarks/environments.py                 # the debug model, 3 seeds, 30 steps, 50 ms
    .venv/bin/python benchmarks/environments.py --delay-ms 200  # a slower tool
    .venv/bin/python benchmarks/environments.py --quick         # CI's smoke run: 1 seed, 4 steps, no measurement

The workload: the tiny model (with a chat template: it has none; and stop tokens that end its turns at ~8 tokens:
``chat_model``) trains on multi-turn episodes of
``benchmarks/workloads.py: LatencyEnv``, three assistant turns each (up to 16 tokens), the environment answering
every turn after ``delay_ms`` (``asyncio.sleep``: a tool behind a network call), rewarded by the last turn's share of
digits. 4 prompts x 8 episodes a step, asynchronous (``weight_sync.async_weight_update``, ``off_policy.async_ratio``
1: the next step's 32 episodes run while a step trains), continuous batching (each turn joins the engine's batch as
it is sent). Two modes per seed, interleaved, the order rotated per seed: ``delay_ms`` 0 and ``--delay-ms``.

An episode waits for its environment ``turns`` times, so each of its groups takes ``turns x delay_ms`` longer than
with an instant environment; whether a step does depends on whether that wait overlaps training (the turns of the
step ahead are sent by the episodes' own thread while a step trains: ``rollout/pump.py``) and the other
episodes' generation.

Table per mode: median step time (``step_time_s`` of every step but the first two), median rollout wait
(``rollout_time_s``: how long a step waited for its batch), assistant turns per trained episode
(``completions.jsonl``), final reward. Key=value lines: ``env_delay_ms``,
``step_time_0ms_s`` and ``step_time_<delay>ms_s`` (medians over seeds of each run's median),
``env_latency_step_ratio_seed<i>`` (per seed the delayed run's median step time over the instant one's; the goal:
at most 1.10 at 50 ms on every seed), ``env_latency_step_ratio`` (their median), ``rollout_wait_0ms_s`` / ``rollout_wait_<delay>ms_s``,
``episode_turns_mean`` (the delayed runs': after each turn that stops, the episode waits for the environment), then
``pair_efficiency`` (``benchmarks/common.py``).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # torchtitan_flux, for workloads
sys.path.insert(2, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))  # model_assets
from common import ROOT, ArgumentParser, count, number, pair_efficiency, pair_lines, run_training  # noqa: E402

TINY_MODEL = os.path.join(ROOT, "assets", "tiny-llama")  # scripts/setup.sh
WARMUP_STEPS = 2  # left out of the medians: the first steps wait for the pipeline to fill
QUICK_STEPS = 4
TURNS = 3


def chat_model(out: str) -> str:
    """The tiny model's chat variant (``model_assets.build_chat_model_dir``: a chat template, and stop tokens that
    end its turns at ~8 tokens, so an episode has its three turns)."""
    from model_assets import build_chat_model_dir

    return str(build_chat_model_dir(TINY_MODEL, os.path.join(out, "tiny-chat")))


def overrides(model: str, delay_ms: float) -> list[str]:
    return ["--model.hf_assets_path", model, "--rollout.environment", "benchmarks.workloads:LatencyEnv",
            "--rollout.environment_args", f"delay_ms={delay_ms:g},turns={TURNS}", "--rollout.max_turns", str(TURNS),
            "--rollout.max_new_tokens", "16", "--training.seq_len", "128", "--rollout.continuous_batching", "true",
            "--weight_sync.async_weight_update", "true", "--off_policy.async_ratio", "1",
            "--adaptive_async.enabled", "false", "--eval.every_steps", "0", "--metrics.log_completions_every", "1",
            "--rollout.borrow_idle_engine_cores", "false"]  # refused with an environment (turns sent mid-step)


def median_after_warmup(rows: list[dict], key: str) -> float:
    xs = [r[key] for r in rows[WARMUP_STEPS:] if isinstance(r.get(key), (int, float))]
    return statistics.median(xs) if xs else float("nan")


def episode_turns(run_dir: str) -> list[int]:
    """The assistant turns of every trained episode (``completions.jsonl``)."""
    with open(os.path.join(run_dir, "completions.jsonl")) as f:
        return [json.loads(line)["episode"]["turns"] for line in f]


def final_reward(rows: list[dict]) -> float:
    tail = rows[-10:]
    return statistics.mean(r["reward_mean"] for r in tail) if tail else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run for CI: 1 seed, {QUICK_STEPS} steps (its figures are no measurement)")
    ap.add_argument("--seeds", type=count(), default=3, help="rollout seeds 0..N-1 (default 3)")
    ap.add_argument("--steps", type=count(WARMUP_STEPS + 2), default=30,
                    help=f"steps per run (default 30; at least {WARMUP_STEPS + 2}: the first {WARMUP_STEPS} are "
                    "left out of the medians)")
    ap.add_argument("--delay-ms", type=number(above=True), default=50.0,
                    help="the slow environment's time per step, in ms (default 50)")
    ap.add_argument("--out", default=os.path.join(ROOT, "outputs", "bench_environments"))
    ap.add_argument("extra", nargs="*", help="--section.field value overrides for every run")
    args = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(TINY_MODEL, "config.json")):
        ap.error(f"the tiny model is missing at {TINY_MODEL}; allowed: after scripts/setup.sh has built it")
    seeds = 1 if args.quick else args.seeds
    steps = QUICK_STEPS if args.quick else args.steps
    os.makedirs(args.out, exist_ok=True)
    model = chat_model(args.out)
    delays = {"0ms": 0.0, f"{args.delay_ms:g}ms": args.delay_ms}
    names = list(delays)

    pair = pair_efficiency()  # before any run of ours: what this machine allows two processes side by side
    t_start = time.perf_counter()
    runs: dict[str, list[list[dict]]] = {m: [] for m in names}
    turns: dict[str, list[int]] = {m: [] for m in names}
    for seed in range(seeds):
        for mode in names[seed % 2:] + names[:seed % 2]:  # the order rotated per seed
            out = os.path.join(args.out, mode, f"seed{seed}")
            shutil.rmtree(out, ignore_errors=True)  # metrics.jsonl appends
            rows, _ = run_training(out, "--training.steps", str(steps), "--rollout.seed", str(seed),
                                   *overrides(model, delays[mode]), *args.extra, warm=True)
            runs[mode].append(rows)
            turns[mode] += episode_turns(out)
            print(f"[{time.perf_counter() - t_start:7.1f}s] {mode:<6} seed {seed}: {len(rows)} steps, median step "
                  f"{median_after_warmup(rows, 'step_time_s'):.3f} s", flush=True)

    fast, slow = names
    per_seed = [median_after_warmup(s, "step_time_s") / median_after_warmup(f, "step_time_s")
                for f, s in zip(runs[fast], runs[slow])]
    print()
    print(f"machine: {platform.machine()} {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}; debug model; "
          f"{seeds} seeds x {steps} steps; 4 prompts x 8 episodes a step, {TURNS} turns each; async_ratio 1")
    print("| environment delay | median step time (per seed) | median rollout wait | turns per episode "
          "| final reward |")
    print("|---|---|---|---|---|")
    keyvals = [f"env_delay_ms={args.delay_ms:g}"]
    for mode in names:
        step_s = [median_after_warmup(r, "step_time_s") for r in runs[mode]]
        wait_s = [median_after_warmup(r, "rollout_time_s") for r in runs[mode]]
        print(f"| {mode} | {' / '.join(f'{x:.3f}' for x in step_s)} s | {statistics.median(wait_s):.3f} s | "
              f"{statistics.mean(turns[mode]):.2f} | {' / '.join(f'{final_reward(r):.3f}' for r in runs[mode])} |")
        keyvals += [f"step_time_{mode}_s={statistics.median(step_s):.4f}",
                    f"rollout_wait_{mode}_s={statistics.median(wait_s):.4f}"]
    print(f"total benchmark wall time: {time.perf_counter() - t_start:.0f}s; runs under {args.out}")
    if args.quick:
        print("(--quick: one seed, a few steps: a smoke test of every code path, not a measurement)")
    keyvals += [f"episode_turns_mean={statistics.mean(turns[slow]):.3f}",
                *(f"env_latency_step_ratio_seed{i}={r:.3f}" for i, r in enumerate(per_seed)),
                f"env_latency_step_ratio={statistics.median(per_seed):.3f}"]
    print("\n".join(keyvals + pair_lines(pair)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
