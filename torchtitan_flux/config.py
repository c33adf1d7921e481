"""Job-config sections torchtitan_flux adds to torchtitan's ``JobConfig``.

torchtitan 0.2.2 merges a ``JobConfig`` dataclass named by ``[job] custom_config_module`` into its own
(``ConfigManager._merge_configs``); ``torchtitan_flux.train`` names this module automatically, so every TOML
and ``--section.field`` override below works without the user setting it.

``validate_config`` checks types, ranges and cross-field consistency and raises ``ConfigError`` naming the
field and what is allowed. It runs on every rank before any engine process is started.

Simplification: torchtitan's own sections are validated by torchtitan; we check only the fields we rely on.
"""


import dataclasses
import importlib
import ipaddress
import importlib.util
import inspect
import logging
import math
import os
import re
import socket
import types
import typing
import urllib.parse
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import tyro

from torchtitan_flux.engine.auth import TOKEN_ENV, is_loopback, read_token

# CLI booleans take a value (``--weight_sync.async_weight_update true``), like every other field.
Bool = Annotated[bool, tyro.conf.FlagConversionOff]


class ConfigError(ValueError):
    """A bad config value. The message names the field (``section.field``) and the allowed values."""


@dataclass
class Grpo:
    """``[grpo]``: the GRPO objective."""

    group_size: int = 8
    """Completions sampled per prompt (G). Advantages are normalised within each group. Must be >= 2."""

    clip_low: float = 0.2
    """Lower clip bound epsilon_low: the policy ratio is clipped at 1 - clip_low. In (0, 1)."""

    clip_high: float = 0.28
    """Upper clip bound epsilon_high: the policy ratio is clipped at 1 + clip_high (DAPO's clip-higher). > 0."""

    kl_coef: float = 0.0
    """Coefficient of the KL penalty against a frozen copy of the initial policy. 0 disables it (and the
    reference model is then not built). >= 0."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator on sampled tokens: k1 = log(pi/ref), k2 = 0.5*log(pi/ref)^2, k3 = ref/pi - log(ref/pi) - 1."""

    loss_normalization: Literal["token", "sequence"] = "token"
    """"token": sum of per-token losses over all completion tokens of the batch divided by their count (DAPO);
    "sequence": mean over completions of each completion's mean token loss (original GRPO)."""

    temperature: float = 1.0
    """Sampling temperature of the rollout engines; the trainer divides its logits by it too, so behaviour and
    trainer log-probabilities refer to the same distribution. > 0."""

    tis_cap: float = 2.0
    """Truncated importance sampling: each token's loss is weighted by min(pi_trainer / pi_behaviour, tis_cap)
    (detached) and the clipped ratio is taken against the trainer's current policy (decoupled PPO). 0 disables
    it: the clipped ratio is then taken against the behaviour (engine) log-probabilities directly. >= 0."""

    advantage_std_normalize: Bool = True
    """Divide group-centred rewards by the group's standard deviation (+1e-4). Groups whose rewards are all equal
    get advantage 0 either way: they contribute no policy gradient (only KL, if enabled) and are counted in
    the ``zero_variance_groups`` metric."""

    staleness_discount: float = 0.0
    """Weight of a sample is multiplied by (1 + version_gap) ** -staleness_discount (a staleness-adaptive step
    size). 0 disables it. >= 0."""


