"""Bad input: each case gets one clear error naming the field (or resource) and what is allowed, before any
process is spawned. Table-driven over the real parse path (``run/config_file.load_config``: the TOML and the
overrides on ``GRPOTrainer.Config``, torchtitan 0.3.0's ``Trainer.Config`` with our sections)."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import re
import socket
import subprocess

import sys
import types
import typing

import pytest
import torch
from conftest import DEBUG_TOML, ROOT

from torchtitan_flux.patches import apply_patches

apply_patches()

from torchtitan_flux.config import ADDED_TO_TORCHTITAN, SECTIONS
from torchtitan_flux.errors import ConfigError  # noqa: E402
from torchtitan_flux.ranges import field_ranges  # noqa: E402
from torchtitan_flux.run.validation import validate_config  # noqa: E402
from torchtitan_flux.run.config_file import load_config  # noqa: E402
from torchtitan_flux.run.trainer import GRPOTrainer  # noqa: E402
from torchtitan_flux.train import _report  # noqa: E402


def parse(*overrides: str, toml: str | None = None):
    return load_config(["--job.config_file", toml or str(DEBUG_TOML), *overrides], GRPOTrainer.Config())


def good_reward(completions, **_):
    return [1.0] * len(completions)


def nan_reward(completions, **_):
    return [float("nan")] * len(completions)


def str_reward(completions, **_):
    return ["yes"] * len(completions)


CASES = [
    (("--grpo.group_size", "1"), "grpo.group_size"),
    (("--grpo.clip_low", "0"), "grpo.clip_low"),
    (("--grpo.clip_high", "-0.1"), "grpo.clip_high"),
    (("--grpo.kl_coef", "-1"), "grpo.kl_coef"),
    (("--grpo.temperature", "0"), "grpo.temperature"),
    (("--grpo.tis_cap", "-2"), "grpo.tis_cap"),
    (("--rollout.prompts_per_step", "0"), "rollout.prompts_per_step"),
    # issue 40's third sweep: values that passed validation and failed late (torch's or Python's errors, a
    # MemoryError after 78 s, "engines did not join" after 39 s, a NaN loss, or silently nothing)
    (("--optimizer.weight_decay", "nan"), "optimizer.weight_decay = nan is out of range; allowed: a finite number in "
                                          "[0, 1]"),
    (("--optimizer.weight_decay", "-0.1"), "optimizer.weight_decay = -0.1 is out of range"),
    (("--optimizer.eps", "nan"), "optimizer.eps = nan is out of range; allowed: a finite number in (0, 1)"),
    (("--optimizer.eps", "-1e-8"), "optimizer.eps = -1e-08 is out of range"),
    (("--lr_scheduler.decay_ratio", "nan"), "lr_scheduler.decay_ratio = nan is out of range; allowed: unset, or a "
                                            "number in [0, 1]"),
    (("--lr_scheduler.min_lr_factor", "2"), "lr_scheduler.min_lr_factor = 2.0 is out of range"),
    (("--weight_sync.bucket_size_mb", "1e308"), "weight_sync.bucket_size_mb = 1e+308 is out of range; allowed: a "
                                                "number in (0, 65536]"),
    (("--rollout.num_engines", "99999999999999999999"), "rollout.num_engines = 99999999999999999999 is out of "
                                                        "range; allowed: an integer in [1, 1024]"),
    (("--rollout.prompts_per_step", "99999999999999999999"), "rollout.prompts_per_step = 99999999999999999999"),
    (("--rollout.engine_threads", "99999999999999999999"), "rollout.engine_threads = 99999999999999999999"),
    (("--grpo.group_size", "99999999999999999999"), "grpo.group_size = 99999999999999999999 is out of range; "
                                                    "allowed: an integer in [2, 4096]"),
    (("--eval.n", "99999999999999999999"), "eval.n = 99999999999999999999 is out of range"),
    # our own, beside the sweep's: values that passed validation and failed later or did nothing useful
    (("--rollout.top_k", "99999999999999999999"), "rollout.top_k = 99999999999999999999 is out of range; allowed: 0 "
                                                  "(off) to vocab_size = 259"),
    (("--eval.num_prompts", "99999999999999999999"), "eval.num_prompts = 99999999999999999999 is out of range; "
                                                     "allowed: an integer in [0, 65536]"),
    (("--rollout.reward_workers", "99999999999999999999"), "rollout.reward_workers = 99999999999999999999 is out of "
                                                           "range; allowed: an integer in [1, 1024]"),
    (("--lr_scheduler.warmup_steps", "-5"), "lr_scheduler.warmup_steps = -5 is out of range; allowed: an integer >= 0"),
    (("--weight_sync.sparse_max_bytes_ratio", "0.2"), "weight_sync.sparse_max_bytes_ratio = 0.2 is out of range; "
                                                      "allowed: 0.5 (the default) unless weight_sync.method = "
                                                      "\"sparse\""),
    (("--rollout.max_new_tokens", "0"), "rollout.max_new_tokens"),
    (("--rollout.num_engines", "0"), "rollout.num_engines"),
    (("--rollout.task", "poetry"), "rollout.task = 'poetry' is out of range; allowed: digits | arithmetic | dataset | "
                                   "gsm8k, 'reasoning_gym:<name>' or 'package.module:name'"),
    (("--rollout.task", "jsonl"), "rollout.task = 'jsonl' was renamed: use 'dataset'"),
    (("--model.name", "flux"), "model.name = 'flux' is not allowed; allowed: 'hf_auto'"),  # torchtitan's FLUX
    (("--model.name", "llama3"), "model.name = 'llama3' is not allowed; allowed: 'hf_auto'"),
    (("--rollout.reward_funcs", "nope:fn"), "rollout.reward_funcs = 'nope:fn' cannot be imported"),
    (("--rollout.reward_funcs", "answer_match", "--rollout.reward_weights", "1", "2"), "rollout.reward_weights"),
    (("--eval.n", "0"), "eval.n"),
    (("--metrics.log_completions_every", "-1"), "metrics.log_completions_every"),
    (("--rollout.engine", "vllm"), "rollout.urls"),
    (("--rollout.colocated", "true", "--rollout.engine", "vllm", "--rollout.urls", "http://127.0.0.1:8000"),
     "rollout.colocated = true puts embedded engines on the trainer's device"),
    (("--rollout.colocated", "true", "--rollout.engine_devices", "cpu"), "no rollout.engine_devices"),
    (("--rollout.dispatch_dead_zone", "1"), "rollout.dispatch_dead_zone = 1.0 is out of range; allowed: a number in [0, 1)"),
    (("--rollout.dispatch_dead_zone", "-0.1"), "rollout.dispatch_dead_zone"),
    # silent before 2026-11-25 (issue 27): one metric for both, the NaN never named, the urls unused
    (("--rollout.reward_funcs", "answer_match,answer_match"),
     "rollout.reward_funcs lists ['answer_match'] more than once; allowed: each function once"),
    (("--rollout.reward_funcs", "answer_match", "--rollout.reward_weights", "nan"),
     "rollout.reward_weights = [nan] holds nan; allowed: finite numbers"),
    (("--rollout.urls", "http://127.0.0.1:8000"),
     "rollout.urls = ['http://127.0.0.1:8000'] is set, but rollout.engine = 'embedded' starts its own engines"),
    (("--debug.seed", str(2**70)), f"debug.seed = {2**70} is out of range"),  # before: a torch traceback
    (("--off_policy.max_version_gap", "100000"), "off_policy.max_version_gap = 100000 is out of range; allowed: at "
                                                 "most training.steps = 60"),  # before: a join timeout
    (("--rollout.engine_stall_seconds", "30", "--weight_sync.timeout_seconds", "30"),
     "rollout.engine_stall_seconds = 30 is out of range; allowed: more than weight_sync.timeout_seconds = 30"),
    (("--rollout.dispatch_max_share", "0"), "rollout.dispatch_max_share = 0.0 is out of range; allowed: a number in (0, 1]"),
    (("--rollout.dispatch_max_share", "1.5"), "rollout.dispatch_max_share"),
    (("--rollout.launch", "true"), "rollout.launch = true needs rollout.engine = 'vllm'"),
    (("--rollout.engine", "vllm", "--rollout.launch", "true", "--rollout.urls", "http://127.0.0.1:8000"),
     "must be empty when rollout.launch = true"),
    (("--rollout.engine", "vllm", "--rollout.launch", "true", "--rollout.launch_python", "/nonexistent/python"),
     "rollout.launch_python = '/nonexistent/python' does not exist"),
    (("--rollout.engine", "vllm", "--rollout.launch", "true", "--rollout.launch_python", "/bin/sh",
      "--rollout.launch_timeout_s", "0"), "rollout.launch_timeout_s"),
    (("--rollout.task", "dataset", "--rollout.dataset_path", "/nonexistent.jsonl"), "rollout.dataset_path"),
    (("--weight_sync.timeout_seconds", "-1"), "weight_sync.timeout_seconds"),
    (("--weight_sync.bucket_size_mb", "0"), "weight_sync.bucket_size_mb"),
    (("--weight_sync.interval", "0"), "weight_sync.interval"),
    (("--weight_sync.method", "sparse", "--rollout.colocated", "true"),
     "weight_sync.method = 'sparse' patches what travels on a wire"),
    (("--weight_sync.sparse_max_bytes_ratio", "0"), "weight_sync.sparse_max_bytes_ratio"),
    (("--weight_sync.interval", "3"),  # the old hang: rollouts could never be fresh enough (max_version_gap 1)
     "weight_sync.interval = 3 is out of range; allowed: at most off_policy.max_version_gap + 1 = 2"),
    (("--weight_sync.overhead_target", "1"), "weight_sync.overhead_target = 1.0 is out of range; allowed: a number in (0, 1)"),
    (("--weight_sync.max_interval", "0"), "weight_sync.max_interval"),
    (("--weight_sync.master_port", "70000"), "weight_sync.master_port"),
    (("--weight_sync.master_addr", "10.0.0.5"),
     "weight_sync.master_addr = '10.0.0.5' is not a loopback address, so it needs the shared token: set the "
     "environment variable TORCHTITAN_FLUX_TOKEN"),
    (("--weight_sync.master_addr", "0.0.0.0", "--weight_sync.auth_token_env", "MY_FLUX_TOKEN"),
     "set the environment variable MY_FLUX_TOKEN (named by weight_sync.auth_token_env"),
    (("--rollout.engine", "vllm", "--rollout.urls", "http://gen1:8000"),
     "rollout.urls = 'http://gen1:8000' is not a loopback address"),
    (("--rollout.engine", "sglang", "--rollout.urls", "http://127.0.0.1:30000,http://10.0.0.7:30000"),
     "rollout.urls = 'http://10.0.0.7:30000' is not a loopback address"),
    (("--weight_sync.master_addr", "10.0.0.5"), "Allowed without it: loopback addresses (127.0.0.0/8, ::1, localhost)"),
    (("--weight_sync.auth_token_env", "MY-TOKEN"),
     "weight_sync.auth_token_env = 'MY-TOKEN' is out of range; allowed: the name of an environment variable"),
    (("--adaptive_async.min_async_ratio", "0.8", "--adaptive_async.max_async_ratio", "0.2"),
     "min_async_ratio <= max_async_ratio"),
    (("--adaptive_async.target_staleness", "1.5"), "adaptive_async.target_staleness"),
    (("--adaptive_async.ema_alpha", "0"), "adaptive_async.ema_alpha"),
    (("--off_policy.max_version_gap", "-1"),
     "off_policy.max_version_gap = -1 is out of range; allowed: an integer >= 1"),
    (("--off_policy.async_ratio", "1.5"), "off_policy.async_ratio = 1.5 is out of range; allowed: a number in [0, 1]"),
    (("--off_policy.async_ratio", "0.5", "--adaptive_async.enabled", "true"),
     "off_policy.async_ratio = 0.5 is out of range; allowed: unset (the default) or 0 with adaptive_async.enabled = "
     "true"),
    (("--off_policy.async_ratio", "-1"), "off_policy.async_ratio = -1.0 is out of range; allowed: a number in [0, 1] "
                                         "(unset: follows weight_sync.async_weight_update)"),
    (("--off_policy.max_pipeline_depth", "2"), "off_policy.max_pipeline_depth = 2 is out of range; allowed: 0 (the "
                                               "default) unless off_policy.feedforward = true"),
    (("--off_policy.max_pipeline_depth", "-1"),
     "off_policy.max_pipeline_depth = -1 is out of range; allowed: an integer >= 0"),
    (("--adaptive_async.kp", "-1"), "adaptive_async.kp"),
    (("--adaptive_async.enabled", "true", "--adaptive_async.controller", "throughput", "--off_policy.feedforward",
      "true"), "off_policy.feedforward = True is out of range; allowed: false with adaptive_async.controller = "
               "\"throughput\": that law holds its own Little's-law depth"),
    (("--adaptive_async.starve_fraction", "1"), "adaptive_async.starve_fraction"),
    (("--adaptive_async.controller", "no_such_module:Cls"), "adaptive_async.controller"),
    (("--adaptive_async.controller", "nocolon"), "adaptive_async.controller"),
    (("--model.hf_assets_path", "/nonexistent/model"), "model.hf_assets_path = '/nonexistent/model' has no "
                                                       "tokenizer.json; point it at a HF model folder (the tiny one: "
                                                       "scripts/setup.sh builds it; SmolLM2-135M-Instruct, which the "
                                                       "smollm2 configs use: scripts/get_real_model.sh)"),
    # infinities, NaN, zero/negative counts (torchtitan's own fields too): one line, before any work
    (("--grpo.clip_high", "inf"), "grpo.clip_high = inf is out of range; allowed: a finite number"),
    (("--adaptive_async.kp", "nan"), "adaptive_async.kp = nan is out of range; allowed: a finite number"),
    (("--training.steps", "0"), "training.steps = 0 is out of range; allowed: an integer >= 1"),
    (("--training.steps", "-3"), "training.steps = -3 is out of range"),
    (("--training.local_batch_size", "0"), "training.local_batch_size = 0 is out of range"),
    (("--checkpoint.enable", "--checkpoint.interval", "0"), "checkpoint.interval = 0 is out of range"),
    (("--optimizer.lr", "nan"), "optimizer.lr = nan is out of range; allowed: a finite number in (0, 1]"),
    (("--optimizer.lr", "1e300"), "optimizer.lr = 1e+300 is out of range; allowed: a finite number in (0, 1] (Adam "
                                  "moves each weight by about lr per step)"),
    (("--rollout.engine", "vllm", "--rollout.urls", "http://999.1.1.1:8000"),  # before: "needs the shared token"
     "rollout.urls = 'http://999.1.1.1:8000' is not a server URL (host '999.1.1.1' is not an IP address or a host "
     "name); allowed: http(s)://host:port with host an IP address or a host name, e.g. 'http://127.0.0.1:8000'"),
    (("--rollout.engine", "vllm", "--rollout.urls", "http://127.0.0.1:99999"),
     "rollout.urls = 'http://127.0.0.1:99999' is not a server URL (Port out of range 0-65535)"),
    (("--rollout.engine", "sglang", "--rollout.urls", "127.0.0.1:30000"), "rollout.urls = '127.0.0.1:30000' is not a "
                                                                          "server URL (no scheme)"),
    (("--rollout.engine", "vllm", "--rollout.urls", "http://127.0.0.1:8000,http://127.0.0.1:8000"),
     "names 'http://127.0.0.1:8000' more than once; allowed: each server once"),
    # issue 27's second sweep (2026-11-26): torchtitan fields that failed late with its traceback, or silently
    (("--training.max_norm", "0"), "training.max_norm = 0.0 is out of range; allowed: a finite number > 0"),
    (("--training.max_norm", "-1"), "training.max_norm = -1.0 is out of range"),  # before: the gradient reversed
    (("--optimizer.name", "SGD"), "optimizer.name = 'SGD' is out of range; allowed: Adam | AdamW"),
    (("--checkpoint.enable", "true", "--checkpoint.keep_latest_k", "1"),
     "checkpoint.keep_latest_k = 1 is out of range; allowed: 0 (keep all) or >= 2"),
    (("--parallelism.data_parallel_shard_degree", "4"),
     "parallelism.data_parallel_shard_degree = 4 is out of range; allowed: -1 (the rest) or 1"),
    (("--parallelism.tensor_parallel_degree", "2"),
     "parallelism.tensor_parallel_degree = 2 is out of range; allowed: 1 (the trainer is data-parallel only"),
    (("--parallelism.pipeline_parallel_degree", "2"), "parallelism.pipeline_parallel_degree = 2 is out of range"),
    (("--parallelism.data_parallel_replicate_degree", "0"),
     "parallelism.data_parallel_replicate_degree = 0 is out of range; allowed: a divisor of the number of trainer"),
    # captured decode steps (rollout.decode_graphs) where they cannot apply
    (("--rollout.decode_graphs", "true"), "rollout.decode_graphs = true needs rollout.continuous_batching = true (it "
                                          "captures the continuous batcher's step); allowed: false (the default)"),
    (("--rollout.decode_graphs", "true", "--rollout.continuous_batching", "true", "--rollout.colocated", "true"),
     "rollout.decode_graphs = true needs engines on GPUs (CUDA graphs), these run on a CPU; allowed: false"),
    (("--rollout.decode_graphs", "true", "--rollout.continuous_batching", "true"),
     "rollout.decode_graphs = true needs rollout.colocated = true (an engine on a GPU of its own receives weights "
     "over NCCL, and a CUDA graph's capture waits for every NCCL receive pending in its process"),
    (("--rollout.decode_graphs", "true", "--rollout.continuous_batching", "true", "--rollout.engine", "vllm",
      "--rollout.urls", "http://127.0.0.1:8000"),
     "rollout.decode_graphs = true is the embedded engine's (rollout.engine = 'vllm' captures its own); allowed"),
    (("--training.seq_len", "4096"),  # the tiny model's config.json: max_position_embeddings 2048
     "rollout.max_prompt_tokens (auto: training.seq_len - max_new_tokens = 4080) + rollout.max_new_tokens (16) = 4096 "
     "tokens exceeds max_position_embeddings = 2048 of "),
    (("--rollout.max_prompt_tokens", "2040", "--training.seq_len", "4096"),
     "rollout.max_prompt_tokens (2040) + rollout.max_new_tokens (16) = 2056 tokens exceeds max_position_embeddings"),
]


@pytest.mark.parametrize("overrides,needle", CASES, ids=[c[1] + ":" + " ".join(c[0]) for c in CASES])
def test_bad_value_names_field_and_allowed(tiny_model_dir, overrides, needle, monkeypatch, capsys):
    """Each case is refused by validation, and what the entry point makes of it (``train._report``, the handler
    of ``train.main``) is exactly one ``error: ...`` line on stderr naming the field, nothing on stdout, exit
    code 2 (the whole command is run once, in ``test_stops.py::test_bad_input_is_one_line_exit_2_...``)."""
    monkeypatch.delenv("TORCHTITAN_FLUX_TOKEN", raising=False)
    monkeypatch.delenv("TORCHTITAN_FLUX_DEBUG", raising=False)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    with pytest.raises(ConfigError) as e:  # the front end's (model.name) or validation's
        validate_config(parse(*overrides))
    capsys.readouterr()
    assert needle in str(e.value)
    code = _report(e.value)
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert out.err.splitlines() == [f"error: {e.value}"] and out.err.endswith("\n"), out.err
    field = needle.split(" ")[0].rstrip(":(")
    assert re.match(r"error: [a-z_]+\.[a-z_.]+", out.err) and (field in out.err), out.err


def test_one_syntax_for_every_list_and_boolean():
    """Issue 27's paper cut: ``reward_funcs`` took ``a,b`` but ``reward_weights`` refused ``1,2`` (tyro wanted
    ``1 2``), and ``--checkpoint.enable=true`` was an unrecognized option. Both forms now work for every field."""
    for weights in (("1.0,0.5",), ("1.0", "0.5")):
        cfg = parse("--rollout.reward_funcs", "answer_match,digits", "--rollout.reward_weights", *weights)
        assert cfg.rollout.reward_funcs == ["answer_match", "digits"] and cfg.rollout.reward_weights == [1.0, 0.5]
    assert parse("--rollout.reward_weights=2,3").rollout.reward_weights == [2.0, 3.0]
    for form in (("--checkpoint.enable=true",), ("--checkpoint.enable", "true")):
        assert parse(*form).checkpoint.enable is True  # a torchtitan flag
    assert parse("--checkpoint.enable=false").checkpoint.enable is False
    for form in (("--weight_sync.async_weight_update=true",), ("--weight_sync.async_weight_update", "true")):
        assert parse(*form).weight_sync.async_weight_update is True  # one of ours
    assert parse("--checkpoint.enable").checkpoint.enable is True  # bare, as torchtitan's flags were
    # a string field whose value reads "false" stays a string (before 2026-11-25 it became a tyro flag)
    assert parse("--rollout.task=false").rollout.task == "false"
    assert parse("--parallelism.spmd_backend", "partial_dtensor").parallelism.spmd_backend == "partial_dtensor"


def test_a_comma_inside_a_quoted_value_does_not_split_a_list():
    """The fifth sweep: ``--rollout.environment_args 'fault="a,b",fault_after=10'`` gave ['fault="a', 'b"', ...]
    (tyro's ``list[str]`` rule). Mutation: a plain ``split(",")`` in ``_from_cli``."""
    from torchtitan_flux.run.config_file import split_outside_quotes

    cfg = parse("--rollout.environment_args", 'fault="a,b",fault_after=10', "--rollout.reward_funcs", "a:b,c:d")
    assert cfg.rollout.environment_args == ['fault="a,b"', "fault_after=10"]
    assert cfg.rollout.reward_funcs == ["a:b", "c:d"]
    assert split_outside_quotes('x="a\\",b",,y') == ['x="a\\",b"', "", "y"]
    assert split_outside_quotes("") == [""]


def test_an_explicit_ratio_0_with_the_async_push_is_named_in_a_warning(caplog):
    """The toggle alone makes a run asynchronous (the ratio follows it); an explicit ``async_ratio = 0`` beside it
    keeps the background push on-policy, and the user who meant overlap is told which field gives it."""
    with caplog.at_level("WARNING", logger="torchtitan_flux"):
        validate_config(parse("--weight_sync.async_weight_update", "true", "--off_policy.async_ratio", "0"))
    assert any("set off_policy.async_ratio = 1 (or leave it unset)" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="torchtitan_flux"):
        validate_config(parse("--weight_sync.async_weight_update", "true"))
        validate_config(parse("--weight_sync.async_weight_update", "true", "--off_policy.async_ratio", "1"))
        validate_config(parse())
    assert not any("async_ratio = 1" in r.message for r in caplog.records)


def test_auto_and_integer_intervals_parse_and_validate(tiny_model_dir):
    for value, expect in (("auto", "auto"), ("2", 2)):
        cfg = parse("--weight_sync.interval", value)
        validate_config(cfg)
        assert cfg.weight_sync.interval == expect
    validate_config(parse("--weight_sync.interval", "5", "--off_policy.max_version_gap", "4"))


def test_a_module_that_exits_at_import_is_one_line_with_its_reason():
    """Before 2026-11-25 (issue 27): ``sys.exit("reason")`` at a reward module's import ended the run, reason lost."""
    from torchtitan_flux.user_code import import_spec

    with pytest.raises(ConfigError, match=r"^rollout.reward_funcs = 'fakes.exits_at_import:f' cannot be imported: "
                                          r"SystemExit: this module needs a GPU$"):
        import_spec("rollout.reward_funcs", "fakes.exits_at_import:f")



def test_a_module_that_calls_os_exit_at_import_is_one_line():
    """The fifth sweep's item 8: ``os._exit(0)`` at an environment's import ended the run with exit code 0 and an
    empty log. In a child process: on the old code the import ends the process. Mutations: os._exit left alone, or
    not restored after the import."""
    import os
    import subprocess

    code = ("import os\n"
            "real = os._exit\n"
            "from torchtitan_flux.user_code import import_spec\n"
            "try:\n"
            "    import_spec('rollout.environment', 'fakes.os_exits_at_import:Env')\n"
            "except Exception as e:\n"
            "    print(type(e).__name__, e)\n"
            "print(os._exit is real)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert p.stdout.splitlines() == [
        "ConfigError rollout.environment = 'fakes.os_exits_at_import:Env' cannot be imported: it called os._exit(0) at "
        "import (the run would end silently); allowed: a module that only defines things when imported", "True"], p


def _range_fields(prefix: str, cls) -> list:
    """(path, range, allowed text, is int) of every field of ``cls`` declaring a ``Range``, nested tables included."""
    hints = typing.get_type_hints(cls)
    out = [(f"{prefix}.{name}", rng, allowed, hints[name] is int) for name, (rng, allowed) in field_ranges(cls).items()]
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type):
            out += _range_fields(f"{prefix}.{f.name}", f.type)
    return out


