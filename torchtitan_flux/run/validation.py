"""``validate_config``: types, ranges (declared on the fields, ``Range``) and cross-field rules of our config
sections and of the torchtitan fields we rely on; the first bad value raises ``ConfigError`` naming the field and
what is allowed. Runs in the entry point (one ``error:`` line, exit 2) and on every rank before any engine starts;
never writes into the config. User code the config names is imported here, so a bad name is a validation error.
"""

import dataclasses
import importlib
import importlib.util
import ipaddress
import logging
import math
import os
import re
import socket
import types
import typing
import urllib.parse
from typing import Any, Literal

import torch

from torchtitan_flux.config import ADDED_TO_TORCHTITAN, SECTIONS, AdaptiveAsync
from torchtitan_flux.engine.kinds import engine_kind, kind_names
from torchtitan_flux.engine.vllm_launch import resolve_launch_python
from torchtitan_flux.errors import ConfigError
from torchtitan_flux.auth import is_loopback, read_token
from torchtitan_flux.ranges import field_ranges
from torchtitan_flux.user_code import import_spec, step_callback
from torchtitan_flux.wire import cuda_rules

logger = logging.getLogger("torchtitan_flux")


def _allowed(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_allowed(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _check_port_free(host: str, port: int) -> None:
    """The weight-sync rendezvous must be able to listen on host:port (bound once here, before any engine starts)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, port))
    except OSError as e:
        raise ConfigError(f"weight_sync.master_port = {port}: cannot listen on {host}:{port} ({e.strerror or e}); "
                          "allowed: a free port, or 0 to pick one") from None


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
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{name} = {value!r} is not allowed; allowed: unset")
        return
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


def _check_dataclass(prefix: str, obj: Any, cls: type | None = None) -> None:
    """Every field of ``cls`` (default: ``obj``'s class) on ``obj``."""
    hints = typing.get_type_hints(cls or type(obj))
    for f in dataclasses.fields(cls or obj):
        _check_type(f"{prefix}.{f.name}", getattr(obj, f.name), hints[f.name])


def _require(cond: bool, name: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"{name} = {value!r} is out of range; allowed: {allowed}")


def _check_ranges(prefix: str, cls: type, obj: Any) -> None:
    """Every field of ``cls`` (a config.py section) that declares a ``Range``, nested tables included."""
    for name, (rng, allowed) in field_ranges(cls).items():
        value = getattr(obj, name)
        _require(value is None or rng.contains(value), f"{prefix}.{name}", value, allowed)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type):
            _check_ranges(f"{prefix}.{f.name}", f.type, getattr(obj, f.name))


_HOST_NAME = re.compile(r"(?!-)[\w-]{1,63}(?<!-)(\.(?!-)[\w-]{1,63}(?<!-))*", re.ASCII)  # DNS labels (and Docker's _)


def _check_url(name: str, url: str) -> None:
    """A server URL is ``http(s)://host[:port]``, ``host`` an IP address or a DNS name (never ``999.1.1.1``)."""
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


def _validate_torchtitan_fields(job_config: Any) -> None:
    """The torchtitan fields whose bad values would fail late (a bare assert, a NaN loss) or pass silently."""
    tr, ck, opt = job_config.training, job_config.checkpoint, job_config.optimizer
    for name in ("steps", "local_batch_size", "seq_len"):  # the front end leaves them to us (config_file.py)
        _check_type(f"training.{name}", getattr(tr, name), int)
    for name in ("steps", "local_batch_size", "seq_len"):
        _require(getattr(tr, name) >= 1, f"training.{name}", getattr(tr, name), "an integer >= 1")
    gap = job_config.off_policy.max_version_gap  # each embedded engine keeps max_version_gap + 1 weight copies
    _require(gap <= max(1, tr.steps), "off_policy.max_version_gap", gap,
             f"at most training.steps = {tr.steps} (each embedded engine keeps max_version_gap + 1 copies of the "
             "weights)")
    seed = job_config.debug.seed
    _require(seed is None or 0 <= seed < 2**63, "debug.seed", seed, "an integer in [0, 2**63), or unset")
    if ck.enable:
        _require(ck.interval >= 1, "checkpoint.interval", ck.interval, "an integer >= 1")
    if ck.enable:  # torchtitan: a ValueError traceback
        _require(ck.keep_latest_k != 1, "checkpoint.keep_latest_k", ck.keep_latest_k,
                 "0 (keep all) or >= 2 (the newest may still be being written)")
    # Adam moves every weight by about lr per step: beyond 1 is a typo (GRPO fine-tuning uses ~1e-7 .. 1e-5)
    _require(math.isfinite(opt.lr) and 0 < opt.lr <= 1, "optimizer.lr", opt.lr,
             "a finite number in (0, 1] (Adam moves each weight by about lr per step)")
    _require(opt.name in ("Adam", "AdamW"), "optimizer.name", opt.name, "Adam | AdamW (torchtitan's optimizers)")
    _require(math.isfinite(opt.weight_decay) and 0 <= opt.weight_decay <= 1, "optimizer.weight_decay", opt.weight_decay,
             "a finite number in [0, 1] (AdamW shrinks each weight by lr * weight_decay per step)")
    _require(math.isfinite(opt.eps) and 0 < opt.eps < 1, "optimizer.eps", opt.eps, "a finite number in (0, 1)")
    sched = job_config.lr_scheduler
    _require(sched.warmup_steps >= 0, "lr_scheduler.warmup_steps", sched.warmup_steps, "an integer >= 0")
    _require(sched.decay_ratio is None or (math.isfinite(sched.decay_ratio) and 0 <= sched.decay_ratio <= 1),
             "lr_scheduler.decay_ratio", sched.decay_ratio, "unset, or a number in [0, 1]")
    _require(math.isfinite(sched.min_lr_factor) and 0 <= sched.min_lr_factor <= 1, "lr_scheduler.min_lr_factor",
             sched.min_lr_factor, "a number in [0, 1]")
    # clip_grad_norm_ scales the gradient by max_norm / norm: 0 trains nothing, a negative value ascends the loss
    _require(math.isfinite(tr.max_norm) and tr.max_norm > 0, "training.max_norm", tr.max_norm, "a finite number > 0")
    # FSDP2's CPU offload steps the optimizer on the host, which waits on no stream event: the snapshot, which reads
    # parameters on its side stream after the step's event (sync/snapshot.py), could copy them half-updated
    _require(not tr.enable_cpu_offload, "training.enable_cpu_offload", tr.enable_cpu_offload,
             "false (the weight snapshot reads parameters on a side stream; a host optimizer step does not wait on it)")
    _check_parallelism(job_config.parallelism, job_config.hf_assets_path)


def _check_parallelism(p: Any, model_dir: str) -> None:
    """The trainer shards data-parallel only (FSDP, optionally HSDP): every rank trains on its own slice of the
    batch, so a tensor, pipeline, context or expert parallel degree would train on the wrong data."""
    for name in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree",
                 "expert_parallel_degree"):
        _require(getattr(p, name) == 1, f"parallelism.{name}", getattr(p, name),
                 "1 (the trainer is data-parallel only: FSDP, or HSDP with data_parallel_replicate_degree)")
    world, rep = int(os.environ.get("WORLD_SIZE", 1)), p.data_parallel_replicate_degree
    _require(rep >= 1 and world % rep == 0, "parallelism.data_parallel_replicate_degree", rep,
             f"a divisor of the number of trainer processes ({world})")
    shard = p.data_parallel_shard_degree
    _require(shard in (-1, world // rep), "parallelism.data_parallel_shard_degree", shard,
             f"-1 (the rest) or {world // rep} (trainer processes {world} / data_parallel_replicate_degree {rep})")
    if world > 1 and p.spmd_backend == "spmd_types" and _tied(model_dir):
        # measured on torch 2.15 / torchtitan 0.3.0, 2 gloo ranks: the tied weight's update differs from a
        # single-process replica's by more than the learning rate after one Adam step (partial_dtensor: 1e-7), and the
        # trainer's log-probabilities drift from the engines' (tests/unit/test_patches.py::test_spmd_types_tied)
        raise ConfigError(f"parallelism.spmd_backend = 'spmd_types' trains a model with tied embeddings ({model_dir}) "
                          f"wrong over {world} ranks (torchtitan 0.3.0); allowed: 'partial_dtensor' (the default)")


def _tied(model_dir: str) -> bool:
    """Whether the model folder's ``config.json`` ties the output projection to the embedding (False if unreadable:
    the folder's own checks name that)."""
    from torchtitan_flux.models.weight_dict import ModelShape

    try:
        return ModelShape.from_hf_dir(model_dir).tied
    except (OSError, ValueError, KeyError, ConfigError):
        return False


def staleness_out_of_reach(a: "AdaptiveAsync", max_version_gap: int) -> str | None:
    """A warning when the version-gap term alone cannot bring staleness to ``target_staleness``: on a slowly
    moving policy the other terms stay near 0, so staleness saturates below the target; None otherwise."""
    total = a.kl_weight + a.iw_var_weight + a.version_gap_weight
    reach = a.version_gap_weight / total * min(1.0, max_version_gap / a.version_gap_norm) if total > 0 else 0.0
    if reach >= a.target_staleness:
        return None
    need = next((g for g in range(1, 65)
                 if a.version_gap_weight / total * min(1.0, g / a.version_gap_norm) >= a.target_staleness), None)
    fix = f"raise off_policy.max_version_gap to {need}" if need else "lower adaptive_async.target_staleness"
    return (f"adaptive_async.target_staleness = {a.target_staleness} may be out of reach: with max_version_gap = "
            f"{max_version_gap} the version-gap term of staleness is at most {reach:.3f}, so the target is reached "
            f"only if the KL / importance-weight terms make up the rest; {fix} (or lower the target to {reach:.2f})")


def validate_config(job_config: Any) -> None:
    """Raise ``ConfigError`` for the first bad value of our sections (and of the torchtitan fields we use)."""
    o = job_config.off_policy
    for sec, cls in {**SECTIONS, **ADDED_TO_TORCHTITAN}.items():  # torchtitan's other fields: the front end's
        _check_dataclass(sec, getattr(job_config, sec), cls)
    for sec, cls in {**SECTIONS, **ADDED_TO_TORCHTITAN}.items():
        _check_ranges(sec, cls, getattr(job_config, sec))
    r, w, a = job_config.rollout, job_config.weight_sync, job_config.adaptive_async
    _require(not a.enabled or not o.async_ratio, "off_policy.async_ratio", o.async_ratio,
             "unset (the default) or 0 with adaptive_async.enabled = true: the controller sets the ratio")
    _require(o.feedforward or o.max_pipeline_depth == 0, "off_policy.max_pipeline_depth", o.max_pipeline_depth,
             "0 (the default) unless off_policy.feedforward = true: it caps the feedforward's depth")
    by_throughput = a.enabled and a.controller == "throughput"
    _require(not (by_throughput and o.feedforward), "off_policy.feedforward", o.feedforward,
             "false with adaptive_async.controller = \"throughput\": that law holds its own Little's-law depth")
    ws_default = dataclasses.fields(type(w))  # a field that only one method reads must not be set for the other
    ratio_default = next(f.default for f in ws_default if f.name == "sparse_max_bytes_ratio")
    _require(w.method == "sparse" or w.sparse_max_bytes_ratio == ratio_default, "weight_sync.sparse_max_bytes_ratio",
             w.sparse_max_bytes_ratio, f"{ratio_default:g} (the default) unless weight_sync.method = \"sparse\": "
             "dense pushes send every bucket whole")

    prof = job_config.profiler
    _require(not prof.enable_memory_snapshot or torch.cuda.is_available(), "profiling.enable_memory_snapshot",
             prof.enable_memory_snapshot, "false on a machine without CUDA (the snapshot records the CUDA caching "
             "allocator's history; profiling.enable_profiling works on CPU)")
    ck = job_config.checkpoint  # torchtitan's DefaultStager asserts a CUDA device, at the first save
    _require(not ck.enable or ck.async_mode != "async_with_pinned_mem" or torch.cuda.is_available(),
             "checkpoint.async_mode", ck.async_mode, "disabled | async on a machine without CUDA (pinned staging "
             "memory needs CUDA)")
    if prof.enable_profiling:
        _require(prof.profile_freq >= prof.profiler_warmup + prof.profiler_active, "profiling.profile_freq",
                 prof.profile_freq, f">= profiling.profiler_warmup + profiling.profiler_active = "
                 f"{prof.profiler_warmup + prof.profiler_active}")

    _check_data(job_config)
    _check_environment(job_config)
    if r.engine_stall_seconds <= job_config.weight_sync.timeout_seconds:  # a request may wait that long for weights
        raise ConfigError(f"rollout.engine_stall_seconds = {r.engine_stall_seconds:g} is out of range; allowed: more "
                          f"than weight_sync.timeout_seconds = {job_config.weight_sync.timeout_seconds:g}")
    kind = engine_kind(r.engine)
    if r.colocated and (not kind.colocatable or r.engine_devices):
        raise ConfigError(f"rollout.colocated = true puts embedded engines on the trainer's device; it needs "
                          f"rollout.engine = {kind_names(lambda k: k.colocatable)} (got {r.engine!r}) and no "
                          f"rollout.engine_devices (got {list(r.engine_devices)!r})")
    if r.in_flight_weight_updates and not kind.in_flight_updates:
        raise ConfigError(f"rollout.in_flight_weight_updates = true is not supported by rollout.engine = {r.engine!r} "
                          f"(docs/engines.md); allowed: false, or rollout.engine = "
                          f"{kind_names(lambda k: k.in_flight_updates)}")
    for name in ("in_flight_weight_updates", "streaming_admission"):
        if getattr(r, name) and kind.serves_serially(r.continuous_batching):
            raise ConfigError(f"rollout.{name} = true needs rollout.continuous_batching = true on the {r.engine!r} "
                              "engine (it serves one request at a time otherwise); allowed: false without it")
    if r.decode_graphs:
        on_cpu = not torch.cuda.is_available() or "cpu" in r.engine_devices
        why = ("needs rollout.continuous_batching = true (it captures the continuous batcher's step)"
               if not r.continuous_batching else f"is the embedded engine's (rollout.engine = {r.engine!r} captures "
               "its own)" if kind.server else "needs rollout.colocated = true (an engine on a GPU of its own receives "
               "weights over NCCL, and a CUDA graph's capture waits for every NCCL receive pending in its process, "
               "which its receiver always has: docs/gpu.md, rule 16)" if not r.colocated
               else "needs engines on GPUs (CUDA graphs), these run on a CPU" if on_cpu else "")
        if why:
            raise ConfigError(f"rollout.decode_graphs = true {why}; allowed: false (the default)")
    _require(r.streaming_admission or r.streaming_carry_over, "rollout.streaming_carry_over", r.streaming_carry_over,
             "true (the default) unless rollout.streaming_admission = true: only streaming admission reads it")
    from torchtitan_flux.config import Rollout

    _require(r.continuous_batching or r.max_batch_sequences == Rollout.max_batch_sequences,
             "rollout.max_batch_sequences", r.max_batch_sequences, f"{Rollout.max_batch_sequences} (the default) "
             "unless rollout.continuous_batching = true: only continuous batching reads it")
    if r.colocated and w.method == "sparse":
        raise ConfigError("weight_sync.method = 'sparse' patches what travels on a wire, but rollout.colocated = true "
                          "engines copy staging in place (no wire); allowed with colocated: 'dense'")
    if r.launch:
        if not kind.launchable:
            raise ConfigError(f"rollout.launch = true needs rollout.engine = {kind_names(lambda k: k.launchable)}, "
                              f"got {r.engine!r}")
        if r.urls:
            raise ConfigError(f"rollout.urls = {r.urls!r} must be empty when rollout.launch = true (the trainer "
                              "starts the servers)")
        if resolve_launch_python(r.launch_python) is None:
            raise ConfigError(f"rollout.launch_python = {r.launch_python!r} does not exist; rollout.launch = true "
                              "needs a Python with vLLM installed (run scripts/setup_vllm.sh to create .venv-vllm)")
    elif not kind.server and r.urls:  # else silently unused
        raise ConfigError(f"rollout.urls = {r.urls!r} is set, but rollout.engine = {r.engine!r} starts its own "
                          f"engines; allowed: no urls, or rollout.engine = {kind_names(lambda k: k.server)} to use "
                          "those servers")
    elif kind.server and not r.urls:
        raise ConfigError(f"rollout.urls is empty; engine = {r.engine!r} needs at least one server URL"
                          + (" (or rollout.launch = true to start local servers)" if kind.launchable else ""))

    for url in r.urls:
        _check_url("rollout.urls", url)
    repeated = sorted({u for u in r.urls if r.urls.count(u) > 1})
    if repeated:  # two handlers would push to one server as two weight-sync ranks, and pause each other's pushes
        raise ConfigError(f"rollout.urls = {r.urls!r} names {repeated[0]!r} more than once; allowed: each server once "
                          "(one server = one engine)")

    if w.interval != "auto":
        _require(w.interval >= 1, "weight_sync.interval", w.interval, 'an integer >= 1, or "auto"')
        gap = job_config.off_policy.max_version_gap
        _require(w.interval <= gap + 1, "weight_sync.interval", w.interval,
                 f"at most off_policy.max_version_gap + 1 = {gap + 1} (rollouts from weights "
                 f"interval - 1 steps old must fit in the gap), or \"auto\"")
    if w.master_port and os.environ.get("RANK", "0") == "0":  # rank 0 hosts it (later ranks would find it taken)
        _check_port_free(w.master_addr, w.master_port)
    _require(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", w.auth_token_env) is not None, "weight_sync.auth_token_env",
             w.auth_token_env, "the name of an environment variable, e.g. 'TORCHTITAN_FLUX_TOKEN'")
    remote = [("weight_sync.master_addr", w.master_addr)] if not is_loopback(w.master_addr) else []
    remote += [("rollout.urls", u) for u in r.urls if not is_loopback(urllib.parse.urlsplit(u).hostname or "")]
    if remote and read_token(w.auth_token_env) is None:
        name, value = remote[0]
        raise ConfigError(f"{name} = {value!r} is not a loopback address, so it needs the shared token: set the "
                          f"environment variable {w.auth_token_env} (named by weight_sync.auth_token_env; servers read "
                          "TORCHTITAN_FLUX_TOKEN). Allowed without it: loopback addresses (127.0.0.0/8, ::1, "
                          "localhost). See \"Security\" in the README.")

    if a.min_async_ratio > a.max_async_ratio:
        raise ConfigError(f"adaptive_async.min_async_ratio = {a.min_async_ratio} exceeds adaptive_async."
                          f"max_async_ratio = {a.max_async_ratio}; need min_async_ratio <= max_async_ratio")
    _require(a.min_async_ratio <= a.initial_async_ratio <= a.max_async_ratio, "adaptive_async.initial_async_ratio",
             a.initial_async_ratio,
             f"within [min_async_ratio, max_async_ratio] = [{a.min_async_ratio}, {a.max_async_ratio}]")
    if a.kl_weight + a.iw_var_weight + a.version_gap_weight <= 0:
        raise ConfigError("adaptive_async.kl_weight + iw_var_weight + version_gap_weight must be > 0")
    _validate_torchtitan_fields(job_config)
    if a.enabled and not by_throughput and (hint := staleness_out_of_reach(a, o.max_version_gap)):
        logger.warning(hint)
    pid_only = [f.name for f in dataclasses.fields(a)  # what the throughput law does not read, set by the user
                if f.name not in ("enabled", "controller", "ema_alpha", "starve_fraction", "ess_floor")
                and getattr(a, f.name) != (f.default if f.default is not dataclasses.MISSING else f.default_factory())]
    if by_throughput and pid_only:
        logger.warning(f"adaptive_async.{', adaptive_async.'.join(pid_only)} set, but adaptive_async.controller = "
                       "\"throughput\" (the default) does not read them; set adaptive_async.controller = \"pid\" "
                       "for the staleness law they tune")
    if by_throughput and o.max_version_gap == 1:
        logger.warning("adaptive_async.controller = \"throughput\" with off_policy.max_version_gap = 1 has nothing to "
                       "choose (its lookahead is whole steps in [1, max_version_gap]); raise off_policy.max_version_gap "
                       "(the suite in docs/controller.md uses 8)")
    if w.async_weight_update and o.async_ratio == 0 and not a.enabled:
        logger.warning("weight_sync.async_weight_update = true with off_policy.async_ratio = 0: weights are pushed in "
                       "the background, but every step waits for the newest ones (on-policy); set "
                       "off_policy.async_ratio = 1 (or leave it unset) to let generation run ahead")
    if a.controller not in ("pid", "throughput"):
        from torchtitan_flux.rl.controller import ControlLaw

        law = import_spec("adaptive_async.controller", a.controller)
        _require(isinstance(law, type) and issubclass(law, ControlLaw), "adaptive_async.controller", a.controller,
                 "'pid', or 'package.module:Class' naming a class with update(staleness, target), metrics(), "
                 "state_dict() and load_state_dict() (torchtitan_flux.rl.controller.ControlLaw)")
    _check_model_folder(job_config)
    if r.colocated and torch.cuda.is_available():
        _check_colocated_memory(job_config)
        if setting := cuda_rules.expandable_segments_setting():
            logger.warning(f"{setting} with rollout.colocated = true: the engines map the trainer's staging by CUDA "
                           "IPC, which for expandable segments needs ptrace rights between the processes (some "
                           "containers refuse them: the engines' joins would fail); unset it or set "
                           "expandable_segments:False for colocated runs")
    elif engine_pool_bytes(job_config):
        _check_kv_pools_fit(job_config)


TRAIN_BYTES_PER_PARAM = 16  # float32 parameter + gradient + AdamW's two moments
# per process on the device (trainer + each engine): its CUDA context, kernels and allocator slack; measured on an H200
# (torch 2.11, CUDA 13; the smoke's ``colocated`` part, 2026-11-27): 0.58-0.84 GB per engine beyond its weight copies
CUDA_CONTEXT_BYTES = 2**30


def colocated_memory_problem(params: int, wire_bytes: int, engines: int, copies: int, device_bytes: int,
                             shards: int = 1, pool_bytes: int = 0, graphs: bool = False) -> str | None:
    """Why colocated engines cannot fit beside training on one device, else None. Formula (docs/gpu.md, review 4
    finding 6): ``engines x (copies x P x w + K) + P x w`` (each engine's weight copies and KV pool ``K``,
    ``engine_pool_bytes``, and rank 0's device staging) must
    fit in ``device - (16 P / shards + 10% of the device + 1 GiB x (engines + 1))`` (training state: float32
    parameters, gradients and AdamW's moments, sharded over ``shards`` ranks; the margin: activations, allocator
    slack and a CUDA context per process)."""
    model = params * wire_bytes
    need = engines * (copies * model + pool_bytes) + model
    margin = device_bytes // 10 + CUDA_CONTEXT_BYTES * (engines + 1)
    free = device_bytes - (TRAIN_BYTES_PER_PARAM * params // max(1, shards) + margin)
    if need <= free:
        return None
    gib = 2**30
    return (f"rollout.colocated = true needs {need / gib:.1f} GiB for {engines} engine(s) x ({copies} weight copies "
            f"(max(2, off_policy.max_version_gap + 1)) x {model / gib:.1f} GiB + a KV pool (with decode graphs, if "
            f"on) of {pool_bytes / gib:.1f} GiB) + staging {model / gib:.1f} GiB, but "
            f"the {device_bytes / gib:.1f} GiB device leaves {max(free, 0) / gib:.1f} GiB beside training "
            f"({TRAIN_BYTES_PER_PARAM} B x {params / 1e9:.2f}B parameters / {shards} FSDP shard(s) + a margin of 10% "
            f"and 1 GiB per process); allowed: fewer rollout.num_engines, a smaller off_policy.max_version_gap, "
            + ("weight_sync.wire_dtype = 'bfloat16', " if wire_bytes > 2 else "")
            + ("a smaller rollout.max_batch_sequences or training.seq_len, " if pool_bytes else "")
            + ("rollout.decode_graphs = false, " if graphs else "")
            + "or engines on their own GPUs (rollout.colocated = false"
            + (", with rollout.decode_graphs = false)" if graphs else ")"))


def hf_param_count(shape: Any) -> int:
    """Parameters of a model of ``weight_dict.ModelShape`` (HF layout; a tied model counts its embedding once)."""
    d, hd = shape.dim, shape.head_dim
    q, kv = shape.n_heads * hd, shape.n_kv_heads * hd
    layer = d * q + 2 * d * kv + q * d + 3 * d * shape.intermediate_size + 2 * d
    layer += (2 * hd if shape.qk_norm else 0) + (q + 2 * kv if shape.qkv_bias else 0)
    return shape.vocab_size * d * (1 if shape.tied else 2) + shape.n_layers * layer + d


def kv_pool_bytes(job_config: Any) -> int:
    """One embedded engine's K/V with continuous batching: its pool (``inference.SlotCache``), ``max_batch_sequences``
    rows of ``training.seq_len`` slots in the wire dtype (an embedded engine computes in it), twice that with
    ``rollout.environment`` (ended turns' K/V kept for the next turns, ``engine/kept.py``: at most as many rows
    again); 0 without."""
    from torchtitan_flux.models import inference
    from torchtitan_flux.models.weight_dict import ModelShape

    r, w = job_config.rollout, job_config.weight_sync
    if not r.continuous_batching or engine_kind(r.engine).server:  # servers keep their own caches
        return 0
    shape = ModelShape.from_hf_dir(job_config.hf_assets_path)
    wire = 4 if w.wire_dtype == "auto" else getattr(torch, w.wire_dtype).itemsize  # "auto": float32 parameters
    pool = inference.kv_pool_bytes(shape, r.max_batch_sequences, job_config.training.seq_len, wire)
    return pool * (2 if r.environment else 1)


def engine_pool_bytes(job_config: Any) -> int:
    """One embedded engine's device memory beyond its weight versions, the one count of it that the memory checks
    use: its KV pool (``kv_pool_bytes``), and with ``rollout.decode_graphs`` what its captured decode steps hold (a
    static weight copy, per-row buffers, the graphs' private pool: ``inference.decode_graph_bytes``)."""
    from torchtitan_flux.models import inference
    from torchtitan_flux.models.weight_dict import ModelShape

    r, w = job_config.rollout, job_config.weight_sync
    pool = kv_pool_bytes(job_config)
    if not (pool and r.decode_graphs):
        return pool
    wire = 4 if w.wire_dtype == "auto" else getattr(torch, w.wire_dtype).itemsize
    shape = ModelShape.from_hf_dir(job_config.hf_assets_path)
    return pool + inference.decode_graph_bytes(shape, r.max_batch_sequences, job_config.training.seq_len, wire)


def _memory_available() -> int | None:
    """This machine's ``MemAvailable`` (bytes), None where /proc/meminfo has none."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _check_kv_pools_fit(job_config: Any) -> None:
    """Engines not colocated: on a CPU their KV pools (``engine_pool_bytes`` each) and their prepared copies of the model
    (``inference.prepare``: about one model each) fit in half the memory available now (the rest: the trainer and
    the engines' weight versions); on GPUs each engine's pool and weight versions
    (``max(2, off_policy.max_version_gap + 1)``) fit in the smallest visible device less 10 % and 1 GiB."""
    from torchtitan_flux.models.weight_dict import ModelShape

    r, w = job_config.rollout, job_config.weight_sync
    pool = engine_pool_bytes(job_config)
    wire = 4 if w.wire_dtype == "auto" else getattr(torch, w.wire_dtype).itemsize
    model = hf_param_count(ModelShape.from_hf_dir(job_config.hf_assets_path)) * wire
    gib = 2**30
    fields = (f"rollout.max_batch_sequences = {r.max_batch_sequences} rows x training.seq_len = "
              f"{job_config.training.seq_len} slots: each embedded engine's KV pool takes "
              f"{pool / gib:.1f} GiB")
    on_gpu = torch.cuda.is_available() and not (r.engine_devices and all(d == "cpu" for d in r.engine_devices))
    if on_gpu:
        device = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
        room = device - device // 10 - CUDA_CONTEXT_BYTES - max(2, job_config.off_policy.max_version_gap + 1) * model
        if pool <= room:
            return
        rows = max(0, room * r.max_batch_sequences // max(1, pool))
        raise ConfigError(f"{fields}, beside its weight versions more than its {device / gib:.1f} GiB GPU holds; "
                          f"allowed: rollout.max_batch_sequences <= {rows} here, or a shorter training.seq_len")
    available = _memory_available()
    if available is None or r.num_engines * (pool + model) <= available // 2:
        return
    room = available // 2 // max(1, r.num_engines) - model
    rows = max(0, room * r.max_batch_sequences // max(1, pool))
    raise ConfigError(f"{fields}, {r.num_engines} engine(s) {r.num_engines * pool / gib:.1f} GiB and their prepared "
                      f"copies of the model {r.num_engines * model / gib:.1f} GiB, more than half the "
                      f"{available / gib:.1f} GiB this machine has available; allowed: rollout.max_batch_sequences "
                      f"<= {rows} here, or a shorter training.seq_len")


def _check_colocated_memory(job_config: Any) -> None:
    """``colocated_memory_problem`` for this run on this rank's GPU (training state sharded over the FSDP degree:
    ``parallelism.data_parallel_shard_degree``, -1: WORLD_SIZE / the replicate degree)."""
    from torchtitan_flux.models.weight_dict import ModelShape

    r, w = job_config.rollout, job_config.weight_sync
    shape = ModelShape.from_hf_dir(job_config.hf_assets_path)
    wire = 4 if w.wire_dtype == "auto" else getattr(torch, w.wire_dtype).itemsize  # "auto": float32 parameters
    device = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory
    p = job_config.parallelism
    shards = p.data_parallel_shard_degree if p.data_parallel_shard_degree > 0 else \
        int(os.environ.get("WORLD_SIZE", "1")) // max(1, p.data_parallel_replicate_degree)
    why = colocated_memory_problem(hf_param_count(shape), wire, r.num_engines,
                                   max(2, job_config.off_policy.max_version_gap + 1), device, shards=max(1, shards),
                                   pool_bytes=engine_pool_bytes(job_config), graphs=r.decode_graphs)
    if why:
        raise ConfigError(why)


def _check_model_folder(job_config: Any) -> None:
    """``model.hf_assets_path`` has a tokenizer and a readable config.json whose ``max_position_embeddings`` holds the
    longest sequence a rollout makes (a prompt of ``max_prompt_tokens`` plus ``max_new_tokens``)."""
    from torchtitan_flux.models import hf as hf_folder
    from torchtitan_flux.data.tasks import max_prompt_tokens

    hf, r = job_config.hf_assets_path, job_config.rollout
    for fname in ("tokenizer.json", "config.json"):
        if not os.path.isfile(os.path.join(hf, fname)):
            raise ConfigError(f"model.hf_assets_path = {hf!r} has no {fname}; point it at a HF model folder (the "
                              "tiny one: scripts/setup.sh builds it; SmolLM2-135M-Instruct, which the smollm2 "
                              "configs use: scripts/get_real_model.sh)")
    try:
        cfg = hf_folder.read_config(hf)
        max_pos = cfg.get("max_position_embeddings")
        eos = hf_folder.eos_token_ids(cfg)
        hf_folder.architecture(cfg, os.path.join(hf, "config.json"))  # a family or variant we refuse: here, not late
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"model.hf_assets_path = {hf!r}: {e}") from None
    vocab = cfg.get("vocab_size")
    if isinstance(vocab, int):  # torch.topk refuses k past the vocabulary, in the engine, at the first request
        _require(r.top_k <= vocab, "rollout.top_k", r.top_k, f"0 (off) to vocab_size = {vocab} of "
                 f"{os.path.join(hf, 'config.json')}")
    if isinstance(vocab, int) and any(not 0 <= e < vocab for e in eos):  # else no completion could ever end
        raise ConfigError(f"{os.path.join(hf, 'config.json')}: eos_token_id = {cfg.get('eos_token_id')!r} is outside "
                          f"the vocabulary (vocab_size = {vocab}); allowed: token ids in [0, {vocab})")
    prompt = max_prompt_tokens(job_config)
    if isinstance(max_pos, int) and prompt + r.max_new_tokens > max_pos:
        budget = r.max_prompt_tokens or f"auto: training.seq_len - max_new_tokens = {prompt}"
        raise ConfigError(f"rollout.max_prompt_tokens ({budget}) + rollout.max_new_tokens ({r.max_new_tokens}) = "
                          f"{prompt + r.max_new_tokens} tokens exceeds max_position_embeddings = {max_pos} of "
                          f"{os.path.join(hf, 'config.json')}; allowed: at most {max_pos} (lower training.seq_len, "
                          "rollout.max_prompt_tokens or rollout.max_new_tokens)")
    if r.launch:
        from torchtitan_flux.engine.vllm_launch import unservable_reason

        if why := unservable_reason(hf):
            raise ConfigError(f"rollout.launch = true cannot serve model.hf_assets_path = {hf!r} here: {why}; "
                              "use a GPU, or a model with a supported head_dim (rollout.engine = 'embedded' serves any)")


MULTI_TURN_FIELDS = ("environment_args", "max_turns", "max_episodes_in_flight", "environment_timeout_seconds",
                     "environment_reward_weight")  # read only with rollout.environment


def _check_environment(job_config: Any) -> None:
    """``rollout.environment``: its class loads in torchtitan's shape with ``environment_args``, the model has a
    chat template; the multi-turn fields are left alone without it."""
    from torchtitan_flux.config import Rollout
    from torchtitan_flux.rollout.episode_groups import load_configured_environment

    r = job_config.rollout
    if not r.environment:
        defaults = {f.name: f.default_factory() if callable(f.default_factory) else f.default
                    for f in dataclasses.fields(Rollout) if f.name in MULTI_TURN_FIELDS}
        for name, default in defaults.items():
            _require(getattr(r, name) == default, f"rollout.{name}", getattr(r, name),
                     f"{default!r} (the default) unless rollout.environment is set: only multi-turn episodes read it")
        return
    from torchtitan_flux.engine.kinds import engine_kind

    if r.borrow_idle_engine_cores and engine_kind(r.engine).borrowable_cores:
        raise ConfigError("rollout.borrow_idle_engine_cores = true cannot be used with rollout.environment: episodes "
                          "send their turns while the trainer computes, so no engine's core is free to lend; set "
                          "--rollout.borrow_idle_engine_cores false")
    load_configured_environment(r)
    from torchtitan_flux.data.datasets import ChatTemplate

    try:
        ChatTemplate(job_config.hf_assets_path)
    except ConfigError as e:
        raise ConfigError(f"rollout.environment = {r.environment!r} renders conversations with the model's chat "
                          f"template: {e}; for the tiny debug model use its chat variant, which scripts/setup.sh "
                          "builds (--model.hf_assets_path ./assets/tiny-chat)") from None


def _check_data(job_config: Any) -> None:
    """Task, dataset, prompt length, rewards, ``[eval]`` and our ``[metrics]`` fields (docs/data.md)."""
    from torchtitan_flux.data import tasks

    r, ev = job_config.rollout, job_config.eval
    try:
        tasks.task_factory(r.task)
    except ValueError as e:
        raise ConfigError(str(e).replace("is not allowed", "is out of range")) from None
    if r.task.startswith(tasks.REASONING_GYM):
        tasks.reasoning_gym_config(r.task, list(r.task_args))
    elif r.task_args:
        raise ConfigError(f"rollout.task_args = {list(r.task_args)} with rollout.task = {r.task!r}; allowed: [] (only "
                          "rollout.task = 'reasoning_gym:<name>' takes task_args)")
    if r.task in tasks.DATASET_TASKS and not os.path.exists(r.dataset_path):
        raise ConfigError(f"rollout.dataset_path = {r.dataset_path!r} does not exist; task {r.task!r} needs a dataset "
                          "file or folder")
    seq_len = job_config.training.seq_len
    if tasks.max_prompt_tokens(job_config) < 1 or tasks.max_prompt_tokens(job_config) + r.max_new_tokens > seq_len:
        raise ConfigError(f"rollout.max_prompt_tokens ({r.max_prompt_tokens or 'auto'}) + rollout.max_new_tokens "
                          f"({r.max_new_tokens}) must fit in training.seq_len = {seq_len} with room for a prompt; lower "
                          "them or raise training.seq_len")
    for spec in r.reward_funcs:
        if spec not in tasks.BUILTIN_REWARDS:
            import_spec("rollout.reward_funcs", spec)
    if "math_verify" in r.reward_funcs and importlib.util.find_spec("math_verify") is None:
        raise ConfigError("rollout.reward_funcs names 'math_verify', which needs `pip install math-verify`")
    if r.reward_weights and len(r.reward_weights) != len(r.reward_funcs):
        raise ConfigError(f"rollout.reward_weights has {len(r.reward_weights)} entries for {len(r.reward_funcs)} "
                          "rollout.reward_funcs; allowed: one weight per function, or none (all 1.0)")
    twice = sorted({s for s in r.reward_funcs if r.reward_funcs.count(s) > 1})
    if twice:  # one metric per function name: the second would silently merge into the first
        raise ConfigError(f"rollout.reward_funcs lists {twice} more than once; allowed: each function once (give it "
                          "a larger rollout.reward_weights entry instead)")
    bad = [w for w in r.reward_weights if not math.isfinite(w)]
    if bad:
        raise ConfigError(f"rollout.reward_weights = {r.reward_weights!r} holds {bad[0]!r}; allowed: finite numbers")
    _require(math.isfinite(r.environment_reward_weight), "rollout.environment_reward_weight",
             r.environment_reward_weight, "a finite number (like rollout.reward_weights)")
    if ev.dataset_path and not os.path.exists(ev.dataset_path):
        raise ConfigError(f"eval.dataset_path = {ev.dataset_path!r} does not exist")
    for spec in job_config.metrics.step_callbacks:
        step_callback(import_spec("metrics.step_callbacks", spec), f"metrics.step_callbacks = {spec!r}")
