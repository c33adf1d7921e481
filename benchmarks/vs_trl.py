#!/usr/bin/env python
"""torchtitan_flux vs Hugging Face TRL's GRPOTrainer, side by side on CPU, same model, task and hyper-parameters.

    bash scripts/setup_trl.sh                         # once: .venv-trl with TRL (and the model check)
    .venv/bin/python benchmarks/vs_trl.py             # full: 2 toy workloads x (sync, async, adaptive, TRL) x 3 seeds
    .venv/bin/python benchmarks/vs_trl.py --workloads real   # the real model: (async, async_fixed, TRL) x 3 seeds
    .venv/bin/python benchmarks/vs_trl.py --quick     # smoke: 1 seed, few steps, no speedup claims

Workloads (all: G = 8 completions per prompt, 4 prompts per step, temperature 1, AdamW with a constant LR, betas
(0.9, 0.95), eps 1e-8, weight decay 0, grad clip 1.0, no KL, token-level loss normalisation, group-std-scaled
advantages, one optimizer step per generation batch):

* small: ``tiny`` flavor (279k params), digits task, 16 new tokens, lr 3e-3, target mean reward 0.8;
* long:  ``small`` flavor (1.54M params), digits task, 128 new tokens, lr 3e-3, target 0.8 (generation dominates);
* real:  SmolLM2-135M-Instruct (``scripts/get_real_model.sh``), the README's capitals task
  (``train_configs/smollm2_capitals_cpu.toml`` without its evaluation: chat-templated questions,
  ``examples/capital_rewards.py``), 12 new tokens, lr 2e-5, 20 steps, target mean reward 0.5.

Both systems load the same HF folder (toys: ``model_assets.build_model_dir``, whose logits in transformers equal
ours, see ``benchmarks/trl_runner.py --check-model``; real: the converted folder, checked by get_real_model.sh) and
train on the same prompts, handed to TRL in step order, unshuffled: digits, the prompt list of
``DigitsTask().prompts(seed, step, 4)``; real, the records DatasetTask draws (its EpochSampler, rollout.seed =
seed) rendered by our ChatTemplate, and trl_runner checks that TRL's tokenization gives our engine's prompt ids.

Threads: TRL is one process with 2 torch threads. Ours runs as launched in the README (one trainer rank + one
embedded engine process) with ``rollout.engine_threads`` = 1 thread for the engine and the remaining core for the
trainer (``run.threads.TrainerThreads``). The toys' config keeps that split fixed; the real workload's config borrows:
the trainer also computes on the engine's core while the engine holds no request (``async``); ``async_fixed`` is
the same run with the fixed split. Both systems use the machine's 2 cores.

Timing (wall clock, the same definition for both):
* ``time_s`` of step k = time from the start of step 1 to the end of step k. TRL: a TrainerCallback
  (on_step_begin of step 1, on_step_end of step k). Ours: each ``metrics.jsonl`` row's wall-clock ``time``
  (written right after the step), with step 1's start = its ``time`` - its ``step_time_s``. This includes
  everything between steps (metrics, TensorBoard, logging), which the trainer's own ``step_time_s`` leaves out.
* time to target: ``time_s`` of the first step at which the mean reward over the trailing ``--window`` steps
  reaches the target. It EXCLUDES process startup (imports, model load, engine spawn / trainer construction);
  the "incl. startup" column adds the time from process launch to the start of step 1.
* samples/s: completions trained per second over the whole run (steps * prompts * G / time_s of the last step);
  s/step: median of the per-step wall periods.

Runs are interleaved (seed by seed, the order of the systems rotated per seed) so that machine noise spreads over
all systems; tables report medians over seeds. One discarded warm-up run per system fills the page cache first.
The CPU time other processes use in the second before each launch is recorded; the report warns when the
machine was busy, because other
load slows TRL's 2-thread OpenMP process far more than our single-threaded processes (measured: 10-100x slower
TRL steps while other jobs ran), which biases the comparison in our favour. Record numbers on a quiet machine.

TRL settings (trl_runner.py, all chosen to make TRL as fast as it goes here, none to slow it): use_cpu, fp32, no
gradient checkpointing, no torch.compile, one generation per optimizer step (generation_batch_size = the train
batch), no old-logprob recomputation (num_iterations=1), beta=0 (no reference model), loss_type="dapo" (token
sum / token count over the batch = our "token"), scale_rewards="group", epsilon 0.2 / epsilon_high 0.28,
adamw_torch, lr_scheduler_type="constant", logging effectively off (logging_steps=1e9), no checkpoints, no
completion logging. Model variant: attn_implementation sdpa, transformers' default dynamic KV cache, 2 threads
(``--trl-attn/--trl-cache/--trl-threads`` change them). ``--tune-trl`` measures all 8 combinations (threads 1/2 x
sdpa/eager x dynamic/static cache), interleaved, in short runs (12 / 4 steps; ``--steps`` sets more) and prints
them fastest first. On 2026-11-23 (2 vCPU Xeon) its short runs put the static cache 2-5% ahead, but full runs
did not: TRL's s/step over ours async, each pair side by side in one run, was 2.40 (small) and 1.88 (long)
with the static cache against 2.22 and 1.70 with the dynamic one, so dynamic stays the default. Re-check on
the machine that records the numbers, with full-length runs.

Output: ``--out`` (default outputs/vs_trl): ``runs/<workload>/<system>/seed<N>/`` (ours: the dump folder with
metrics.jsonl and train.log; TRL: trl.jsonl), ``curve.jsonl`` in each (step, reward_mean, time_s, step_time_s,
samples_per_s), ``results.json`` (every run), ``report.txt`` (the tables) and ``curves_<workload>.png``
(``scripts/plot_runs.py``, seed 0 of every system). The last lines printed are
``speedup_vs_trl_small=X`` and ``speedup_vs_trl_long=Y`` (and ``speedup_vs_trl_real``): TRL's median time to target
divided by the best median time to target among our modes whose reward quality matches TRL's (reached the target
on at least as many seeds, and median final reward >= TRL's - 0.05). The real workload also prints
``per_step_ratio_real`` (TRL's median s/step over that mode's) and ``speedup_limit_real``: TRL's median s/step over
(train + generation) / 2 of the ``async_fixed`` runs, each a one-core time: both jobs packed perfectly on the two
cores, the most any schedule of the same work allows per step (``speedup_limit``), and
``speedup_limit_real_at_pair_efficiency``: that limit where the two cores run two processes side by side at the
machine's pair efficiency (``pair_efficiency``, the last line: ``benchmarks/common.py``, measured before the runs;
1.0 = fully in parallel; below 0.8 the report warns that overlap cannot show here).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "scripts"))  # model_assets
from common import (ArgumentParser, busy_cores, count, number, pair_efficiency, pair_lines, paired,  # noqa: E402
                    run_child)

OUR_MODES = {
    "sync": ["--weight_sync.async_weight_update", "false", "--adaptive_async.enabled", "false",
             "--off_policy.async_ratio", "0"],
    "async": ["--weight_sync.async_weight_update", "true", "--adaptive_async.enabled", "false",
              "--off_policy.max_version_gap", "1", "--off_policy.async_ratio", "1"],
    "async2": ["--weight_sync.async_weight_update", "true", "--adaptive_async.enabled", "false",
               "--off_policy.max_version_gap", "2", "--off_policy.async_ratio", "1"],
    # "async" with the fixed split: one core trains, one generates, whatever each is doing (the toy workloads'
    # debug_cpu.toml runs so in every mode; the real workload's config borrows the idle engine's core)
    "async_fixed": ["--weight_sync.async_weight_update", "true", "--adaptive_async.enabled", "false",
                    "--off_policy.max_version_gap", "1", "--off_policy.async_ratio", "1",
                    "--rollout.borrow_idle_engine_cores", "false"],
    # the controller over the async push, bounded like "async" (max_version_gap 1): it decides, step by step,
    # between one-step-ahead generation and on-policy steps
    "adaptive": ["--weight_sync.async_weight_update", "true", "--adaptive_async.enabled", "true",
                 "--adaptive_async.controller", "pid", "--off_policy.max_version_gap", "1"],
}
SYSTEMS = list(OUR_MODES) + ["trl"]
DEFAULT_SYSTEMS = ["sync", "async", "adaptive", "trl"]
REAL_SYSTEMS = ["async", "async_fixed", "trl"]  # the real workload's default: ~4 min per run of ours, ~6 of TRL's


@dataclass
class Workload:
    name: str
    flavor: str  # a toy flavor (model_assets.build_model_dir) or "smollm2" (the real model, REAL_MODEL)
    max_new_tokens: int
    steps: int
    lr: float
    target: float
    seq_len: int
    group_size: int = 8
    prompts_per_step: int = 4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_norm: float = 1.0
    config: str = "debug_cpu.toml"  # our run's base config (train_configs/)
    task_args: tuple[str, ...] = ("--rollout.task", "digits")  # our run's task overrides


REAL_MODEL = REPO / "assets" / "smollm2-135m-instruct"  # scripts/get_real_model.sh
WORKLOADS = {
    "small": Workload("small", "tiny", max_new_tokens=16, steps=40, lr=3e-3, target=0.8, seq_len=64),
    "long": Workload("long", "small", max_new_tokens=128, steps=30, lr=3e-3, target=0.8, seq_len=160),
    # the README's real run (train_configs/smollm2_capitals_cpu.toml) without its evaluation: SmolLM2-135M-Instruct,
    # chat-templated capital questions, examples/capital_rewards.py; the target is the training reward's
    # trailing mean (window --window), which the README run passed around step 8 (0.35 -> 0.52 by step 10)
    "real": Workload("real", "smollm2", max_new_tokens=12, steps=20, lr=2e-5, target=0.5, seq_len=80,
                     config="smollm2_capitals_cpu.toml",
                     task_args=("--eval.at_start", "false", "--eval.every_steps", "0")),
}
QUICK_STEPS = {"small": 6, "long": 3, "real": 2}  # --quick: CI's smoke run of every code path, not a measurement


@dataclass
class RunResult:
    workload: str
    system: str
    seed: int
    ok: bool
    error: str = ""
    steps: int = 0
    median_step_s: float | None = None
    samples_per_s: float | None = None
    time_to_target_s: float | None = None
    steps_to_target: int | None = None
    startup_s: float | None = None
    final_reward: float | None = None
    process_wall_s: float | None = None
    load_before: float | None = None  # cores kept busy by other processes in the second before launch
    train_s: float | None = None  # ours: median train_time_s per step (step 1 left out)
    gen_s: float | None = None  # ours: median gen_time_s per step (step 1 left out)
    run_dir: str = ""
    curve: list[dict] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- helpers


def model_dir(out: Path, flavor: str) -> Path:
    if flavor == "smollm2":
        return REAL_MODEL
    from model_assets import build_model_dir

    return build_model_dir(out / "models" / flavor, flavor=flavor, seed=0)


def step_prompts(wl: Workload, seed: int, steps: int, mdir: Path) -> list[list]:
    """Each step's prompts as our run sees them. Digits: the texts. Real: {text, answer, ids} with the text
    rendered by our ChatTemplate and the records drawn by DatasetTask's EpochSampler (rollout.seed = ``seed``), in
    data/capitals/train.jsonl's order; ids: our tokenizer's (no BOS: the template writes its own)."""
    n = wl.prompts_per_step
    if wl.flavor != "smollm2":
        from torchtitan_flux.data.tasks import DigitsTask

        t = DigitsTask()
        return [[p.text for p in t.prompts(seed, s, n)] for s in range(1, steps + 1)]
    from torchtitan_flux.data.datasets import ChatTemplate, EpochSampler
    from torchtitan_flux.patches import apply_patches

    apply_patches()  # before importing torchtitan (its triton stub on CPU)
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    with open(REPO / "data" / "capitals" / "train.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    template, tok = ChatTemplate(str(mdir)), HuggingFaceTokenizer(tokenizer_path=str(mdir))
    sampler = EpochSampler(len(rows), seed)
    out = []
    for s in range(1, steps + 1):
        step = []
        for i in sampler.indices((s - 1) * n, n):
            text = template.render([{"role": "user", "content": rows[i]["prompt"]}], add_generation_prompt=True)
            step.append({"text": text, "answer": rows[i]["answer"],
                         "ids": tok.encode(text, add_bos=False, add_eos=False)})
        out.append(step)
    return out


def time_to_target(curve: list[dict], target: float, window: int) -> tuple[float | None, int | None]:
    rewards = [r["reward_mean"] for r in curve]
    for i in range(len(curve)):
        lo = max(0, i - window + 1)
        if i + 1 >= window and sum(rewards[lo : i + 1]) / (i + 1 - lo) >= target:
            return curve[i]["time_s"], curve[i]["step"]
    return None, None


def summarise(res: RunResult, curve: list[dict], wl: Workload, window: int, first_start_epoch: float | None,
              launch_epoch: float) -> RunResult:
    res.curve = curve
    res.steps = len(curve)
    if not curve:
        res.ok, res.error = False, res.error or "no steps recorded"
        return res
    periods = [curve[0]["time_s"]] + [b["time_s"] - a["time_s"] for a, b in zip(curve, curve[1:])]
    res.median_step_s = statistics.median(periods)
    res.samples_per_s = len(curve) * wl.prompts_per_step * wl.group_size / max(curve[-1]["time_s"], 1e-9)
    res.time_to_target_s, res.steps_to_target = time_to_target(curve, wl.target, window)
    tail = [r["reward_mean"] for r in curve[-5:]]
    res.final_reward = sum(tail) / len(tail)
    if first_start_epoch is not None:
        res.startup_s = first_start_epoch - launch_epoch
    return res


def write_curve(path: Path, curve: list[dict]) -> None:
    with open(path, "w") as f:
        for r in curve:
            f.write(json.dumps(r) + "\n")


# -------------------------------------------------------------------------------------------------- ours

def _our_curve(run_dir: Path) -> tuple[list[dict], float | None]:
    """The reward curve from ``metrics.jsonl``: each row's wall-clock ``time`` (written right after the step),
    step 1 starting at its row's ``time`` minus its ``step_time_s``; also that start (epoch seconds)."""
    metrics = {}
    with open(run_dir / "metrics.jsonl") as f:
        for line in f:
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if isinstance(d, dict) and "step" in d and "reward_mean" in d:  # not the eval.at_start row
                metrics[int(d["step"])] = d
    steps = sorted(metrics)
    if not steps:
        return [], None
    start = metrics[steps[0]]["time"] - metrics[steps[0]]["step_time_s"]
    curve: list[dict] = []
    for s in steps:
        curve.append(_point(s, metrics[s]["reward_mean"], metrics[s]["time"] - start, curve))
    return curve, start