RANGE_FIELDS = [rf for sec, cls in {**SECTIONS, **ADDED_TO_TORCHTITAN}.items() for rf in _range_fields(sec, cls)]


def _edges(rng, is_int: bool) -> list[tuple[float, bool]]:
    """(value, allowed?) at each declared bound: an inclusive bound passes and its nearest neighbour outside fails;
    an exclusive bound fails and its nearest neighbour inside passes."""
    def toward(bound, direction: int):
        return int(bound) + direction if is_int else math.nextafter(float(bound), direction * math.inf)

    edges = []
    for bound, inclusive, inside in ((rng.ge, True, 1), (rng.gt, False, 1), (rng.le, True, -1), (rng.lt, False, -1)):
        if bound is not None:
            edges += [(int(bound) if is_int else float(bound), inclusive),
                      (toward(bound, -inside if inclusive else inside), not inclusive)]
    return edges


@pytest.mark.parametrize("path,rng,allowed,is_int", RANGE_FIELDS, ids=[rf[0] for rf in RANGE_FIELDS])
def test_every_declared_range_is_checked(tiny_model_dir, path, rng, allowed, is_int):
    """Generated from config.py's ``Range`` declarations, so a section the validation loop missed fails here: just
    outside a bound is the field's one out-of-range error; the bound (or, when exclusive, just inside) passes it."""
    assert len(RANGE_FIELDS) > 40  # field_ranges finds the declarations (none would run no case at all)
    *parents, name = path.split(".")
    for value, ok in _edges(rng, is_int):
        cfg = parse()
        setattr(functools.reduce(getattr, parents, cfg), name, value)
        try:
            validate_config(cfg)
            error = ""
        except ConfigError as e:
            error = str(e)
        out_of_range = f"{path} = {value!r} is out of range; allowed: {allowed}"
        assert (error != out_of_range) if ok else (error == out_of_range), (value, error)