@dataclass
class Rollout:
    """``[rollout]``: where completions come from and what they are scored on."""

    engine: Literal["embedded", "vllm", "sglang"] = "embedded"
    """Rollout engine: "embedded" (a child process holding its own copy of the policy; the default, needs no
    server), "vllm" or "sglang" (HTTP servers; see ``urls``)."""

    num_engines: int = 1
    """Number of embedded engine processes, or of vLLM servers started with ``launch = true`` (otherwise servers
    are counted by ``urls``). >= 1."""

    urls: list[str] = field(default_factory=list)
    """Base URLs of vLLM / SGLang servers, e.g. ["http://127.0.0.1:8000"]. Required for those engines."""

    prompts_per_step: int = 4
    """Prompts per training step; the batch holds prompts_per_step * grpo.group_size completions. >= 1."""

    max_new_tokens: int = 16
    """Maximum completion length in tokens. >= 1."""

    top_k: int = 0
    """Sample only from the top-k tokens; 0 disables. The reported behaviour log-probabilities stay those of the
    full tempered distribution (what the trainer recomputes), so top-k sampling is slightly off-policy; keep 0
    unless you want that. >= 0."""

    task: str = "digits"
    """Task: "digits" (dense reward: fraction of completion characters that are digits; a random-init model
    learns it in minutes), "arithmetic" (exact-match sums, final-answer extraction), "dataset" (records of
    ``dataset_path``, scored by ``reward_funcs``; "jsonl" is its old name and still works), "gsm8k" (a dataset in
    GSM8K's format scored by its final answer), or "package.module:name" (a task factory; docs/data.md)."""

    dataset_path: str = ""
    """Dataset of tasks "dataset" / "gsm8k": a local .jsonl / .json / .parquet / .csv file, a folder of such files
    (splits named by file name: train.jsonl, test.jsonl), or a ``save_to_disk`` folder (docs/data.md)."""

    reward_fn: str = ""
    """Old single reward function, "package.module:function", called per sample as fn(prompt, completion,
    answer) -> float. Still works; ``reward_funcs`` (TRL's batched signature) replaces it."""

    engine_threads: int = 1
    """CPU threads of each engine on this machine (an embedded engine's torch threads, or a launched vLLM
    server's OpenMP threads); the trainer gets the remaining cores. >= 1."""

    engine_device: str = "auto"
    """Device of the embedded engines: "auto" (CPU when the trainer is on CPU, else the GPU after the trainer's
    local ranks), "cpu", or "cuda:N"."""

    seed: int = 0
    """Base seed of the engines' samplers (each request derives its own generator from it)."""

    dispatch_dead_zone: float = 0.1
    """Dead zone of the dispatch split. Prompts are split across engines in proportion to an EMA of each engine's
    measured completions/s; the previous split is kept while every engine's share would change by less than this
    fraction of itself (0.1: by less than 10%), so timing jitter does not reshuffle work. 0 re-splits on every
    change. In [0, 1)."""

    dispatch_max_share: float = 0.75
    """Imbalance cap of the dispatch split: while more than one engine is alive, no engine gets more than this
    fraction of a step's prompts (the excess goes to the others in proportion to their speed), however much
    faster it measures; a lone engine gets everything. Below 1 / (engines alive) the split is even. In (0, 1]."""

    launch: Bool = False
    """Engine "vllm" only: the trainer starts ``num_engines`` local vLLM servers itself (free ports, model
    ``model.hf_assets_path``, the flags of ``scripts/launch_vllm.sh``, interpreter ``launch_python``), waits for
    their ``/health``, uses them as ``urls`` and stops them when it closes. ``urls`` must then be empty."""

    launch_python: str = ".venv-vllm/bin/python"
    """Python interpreter with vLLM installed, used when ``launch`` is true (``scripts/setup_vllm.sh`` creates
    ``.venv-vllm``); a relative path is taken from the current directory, then from the repository root. Must
    exist when ``launch`` is true."""

    launch_timeout_s: float = 600.0
    """Seconds to wait for a launched vLLM server to answer ``/health`` before giving up (the error names the
    server's log file). > 0."""

    engine_devices: list[str] = field(default_factory=list)
    """Device of each engine, one entry per engine ("cpu" or "cuda:N"): embedded engines run there, servers
    started by ``launch`` see only that GPU (``CUDA_VISIBLE_DEVICES``). Empty: CPU when the trainer is on CPU,
    else engine i on ``cuda:{LOCAL_WORLD_SIZE + i}``. Checked against the visible GPUs before any engine starts;
    never a trainer GPU, never one GPU twice. Replaces ``engine_device`` (still honoured when set)."""

    dataset_split: str = "train"
    """Split of ``dataset_path`` to train on, when it is a folder or a saved ``DatasetDict`` (a single file has
    one split)."""

    prompt_column: str = "prompt"
    """Dataset column holding the prompt text (task "gsm8k" also accepts "question")."""

    messages_column: str = "messages"
    """Dataset column holding a chat prompt (a list of {"role", "content"} messages), used when there is no
    ``prompt_column``; rendered with the model folder's chat template."""

    answer_column: str = "answer"
    """Dataset column passed to the rewards as ``answer`` (every other column is passed under its own name)."""

    apply_chat_template: Bool = False
    """Render text prompts as a one-message user chat through the model folder's chat template (chat datasets
    always are)."""

    max_prompt_tokens: int = 0
    """Longest prompt in tokens; 0 means ``training.seq_len - max_new_tokens``. ``max_prompt_tokens +
    max_new_tokens`` must fit in ``training.seq_len``. >= 0."""

    long_prompts: Literal["drop", "error"] = "drop"
    """Dataset prompts longer than ``max_prompt_tokens``: "drop" them (how many is logged at start) or "error"
    (refuse the dataset)."""

    reward_funcs: list[str] = field(default_factory=list)
    """Reward functions with TRL's batched signature f(prompts, completions, completion_ids, **columns) ->
    list[float | None], each "package.module:function" or a built-in ("answer_match", "math_verify", "digits");
    sync or async. Empty: ``reward_fn``, else the task's own reward (docs/data.md)."""

    reward_weights: list[float] = field(default_factory=list)
    """Weight of each of ``reward_funcs`` in the total reward; empty means 1.0 each."""

    reward_workers: int = 1
    """Threads scoring rewards off the trainer's main loop. >= 1."""

    max_engine_restarts: int = 3
    """A dead embedded engine is restarted at most this many times within any 10 minutes; one that dies more
    often (it fails the same way every time: a bad device, a bad setting) is given up: the run goes on with the
    other engines, or, with none left, stops at the step boundary like for a lost engine (checkpoint of the last
    completed step when checkpoints are on), the engine's own error in the log. 0: never restart. >= 0."""


