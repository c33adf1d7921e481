"""Async vs blocking weight push on one config, side by side in one run.

Runs ``train_configs/debug_cpu.toml`` (or ``--config``) with ``weight_sync.async_weight_update`` false and true,
``--reps`` times each, interleaved, and reports per-step medians after ``--warmup`` steps:

* steps/s of each mode and ``async_speedup`` = async / sync;
* ``overlap_limit`` = (T + G + S) / max(T, G) from the sync run's train time T, engine generation time G and
  blocking sync time S: the best an ideal overlap of generation with training could do;
* ``fraction_of_limit`` = async_speedup / overlap_limit;
* ``pair_efficiency`` (every mode; ``benchmarks/common.pair_efficiency``, measured before the runs): a fixed
  single-thread matmul loop alone / two processes running it together, 1.0 = two cores fully in parallel, with a
  WARNING line below 0.8; ``overlap_limit_at_pair_efficiency``: the overlap limit with the two jobs side by side
  at that efficiency (the shorter at its pace, the rest of the longer alone);
* ``blocked_fraction``: trainer time spent in weight sync per async step / async step time;
* ``push_bandwidth_ratio``: bytes per second of our blocking push (header + buckets, timed on the sending
  thread until its Works complete) / a raw gloo broadcast of one contiguous buffer of the same bytes between
  two processes, timed the same way on the sender, each after the same idle gap (the sync run's train time)
  as our pushes, which follow a training step.

``--slow-sync SECONDS`` instead compares ``weight_sync.interval`` 1 with "auto" (``SyncCadence``, ``rl/off_policy.py``) when
every push costs the engine SECONDS more (``FLUX_FAULT_PUSH_DELAY`` of ``tests/fault_inject``: a slow link or a
large model), in blocking mode unless the extra overrides say otherwise, with ``max_version_gap`` 16 so that
the interval may rise: steps/s, sync overhead (blocked sync time / training time), mean version gap and final
reward of each, and ``slow_sync_speedup`` = auto / interval 1 steps/s.

``--colocated`` instead compares, in blocking mode, the broadcast push (the engine in its own process on a gloo
group) with ``rollout.colocated`` (the engine copies staging from shared memory): the median push time of each
(``weight_push_s``, the sending side until the engine holds the version), steps/s, and
``colocated_push_speedup`` = broadcast push time / colocated push time. Use a larger model to see more than
fixed costs (``-- --model.hf_assets_path assets/medium-llama``, built by ``scripts/model_assets.py``).

``--sparse`` instead compares ``weight_sync.method`` "dense" and "sparse" with a bfloat16 wire, blocking, per learning
rate (``--lrs``, default 1e-6,1e-5), on the real model (``train_configs/smollm2_capitals_cpu.toml``, from
``scripts/get_real_model.sh``; ``--quick``: the debug config) with a small batch (2 prompts x 4): changed fraction per
push, bytes per push, push time, the trainer's diff time, patched buckets; ``sparse_bytes_ratio`` = median sparse /
median dense bytes per push at the first lr, ``sparse_push_speedup`` = dense / sparse median push time there,
``sparse_bit_exact`` = 1 when every sparse run gave the dense run's losses bit for bit and both ended with equal
checksums, ``sparse_async_blocked_fraction``: trainer time blocked in weight sync / step time of an async sparse run
at the first lr. Then the crossover on this machine: one 32 MiB bf16 bucket pushed between two processes on gloo
(loopback) as a patch of a given changed share vs whole, everything included (diff, both transfers, the receiver's
base copy and scatter): ``sparse_crossover_share`` = the smallest share where the patch is no faster.
``sparse_breakeven_gbit_s``: the link bandwidth below which sparse pushes are faster at the first lr, from the run's
bytes saved per push / the extra push time they cost here (loopback moves bytes almost for free: the diff dominates).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (DEBUG_CONFIG, ROOT, ArgumentParser, count, existing_file, free_port, median, number,  # noqa: E402
                    numbers, pair_efficiency, pair_lines, paired, run_training)

FAULT_INJECT = os.path.join(ROOT, "tests", "fault_inject")


def overlap_limit(train_s: float, gen_s: float, sync_s: float, efficiency: float = 1.0) -> float:
    """The most overlapping generation with training can speed a step up: the serial step (train + generation +
    sync) over both jobs side by side on two cores that run together at ``efficiency`` (1: fully in parallel):
    the shorter job at that pace, the rest of the longer alone."""
    side_by_side = max(train_s, gen_s) + min(train_s, gen_s) * (1 / paired(efficiency) - 1)
    return (train_s + gen_s + sync_s) / side_by_side


def run(config: str, out: str, steps: int, async_mode: bool, extra: list[str]) -> tuple[list[dict], dict]:
    """One run with the one toggle, ``weight_sync.async_weight_update`` (``off_policy.async_ratio`` unset follows
    it: 1 when on, 0 when off)."""
    return run_training(out, "--training.steps", str(steps), "--weight_sync.async_weight_update",
                        str(async_mode).lower(), *extra, config=config)


def _raw_broadcast(rank: int, port: int, nbytes: int, iters: int, idle_s: float, q) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, is_master=rank == 0, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), rank, 2, timedelta(seconds=60))
    buf = torch.zeros(nbytes // 4)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for _ in range(5):
        pg.broadcast([buf], opts).wait()
    times = []
    for _ in range(iters):
        pg.barrier().wait()
        time.sleep(idle_s)  # a push follows a training step: time both after the same idle gap (cold caches)
        t0 = time.perf_counter()
        pg.broadcast([buf], opts).wait()
        times.append(time.perf_counter() - t0)  # on the sender, as our push is timed
    if rank == 0:
        q.put(statistics.median(times))


def raw_broadcast_seconds(nbytes: int, idle_s: float, iters: int = 30) -> float:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_raw_broadcast, args=(r, port, nbytes, iters, idle_s, q), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    t = q.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
    return t


def slow_sync(args, pair: float) -> None:
    """interval 1 vs "auto" with every push slowed by ``args.slow_sync`` seconds on the engine."""
    env = {"FLUX_FAULT_PUSH_DELAY": str(args.slow_sync),
           "PYTHONPATH": os.pathsep.join([FAULT_INJECT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    modes = {"interval1": ["--weight_sync.interval", "1"], "auto": ["--weight_sync.interval", "auto"]}
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    summaries: dict[str, list[dict]] = {m: [] for m in modes}
    finals: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="flux_bench_") as tmp:
        for rep in range(args.reps):
            for mode, flags in modes.items():
                r, summary = run_training(
                    os.path.join(tmp, f"{mode}{rep}"), "--training.steps", str(args.steps),
                    "--off_policy.max_version_gap", str(min(16, args.steps)), *flags, *args.extra, config=args.config,
                    env=env)
                rows[mode] += r[args.warmup :]
                summaries[mode].append(summary)
                finals[mode].append(statistics.mean(x["reward_mean"] for x in r[-5:]))
    sps = {m: statistics.median(x["steps_per_s"] for x in summaries[m]) for m in modes}
    overhead = {m: sum(x["weight_sync_s"] for x in rows[m]) / sum(x["train_time_s"] for x in rows[m]) for m in modes}
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, torch {__import__('torch').__version__}; "
          f"{time.strftime('%Y-%m-%d')}; {args.reps} reps x {args.steps} steps, first {args.warmup} dropped; "
          f"every push +{args.slow_sync} s on the engine")
    print(f"{'mode':<10} {'steps/s':>8} {'overhead':>9} {'interval':>9} {'gap':>5} {'final reward (per rep)':>24}")
    for m in modes:
        interval = statistics.median(x.get("sync_interval", 1) for x in rows[m])
        gap = statistics.mean(x["version_gap_mean"] for x in rows[m])
        print(f"{m:<10} {sps[m]:>8.2f} {overhead[m]:>9.3f} {interval:>9.1f} {gap:>5.2f} "
              f"{' '.join(f'{f:.3f}' for f in finals[m]):>24}")
    print(f"slow_sync_speedup={sps['auto'] / sps['interval1']:.3f}")
    print(f"auto_overhead={overhead['auto']:.3f}")
    print(f"interval1_overhead={overhead['interval1']:.3f}")
    print(f"auto_final_reward={statistics.median(finals['auto']):.3f}")
    print(f"interval1_final_reward={statistics.median(finals['interval1']):.3f}")
    print("\n".join(pair_lines(pair)))


def colocated(args, pair: float) -> None:
    """Blocking pushes over a gloo group vs the colocated hand-over, interleaved."""
    modes = {"broadcast": ["--rollout.colocated", "false"], "colocated": ["--rollout.colocated", "true"]}
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    sps: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="flux_bench_") as tmp:
        for rep in range(args.reps):
            for mode, flags in modes.items():
                r, summary = run(args.config, os.path.join(tmp, f"{mode}{rep}"), args.steps, False,
                                 [*flags, *args.extra])
                rows[mode] += r[args.warmup :]
                sps[mode].append(summary["steps_per_s"])
                nbytes = summary["weight_bytes"]
    push = {m: median(rows[m], "weight_push_s") for m in modes}
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, torch {__import__('torch').__version__}; "
          f"{time.strftime('%Y-%m-%d')}; {args.reps} reps x {args.steps} steps, first {args.warmup} dropped; "
          f"{nbytes / 2**20:.1f} MiB per push, blocking")
    print(f"{'mode':<10} {'steps/s':>8} {'push ms':>8} {'sync ms':>8} {'GB/s':>6}")
    for m in modes:
        print(f"{m:<10} {statistics.median(sps[m]):>8.2f} {1e3 * push[m]:>8.2f} "
              f"{1e3 * median(rows[m], 'weight_sync_s'):>8.2f} {nbytes / push[m] / 1e9:>6.2f}")
    print(f"colocated_push_speedup={push['broadcast'] / push['colocated']:.3f}")
    print(f"colocated_steps_ratio={statistics.median(sps['colocated']) / statistics.median(sps['broadcast']):.3f}")
    print("\n".join(pair_lines(pair)))


REAL_CONFIG = os.path.join(ROOT, "train_configs", "smollm2_capitals_cpu.toml")


def real_model_missing(root: str) -> str | None:
    """Why ``--sparse`` (on the real model) cannot run: the model folder is not built; None when it is."""
    if os.path.isfile(os.path.join(root, "assets", "smollm2-135m-instruct", "config.json")):
        return None
    return ("argument --sparse: measures the real model, which is not built: run scripts/get_real_model.sh first "
            "(or --config FILE for another model, --quick for the debug model)")


def sparse(args, pair: float) -> None:
    """Dense vs sparse bf16 pushes per learning rate (see the module docstring)."""
    config = args.config or (DEBUG_CONFIG if args.quick else REAL_CONFIG)
    lrs = args.lrs[: 1 if args.quick else None]
    small = ["--rollout.prompts_per_step", "2", "--grpo.group_size", "4", "--training.local_batch_size", "8",
             "--eval.at_start", "false", "--eval.every_steps", "0",
             # the embedded engine computes in the wire dtype: bf16 logprobs of this 30-layer model differ from the
             # trainer's fp32 ones by up to ~0.3 (measured), beyond the default tolerance; checksums show exactness
             "--weight_sync.probe_tolerance", "1.0"] if config == REAL_CONFIG else []
    common = ["--training.steps", str(args.steps), "--weight_sync.wire_dtype", "bfloat16", *small, *args.extra]
    res: dict[tuple[float, str], tuple[list[dict], dict]] = {}
    with tempfile.TemporaryDirectory(prefix="flux_bench_") as tmp:
        for lr in lrs:
            for method in ("dense", "sparse"):
                res[lr, method] = run(config, os.path.join(tmp, f"{method}{lr}"), args.steps, False,
                                      [*common, "--optimizer.lr", str(lr), "--weight_sync.method", method])
        a_rows, a_sum = run(config, os.path.join(tmp, "async"), args.steps, True,
                            [*common, "--optimizer.lr", str(lrs[0]), "--weight_sync.method", "sparse"])
    exact = all(
        [r["loss"] for r in res[lr, "dense"][0]] == [r["loss"] for r in res[lr, "sparse"][0]]
        and res[lr, "dense"][1]["checksums_match"] and res[lr, "sparse"][1]["checksums_match"] for lr in lrs
    ) and a_sum["checksums_match"]
    nbytes = res[lrs[0], "dense"][1]["weight_bytes"]
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, torch {__import__('torch').__version__}; "
          f"{time.strftime('%Y-%m-%d')}; {os.path.relpath(config, ROOT)}, {args.steps} steps blocking, bf16 wire: "
          f"{nbytes / 2**20:.1f} MiB dense per push")
    print(f"{'lr':>7} {'method':<7} {'changed':>8} {'MB/push':>8} {'ratio':>6} {'patched':>8} {'push ms':>8} "
          f"{'diff ms':>8} {'step s':>7}")
    ratio = speedup = 0.0
    for lr in lrs:
        d = res[lr, "dense"][0]
        for method in ("dense", "sparse"):
            rows = res[lr, method][0]
            r = median(rows, "weight_push_bytes") / median(d, "weight_push_bytes")
            sp = median(d, "weight_push_s") / median(rows, "weight_push_s")
            if lr == lrs[0] and method == "sparse":
                ratio, speedup = r, sp
                saved = median(d, "weight_push_bytes") - median(rows, "weight_push_bytes")
                extra = median(rows, "weight_push_s") - median(d, "weight_push_s")
                breakeven = saved * 8 / extra / 1e9 if extra > 0 else float("inf")
            print(f"{lr:>7.0e} {method:<7} {median(rows, 'weight_changed_fraction'):>8.4f} "
                  f"{median(rows, 'weight_push_bytes') / 1e6:>8.2f} {r:>6.3f} "
                  f"{median(rows, 'weight_patched_buckets'):>8.0f} {1e3 * median(rows, 'weight_push_s'):>8.1f} "
                  f"{1e3 * median(rows, 'weight_diff_s'):>8.1f} {median(rows, 'step_time_s'):>7.2f}")
    blocked = median(a_rows, "weight_sync_s") / median(a_rows, "step_time_s")
    print(f"async sparse at lr {lrs[0]:.0e}: trainer blocked {1e3 * median(a_rows, 'weight_sync_s'):.1f} ms per "
          f"{median(a_rows, 'step_time_s'):.2f} s step; checksums equal: {a_sum['checksums_match']}")
    shares, times = sparse_crossover(quick=args.quick)
    print(f"{'share':>6} {'patch ms':>9} {'whole ms':>9}   (one 32 MiB bf16 bucket, gloo loopback, end to end)")
    for sh, (tp, tw) in zip(shares, times):
        print(f"{sh:>6.3f} {1e3 * tp:>9.2f} {1e3 * tw:>9.2f}")
    cross = next((sh for sh, (tp, tw) in zip(shares, times) if tp >= tw), float("inf"))
    print(f"sparse_bytes_ratio={ratio:.4f}")
    print(f"sparse_push_speedup={speedup:.3f}")
    print(f"sparse_bit_exact={int(exact)}")
    print(f"sparse_async_blocked_fraction={blocked:.4f}")
    print(f"sparse_crossover_share={cross:.3f}")
    print(f"sparse_breakeven_gbit_s={breakeven:.2f}")
    print("\n".join(pair_lines(pair)))


def _crossover(rank: int, port: int, shares: list[float], iters: int, q) -> None:
    import torch
    import torch.distributed as dist

    from torchtitan_flux.wire import transport

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, is_master=rank == 0, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(dist.PrefixStore("cross", store), rank, 2, timedelta(seconds=60))
    n = 16 * 2**20  # 32 MiB of bf16
    g = torch.Generator().manual_seed(0)
    base = torch.randn(n, generator=g).to(torch.bfloat16)
    held, out = base.clone(), torch.empty_like(base)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0

    def bcast(t):
        pg.broadcast([t], opts).wait()

    results = []
    for share in shares:
        new = base.clone()
        pick = torch.randperm(n, generator=g)[: int(share * n)]
        new[pick] = (new[pick].float() + 1).to(torch.bfloat16)
        tp, tw = [], []
        for _ in range(iters):
            pg.barrier().wait()
            t0 = time.perf_counter()
            if rank == 0:  # the trainer: diff, then send the patch
                idx = transport.changed(new, base)
                bcast(torch.tensor([idx.numel()]))
                bcast(idx)
                bcast(new[idx.long()])
            else:  # the engine: the count, the base copy, the patch, the scatter
                k = torch.zeros(1, dtype=torch.int64)
                bcast(k)
                out.copy_(held)
                idx = torch.empty(int(k), dtype=torch.int32)
                vals = torch.empty(int(k), dtype=torch.bfloat16)
                bcast(idx)
                bcast(vals)
                transport.apply_patch(out, idx, vals)
            pg.barrier().wait()
            tp.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            bcast(new if rank == 0 else out)
            pg.barrier().wait()
            tw.append(time.perf_counter() - t0)
        results.append((statistics.median(tp), statistics.median(tw)))
    if rank == 1:
        q.put(results)


def sparse_crossover(quick: bool) -> tuple[list[float], list[tuple[float, float]]]:
    shares = [0.05, 0.3] if quick else [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_crossover, args=(r, port, shares, 3 if quick else 9, q), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    out = q.get(timeout=600)
    for p in procs:
        p.join()
    return shares, out


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=existing_file, default=None,
                    help="default: train_configs/debug_cpu.toml (--sparse: the real model's)")
    ap.add_argument("--steps", type=count(), default=40)
    ap.add_argument("--warmup", type=count(0), default=5, help="steps left out of the medians (fewer than --steps)")
    ap.add_argument("--reps", type=count(), default=2)
    ap.add_argument("--slow-sync", type=number(), default=0.0, metavar="SECONDS",
                    help="compare weight_sync.interval 1 with auto, every push slowed by SECONDS on the engine")
    ap.add_argument("--colocated", action="store_true",
                    help="compare the broadcast push with rollout.colocated (blocking mode)")
    ap.add_argument("--sparse", action="store_true",
                    help="compare weight_sync.method dense and sparse (bf16 wire) on the real model, per --lrs")
    ap.add_argument("--lrs", type=numbers(above=True), default="1e-6,1e-5",
                    help="with --sparse: learning rates, comma-separated")
    ap.add_argument("--quick", action="store_true", help="smoke run for CI (the cheapest that exercises every code path; its figures are no measurement)")
    ap.add_argument("extra", nargs="*", help="--section.field value overrides for every run")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup, args.reps = 8, 2, 1
    if not args.sparse and args.steps <= args.warmup:
        ap.error(f"argument --steps: got {args.steps}; allowed: more than --warmup ({args.warmup})")
    if args.sparse and not args.quick and not args.config and (why := real_model_missing(ROOT)):
        ap.error(why)  # before minutes of runs that would fail inside the first torchrun
    pair = pair_efficiency()  # before any run of ours: what this machine allows two processes side by side
    if args.sparse:
        if not args.quick and args.steps == 40:
            args.steps = 6
        return sparse(args, pair)
    args.config = args.config or DEBUG_CONFIG
    if args.slow_sync > 0:
        return slow_sync(args, pair)
    if args.colocated:
        return colocated(args, pair)

    per_mode: dict[str, list[dict]] = {"sync": [], "async": []}
    summaries: dict[str, list[dict]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory(prefix="flux_bench_") as tmp:
        for rep in range(args.reps):
            for mode in ("sync", "async"):
                rows, summary = run(args.config, os.path.join(tmp, f"{mode}{rep}"), args.steps, mode == "async",
                                    args.extra)
                per_mode[mode] += rows[args.warmup :]
                summaries[mode].append(summary)
    s, a = per_mode["sync"], per_mode["async"]
    sps = {m: statistics.median(x["steps_per_s"] for x in summaries[m]) for m in summaries}
    T, G, S = median(s, "train_time_s"), median(s, "gen_time_s"), median(s, "weight_sync_s")
    limit = overlap_limit(T, G, S)
    speedup = sps["async"] / sps["sync"]
    blocked = median(a, "weight_sync_s") / median(a, "step_time_s")
    nbytes = summaries["sync"][0]["weight_bytes"]
    push_s = median(s, "weight_push_s")
    # the sync run's train time is the gap before each push; capped at 1 s (caches are as cold after 1 s as after
    # the real model's 16 s, and 30 gaps of 16 s would take 8 minutes)
    raw_s = raw_broadcast_seconds(nbytes, idle_s=min(T, 1.0))
    bw, raw_bw = nbytes / push_s, nbytes / raw_s

    print(f"machine: {platform.machine()} {os.cpu_count()} cores, torch {__import__('torch').__version__}; "
          f"{time.strftime('%Y-%m-%d')}; {args.reps} reps x {args.steps} steps, first {args.warmup} dropped")
    print(f"{'mode':<6} {'steps/s':>8} {'step ms':>8} {'train ms':>9} {'gen ms':>7} {'wait ms':>8} "
          f"{'sync ms':>8} {'push ms':>8} {'gap':>5}")
    for mode, rows in per_mode.items():
        print(f"{mode:<6} {sps[mode]:>8.2f} {1e3 * median(rows, 'step_time_s'):>8.1f} "
              f"{1e3 * median(rows, 'train_time_s'):>9.1f} {1e3 * median(rows, 'gen_time_s'):>7.1f} "
              f"{1e3 * median(rows, 'rollout_time_s'):>8.1f} {1e3 * median(rows, 'weight_sync_s'):>8.2f} "
              f"{1e3 * median(rows, 'weight_push_s'):>8.2f} {statistics.mean(r['version_gap_mean'] for r in rows):>5.2f}")
    print(f"push: {nbytes / 1e6:.2f} MB in {1e3 * push_s:.2f} ms = {bw / 1e9:.3f} GB/s; raw gloo broadcast of the "
          f"same bytes {1e3 * raw_s:.2f} ms = {raw_bw / 1e9:.3f} GB/s")
    print(f"async_speedup={speedup:.3f}")
    print(f"overlap_limit={limit:.3f}")
    print(f"fraction_of_limit={speedup / limit:.3f}")
    print(f"blocked_fraction={blocked:.4f}")
    print(f"push_bandwidth_ratio={bw / raw_bw:.3f}")
    print("\n".join(pair_lines(pair)))
    print(f"overlap_limit_at_pair_efficiency={overlap_limit(T, G, S, pair):.3f}")


if __name__ == "__main__":
    main()