def test_launch_refuses_a_head_dim_vllm_cpu_cannot_serve(tiny_model_dir, monkeypatch):
    """The tiny debug model has head_dim 16: a launched CPU vLLM server would exit after ~1 min of loading; the
    run is refused before anything starts. With a GPU the CPU rule does not apply."""
    from torchtitan_flux.engine import vllm_launch as vllm

    args = ("--rollout.engine", "vllm", "--rollout.launch", "true", "--rollout.launch_python", sys.executable)
    monkeypatch.setattr(vllm, "_has_gpu", lambda: False)
    with pytest.raises(ConfigError, match=r"rollout.launch = true cannot serve model.hf_assets_path = .*: the "
                                          r"model's head_dim is 16, and vLLM's CPU attention serves head sizes 32, 64"):
        validate_config(parse(*args))
    monkeypatch.setattr(vllm, "_has_gpu", lambda: True)
    validate_config(parse(*args))


def test_non_loopback_addresses_need_only_the_token(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("TORCHTITAN_FLUX_TOKEN", raising=False)
    validate_config(parse("--rollout.engine", "vllm", "--rollout.urls",
                          "http://localhost:8000,http://[::1]:8001,http://127.0.0.2:8002",
                          "--weight_sync.master_addr", "::1"))
    monkeypatch.setenv("MY_FLUX_TOKEN", "s3cret")
    validate_config(parse("--rollout.engine", "vllm", "--rollout.urls", "http://gen1:8000",
                          "--weight_sync.master_addr", "10.0.0.5", "--weight_sync.auth_token_env", "MY_FLUX_TOKEN"))


def _write(tmp_path, text: str) -> str:
    p = tmp_path / "bad.toml"
    p.write_text(DEBUG_TOML.read_text() + "\n" + text)
    return str(p)


def test_wrong_type_in_toml(tiny_model_dir, tmp_path):
    cfg = parse(toml=_write(tmp_path, "[adaptive_async]\nenabled = 'yes'\n"))
    with pytest.raises(ConfigError, match=r"adaptive_async.enabled must be of type bool"):
        validate_config(cfg)


def test_wrong_type_of_a_torchtitan_field_in_toml(tiny_model_dir, tmp_path):
    """Before 2026-11-25 (issue 27): ``steps = "five"`` gave ``TypeError: '>=' not supported`` with a traceback."""
    p = tmp_path / "five.toml"
    p.write_text(DEBUG_TOML.read_text().replace("steps = 60", 'steps = "five"'))
    cfg = parse(toml=str(p))
    with pytest.raises(ConfigError, match=r"^training.steps must be of type int, got str 'five'"):
        validate_config(cfg)


def test_bad_on_config_mismatch_in_toml(tiny_model_dir, tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text(DEBUG_TOML.read_text().replace('folder = "checkpoint"', 'folder = "checkpoint"\non_config_mismatch = "ask"'))
    with pytest.raises(ConfigError, match=r"^checkpoint.on_config_mismatch = 'ask' is not allowed; allowed values: "
                                          r"'error' \| 'warn'$"):
        validate_config(parse(toml=str(p)))


def test_wrong_type_list_in_toml(tiny_model_dir, tmp_path):
    text = DEBUG_TOML.read_text().replace('task = "digits"', 'task = "digits"\nurls = "http://x"')
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=r"rollout.urls must be a list of str"):
        validate_config(parse(toml=str(p)))


TORCHTITAN_TYPE_CASES = [  # 0.3.0's own fields (no validate_config rule): before, each reached torchtitan as given
    ('[compile]\nenable = "yes"', "compile.enable = 'yes' is not allowed; allowed: true | false"),
    ("[training]\ngc_freq = true", "training.gc_freq = True is not allowed; allowed: an integer"),  # bool is no int
    ("[metrics]\nlog_freq = 1.5", "metrics.log_freq = 1.5 is not allowed; allowed: an integer"),
    ('[optimizer]\nlr = "1e-4"', "optimizer.lr = '1e-4' is not allowed; allowed: a number"),  # was a TypeError
    ('[lr_scheduler]\ndecay_type = "exp"',
     "lr_scheduler.decay_type = 'exp' is not allowed; allowed values: 'linear' | 'sqrt' | 'cosine'"),
    ('[debug]\nseed = "x"', "debug.seed = 'x' is not allowed; allowed: an integer | unset"),
    ('[compile]\ncomponents = ["model", 3]', "compile.components[1] = 3 is not allowed; allowed: a string"),
    ('[checkpoint]\nexclude_from_loading = "x"',
     "checkpoint.exclude_from_loading = 'x' is not allowed; allowed: a list of strings"),
    ("[job]\ndump_folder = 5", "job.dump_folder = 5 is not allowed; allowed: a string"),  # a 0.2.2 key, as written
    ('[profiling]\nenable_profiling = "on"', "profiling.enable_profiling = 'on' is not allowed; allowed: true | false"),
    ("[parallelism]\nmodule_fqns_per_model_part = [[1]]", "parallelism.module_fqns_per_model_part = [[1]] is not "
                                                          "allowed; allowed: a list of lists of strings | unset"),
]


@pytest.mark.parametrize("text,message", TORCHTITAN_TYPE_CASES, ids=[m.split(" ")[0] for _, m in TORCHTITAN_TYPE_CASES])
def test_a_torchtitan_field_of_the_wrong_type_in_a_toml_is_one_line(tmp_path, text, message):
    """The front end checks each 0.3.0 field it sets against the field's declared type (``config_file._typed``):
    one line naming the key as written, the value and the allowed ones, before torchtitan sees a string. Mutations:
    no ``_typed`` in ``_set`` (every case passes the front end); a bool accepted as an int (``gc_freq``); a list's
    items unchecked (``components``)."""
    (tmp_path / "t.toml").write_text(text + "\n")
    with pytest.raises(ConfigError) as e:
        parse(toml=str(tmp_path / "t.toml"))
    assert str(e.value) == message


def test_a_torchtitan_field_of_the_wrong_type_on_the_command_line_is_one_line():
    """A command-line string that does not read as the field's type stays a string (``_from_cli``), and the same
    check names it. Mutation: no ``_typed`` in ``_set`` (``compile.enable`` becomes the string 'yes')."""
    for args, message in ((("--compile.enable", "yes"), "compile.enable = 'yes' is not allowed; allowed: true | false"),
                          (("--parallelism.spmd_backend", "dtensor"), "parallelism.spmd_backend = 'dtensor' is not "
                           "allowed; allowed values: 'partial_dtensor' | 'full_dtensor' | 'spmd_types'"),
                          (("--training.gc_freq", "often"), "training.gc_freq = 'often' is not allowed; allowed: an "
                           "integer")):
        with pytest.raises(ConfigError) as e:
            parse(*args)
        assert str(e.value) == message


def test_values_of_a_torchtitan_fields_type_pass_the_check(tmp_path):
    """An int is a number (TOML writes 2 for 2.0), ``none`` unsets an optional field, a table sets a dict field.
    Mutations: a float field requiring a float (``min_lr_factor = 0``); a union not tried option by option."""
    (tmp_path / "t.toml").write_text("[lr_scheduler]\nmin_lr_factor = 0\n[training]\nmax_norm = 2\n"
                                     "[optimizer.optimizer_factory_kwargs_by_name]\nAdamW = {foreach = true}\n")
    cfg = parse("--debug.seed", "none", "--compile.enable", "true", toml=str(tmp_path / "t.toml"))
    assert (cfg.lr_scheduler.min_lr_factor, cfg.training.max_norm, cfg.debug.seed, cfg.compile.enable) == (0, 2, None,
                                                                                                        True)
    assert cfg.optimizer.optimizer_factory_kwargs_by_name == {"AdamW": {"foreach": True}}


def test_our_fields_in_torchtitans_sections_are_type_checked_by_validation(tmp_path):
    """``[metrics] log_completions_every`` (ours, so left to ``validate_config`` by the front end) was only
    range-checked: a string gave a ``TypeError`` traceback. Mutation: ``ADDED_TO_TORCHTITAN`` out of
    validate_config's type-check loop."""
    text = DEBUG_TOML.read_text().replace("[metrics]", "[metrics]\nlog_completions_every = 'x'")
    (tmp_path / "t.toml").write_text(text)
    with pytest.raises(ConfigError) as e:
        validate_config(parse(toml=str(tmp_path / "t.toml")))
    assert str(e.value) == "metrics.log_completions_every must be of type int, got str 'x'"


PARAM_GROUPS = """[[optimizer.param_groups]]
pattern = "norm"
optimizer_name = "AdamW"
optimizer_kwargs = {lr = 1e-3, weight_decay = 0.0}
[[optimizer.param_groups]]
pattern = ".*"
optimizer_name = "AdamW"
optimizer_kwargs = {lr = 1e-4}
"""


def test_optimizer_param_groups_from_a_toml_are_torchtitans_param_group_configs(tmp_path):
    """0.3.0's ``optimizer.param_groups`` given as a list of TOML tables become ``ParamGroupConfig``s, which
    ``AdamOptimizers`` builds its groups from (the ``[optimizer]`` lr is then unused). Mutation: the tables left as
    dicts (``_table`` not called): the isinstance check fails, and torchtitan's build with ``pg.pattern``."""
    from torchtitan.components.optimizer import ParamGroupConfig

    from torchtitan_flux.run.trainer import AdamOptimizers

    (tmp_path / "t.toml").write_text(PARAM_GROUPS)
    groups = parse(toml=str(tmp_path / "t.toml")).optimizer.param_groups
    assert all(isinstance(g, ParamGroupConfig) for g in groups)
    assert [(g.pattern, g.optimizer_kwargs) for g in groups] == [("norm", {"lr": 1e-3, "weight_decay": 0.0}),
                                                                 (".*", {"lr": 1e-4})]
    model = torch.nn.Sequential()
    model.add_module("norm", torch.nn.LayerNorm(2))
    model.add_module("proj", torch.nn.Linear(2, 2))
    config = dataclasses.replace(parse(toml=str(tmp_path / "t.toml")).optimizer, implementation="for-loop")
    lrs = sorted(g["lr"] for o in AdamOptimizers(config, model_parts=[model]).optimizers for g in o.param_groups)
    assert lrs == [1e-4, 1e-3]


@pytest.mark.parametrize("change,message", [
    (("pattern = \".*\"", "patern = \".*\""), "optimizer.param_groups[1]: unknown key(s) {'patern'}; allowed: "
     "pattern, optimizer_name, optimizer_kwargs (required: pattern, optimizer_name)"),
    (('pattern = "norm"\n', ""), "optimizer.param_groups[0]: missing key(s) {'pattern'}; allowed: pattern, "
     "optimizer_name, optimizer_kwargs (required: pattern, optimizer_name)"),
    (("{lr = 1e-4}", "1e-4"), "optimizer.param_groups[1].optimizer_kwargs = 0.0001 is not allowed; allowed: a table"),
])
def test_a_bad_optimizer_param_group_is_one_line(tmp_path, change, message):
    """An unknown or missing key of a ``[[optimizer.param_groups]]`` table, or a value of the wrong type, is one line
    naming the table and the allowed keys (before: a dict reached torchtitan, which failed on ``pg.pattern``).
    Mutations: no unknown-key check in ``_table`` (the dataclass' own TypeError); no missing-key check."""
    (tmp_path / "t.toml").write_text(PARAM_GROUPS.replace(*change))
    with pytest.raises(ConfigError) as e:
        parse(toml=str(tmp_path / "t.toml"))
    assert str(e.value) == message
    with pytest.raises(ConfigError, match=r"^optimizer.param_groups\[0\] = 'x' is not allowed; allowed: a table "
                                          r"\(keys: pattern, optimizer_name, optimizer_kwargs\)$"):
        parse("--optimizer.param_groups", "x")  # tables are a TOML's only


def test_unknown_key_in_toml(tiny_model_dir, tmp_path):
    text = DEBUG_TOML.read_text().replace("group_size = 8", "group_size = 8\ngroupsize = 4")
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ValueError, match="groupsize"):
        parse(toml=str(p))