@dataclass
class WeightSync:
    """``[weight_sync]``: how trained weights reach the engines."""

    async_weight_update: Bool = False
    """false: after each optimizer step the trainer blocks until every engine holds the new weights.
    true: the weights are snapshotted into a staging buffer and pushed by a background thread while the
    trainer goes on; the trainer never waits on an engine."""

    timeout_seconds: float = 60.0
    """An engine that has not applied a push this many seconds after it was sent is marked lagging, keeps
    serving its old version, and gets a full resync when it answers again. > 0."""

    bucket_size_mb: float = 64.0
    """Weights are flattened into buckets of about this size for transfer. > 0."""

    interval: int | Literal["auto"] = 1
    """Push every N optimizer steps: an integer >= 1 and <= ``adaptive_async.max_version_gap + 1`` (a larger one
    could never produce rollouts fresh enough to train on), or "auto": start at 1 and tune the interval so that
    the trainer's time lost to weight sync stays under ``overhead_target`` (``torchtitan_flux/sync_cadence.py``;
    logged as ``sync_interval``, ``sync_overhead``). In async mode, generation runs at most
    ``max_version_gap - (interval - 1)`` steps ahead, so that rollouts from weights up to ``interval - 1`` steps
    old still fit in the gap."""

    method: Literal["full", "delta"] = "full"
    """"full" sends all weights; "delta" sends only tensors that changed since the last push."""

    master_addr: str = "127.0.0.1"
    """Address the trainer's weight-sync rendezvous (a TCPStore) listens on, and engines connect to. Loopback by
    default; any other address needs the shared token (``auth_token_env``)."""

    master_port: int = 0
    """Port of the weight-sync rendezvous; 0 picks a free port. 0..65535."""

    auth_token_env: str = TOKEN_ENV
    """Name of the environment variable holding the shared token (the token itself never goes in a config file, log,
    metric or checkpoint). When it is set, every HTTP request to a rollout server carries ``Authorization: Bearer
    <token>``, every weight-sync group is preceded by a mutual HMAC proof of the token (engines without it are
    refused), and servers started by ``rollout.launch`` refuse requests without it. It must be set when
    ``master_addr`` or a ``rollout.urls`` host is not a loopback address. Servers take the token from
    ``TORCHTITAN_FLUX_TOKEN`` whatever this field names. See "Security" in the README."""

    wire_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype of the weights on the wire and in the staging buffer (parameters are cast while snapshotting).
    "auto": the dtype the engines declare (none do yet), else the parameters' own dtype."""

    probe_every: int = 10
    """Post-sync logprob probe: every N steps (and after the last), once the engines hold the step's weights, each
    engine scores a fixed probe sequence and the trainer compares those logprobs with its own
    (``torchtitan_flux/probe.py``); a difference above ``probe_tolerance`` stops the run naming the engine, the
    version and the worst token. Catches wrong names or layouts, dropped tensors, untied heads, wrong dtypes. A
    probe step waits for its push (async runs included). 0 disables. >= 0."""

    probe_tolerance: float = 0.1
    """Largest allowed |engine - trainer| logprob at any probe token. fp32 engines agree to ~1e-5; bf16 ones to a
    few 1e-2. > 0."""

    overhead_target: float = 0.10
    """With ``interval = "auto"``: the largest share of the training step's compute time that weight sync may cost
    the trainer (blocking mode: the wait for the push; async mode: the snapshot plus the rollout wait the push can
    explain, at most its duration). The interval rises when the measured overhead is above it and falls, one step
    at a time, when it is below half of it. In (0, 1)."""

    max_interval: int = 16
    """With ``interval = "auto"``: the interval never goes above this, nor above ``adaptive_async.max_version_gap
    + 1``. >= 1."""

    verify_every: int = 10
    """Engines that checksum what they receive (vLLM through our gloo extension, CPU) hash every N-th push and
    always the final one, which ``summary.json`` compares with the trainer's weights (a hash costs a copy and a
    sha256 of the whole model: sampling keeps it off most pushes). Embedded engines hash only when asked (the
    summary); vLLM's NCCL path (GPU) and SGLang keep no hash: the logprob probe (``probe_every``) verifies them.
    0: never hash. >= 0."""


@dataclass
class PhaseSpec:
    """One phase of ``adaptive_async.phase_schedule``."""

    steps: int = 0
    """Length of the phase in steps (ignored for "main", which lasts between warmup and cooldown). >= 0."""

    target_staleness: float = -1.0
    """Target staleness during the phase; negative means ``adaptive_async.target_staleness``."""


@dataclass
class PhaseSchedule:
    """``[adaptive_async.phase_schedule]``: warmup, main and cooldown phases."""

    warmup: PhaseSpec = field(default_factory=PhaseSpec)
    """Warmup phase: the first ``warmup.steps`` steps."""

    main: PhaseSpec = field(default_factory=PhaseSpec)
    """Main phase: between warmup and cooldown."""

    cooldown: PhaseSpec = field(default_factory=PhaseSpec)
    """Cooldown phase: the last ``cooldown.steps`` steps of ``training.steps``."""