def _point(step: int, reward: float, t: float, curve: list[dict]) -> dict:
    prev = curve[-1]["time_s"] if curve else 0.0
    return {"step": step, "reward_mean": reward, "time_s": t, "step_time_s": t - prev}


def run_ours(mode: str, wl: Workload, seed: int, steps: int, mdir: Path, run_dir: Path, window: int,
             timeout: float, extra: list[str] | None = None) -> RunResult:
    res = RunResult(wl.name, mode, seed, ok=False, run_dir=str(run_dir))
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = [
        torchrun, "--nproc_per_node=1", "--standalone", "-m", "torchtitan_flux.train",
        "--job.config_file", str(REPO / "train_configs" / wl.config),
        "--job.dump_folder", str(run_dir),
        "--model.hf_assets_path", str(mdir),
        "--training.steps", str(steps),
        "--training.seq_len", str(wl.seq_len),
        "--training.max_norm", str(wl.max_norm),
        "--optimizer.lr", str(wl.lr), "--optimizer.beta1", str(wl.beta1), "--optimizer.beta2", str(wl.beta2),
        "--optimizer.eps", str(wl.eps), "--optimizer.weight_decay", str(wl.weight_decay),
        # constant LR, as TRL's lr_scheduler_type="constant" (warmup 1 = factor 1 from the first step)
        "--lr_scheduler.warmup_steps", "1", "--lr_scheduler.decay_ratio", "0.0",
        "--grpo.group_size", str(wl.group_size), "--grpo.temperature", "1.0", "--grpo.kl_coef", "0.0",
        "--grpo.loss_normalization", "token",
        *wl.task_args, "--rollout.prompts_per_step", str(wl.prompts_per_step),
        "--rollout.max_new_tokens", str(wl.max_new_tokens), "--rollout.top_k", "0",
        "--rollout.seed", str(seed), "--debug.seed", str(seed),
        "--checkpoint.enable", "false",
        *OUR_MODES[mode],
        *(extra or []),
    ]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    log_path = run_dir / "train.log"
    launch = time.time()
    t0 = time.perf_counter()
    try:
        with open(log_path, "w") as log:
            log.write(" ".join(cmd) + "\n")
            log.flush()
            p = run_child(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    res.process_wall_s = time.perf_counter() - t0
    if rc != 0:
        res.error = f"exit {rc}; see {log_path}"
    curve, start = _our_curve(run_dir) if (run_dir / "metrics.jsonl").is_file() else ([], None)
    res.ok = rc == 0
    summarise(res, curve, wl, window, start, launch)
    res.train_s, res.gen_s = _our_phase_times(run_dir)
    write_curve(run_dir / "curve.jsonl", curve)
    return res


def _our_phase_times(run_dir: Path) -> tuple[float | None, float | None]:
    """Median training and generation seconds per step from ``metrics.jsonl`` (step 1 left out: warm-up)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None, None
    rows = []
    for line in path.read_text().splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and d.get("step", 0) > 1 and "train_time_s" in d and "gen_time_s" in d:
            rows.append(d)
    if not rows:
        return None, None
    return statistics.median(r["train_time_s"] for r in rows), statistics.median(r["gen_time_s"] for r in rows)


# --------------------------------------------------------------------------------------------------- TRL


def run_trl(wl: Workload, seed: int, steps: int, mdir: Path, run_dir: Path, window: int, timeout: float,
            trl_python: str, attn: str, cache: str | None, threads: int = 2) -> RunResult:
    res = RunResult(wl.name, "trl", seed, ok=False, run_dir=str(run_dir))
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    spec = {
        "model_dir": str(mdir), "prompts": step_prompts(wl, seed, steps, mdir),
        "task": "capitals" if wl.flavor == "smollm2" else "digits",
        "group_size": wl.group_size, "max_new_tokens": wl.max_new_tokens, "lr": wl.lr, "beta1": wl.beta1,
        "beta2": wl.beta2, "eps": wl.eps, "weight_decay": wl.weight_decay, "max_norm": wl.max_norm,
        "seed": seed, "threads": threads, "out": str(run_dir / "trl.jsonl"),
        "attn_implementation": attn, "cache_implementation": None if cache == "dynamic" else cache,
    }
    with open(run_dir / "spec.json", "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    cmd = [trl_python, str(REPO / "benchmarks" / "trl_runner.py"), "--spec", str(run_dir / "spec.json")]
    log_path = run_dir / "train.log"
    launch = time.time()
    t0 = time.perf_counter()
    try:
        with open(log_path, "w") as log:
            p = run_child(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    res.process_wall_s = time.perf_counter() - t0
    res.ok = rc == 0
    if rc != 0:
        res.error = f"exit {rc}; see {log_path}"
    curve, start = [], None
    if (run_dir / "trl.jsonl").is_file():
        with open(run_dir / "trl.jsonl") as f:
            for line in f:
                try:
                    d = json.loads(line)
                except ValueError:
                    continue
                if d.get("event") == "start":
                    start = d.get("start_epoch")
                elif "step" in d:
                    curve.append({k: d[k] for k in ("step", "reward_mean", "time_s", "step_time_s")})
    summarise(res, curve, wl, window, start, launch)
    write_curve(run_dir / "curve.jsonl", curve)
    return res


def tune_trl(args, wls: list[Workload], mdirs: dict, out: Path, seeds: list[int]) -> int:
    """Median s/step of TRL variants; runs interleaved (variant order rotated per repeat)."""
    variants = [(t, a, c) for t in (1, 2) for a in ("sdpa", "eager") for c in (None, "static")]
    steps = {"small": 12, "long": 4} if args.steps is None else {w.name: args.steps for w in wls}
    repeats = len(seeds)  # one repeat per seed given (default 3; --quick: 1); every repeat uses seed 0
    got: dict[tuple, list[float]] = {}
    for rep in range(repeats):
        for wl in wls:
            order = variants[rep % len(variants):] + variants[: rep % len(variants)]
            for t, a, c in order:
                run_dir = out / "runs" / "_tune" / wl.name / f"t{t}_{a}_{c or 'dynamic'}"
                r = run_trl(wl, 0, steps[wl.name], mdirs[wl.flavor], run_dir, args.window, args.timeout,
                            args.trl_python, a, c, t)
                # drop the first step (allocator / kernel warm-up) from the median
                periods = [x["step_time_s"] for x in r.curve[1:]] or [x["step_time_s"] for x in r.curve]
                if r.ok and periods:
                    got.setdefault((wl.name, t, a, c), []).append(statistics.median(periods))
                print(f"{wl.name:<5} threads={t} attn={a:<5} cache={c or 'dynamic':<7} rep {rep}: "
                      + (f"{statistics.median(periods):.4f} s/step" if r.ok and periods else f"FAILED {r.error}"),
                      flush=True)
    print()
    for wl in wls:
        # best (min) over repeats: the variant's capability, least disturbed by other load on the machine
        rows = sorted(((min(v), statistics.median(v), k) for k, v in got.items() if k[0] == wl.name))
        print(f"== TRL variants, workload {wl.name}: median s/step of a run; best and median over {repeats} runs "
              "(fastest first)")
        for best, med, (_, t, a, c) in rows:
            print(f"threads={t} attn_implementation={a:<5} cache_implementation={c or 'dynamic (default)':<18} "
                  f"best {best:.4f}  median {med:.4f} s/step")
    return 0


# ------------------------------------------------------------------------------------------------ report


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def aggregate(results: list[RunResult], wl: Workload, systems: list[str]) -> dict[str, dict]:
    agg = {}
    for s in systems:
        rs = [r for r in results if r.workload == wl.name and r.system == s and r.curve]
        if not rs:
            continue
        reached = [r for r in rs if r.time_to_target_s is not None]
        agg[s] = {
            "seeds": len(rs),
            "failed": sum(not r.ok for r in results if r.workload == wl.name and r.system == s),
            "median_step_s": _med([r.median_step_s for r in rs]),
            "samples_per_s": _med([r.samples_per_s for r in rs]),
            "reached": len(reached),
            # median over the seeds that reached the target; a seed that did not counts as +inf
            "ttt_s": _med_inf([r.time_to_target_s for r in rs]),
            "ttt_incl_startup_s": _med_inf([None if r.time_to_target_s is None or r.startup_s is None
                                            else r.time_to_target_s + r.startup_s for r in rs]),
            "steps_to_target": _med_inf([r.steps_to_target for r in rs]),
            "startup_s": _med([r.startup_s for r in rs]),
            "final_reward": _med([r.final_reward for r in rs]),
            "train_s": _med([r.train_s for r in rs]),
            "gen_s": _med([r.gen_s for r in rs]),
        }
    return agg


def _med_inf(xs):
    """Median where None (did not reach the target) counts as +inf; None if the median itself is +inf."""
    if not xs:
        return None
    vals = sorted(float("inf") if x is None else float(x) for x in xs)
    m = statistics.median(vals)
    return None if m == float("inf") else m


def table(wl: Workload, agg: dict[str, dict], window: int) -> str:
    lines = [
        f"== workload {wl.name}: flavor {wl.flavor}, G={wl.group_size}, prompts/step={wl.prompts_per_step}, "
        f"max_new_tokens={wl.max_new_tokens}, lr={wl.lr}, target mean reward {wl.target} "
        f"(trailing {window}-step mean)",
        f"{'system':<17} {'seeds':>5} {'s/step':>8} {'samples/s':>10} {'ttt_s':>8} {'reached':>8} "
        f"{'steps':>6} {'ttt+startup_s':>14} {'startup_s':>10} {'final_reward':>13}",
    ]
    for s, a in agg.items():
        name = f"ours:{s}" if s != "trl" else "trl"
        lines.append(
            f"{name:<17} {a['seeds']:>5} {_fmt(a['median_step_s'], '.4f'):>8} {_fmt(a['samples_per_s'], '.1f'):>10} "
            f"{_fmt(a['ttt_s'], '.2f'):>8} {str(a['reached']) + '/' + str(a['seeds']):>8} "
            f"{_fmt(a['steps_to_target'], '.0f'):>6} {_fmt(a['ttt_incl_startup_s'], '.2f'):>14} "
            f"{_fmt(a['startup_s'], '.2f'):>10} {_fmt(a['final_reward'], '.3f'):>13}"
            + (f"  ({a['failed']} failed)" if a["failed"] else "")
        )
    return "\n".join(lines)


def speedup(agg: dict[str, dict]) -> tuple[float | None, str, str | None]:
    """(TRL's time to target / the best matching mode of ours', why, that mode)."""
    trl = agg.get("trl")
    if not trl:
        return None, "no TRL runs", None
    ours = {s: a for s, a in agg.items() if s != "trl"}
    ok = {s: a for s, a in ours.items()
          if a["ttt_s"] is not None and a["reached"] >= trl["reached"]
          and (trl["final_reward"] is None or (a["final_reward"] or 0) >= trl["final_reward"] - 0.05)}
    if not ok:
        return None, "no mode of ours matched TRL's reward quality", None
    best = min(ok, key=lambda s: ok[s]["ttt_s"])
    if trl["ttt_s"] is None:
        # TRL did not reach the target (median): no ratio is claimed (its run time would only be a lower bound)
        return None, (f"TRL did not reach the target (median); best of ours: {best} {ok[best]['ttt_s']:.2f}s; "
                      "rerun with more --steps"), best
    return trl["ttt_s"] / ok[best]["ttt_s"], f"best of ours: {best}", best


def speedup_limit(agg: dict[str, dict]) -> tuple[float | None, str]:
    """The most two cores allow per step: TRL's median s/step over ours with both jobs' one-core times packed
    perfectly on two cores, (train + generation) / 2, from the fixed split's runs (``async_fixed``: training on
    one core, generation on the other). Equal steps to target assumed; a core's single-thread work is the most
    efficient there is here (two threads on one job scale below 2x), so no schedule of the same work beats it."""
    fixed, trl = agg.get("async_fixed"), agg.get("trl")
    if not fixed or not trl or fixed["train_s"] is None or fixed["gen_s"] is None or trl["median_step_s"] is None:
        return None, "needs async_fixed and trl runs"
    ideal = (fixed["train_s"] + fixed["gen_s"]) / 2
    return trl["median_step_s"] / ideal, (f"TRL {trl['median_step_s']:.2f} s/step over (train {fixed['train_s']:.2f}"
                                          f" + generation {fixed['gen_s']:.2f}) / 2 = {ideal:.2f} s")


# -------------------------------------------------------------------------------------------------- main


def overrides(text: str) -> str:
    """An argparse type: overrides as a shell would split them (balanced quotes)."""
    try:
        shlex.split(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"got {text!r} ({e}); allowed: --section.field value pairs, quoted as "
                                         "in a shell") from None
    return text


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog=__doc__)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 seed, few steps, no warm-up")
    ap.add_argument("--out", default="outputs/vs_trl", help="output folder (default outputs/vs_trl)")
    ap.add_argument("--seeds", type=count(0), nargs="+", default=None, help="seeds (default 0 1 2; --quick: 0)")
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=["small", "long"],
                    help="default small long; real: the real model (scripts/get_real_model.sh first)")
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=None,
                    help=f"our modes and/or trl (default {' '.join(DEFAULT_SYSTEMS)}, for the real workload "
                         f"{' '.join(REAL_SYSTEMS)}; also: async2 = fixed bound 2, async_fixed = no core borrowing)")
    ap.add_argument("--steps", type=count(), default=None, help="override the steps of every workload")
    ap.add_argument("--window", type=count(), default=3, help="trailing window of the time-to-target mean (default 3)")
    ap.add_argument("--trl-python", default=str(REPO / ".venv-trl" / "bin" / "python"))
    ap.add_argument("--trl-attn", default="sdpa", choices=["sdpa", "eager"],
                    help="TRL model attn_implementation (default sdpa; see --tune-trl)")
    ap.add_argument("--trl-cache", default="dynamic",
                    help="TRL cache_implementation: dynamic (transformers' default; the faster in full runs here, "
                         "see the module docstring) or static")
    ap.add_argument("--ours-args", type=overrides, default="",
                    help="extra overrides for every run of ours, e.g. \"--rollout.engine_threads 2\" (as configured "
                         "by default: debug_cpu.toml + the workload's overrides)")
    ap.add_argument("--trl-threads", type=count(), default=2, help="torch threads of the TRL process (default 2)")
    ap.add_argument("--tune-trl", action="store_true",
                    help="only measure TRL variants (threads x attention x KV cache), interleaved, a few steps each "
                         "per workload, print their median s/step and exit: how the TRL defaults here were chosen")
    ap.add_argument("--no-warmup", action="store_true", help="skip the discarded warm-up run of each system")
    ap.add_argument("--timeout", type=number(above=True), default=1800.0, help="per-run timeout in seconds")
    args = ap.parse_args(argv)

    out = (REPO / args.out) if not os.path.isabs(args.out) else Path(args.out)
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    wls = [WORKLOADS[w] for w in args.workloads]
    systems_of = {w.name: args.systems or (REAL_SYSTEMS if w.name == "real" else DEFAULT_SYSTEMS) for w in wls}
    if any("trl" in v for v in systems_of.values()) and not os.access(args.trl_python, os.X_OK):
        print(f"vs_trl: error: {args.trl_python} not found; run `bash scripts/setup_trl.sh` first", file=sys.stderr)
        return 2
    if "real" in args.workloads and not (REAL_MODEL / "config.json").is_file():
        print(f"vs_trl: error: {REAL_MODEL} not found; run `scripts/get_real_model.sh` first", file=sys.stderr)
        return 2
    steps_of = {w.name: args.steps or (QUICK_STEPS[w.name] if args.quick else w.steps) for w in wls}
    mdirs = {w.flavor: model_dir(out, w.flavor) for w in wls}

    def one(system: str, wl: Workload, seed: int, steps: int, run_dir: Path) -> RunResult:
        mdir = mdirs[wl.flavor]
        if system == "trl":
            return run_trl(wl, seed, steps, mdir, run_dir, args.window, args.timeout, args.trl_python,
                           args.trl_attn, args.trl_cache, args.trl_threads)
        return run_ours(system, wl, seed, steps, mdir, run_dir, args.window, args.timeout,
                        shlex.split(args.ours_args))

    if args.tune_trl:
        return tune_trl(args, wls, mdirs, out, seeds)

    pair = pair_efficiency()  # before any run: what this machine allows two processes side by side
    t_start = time.perf_counter()
    if not args.quick and not args.no_warmup:
        wl0 = wls[0]
        for s in systems_of[wl0.name]:
            r = one(s, wl0, 0, 3, out / "runs" / "_warmup" / s)
            print(f"warm-up {s}: {'ok' if r.ok else r.error} ({r.process_wall_s:.1f}s)", flush=True)

    results: list[RunResult] = []
    for i, seed in enumerate(seeds):
        for wl in wls:
            systems = systems_of[wl.name]
            order = systems[i % len(systems):] + systems[: i % len(systems)]  # rotate per seed
            for s in order:
                run_dir = out / "runs" / wl.name / s / f"seed{seed}"
                load = busy_cores()
                r = one(s, wl, seed, steps_of[wl.name], run_dir)
                r.load_before = load
                results.append(r)
                print(f"[{time.perf_counter() - t_start:7.1f}s] {wl.name:<5} {s:<8} seed {seed}: "
                      + (f"{r.steps} steps, {_fmt(r.median_step_s, '.4f')} s/step, "
                         f"{_fmt(r.samples_per_s, '.1f')} samples/s, ttt {_fmt(r.time_to_target_s, '.2f')}s "
                         f"(step {r.steps_to_target}), final reward {_fmt(r.final_reward)}, "
                         f"startup {_fmt(r.startup_s, '.1f')}s" if r.curve else "")
                      + ("" if r.ok else f"  FAILED: {r.error}"), flush=True)

    with open(out / "results.json", "w") as f:
        json.dump({"args": vars(args), "workloads": {w.name: asdict(w) | {"steps": steps_of[w.name]} for w in wls},
                   "runs": [asdict(r) for r in results]}, f, indent=1)

    report, keyvals = [], []
    for wl in wls:
        agg = aggregate(results, wl, systems_of[wl.name])
        report.append(table(wl, agg, args.window))
        sp, why, best = speedup(agg)
        report.append(f"speedup (TRL time to target / ours, {why}): {_fmt(sp, '.2f')}")
        keyvals.append(f"speedup_vs_trl_{wl.name}={_fmt(sp, '.2f') if sp is not None else 'nan'}")
        if wl.name == "real":
            if best is None:  # no mode matched TRL's reward quality: the per-step ratio of our fastest
                best = min((k for k in agg if k != "trl" and agg[k]["median_step_s"]),
                           key=lambda k: agg[k]["median_step_s"], default=None)
            trl, ours = agg.get("trl"), agg.get(best or "")
            per_step = (trl["median_step_s"] / ours["median_step_s"]
                        if trl and ours and trl["median_step_s"] and ours["median_step_s"] else None)
            report.append(f"per-step ratio (TRL median s/step / ours{', ' + best if best else ''}): "
                          f"{_fmt(per_step, '.2f')}")
            lim, why_lim = speedup_limit(agg)
            report.append(f"speedup limit (per step, two cores): {_fmt(lim, '.2f')} ({why_lim})")
            keyvals.append(f"per_step_ratio_real={_fmt(per_step, '.2f') if per_step is not None else 'nan'}")
            keyvals.append(f"speedup_limit_real={_fmt(lim, '.2f') if lim is not None else 'nan'}")
            # the two cores pack the work at the pair's efficiency: the ideal per-step time grows by 1 / efficiency
            lim_e = None if lim is None else lim * paired(pair)
            report.append(f"speedup limit at this machine's pair efficiency {pair:.2f}: {_fmt(lim_e, '.2f')}")
            keyvals.append(f"speedup_limit_real_at_pair_efficiency={'nan' if lim_e is None else _fmt(lim_e, '.2f')}")
        first = [r for r in results if r.workload == wl.name and r.seed == seeds[0] and r.curve]
        if first:
            png = out / f"curves_{wl.name}.png"
            cmd = [sys.executable, str(REPO / "scripts" / "plot_runs.py"),
                   *[f"{Path(r.run_dir) / 'curve.jsonl'}:{'ours ' + r.system if r.system != 'trl' else 'TRL'}"
                     for r in first],
                   "-o", str(png), "--title", f"{wl.name}: {'capitals' if wl.name == 'real' else 'digits'} "
                                              f"reward, seed {seeds[0]}",
                   "--target", str(wl.target)]
            p = run_child(cmd, capture_output=True, text=True)
            report.append(f"curves: {png}" if p.returncode == 0 else f"plot failed: {p.stderr.strip()}")
    text = "\n".join(report)
    note = ("time to target excludes process startup (imports, model load, engine spawn); the ttt+startup "
            "column includes it. Medians over seeds; a seed that never reached the target counts as +inf.")
    loads = [r.load_before for r in results if r.load_before is not None]
    if loads and max(statistics.median(loads), statistics.mean(loads)) > 0.2:
        note += (f"\nWARNING: the machine was busy: other processes kept {statistics.mean(loads):.2f} of its "
                 f"{os.cpu_count()} cores busy on average (median {statistics.median(loads):.2f}) just before the "
                 "runs. Other load slows TRL's 2-thread OpenMP process far more than our "
                 "single-threaded trainer and engine processes (seen: 10-100x slower TRL steps), so these numbers "
                 "favour us; take the recorded numbers on a quiet machine.")
    *pair_warning, pair_kv = pair_lines(pair)
    note += "".join("\n" + w for w in pair_warning)
    keyvals.append(pair_kv)
    per_run = ["", "per run (workload system seed: steps, median s/step, samples/s, time to target s (step), "
               "startup s, final reward, process wall s, cores busy with other work at launch)"]
    for r in results:
        per_run.append(f"{r.workload} {r.system} {r.seed}: {r.steps}, {_fmt(r.median_step_s, '.4f')}, "
                       f"{_fmt(r.samples_per_s, '.1f')}, {_fmt(r.time_to_target_s, '.2f')} ({r.steps_to_target}), "
                       f"{_fmt(r.startup_s, '.2f')}, {_fmt(r.final_reward)}, {_fmt(r.process_wall_s, '.1f')}, "
                       f"busy {_fmt(r.load_before, '.2f')}"
                       + ("" if r.ok else f"  FAILED: {r.error}"))
    with open(out / "report.txt", "w") as f:
        f.write(text + "\n" + note + "\n" + "\n".join(per_run) + "\n\n" + "\n".join(keyvals) + "\n")
    print()
    print(text)
    print(note)
    print(f"total benchmark wall time: {time.perf_counter() - t_start:.0f}s; raw runs under {out / 'runs'}")
    if args.quick:
        print("(--quick: short runs on one seed; the speedups below are a smoke test, not a measurement)")
    for kv in keyvals:
        print(kv)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