def test_unknown_section_in_toml(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="grpoo"):
        parse(toml=_write(tmp_path, "[grpoo]\ngroup_size = 4\n"))


def test_port_already_in_use(tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"weight_sync.master_port = {port}: cannot listen on 127.0.0.1:{port}"):
            validate_config(parse("--weight_sync.master_port", str(port)))


def test_toml_syntax_error_is_one_line_naming_file_and_line(tiny_model_dir, tmp_path):
    """Through the entry point (no torchrun: it stops before any process group). Before: torchtitan logged its
    traceback of the TOMLDecodeError, then ours followed, exit 1."""
    import sys

    bad = _write(tmp_path, "[extra\n")
    line = len(DEBUG_TOML.read_text().splitlines()) + 2
    proc = subprocess.run([sys.executable, "-m", "torchtitan_flux.train", "--job.config_file", bad], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: job.config_file = '{bad}': TOML syntax error: Expected ']' at the end of a table declaration (at line "
        f"{line}, column 7); allowed: valid TOML"]
    proc = subprocess.run([sys.executable, "-m", "torchtitan_flux.train", f"--job.config_file={tmp_path}/no.toml"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stderr.strip().splitlines() == [
        f"error: job.config_file = '{tmp_path}/no.toml': No such file or directory; allowed: a readable TOML file"]


@pytest.mark.parametrize("text,line", [
    ("[grpoo]\ngroup_size = 4\n", "unknown section(s) {'grpoo'}; allowed: activation_checkpoint, adaptive_async,"),
    ("[training]\nstepz = 4\n", "unknown key(s) {'stepz'} in [training]; allowed: disable_cuda_graphs, dtype,"),
])
def test_unknown_toml_section_or_key_is_one_line_through_the_entry_point(tiny_model_dir, tmp_path, text, line):
    """Before: torchtitan's ValueError ("Invalid field names in <class ...>") with a traceback. An unknown key in
    one of our sections is named the same way (test_unknown_key_in_toml checks the parse itself)."""
    import sys

    if "[training]" in text:  # a second [training] table would be a TOML error: put the key into the existing one
        bad = tmp_path / "bad.toml"
        bad.write_text(DEBUG_TOML.read_text().replace("[training]\n", "[training]\nstepz = 4\n", 1))
        bad = str(bad)
    else:
        bad = _write(tmp_path, text)
    proc = subprocess.run([sys.executable, "-m", "torchtitan_flux.train", "--job.config_file", bad], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (only,) = proc.stderr.strip().splitlines()
    assert only.startswith(f"error: job.config_file = '{bad}': {line}"), only


def test_reward_function_checks(tiny_model_dir, tmp_path):
    """A bad reward function stops the run before any engine starts (probed on one empty completion)."""
    from torchtitan_flux.errors import RewardError
    from torchtitan_flux.data.tasks import build_task, check_rewards, prompt_tokenizer

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    for fn, match in [("test_config:nan_reward", "finite"), ("test_config:str_reward", "finite")]:
        cfg = parse("--rollout.task", "dataset", "--rollout.dataset_path", str(data), "--rollout.reward_funcs", fn)
        validate_config(cfg)
        task = build_task(cfg, prompt_tokenizer(cfg))
        with pytest.raises(RewardError, match=match):
            check_rewards(task, 0, 60.0, 16, 60.0)
    cfg = parse("--rollout.task", "dataset", "--rollout.dataset_path", str(data), "--rollout.reward_funcs",
                "test_config:missing")
    with pytest.raises(ConfigError, match="rollout.reward_funcs"):
        validate_config(cfg)


def test_bad_jsonl_record(tiny_model_dir, tmp_path):
    from torchtitan_flux.data.tasks import build_task, prompt_tokenizer

    data = tmp_path / "d.jsonl"
    data.write_text('{"answer": "2"}\n')
    cfg = parse("--rollout.task", "dataset", "--rollout.dataset_path", str(data), "--rollout.reward_funcs",
                "test_config:good_reward")
    with pytest.raises(ValueError, match=r"has columns \['answer'\]; it needs a text column named by rollout.prompt_column"):
        build_task(cfg, prompt_tokenizer(cfg))


def test_step_callbacks_from_config_are_imported_and_take_either_form(tiny_model_dir, tmp_path, monkeypatch):
    """``metrics.step_callbacks``: a torchrun user's way to the tutorial's ``@trainer.add_step_callback`` (before: only
    reachable from Python). The trainer calls them (``test_train_e2e.py::test_two_trainer_processes``)."""
    from torchtitan_flux.user_code import step_callback

    for spec, match in [("_step_callbacks:missing", "metrics.step_callbacks = '_step_callbacks:missing' cannot be "
                                                    "imported"),
                        ("no_such_module:fn", "metrics.step_callbacks = 'no_such_module:fn' cannot be imported"),
                        ("_step_callbacks", "must be of the form 'package.module:attribute'"),
                        ("_step_callbacks:NOT_CALLABLE", "is not callable"),
                        ("_step_callbacks:three_arguments", "metrics.step_callbacks = '_step_callbacks:three_arguments'"
                                                            " takes 3 required arguments; allowed: fn(result) or "
                                                            "fn(step, metrics)")]:
        with pytest.raises(ConfigError, match=re.escape(match)):
            validate_config(parse("--metrics.step_callbacks", spec))
    validate_config(parse("--metrics.step_callbacks", "_step_callbacks:tutorial_form,_step_callbacks:step_and_metrics"))
    out = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FLUX_TEST_CALLBACKS", str(out))
    import _step_callbacks as cb

    for fn in (cb.tutorial_form, cb.step_and_metrics):
        step_callback(fn)(7, {"loss": 0.5})
    assert [json.loads(x)["form"] for x in out.read_text().splitlines()] == ["result", "pair"]
    assert all(json.loads(x)["step"] == 7 and json.loads(x)["loss"] == 0.5 for x in out.read_text().splitlines())


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    import shutil

    return shutil.copytree(tiny_model_dir, tmp_path / "model")


def test_a_corrupt_config_json_is_one_line_naming_the_file(model_copy):
    """Before: json's own message (``Expecting value: line 1 column 1``) from deep in the trainer, no file named."""
    (model_copy / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ConfigError, match=rf"model.hf_assets_path = '{model_copy}': {model_copy}/config.json is not "
                                          r"valid JSON \(Expecting property name"):
        validate_config(parse("--model.hf_assets_path", str(model_copy)))
    (model_copy / "config.json").write_bytes(b'{"model_type": "ll\xffama"}')
    with pytest.raises(ConfigError, match=r"config.json is not valid JSON \('utf-8' codec can't decode byte 0xff"):
        validate_config(parse("--model.hf_assets_path", str(model_copy)))


def test_an_eos_token_outside_the_vocabulary_is_refused(model_copy):
    """Before 2026-11-25 (issue 27): accepted, and no completion could ever end."""
    cfg = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [2, cfg["vocab_size"] + 5]}))
    with pytest.raises(ConfigError, match=rf"config.json: eos_token_id = \[2, {cfg['vocab_size'] + 5}\] is outside the "
                                          rf"vocabulary \(vocab_size = {cfg['vocab_size']}\); allowed: token ids in "):
        validate_config(parse("--model.hf_assets_path", str(model_copy)))


@pytest.mark.parametrize("field, value, match", [
    ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "rope_scaling type 'yarn' is not supported"),
    ("hidden_act", "gelu", "hidden_act"),
])
def test_a_model_variant_we_refuse_is_refused_at_validation(model_copy, field, value, match):
    """Before 2026-11-25 (issue 27): the same error, but raised in model.py while torchtitan built the trainer, with
    a traceback."""
    cfg = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ConfigError, match=rf"^model.hf_assets_path = '{model_copy}': .*{match}"):
        validate_config(parse("--model.hf_assets_path", str(model_copy)))


