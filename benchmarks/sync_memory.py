"""Memory the weight sync costs the trainer: per-rank RSS before/after the staging buffer and peak RSS.

Trains the "medium" flavor (25M parameters, built locally) for a few steps on ``--nproc`` trainer ranks with
FSDP and reports, per rank: RSS before the WeightSyncer was built, after it (rank 0 allocates the staging
copy; other ranks allocate nothing), and the run's peak. Rank 0's peak minus its post-staging RSS, compared
with the other ranks', is what pushing costs beyond the staging copy (bucket gathers and buffers).
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, ArgumentParser, count, number, run_training  # noqa: E402


def main() -> None:
    ap = ArgumentParser(description=__doc__)
    ap.add_argument("--nproc", type=count(), default=2, help="trainer ranks (default 2)")
    ap.add_argument("--steps", type=count(), default=4)
    ap.add_argument("--bucket-mb", type=number(above=True), default=8.0)
    ap.add_argument("--quick", action="store_true", help="smoke run for CI (the cheapest that exercises every code path; its figures are no measurement)")
    args = ap.parse_args()
    if args.quick:
        args.steps = 2
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from model_assets import build_model_dir

    model = build_model_dir(os.path.join(ROOT, "assets", "medium-llama"), flavor="medium")
    with tempfile.TemporaryDirectory() as tmp:
        _, summary = run_training(
            tmp, "--model.hf_assets_path", str(model), "--training.steps", str(args.steps),
            "--weight_sync.bucket_size_mb", str(args.bucket_mb), "--rollout.prompts_per_step", "2",
            "--grpo.group_size", "4", "--training.local_batch_size", "4", nproc=args.nproc,
        )
    mb = summary["weight_bytes"] / 2**20
    print(f"machine: {platform.machine()} {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}; "
          f"{args.nproc} ranks; weights {mb:.1f} MiB in {summary['weight_buckets']} buckets of <= {args.bucket_mb} MiB")
    print(f"{'rank':>4} {'before sync':>12} {'after staging':>14} {'staging delta':>14} {'peak':>8} {'peak - after':>13}")
    for r, m in enumerate(summary["memory_per_rank"]):
        print(f"{r:>4} {m['rss_before_sync_mb']:>12.1f} {m['rss_after_staging_mb']:>14.1f} "
              f"{m['rss_after_staging_mb'] - m['rss_before_sync_mb']:>14.1f} {m['peak_rss_mb']:>8.1f} "
              f"{m['peak_rss_mb'] - m['rss_after_staging_mb']:>13.1f}")
    ranks = summary["memory_per_rank"]
    staging = ranks[0]["rss_after_staging_mb"] - ranks[0]["rss_before_sync_mb"]
    push_extra = (ranks[0]["peak_rss_mb"] - ranks[0]["rss_after_staging_mb"]) - min(
        m["peak_rss_mb"] - m["rss_after_staging_mb"] for m in ranks[1:]) if len(ranks) > 1 else float("nan")
    print(f"staging_mib={staging:.1f}")
    print(f"weights_mib={mb:.1f}")
    print(f"push_extra_mib={push_extra:.1f}")
    print(f"bucket_mib={args.bucket_mb}")


if __name__ == "__main__":
    main()