@dataclass
class AdaptiveAsync:
    """``[adaptive_async]``: the controller that sets how asynchronous the run is."""

    enabled: Bool = False
    """Turn the controller on. When off, ``weight_sync.async_weight_update`` alone decides (ratio 0 or 1)."""

    target_staleness: float = 0.15
    """Staleness (in [0, 1]) the controller steers to. In [0, 1]."""

    min_async_ratio: float = 0.0
    """Lower bound of async_ratio. In [0, 1], <= max_async_ratio."""

    max_async_ratio: float = 1.0
    """Upper bound of async_ratio. In [0, 1], >= min_async_ratio."""

    initial_async_ratio: float = 0.5
    """async_ratio at step 1. Within the bounds."""

    kp: float = 3.0
    """Proportional gain, in async-ratio per unit of staleness error. >= 0. (The tutorial's 0.1 / 0.01 / 0.05 are
    in other units: with ours they take ~380 steps to settle on the simulated plant; 3.0 / 0.3 / 1.5 keep its
    10:1:5 proportions and settle in < 30.)"""

    ki: float = 0.3
    """Integral gain (per step). >= 0."""

    kd: float = 1.5
    """Derivative gain, on the measurement (not the error), so target changes cause no kick. >= 0."""

    integral_band: float = 0.1
    """Integral separation: the integral accumulates only while |target - smoothed staleness| <= this, so a
    transient far from target (the staleness spike of a fast learning phase) does not wind it away from the
    operating point it has learned; P and D act on it alone. 1.0 always integrates (a plain PID). In (0, 1].
    Keep it wider than the P-only offset (the error at which ``kp * error`` alone would hold the ratio), or the
    integral never engages and the loop settles off target. Default calibrated on the debug config: in-band
    fraction 0.77 -> 0.81 and throughput up (docs/benchmarks.md)."""

    ema_alpha: float = 0.2
    """EMA weight of the newest staleness sample. In (0, 1]."""

    max_version_gap: int = 0
    """No sample older than this many policy versions is trained on, and generation may run at most this many
    steps ahead of training (``async_ratio * max_version_gap``). Applies to fixed async mode
    (``weight_sync.async_weight_update = true`` runs at async_ratio 1) as well as to the controller. >= 1, or 0
    (the default): 1 in fixed async mode, ``CONTROLLER_DEFAULT_GAP`` (3) with ``enabled``, the smallest gap at
    which the default ``target_staleness`` (0.15) is reachable (with gap 1 staleness saturated at ~0.06)."""

    sync_threshold: float = 0.5
    """When smoothed staleness exceeds this, the next step is forced synchronous. In (0, 1]."""

    kl_weight: float = 0.4
    """Weight of min(1, KL / kl_norm) in staleness. >= 0 (weights must sum to a positive number)."""

    iw_var_weight: float = 0.3
    """Weight of min(1, importance-weight variance / iw_var_norm) in staleness. >= 0."""

    version_gap_weight: float = 0.3
    """Weight of min(1, mean version gap / version_gap_norm) in staleness. >= 0."""

    kl_norm: float = 0.1
    """KL at which the KL term saturates. > 0."""

    iw_var_norm: float = 2.0
    """Importance-weight variance at which that term saturates. > 0."""

    version_gap_norm: float = 5.0
    """Version gap at which that term saturates. > 0."""

    controller: str = "pid"
    """"pid", or "package.module:Class" naming a subclass of ``torchtitan_flux.controller.BaseAsyncController``."""

    phase_schedule: PhaseSchedule = field(default_factory=PhaseSchedule)
    """Per-phase targets: ``[adaptive_async.phase_schedule.warmup]`` etc."""


@dataclass
class Eval:
    """``[eval]``: held-out evaluation through the rollout engines (docs/data.md)."""

    every_steps: int = 0
    """Evaluate the policy after every N-th training step; 0 disables. >= 0."""

    at_start: Bool = False
    """Also evaluate the initial policy (version 0) before the first step."""

    dataset_path: str = ""
    """Held-out dataset (same formats as ``rollout.dataset_path``); empty: ``rollout.dataset_path``'s ``split``.
    Generated tasks (digits, arithmetic) draw their own held-out prompts."""

    split: str = "test"
    """Split of the held-out dataset (a folder or a saved ``DatasetDict``)."""

    num_prompts: int = 0
    """Prompts evaluated: the first N records of the held-out set; 0 means all of a dataset (64 of a generated
    task). >= 0."""

    n: int = 1
    """Completions per prompt. With n > 1, pass@n is logged too. >= 1."""

    temperature: float = 0.0
    """Sampling temperature of evaluation; 0 is greedy. >= 0."""

    pass_threshold: float = 1.0
    """A completion passes when its total reward is >= this (for pass@k)."""


@dataclass
class Metrics:
    """``[metrics]`` fields added to torchtitan's own section."""

    log_completions_every: int = 0
    """Every N steps, write a table of the step's completions (prompt, completion, rewards, version) to
    ``<dump_folder>/completions.jsonl`` and to W&B (``enable_wandb``); 0 disables. >= 0."""

    step_callbacks: list[str] = field(default_factory=list)
    """Functions called on rank 0 after every training step, as ``"package.module:function"`` (imported at start;
    what ``trainer.add_step_callback`` registers in code). Either signature: ``fn(result)`` with ``result.step`` and
    ``result.metrics``, or ``fn(step, metrics)``; ``metrics`` is the step's ``metrics.jsonl`` row as a dict."""


@dataclass
class Checkpoint:
    """``[checkpoint]`` fields added to torchtitan's own section."""

    on_config_mismatch: Literal["error", "warn"] = "error"
    """What a resume does when a setting that shapes the run (the model folder's config.json and tokenizer.json,
    optimizer.name, rollout.prompts_per_step, grpo.group_size, rollout.task, the dataset's records, rollout.seed)
    differs from the one the checkpoint was written with (``fingerprint.json`` in its step folder): "error" refuses
    to start, naming the field; "warn" logs it and resumes anyway (the rollouts an async checkpoint holds for
    later steps are then generated afresh)."""


@dataclass
class JobConfig:
    """The sections merged into torchtitan's JobConfig."""

    grpo: Grpo = field(default_factory=Grpo)
    rollout: Rollout = field(default_factory=Rollout)
    weight_sync: WeightSync = field(default_factory=WeightSync)
    adaptive_async: AdaptiveAsync = field(default_factory=AdaptiveAsync)
    eval: Eval = field(default_factory=Eval)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)


SECTIONS = {"grpo": Grpo, "rollout": Rollout, "weight_sync": WeightSync, "adaptive_async": AdaptiveAsync,
            "eval": Eval}
# fields merged into torchtitan's own sections (their booleans are its)
ADDED_TO_TORCHTITAN = {"metrics": Metrics, "checkpoint": Checkpoint}


# ----------------------------------------------------------------------------------------------- validation