def test_a_truncated_safetensors_file_is_named(model_copy):
    """Before: safetensors' ``SafetensorError: Error while deserializing header`` with a traceback, no file named.
    The trainer turns this ValueError into ``error: model.hf_assets_path = ...: <this>`` (GRPOTrainer.__init__)."""
    from torchtitan_flux.models.hf import read_state_dict

    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"{weights} cannot be read as safetensors \(.*file not fully covered\): "
                                         r"truncated or corrupt"):
        read_state_dict(model_copy)


@pytest.mark.parametrize("fname, text, match", [
    ("tokenizer.json", '{"version": "1.0", "model": {', r"tokenizer.json cannot be loaded \(EOF while parsing"),
    ("tokenizer_config.json", '{"bos_token": ', r"tokenizer_config.json is not valid JSON \(Expecting value"),
])
def test_a_corrupt_tokenizer_is_one_line_naming_the_file(model_copy, fname, text, match):
    from torchtitan_flux.data.tasks import prompt_tokenizer

    (model_copy / fname).write_text(text)
    with pytest.raises(ConfigError, match=rf"model.hf_assets_path = '{model_copy}': {match}"):
        prompt_tokenizer(parse("--model.hf_assets_path", str(model_copy)))


def test_cli_error_before_any_engine_is_spawned(tiny_model_dir, tmp_path):
    """Through torchrun: non-zero exit, the message names the field, and no engine process was started."""
    from conftest import torchrun_cmd

    proc = subprocess.run(
        torchrun_cmd(tmp_path, "--grpo.group_size", "1"), cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert "grpo.group_size = 1 is out of range; allowed: an integer in [2, 4096]" in proc.stderr + proc.stdout
    assert "engine0" not in proc.stderr + proc.stdout
    assert not (tmp_path / "metrics.jsonl").exists()



def test_controller_target_out_of_reach_is_warned_with_a_fix(tiny_model_dir):
    from torchtitan_flux.run.validation import staleness_out_of_reach

    a = parse("--adaptive_async.enabled", "true").adaptive_async
    hint = staleness_out_of_reach(a, 1)  # target 0.15, but the gap term reaches at most 0.3 * 1/5 = 0.06
    assert hint and "raise off_policy.max_version_gap to 3" in hint  # 0.3 * 3/5 = 0.18 >= 0.15
    assert staleness_out_of_reach(a, 3) is None


def test_default_version_gap_is_real_and_the_controller_says_when_it_needs_more(tiny_model_dir, caplog):
    """``off_policy.max_version_gap`` is 1 by default, with or without the controller, and validation never writes
    into the config; the default (throughput) law has nothing to choose at gap 1, and with the "pid" law's default
    target (0.15) gap 1 is out of reach: validation warns about each with the fix (pid: 3 reaches it)."""
    from torchtitan_flux.run.validation import staleness_out_of_reach

    def warnings(*overrides) -> list[str]:
        caplog.clear()
        cfg = parse(*overrides)
        before = dataclasses.asdict(cfg.off_policy)
        with caplog.at_level(logging.WARNING, logger="torchtitan_flux"):
            validate_config(cfg)
        assert dataclasses.asdict(cfg.off_policy) == before
        return [r.getMessage() for r in caplog.records]

    fixed = parse("--weight_sync.async_weight_update", "true")
    validate_config(fixed)
    assert fixed.off_policy.max_version_gap == 1 and fixed.off_policy.async_ratio is None  # unset: follows
    assert any("has nothing to choose" in m for m in warnings("--adaptive_async.enabled", "true"))
    assert not warnings("--adaptive_async.enabled", "true", "--off_policy.max_version_gap", "8")
    tuned = ("--adaptive_async.enabled", "true", "--off_policy.max_version_gap", "8", "--adaptive_async.kp", "2",
             "--adaptive_async.phase_schedule.warmup.steps", "5")
    assert [m for m in warnings(*tuned) if "does not read them" in m] == [
        "adaptive_async.kp, adaptive_async.phase_schedule set, but adaptive_async.controller = \"throughput\" (the "
        "default) does not read them; set adaptive_async.controller = \"pid\" for the staleness law they tune"]
    assert not warnings(*tuned, "--adaptive_async.controller", "pid")
    pid = ("--adaptive_async.enabled", "true", "--adaptive_async.controller", "pid")
    assert any("raise off_policy.max_version_gap to 3" in m for m in warnings(*pid))
    explicit = parse(*pid, "--off_policy.max_version_gap", "3")
    validate_config(explicit)
    assert explicit.off_policy.max_version_gap == 3 and staleness_out_of_reach(explicit.adaptive_async, 3) is None


def test_the_toggle_alone_makes_a_run_asynchronous_and_an_explicit_ratio_wins(tmp_path):
    """``weight_sync.async_weight_update`` selects the push mode and, while ``off_policy.async_ratio`` is unset,
    the ratio too (1 when true, 0 when false); an explicit ratio wins; the controller sets its own."""
    from torchtitan_flux.rl.off_policy import OffPolicyControl

    def control(*overrides):
        cfg = parse(*overrides)
        validate_config(cfg)
        return OffPolicyControl(cfg.off_policy, cfg.adaptive_async, cfg.weight_sync, 10)

    toggle = control("--weight_sync.async_weight_update", "true", "--off_policy.max_version_gap", "4")
    assert (toggle.async_push, toggle.async_ratio, toggle.lookahead, toggle.on_policy) == (True, 1.0, 4.0, False)
    explicit = control("--weight_sync.async_weight_update", "true", "--off_policy.async_ratio", "1",
                       "--off_policy.max_version_gap", "4")
    assert (explicit.async_ratio, explicit.lookahead) == (toggle.async_ratio, toggle.lookahead)
    explicit_0 = control("--weight_sync.async_weight_update", "true", "--off_policy.async_ratio", "0")
    assert explicit_0.async_push and explicit_0.on_policy
    blocking_ahead = control("--off_policy.async_ratio", "0.5", "--off_policy.max_version_gap", "2")
    assert not blocking_ahead.async_push and blocking_ahead.lookahead == 1.0  # push mode and ratio are independent
    sync = control()
    assert sync.async_ratio == 0.0 and sync.on_policy
    for ratio in ((), ("--off_policy.async_ratio", "0")):  # the controller sets the ratio: the toggle sets nothing
        adaptive = control("--weight_sync.async_weight_update", "true", "--adaptive_async.enabled", "true",
                           "--off_policy.max_version_gap", "3", *ratio)
        assert adaptive.controller is None and adaptive.lookahead == adaptive.throughput.lookahead == 1  # the default
        pid = control("--weight_sync.async_weight_update", "true", "--adaptive_async.enabled", "true",
                      "--adaptive_async.controller", "pid", "--off_policy.max_version_gap", "3", *ratio)
        assert pid.async_ratio == pid.controller.law_ratio == 0.5  # initial_async_ratio
    toml = DEBUG_TOML.read_text().replace("async_weight_update = false", "async_weight_update = true")
    (tmp_path / "toggle.toml").write_text(toml)
    cfg = parse(toml=str(tmp_path / "toggle.toml"))
    validate_config(cfg)
    assert cfg.off_policy.async_ratio is None
    assert OffPolicyControl(cfg.off_policy, cfg.adaptive_async, cfg.weight_sync, 10).async_ratio == 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_profiling_settings_that_cannot_run_are_refused_in_one_line():
    """``[profiling]`` is honoured (the loop enters torchtitan's profiler contexts); what cannot run is refused
    before any work: a memory snapshot without CUDA, a profile_freq shorter than warmup + active steps."""
    with pytest.raises(ConfigError, match="profiling.enable_memory_snapshot = True .* without CUDA"):
        validate_config(parse("--profiling.enable_memory_snapshot", "true"))
    with pytest.raises(ConfigError, match=r"profiling.profile_freq = 3 .* >= profiling.profiler_warmup \+ "):
        validate_config(parse("--profiling.enable_profiling", "true", "--profiling.profile_freq", "3"))
    validate_config(parse("--profiling.enable_profiling", "true", "--profiling.profile_freq", "4"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_pinned_async_checkpoints_without_cuda_are_refused():
    """Before 2026-11-26 (issue 27): torchtitan's stager raised an AssertionError traceback at the first save, the
    steps before it lost."""
    with pytest.raises(ConfigError, match=r"^checkpoint.async_mode = 'async_with_pinned_mem' is out of range; "
                                          r"allowed: disabled \| async on a machine without CUDA"):
        validate_config(parse("--checkpoint.enable", "true", "--checkpoint.async_mode", "async_with_pinned_mem"))
    validate_config(parse("--checkpoint.enable", "true", "--checkpoint.async_mode", "async"))


def test_a_toml_with_a_byte_order_mark_is_one_line(tmp_path):
    """Before 2026-11-27: "Invalid statement (at line 1, column 1)", naming nothing a user could see."""
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf" + DEBUG_TOML.read_bytes())
    with pytest.raises(ConfigError, match=rf"^job.config_file = '{re.escape(str(bom))}' starts with a UTF-8 "
                                          r"byte-order mark; allowed: UTF-8 without one"):
        parse(toml=str(bom))
    assert parse().training.steps == 60


@pytest.mark.parametrize("folder", ["", ".", "./"])
def test_a_checkpoint_folder_that_is_the_dump_folder_is_refused(tmp_path, folder):
    """Before 2026-11-27 it said the folder "is in use by another run (pid N)", N being the run itself."""
    import types

    from torchtitan_flux import train

    config = types.SimpleNamespace(dump_folder=str(tmp_path / "run"),
                                   checkpoint=types.SimpleNamespace(enable=True, folder=folder))
    with pytest.raises(ConfigError, match=rf"^checkpoint.folder = '{re.escape(folder)}' is the dump folder itself; "
                                          r"allowed: a folder of its own, e.g. 'checkpoint'"):
        train._lock_run_folders(config)
    for f in train._LOCKS:  # this process holds the dump folder's lock now: let it go
        f.close()
    train._LOCKS.clear()


def test_a_dump_folder_inside_a_running_runs_is_refused(tmp_path):
    """Before 2026-11-27 a second run writing into the first one's ``hf_final/`` was accepted."""
    import fcntl

    from torchtitan_flux import train

    first = tmp_path / "first"
    first.mkdir()
    lock = open(first / ".flux.lock", "a+")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    lock.write("4242")
    lock.flush()
    inside = str(first / "hf_final" / "run2")
    with pytest.raises(ConfigError, match=rf"^job.dump_folder = '{re.escape(inside)}' is inside "
                                          rf"'{re.escape(str(first))}', the dump folder of a running run \(pid 4242\)"):
        train._refuse_inside_a_running_run(inside)
    lock.close()  # that run ended: its folder may hold another's now
    train._refuse_inside_a_running_run(inside)


def test_a_lock_path_that_is_a_folder_is_named(tmp_path):
    """Issue 27's second sweep: ``.flux.lock`` a folder gave "cannot be used (Is a directory)", naming no path
    that was one."""
    from torchtitan_flux.train import _lock_folder

    (tmp_path / ".flux.lock").mkdir()
    with pytest.raises(ConfigError, match=rf"^job.dump_folder = '{re.escape(str(tmp_path))}' cannot be used "
                                          rf"\({re.escape(str(tmp_path / '.flux.lock'))}: Is a directory\); allowed"):
        _lock_folder("job.dump_folder", str(tmp_path), str(tmp_path))


def test_start_up_compares_the_resumed_checkpoints_fingerprint(tiny_model_dir, tmp_path):
    """The fingerprint comparison is reached from the start-up path (``preflight``), not only when called directly:
    a mutation audit found every default-suite resume test passing with start-up never comparing (they call the
    check themselves); only a slow end-to-end test caught it."""
    import json

    from torchtitan_flux.run import resume
    from torchtitan_flux.run.preflight import preflight

    dump = tmp_path / "run"
    cfg = parse("--job.dump_folder", str(dump), "--checkpoint.enable", "true")
    validate_config(cfg)
    first = preflight(cfg)  # no checkpoint yet: nothing to compare
    step_dir = dump / "checkpoint" / "step-3"
    step_dir.mkdir(parents=True)
    (step_dir / ".metadata").write_bytes(b"")  # complete, as far as the listing goes
    (step_dir / resume.FINGERPRINT).write_text(json.dumps({**first.fingerprint, "grpo.group_size": 4}))
    with pytest.raises(ConfigError, match=r"^grpo.group_size"):
        preflight(cfg)
    (step_dir / resume.FINGERPRINT).write_text(json.dumps(first.fingerprint))
    assert preflight(cfg).config_changes == []


def test_path_fields_are_made_absolute(tmp_path, monkeypatch):
    """``train._absolute_paths``: relative and ``~`` paths from the command line, the TOML or torchtitan's default
    become absolute, resolved once against the directory the run starts in."""
    from torchtitan_flux.run.trainer import GRPOTrainer
    from torchtitan_flux.train import PATH_FIELDS, _absolute_paths

    assert PATH_FIELDS["job.dump_folder"] == GRPOTrainer.Config().dump_folder  # torchtitan's default, resolved too
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", "/home/someone")
    toml = tmp_path / "c.toml"
    toml.write_text("[model]\nhf_assets_path = \"assets/m\"\n[rollout]\ndataset_path = \"/abs/data\"\n")
    cfg = load_config(["--job.config_file", str(toml), "--job.dump_folder", "~/x"], GRPOTrainer.Config())
    _absolute_paths(cfg)
    assert (cfg.dump_folder, cfg.hf_assets_path) == ("/home/someone/x", str(tmp_path / "assets/m"))
    assert (cfg.rollout.dataset_path, cfg.eval.dataset_path) == ("/abs/data", "")
    cfg = load_config(["--job.config_file", str(toml)], GRPOTrainer.Config())
    _absolute_paths(cfg)
    assert cfg.dump_folder == str(tmp_path / "outputs")


def test_colocated_engines_that_cannot_fit_beside_training_are_refused_by_the_formula():
    """Review 4, finding 6: each colocated engine holds max(2, max_version_gap + 1) wire-dtype copies of the model on
    the trainer's device. An 8B model in bf16 with 2 engines and gap 1 cannot fit on an 80 GiB device beside its
    training state; a 0.6B model can."""
    from types import SimpleNamespace

    from torchtitan_flux.run.validation import colocated_memory_problem, hf_param_count

    llama8b = SimpleNamespace(dim=4096, head_dim=128, n_heads=32, n_kv_heads=8, intermediate_size=14336,
                              n_layers=32, vocab_size=128256, tied=False, qk_norm=False, qkv_bias=False)
    qwen06b = SimpleNamespace(dim=1024, head_dim=128, n_heads=16, n_kv_heads=8, intermediate_size=3072,
                              n_layers=28, vocab_size=151936, tied=True, qk_norm=True, qkv_bias=False)
    big, small = hf_param_count(llama8b), hf_param_count(qwen06b)
    assert 8.0e9 < big < 8.1e9 and 0.59e9 < small < 0.61e9, (big, small)
    gpu = 80 * 2**30
    why = colocated_memory_problem(big, 2, engines=2, copies=2, device_bytes=gpu)
    assert why is not None and why.startswith("rollout.colocated = true needs 74.8 GiB for 2 engine(s) x (2 weight")
    assert "allowed: fewer rollout.num_engines" in why and "\n" not in why
    assert colocated_memory_problem(small, 2, engines=2, copies=2, device_bytes=gpu) is None
    # the engines' copies alone can tip it: 0.6B in float32, 8 engines, gap 7 (8 copies each) on a 24 GiB device
    assert colocated_memory_problem(small, 4, engines=8, copies=8, device_bytes=24 * 2**30) is not None


def test_kv_pools_are_counted_colocated_and_refused_on_a_cpu_that_cannot_hold_them(monkeypatch):
    """Continuous batching's KV pool (max_batch_sequences x training.seq_len slots per engine, fixed at its first
    request) is in the colocated formula, and CPU engines' pools must fit in half the memory available: else one
    line naming both fields and the most rows that fit."""
    from torchtitan_flux.run import validation

    gpu, small = 24 * 2**30, 600_000_000
    assert validation.colocated_memory_problem(small, 2, engines=2, copies=2, device_bytes=gpu) is None
    why = validation.colocated_memory_problem(small, 2, engines=2, copies=2, device_bytes=gpu,
                                              pool_bytes=6 * 2**30)
    assert why is not None and "a KV pool (with decode graphs, if on) of 6.0 GiB" in why and "rollout.max_batch_sequences" in why
    cfg = parse("--rollout.continuous_batching", "true", "--rollout.max_batch_sequences", "64")
    pool = validation.kv_pool_bytes(cfg)
    assert pool > 0 and validation.kv_pool_bytes(parse()) == 0  # the serial engine has none
    with_turns = parse("--rollout.continuous_batching", "true", "--rollout.max_batch_sequences", "64",
                       "--rollout.environment", "examples.environments.calculator:CalculatorEnv")
    assert validation.kv_pool_bytes(with_turns) == 2 * pool  # and at most as much kept for next turns
    from torchtitan_flux.models.weight_dict import ModelShape

    model = validation.hf_param_count(ModelShape.from_hf_dir(cfg.hf_assets_path)) * 4
    monkeypatch.setattr(validation.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(validation, "_memory_available", lambda: 2 * model + pool // 64 * 43)  # half: 21.5 rows
    with pytest.raises(ConfigError, match=r"^rollout.max_batch_sequences = 64 rows x training.seq_len = 64 slots: "
                                          r".* allowed: rollout.max_batch_sequences <= 21 here"):
        validate_config(cfg)
    monkeypatch.setattr(validation, "_memory_available", lambda: 2 * (pool + model))
    validate_config(cfg)
    # engines on GPUs: each pool beside its weight versions in the smallest device
    monkeypatch.setattr(validation.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(validation.torch.cuda, "device_count", lambda: 2)
    small = (2**30 + 2 * model + pool // 2) * 10 // 9  # 10% and 1 GiB less: room for half the rows
    sizes = [80 * 2**30, small]
    monkeypatch.setattr(validation.torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(total_memory=sizes[i]))
    with pytest.raises(ConfigError, match=r"more than its .* GiB GPU holds; allowed: rollout.max_batch_sequences "
                                          r"<= 3[12] here"):
        validate_config(cfg)
    sizes[1] = 80 * 2**30
    validate_config(cfg)


def test_validation_checks_colocated_memory_when_cuda_is_available(monkeypatch):
    """``validate_config`` applies the formula with the device's own memory when CUDA is reported (CPU runs skip it:
    there is no device to fill)."""
    from types import SimpleNamespace

    cfg = parse("--rollout.colocated", "true", "--rollout.num_engines", "2")
    validate_config(cfg)  # no CUDA here: not checked
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    total = {"bytes": 2**20}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=total["bytes"]))
    with pytest.raises(ConfigError, match=r"^rollout.colocated = true needs .* GiB for 2 engine\(s\) x \(2 weight"):
        validate_config(cfg)  # the tiny model does not fit on a 1 MiB device
    total["bytes"] = 80 * 2**30
    validate_config(cfg)


def test_a_colocated_gpu_run_with_expandable_segments_is_warned(monkeypatch, caplog):
    """Fifth review, finding 22 (rule 9): colocated engines map the trainer's device staging by CUDA IPC, which for
    expandable segments (torchtitan's ``run_train.sh`` exports ``PYTORCH_ALLOC_CONF=expandable_segments:True``)
    needs ptrace rights between the processes; validation says so in one line, and only for a colocated GPU run."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64,expandable_segments:True")
    with caplog.at_level("WARNING", logger="torchtitan_flux"):
        validate_config(parse("--rollout.colocated", "true"))
        validate_config(parse())  # engines of their own: no CUDA IPC
    warned = [r.getMessage() for r in caplog.records if "expandable_segments" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(
        "PYTORCH_ALLOC_CONF=max_split_size_mb:64,expandable_segments:True with rollout.colocated = true"), warned
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    caplog.clear()
    with caplog.at_level("WARNING", logger="torchtitan_flux"):
        validate_config(parse("--rollout.colocated", "true"))
    assert not any("expandable_segments" in r.getMessage() for r in caplog.records)


def test_an_empty_value_clears_a_list_field_the_toml_set(tmp_path):
    """``--x.list ""`` is the empty list, clearing what the TOML set (tyro read it as ``[""]``: a reward named "").
    Mutation: the check on the field's type (a string field given "" would become a list)."""
    toml = _write(tmp_path, "").replace("bad.toml", "bad.toml")
    text = DEBUG_TOML.read_text().replace('task = "digits"', 'task = "digits"\nreward_funcs = ["a"]\n'
                                          'environment_args = ["n=1"]\nengine_devices = ["cpu"]')
    (tmp_path / "bad.toml").write_text(text)
    cfg = parse("--rollout.environment_args", "", "--rollout.reward_funcs=", "--rollout.task", "",
                "--rollout.reward_weights", "1.0", "--rollout.engine_devices", "", toml=toml)
    assert (cfg.rollout.environment_args, cfg.rollout.reward_funcs, cfg.rollout.engine_devices) == ([], [], [])
    assert (cfg.rollout.task, cfg.rollout.reward_weights) == ("", [1.0])


def test_decode_graphs_memory_is_counted_with_the_kv_pool_and_refused_where_it_cannot_fit(monkeypatch):
    """``rollout.decode_graphs``' static weight copy, per-row buffers and graph pool go through the one count of an
    engine's memory (``engine_pool_bytes``): a GPU that holds colocated engines' KV pools beside training and the
    weight versions but not the graphs too is refused at start in one line naming the field."""
    from torchtitan_flux.models import inference
    from torchtitan_flux.models.weight_dict import ModelShape
    from torchtitan_flux.run import validation

    monkeypatch.setattr(validation.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(validation.torch.cuda, "device_count", lambda: 1)
    common = ("--rollout.continuous_batching", "true", "--rollout.max_batch_sequences", "64", "--rollout.colocated",
              "true", "--weight_sync.async_weight_update", "true")
    eager, graphs = parse(*common), parse(*common, "--rollout.decode_graphs", "true")
    shape = ModelShape.from_hf_dir(graphs.hf_assets_path)
    extra = validation.engine_pool_bytes(graphs) - validation.engine_pool_bytes(eager)
    assert extra == inference.decode_graph_bytes(shape, 64, graphs.training.seq_len, 4)
    assert extra > validation.hf_param_count(shape) * 4  # a static copy of the weights, and more
    assert validation.engine_pool_bytes(eager) == validation.kv_pool_bytes(eager)
    params = validation.hf_param_count(shape)
    copies = max(2, eager.off_policy.max_version_gap + 1)
    need = copies * params * 4 + validation.kv_pool_bytes(eager) + params * 4  # weight versions, pool, staging
    beside = validation.TRAIN_BYTES_PER_PARAM * params + 2 * validation.CUDA_CONTEXT_BYTES  # training, 2 processes
    fits = (need + extra // 2 + beside) * 10 // 9 + 100  # a device that holds the pool and half the graphs
    monkeypatch.setattr(validation.torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(total_memory=fits))
    validate_config(eager)
    with pytest.raises(ConfigError, match=r"^rollout.colocated = true needs .* a KV pool \(with decode graphs, if on\) "
                                          r"of .*, rollout.decode_graphs = false, or engines on their own GPUs"):
        validate_config(graphs)


def test_the_0_2_2_sections_a_task_factory_may_read_name_their_new_place():
    """A user's task factory or callback written for torchtitan 0.2.2 reads ``config.model.hf_assets_path`` or
    ``config.job.dump_folder``: the AttributeError (which the factory's error line quotes) names the new field.
    Mutation: without ``__getattr__`` the message is Python's bare "no attribute 'model'"."""
    cfg = parse()
    with pytest.raises(AttributeError, match=r"^config.model is gone with torchtitan 0.3.0: read config.hf_assets_path"):
        cfg.model.hf_assets_path
    with pytest.raises(AttributeError, match=r"^config.job is gone .* read config.dump_folder"):
        cfg.job.dump_folder
    with pytest.raises(AttributeError, match=r"object has no attribute 'nonsense'"):
        cfg.nonsense
    assert cfg.hf_assets_path and cfg.dump_folder


def test_spmd_types_with_a_tied_model_on_several_ranks_is_refused(tmp_path, monkeypatch):
    """torchtitan 0.3.0's "spmd_types" trains a tied model wrong over several ranks
    (test_patches.py::test_spmd_types_trains_a_tied_model_wrong_over_two_ranks): our default is "partial_dtensor", and
    "spmd_types" with a tied model and WORLD_SIZE > 1 is one line naming the field. Mutation: the tie or the world
    size left out of the check."""
    import shutil

    tied = tmp_path / "tied"
    shutil.copytree(ROOT / "assets" / "tiny-llama", tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    monkeypatch.setenv("WORLD_SIZE", "2")
    default = parse("--model.hf_assets_path", str(tied))
    assert default.parallelism.spmd_backend == "partial_dtensor"
    validate_config(default)
    validate_config(parse("--parallelism.spmd_backend", "spmd_types"))  # untied: both backends train it right
    bad = parse("--model.hf_assets_path", str(tied), "--parallelism.spmd_backend", "spmd_types")
    with pytest.raises(ConfigError, match=r"^parallelism.spmd_backend = 'spmd_types' trains a model with tied "
                                          r"embeddings .* wrong over 2 ranks .*; allowed: 'partial_dtensor'"):
        validate_config(bad)
    monkeypatch.setenv("WORLD_SIZE", "1")
    validate_config(bad)


def test_fsdp_cpu_offload_is_refused_in_one_line():
    """torchtitan's ``training.enable_cpu_offload`` steps the optimizer on the host, where nothing orders it after the
    snapshot's side-stream read: refused before anything starts. Mutation: the check removed."""
    validate_config(parse())
    with pytest.raises(ConfigError, match=r"^training.enable_cpu_offload = True is out of range; allowed: false "):
        validate_config(parse("--training.enable_cpu_offload", "true"))