def _allowed(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_allowed(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _check_port_free(host: str, port: int) -> None:
    """The weight-sync rendezvous must be able to listen on host:port (checked by binding once, before any engine
    starts; the trainer binds it again moments later)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, port))
    except OSError as e:
        raise ConfigError(
            f"weight_sync.master_port = {port}: cannot listen on {host}:{port} ({e.strerror or e}); allowed: a free "
            "port, or 0 to pick one"
        ) from None


def _check_type(name: str, value: Any, tp: Any) -> None:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                _check_type(name, value, option)
                return
            except ConfigError:
                pass
        raise ConfigError(f"{name} = {value!r} is not allowed; allowed: {_allowed(tp)}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{name} = {value!r} is not allowed; allowed values: {_allowed(tp)}")
        return
    if origin is list:
        (item,) = typing.get_args(tp)
        items = (int, float) if item is float else item  # TOML writes 1 for 1.0
        if not isinstance(value, list) or not all(isinstance(v, items) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{name} must be a list of {item.__name__}, got {value!r}")
        return
    if dataclasses.is_dataclass(tp):
        if not dataclasses.is_dataclass(value):
            raise ConfigError(f"{name} must be a table with fields {[f.name for f in dataclasses.fields(tp)]}")
        _check_dataclass(name, value)
        return
    ok = (
        isinstance(value, bool)
        if tp is bool
        else isinstance(value, tp) and not isinstance(value, bool)
        if tp is int
        else isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if tp is float
        else isinstance(value, tp)
    )
    if not ok:
        if tp is float and isinstance(value, float):
            raise ConfigError(f"{name} = {value!r} is out of range; allowed: a finite number")
        raise ConfigError(f"{name} must be of type {tp.__name__}, got {type(value).__name__} {value!r}")


def _check_dataclass(prefix: str, obj: Any) -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        _check_type(f"{prefix}.{f.name}", getattr(obj, f.name), hints[f.name])


def _require(cond: bool, name: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"{name} = {value!r} is out of range; allowed: {allowed}")


_HOST_NAME = re.compile(r"(?!-)[\w-]{1,63}(?<!-)(\.(?!-)[\w-]{1,63}(?<!-))*", re.ASCII)  # DNS labels (and Docker's _)


def _check_url(name: str, url: str) -> None:
    """A server URL is ``http(s)://host[:port]`` with ``host`` an IP address or a DNS name (a dotted-number host
    must be a valid IPv4 address: ``999.1.1.1`` would otherwise be looked up as a name and fail only later)."""
    why = _url_problem(url)
    if why:
        raise ConfigError(f"{name} = {url!r} is not a server URL ({why}); allowed: http(s)://host:port with host an "
                          "IP address or a host name, e.g. 'http://127.0.0.1:8000'")


def _url_problem(url: str) -> str | None:
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # ValueError for a port out of range or not a number
    except ValueError as e:
        return str(e)
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https"):
        return f"scheme {parts.scheme!r}" if parts.scheme else "no scheme"
    if not host:
        return "no host"
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    if re.fullmatch(r"[\d.]+", host) or not _HOST_NAME.fullmatch(host):
        return f"host {host!r} is not an IP address or a host name"
    return None


@dataclass(frozen=True)
class StepResult:
    """What a one-argument step callback gets: the step and its metrics (the ``metrics.jsonl`` row)."""

    step: int
    metrics: dict[str, Any]


def step_callback(fn: Any, name: str = "the step callback") -> Any:
    """``fn`` as ``callback(step, metrics)``: a function of two positional arguments as it is, one of one
    (``fn(result)``, the tutorial's form) given a ``StepResult``; ``ConfigError`` naming ``name`` for any other."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (some builtins): take the two-argument form
        return fn
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if any(p.kind == p.VAR_POSITIONAL for p in params) or len(required) <= 2 <= len(positional):
        return fn
    if len(required) <= 1 <= len(positional):
        return lambda step, metrics: fn(StepResult(step, metrics))
    raise ConfigError(f"{name} takes {len(required)} required arguments; allowed: fn(result) or fn(step, metrics)")


def import_spec(name: str, spec: str, callable_: bool = True) -> Any:
    """The one importer of ``"package.module:attribute"`` strings (``attribute`` may be dotted): the object, or a
    ``ConfigError`` naming the field ``name``. Used for rewards, tasks, custom controllers and step callbacks."""
    mod, sep, attr = spec.partition(":")
    if not sep or not mod or not attr:
        raise ConfigError(f"{name} = {spec!r} must be of the form 'package.module:attribute'")
    try:
        obj = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{name} = {spec!r} cannot be imported: {e}") from e
    if callable_ and not callable(obj):
        raise ConfigError(f"{name} = {spec!r} is not callable")
    return obj


def resolve_launch_python(path: str) -> str | None:
    """``rollout.launch_python`` as an existing absolute path: as given (absolute, or relative to the current
    directory), else relative to the directory this package is imported from (the repository root of a source
    checkout, where ``scripts/setup_vllm.sh`` puts ``.venv-vllm``); None when neither exists."""
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for cand in (path, os.path.join(package_parent, path)):
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return os.path.abspath(cand)
    return None


def _validate_torchtitan_fields(job_config: Any) -> None:
    """The torchtitan fields a bad value of which would otherwise fail late (a bare assert, a NaN loss) or be
    silently accepted (``steps 0``)."""
    tr, ck, opt = job_config.training, job_config.checkpoint, job_config.optimizer
    _require(tr.steps >= 1, "training.steps", tr.steps, "an integer >= 1")
    _require(tr.local_batch_size >= 1, "training.local_batch_size", tr.local_batch_size, "an integer >= 1")
    _require(tr.seq_len >= 1, "training.seq_len", tr.seq_len, "an integer >= 1")
    mismatch = typing.get_type_hints(Checkpoint)["on_config_mismatch"]
    _check_type("checkpoint.on_config_mismatch", ck.on_config_mismatch, mismatch)
    if ck.enable:
        _require(ck.interval >= 1, "checkpoint.interval", ck.interval, "an integer >= 1")
    # Adam / AdamW (torchtitan's only optimizers) move every weight by about lr per step whatever the gradient's
    # scale: lr 1 already overwrites a model in one step (GRPO fine-tuning uses ~1e-7 .. 1e-5), so beyond 1 is a typo
    _require(math.isfinite(opt.lr) and 0 < opt.lr <= 1, "optimizer.lr", opt.lr,
             "a finite number in (0, 1] (Adam moves each weight by about lr per step)")


CONTROLLER_DEFAULT_GAP = 3  # adaptive_async.max_version_gap's default with the controller (see its docstring)


def staleness_out_of_reach(a: "AdaptiveAsync") -> str | None:
    """A warning when the version-gap term alone cannot bring staleness to ``target_staleness`` (the gap is at
    most ``max_version_gap``): the KL and importance-weight terms then have to, and on a slowly moving policy they
    stay near 0, so staleness saturates below the target and the ratio sits at its maximum (measured with the
    defaults, max_version_gap 1: staleness ~0.06 against 0.15, 0.16 of steps in band)."""
    total = a.kl_weight + a.iw_var_weight + a.version_gap_weight
    reach = a.version_gap_weight / total * min(1.0, a.max_version_gap / a.version_gap_norm) if total > 0 else 0.0
    if reach >= a.target_staleness:
        return None
    need = next((g for g in range(1, 65)
                 if a.version_gap_weight / total * min(1.0, g / a.version_gap_norm) >= a.target_staleness), None)
    fix = f"raise adaptive_async.max_version_gap to {need}" if need else "lower adaptive_async.target_staleness"
    return (f"adaptive_async.target_staleness = {a.target_staleness} may be out of reach: with max_version_gap = "
            f"{a.max_version_gap} the version-gap term of staleness is at most {reach:.3f}, so the target is reached "
            f"only if the KL / importance-weight terms make up the rest; {fix} (or lower the target to {reach:.2f})")


def validate_config(job_config: Any) -> None:
    """Raise ``ConfigError`` for the first bad value of our sections (and of the torchtitan fields we use).
    Resolves ``adaptive_async.max_version_gap = 0`` (its default) in place, so everything after sees the gap."""
    for sec in SECTIONS:
        _check_dataclass(sec, getattr(job_config, sec))
    g, r, w, a = job_config.grpo, job_config.rollout, job_config.weight_sync, job_config.adaptive_async
    if a.max_version_gap == 0:
        a.max_version_gap = CONTROLLER_DEFAULT_GAP if a.enabled else 1
    _require(a.max_version_gap >= 1, "adaptive_async.max_version_gap", a.max_version_gap,
             "an integer >= 1, or 0 for the default (1; 3 with adaptive_async.enabled)")

    _require(g.group_size >= 2, "grpo.group_size", g.group_size, "an integer >= 2")
    _require(0 < g.clip_low < 1, "grpo.clip_low", g.clip_low, "0 < clip_low < 1")
    _require(g.clip_high > 0, "grpo.clip_high", g.clip_high, "> 0")
    _require(g.kl_coef >= 0, "grpo.kl_coef", g.kl_coef, ">= 0")
    _require(g.temperature > 0, "grpo.temperature", g.temperature, "> 0")
    _require(g.tis_cap >= 0, "grpo.tis_cap", g.tis_cap, ">= 0 (0 disables)")
    _require(g.staleness_discount >= 0, "grpo.staleness_discount", g.staleness_discount, ">= 0")

    _require(r.num_engines >= 1, "rollout.num_engines", r.num_engines, "an integer >= 1")
    _require(r.prompts_per_step >= 1, "rollout.prompts_per_step", r.prompts_per_step, "an integer >= 1")
    _require(r.max_new_tokens >= 1, "rollout.max_new_tokens", r.max_new_tokens, "an integer >= 1")
    _require(r.top_k >= 0, "rollout.top_k", r.top_k, ">= 0")
    _require(r.engine_threads >= 1, "rollout.engine_threads", r.engine_threads, ">= 1")
    if not (r.engine_device in ("auto", "cpu") or re.fullmatch(r"cuda:\d+", r.engine_device)):
        raise ConfigError(f"rollout.engine_device = {r.engine_device!r}; allowed: 'auto' | 'cpu' | 'cuda:N'")
    _check_data(job_config)
    _require(0 <= r.dispatch_dead_zone < 1, "rollout.dispatch_dead_zone", r.dispatch_dead_zone, "a number in [0, 1)")
    _require(0 < r.dispatch_max_share <= 1, "rollout.dispatch_max_share", r.dispatch_max_share, "a number in (0, 1]")
    _require(r.launch_timeout_s > 0, "rollout.launch_timeout_s", r.launch_timeout_s, "> 0")
    if r.launch:
        if r.engine != "vllm":
            raise ConfigError(f"rollout.launch = true needs rollout.engine = 'vllm', got {r.engine!r}")
        if r.urls:
            raise ConfigError(
                f"rollout.urls = {r.urls!r} must be empty when rollout.launch = true (the trainer starts the servers)"
            )
        if resolve_launch_python(r.launch_python) is None:
            raise ConfigError(
                f"rollout.launch_python = {r.launch_python!r} does not exist; rollout.launch = true needs a Python "
                "with vLLM installed (run scripts/setup_vllm.sh to create .venv-vllm)"
            )
    elif r.engine in ("vllm", "sglang") and not r.urls:
        raise ConfigError(
            f"rollout.urls is empty; engine = {r.engine!r} needs at least one server URL"
            + (" (or rollout.launch = true to start local servers)" if r.engine == "vllm" else "")
        )

    for url in r.urls:
        _check_url("rollout.urls", url)

    _require(w.timeout_seconds > 0, "weight_sync.timeout_seconds", w.timeout_seconds, "> 0")
    _require(w.bucket_size_mb > 0, "weight_sync.bucket_size_mb", w.bucket_size_mb, "> 0")
    if w.interval != "auto":
        _require(w.interval >= 1, "weight_sync.interval", w.interval, 'an integer >= 1, or "auto"')
        _require(w.interval <= a.max_version_gap + 1, "weight_sync.interval", w.interval,
                 f"at most adaptive_async.max_version_gap + 1 = {a.max_version_gap + 1} (rollouts from weights "
                 f"interval - 1 steps old must fit in the gap), or \"auto\"")
    _require(0 < w.overhead_target < 1, "weight_sync.overhead_target", w.overhead_target, "a number in (0, 1)")
    _require(w.max_interval >= 1, "weight_sync.max_interval", w.max_interval, "an integer >= 1")
    _require(w.verify_every >= 0, "weight_sync.verify_every", w.verify_every, "an integer >= 0 (0 disables)")
    _require(w.probe_every >= 0, "weight_sync.probe_every", w.probe_every, "an integer >= 0 (0 disables)")
    _require(w.probe_tolerance > 0, "weight_sync.probe_tolerance", w.probe_tolerance, "> 0")
    _require(0 <= w.master_port <= 65535, "weight_sync.master_port", w.master_port, "0..65535")
    if w.master_port and os.environ.get("RANK", "0") == "0":  # rank 0 hosts it (later ranks would find it taken)
        _check_port_free(w.master_addr, w.master_port)
    _require(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", w.auth_token_env) is not None, "weight_sync.auth_token_env",
             w.auth_token_env, "the name of an environment variable, e.g. 'TORCHTITAN_FLUX_TOKEN'")
    remote = [("weight_sync.master_addr", w.master_addr)] if not is_loopback(w.master_addr) else []
    remote += [("rollout.urls", u) for u in r.urls if not is_loopback(urllib.parse.urlsplit(u).hostname or "")]
    if remote and read_token(w.auth_token_env) is None:
        name, value = remote[0]
        raise ConfigError(
            f"{name} = {value!r} is not a loopback address, so it needs the shared token: set the environment "
            f"variable {w.auth_token_env} (named by weight_sync.auth_token_env; servers read TORCHTITAN_FLUX_TOKEN). "
            "Allowed without it: loopback addresses (127.0.0.0/8, ::1, localhost). See \"Security\" in the README."
        )

    for f in ("target_staleness", "min_async_ratio", "max_async_ratio", "initial_async_ratio"):
        v = getattr(a, f)
        _require(0 <= v <= 1, f"adaptive_async.{f}", v, "a number in [0, 1]")
    if a.min_async_ratio > a.max_async_ratio:
        raise ConfigError(
            f"adaptive_async.min_async_ratio = {a.min_async_ratio} exceeds adaptive_async.max_async_ratio = "
            f"{a.max_async_ratio}; need min_async_ratio <= max_async_ratio"
        )
    _require(
        a.min_async_ratio <= a.initial_async_ratio <= a.max_async_ratio,
        "adaptive_async.initial_async_ratio",
        a.initial_async_ratio,
        f"within [min_async_ratio, max_async_ratio] = [{a.min_async_ratio}, {a.max_async_ratio}]",
    )
    for f in ("kp", "ki", "kd", "kl_weight", "iw_var_weight", "version_gap_weight"):
        _require(getattr(a, f) >= 0, f"adaptive_async.{f}", getattr(a, f), ">= 0")
    if a.kl_weight + a.iw_var_weight + a.version_gap_weight <= 0:
        raise ConfigError("adaptive_async.kl_weight + iw_var_weight + version_gap_weight must be > 0")
    for f in ("kl_norm", "iw_var_norm", "version_gap_norm"):
        _require(getattr(a, f) > 0, f"adaptive_async.{f}", getattr(a, f), "> 0")
    _require(0 < a.ema_alpha <= 1, "adaptive_async.ema_alpha", a.ema_alpha, "0 < ema_alpha <= 1")
    _require(0 < a.integral_band <= 1, "adaptive_async.integral_band", a.integral_band, "a number in (0, 1]")
    _require(0 < a.sync_threshold <= 1, "adaptive_async.sync_threshold", a.sync_threshold, "0 < x <= 1")
    _validate_torchtitan_fields(job_config)
    if a.enabled and (hint := staleness_out_of_reach(a)):
        logging.getLogger("torchtitan_flux").warning(hint)
    for ph in ("warmup", "main", "cooldown"):
        spec = getattr(a.phase_schedule, ph)
        _require(spec.steps >= 0, f"adaptive_async.phase_schedule.{ph}.steps", spec.steps, ">= 0")
        _require(spec.target_staleness <= 1, f"adaptive_async.phase_schedule.{ph}.target_staleness", spec.target_staleness,
                 "<= 1 (negative = use adaptive_async.target_staleness)")
    if a.controller != "pid":
        import_spec("adaptive_async.controller", a.controller)
    _check_model_folder(job_config)


def _check_model_folder(job_config: Any) -> None:
    """``model.hf_assets_path`` has a tokenizer and a readable config.json whose ``max_position_embeddings`` holds the
    longest sequence a rollout makes (a prompt of ``max_prompt_tokens`` plus ``max_new_tokens``)."""
    from torchtitan_flux import hf as hf_folder
    from torchtitan_flux.tasks import max_prompt_tokens

    hf, r = job_config.model.hf_assets_path, job_config.rollout
    for fname in ("tokenizer.json", "config.json"):
        if not os.path.isfile(os.path.join(hf, fname)):
            raise ConfigError(
                f"model.hf_assets_path = {hf!r} has no {fname}; point it at a HF model folder "
                "(build the tiny one with `python scripts/build_tiny_model.py`)"
            )
    try:
        max_pos = hf_folder.read_config(hf).get("max_position_embeddings")
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.hf_assets_path = {hf!r}: {e}") from None
    prompt = max_prompt_tokens(job_config)
    if isinstance(max_pos, int) and prompt + r.max_new_tokens > max_pos:
        budget = r.max_prompt_tokens or f"auto: training.seq_len - max_new_tokens = {prompt}"
        raise ConfigError(
            f"rollout.max_prompt_tokens ({budget}) + rollout.max_new_tokens ({r.max_new_tokens}) = "
            f"{prompt + r.max_new_tokens} tokens exceeds max_position_embeddings = {max_pos} of "
            f"{os.path.join(hf, 'config.json')}; allowed: at most {max_pos} (lower training.seq_len, "
            "rollout.max_prompt_tokens or rollout.max_new_tokens)"
        )
    if r.launch:
        from torchtitan_flux.engine.vllm_launch import unservable_reason

        if why := unservable_reason(hf):
            raise ConfigError(f"rollout.launch = true cannot serve model.hf_assets_path = {hf!r} here: {why}; "
                              "use a GPU, or a model with a supported head_dim (rollout.engine = 'embedded' serves any)")


def _check_data(job_config: Any) -> None:
    """Task, dataset, prompt length, rewards, ``[eval]`` and our ``[metrics]`` fields (docs/data.md)."""
    from torchtitan_flux import tasks

    r, ev = job_config.rollout, job_config.eval
    try:
        tasks.task_factory(r.task)
    except ValueError as e:
        raise ConfigError(str(e).replace("is not allowed", "is out of range")) from None
    if r.task in tasks.ALIASES:
        logging.getLogger("torchtitan_flux").warning(
            f"rollout.task = {r.task!r} is deprecated; use {tasks.ALIASES[r.task]!r} (same behaviour)")
    if tasks.ALIASES.get(r.task, r.task) in tasks.DATASET_TASKS and not os.path.exists(r.dataset_path):
        raise ConfigError(f"rollout.dataset_path = {r.dataset_path!r} does not exist; task {r.task!r} needs a dataset "
                          "file or folder")
    _require(r.max_prompt_tokens >= 0, "rollout.max_prompt_tokens", r.max_prompt_tokens, ">= 0 (0 = seq_len - max_new_tokens)")
    seq_len = job_config.training.seq_len
    if tasks.max_prompt_tokens(job_config) < 1 or tasks.max_prompt_tokens(job_config) + r.max_new_tokens > seq_len:
        raise ConfigError(
            f"rollout.max_prompt_tokens ({r.max_prompt_tokens or 'auto'}) + rollout.max_new_tokens ({r.max_new_tokens}) "
            f"must fit in training.seq_len = {seq_len} with room for a prompt; lower them or raise training.seq_len"
        )
    for spec in r.reward_funcs:
        if spec not in tasks.BUILTIN_REWARDS:
            import_spec("rollout.reward_funcs", spec)
    if "math_verify" in r.reward_funcs and importlib.util.find_spec("math_verify") is None:
        raise ConfigError("rollout.reward_funcs names 'math_verify', which needs `pip install math-verify`")
    if r.reward_weights and len(r.reward_weights) != len(r.reward_funcs):
        raise ConfigError(f"rollout.reward_weights has {len(r.reward_weights)} entries for {len(r.reward_funcs)} "
                          "rollout.reward_funcs; allowed: one weight per function, or none (all 1.0)")
    if r.reward_fn:
        import_spec("rollout.reward_fn", r.reward_fn)
    _require(r.reward_workers >= 1, "rollout.reward_workers", r.reward_workers, "an integer >= 1")
    _require(r.max_engine_restarts >= 0, "rollout.max_engine_restarts", r.max_engine_restarts, "an integer >= 0")
    _require(ev.every_steps >= 0, "eval.every_steps", ev.every_steps, ">= 0 (0 disables)")
    _require(ev.n >= 1, "eval.n", ev.n, "an integer >= 1")
    _require(ev.num_prompts >= 0, "eval.num_prompts", ev.num_prompts, ">= 0 (0 = all)")
    _require(ev.temperature >= 0, "eval.temperature", ev.temperature, ">= 0 (0 = greedy)")
    if ev.dataset_path and not os.path.exists(ev.dataset_path):
        raise ConfigError(f"eval.dataset_path = {ev.dataset_path!r} does not exist")
    n = job_config.metrics.log_completions_every
    _require(n >= 0, "metrics.log_completions_every", n, ">= 0 (0 disables)")
    _check_type("metrics.step_callbacks", job_config.metrics.step_callbacks, list[str])
    for spec in job_config.metrics.step_callbacks:
        step_callback(import_spec("metrics.step_callbacks", spec), f"metrics.step_callbacks = {spec!r}")
