"""Real vLLM CPU servers (``.venv-vllm``) serving tiny models of every family (``hf_families.py``): a tied Llama,
an untied Llama whose head_dim is not hidden_size / heads, a tied Qwen3 and a tied Qwen2.5: GRPO runs with a push
and a post-sync probe after every step, and wrong pushes that the probe must catch.

Marked ``slow`` and ``vllm`` (each server takes ~30-60 s to start on 2 cores); skipped without ``.venv-vllm``.
"""

from __future__ import annotations

import json
import queue

import pytest
import torch

import transformers  # noqa: F401,E402 - a dev dependency (pyproject): missing, this file errors instead of skipping

from _engine_push import (as_pushed, engine_specs, layout_of, push_like_syncer,  # noqa: E402
                          trainer_weights, wait_event)
from conftest import ROOT, need_vllm, read_metrics, run_train  # noqa: E402
from hf_families import build_hf_model  # noqa: E402

from torchtitan_flux.models import inference  # noqa: E402

from torchtitan_flux.wire import transport

from torchtitan_flux.models import weight_dict
from torchtitan_flux.engine.base import WeightAck, WeightGroupInfo  # noqa: E402
from torchtitan_flux.sync.probe import PROBE_TEXT, compare
from torchtitan_flux.errors import ProbeMismatch  # noqa: E402
from torchtitan_flux.sync.pusher import trainer_group  # noqa: E402

VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(autouse=True)
def _needs_vllm(monkeypatch):
    need_vllm()
    monkeypatch.setenv("VLLM_MAX_MODEL_LEN", "256")  # the tiny models' max_position_embeddings


@pytest.mark.parametrize("family,tied", [("llama", True), ("llama", False), ("qwen3", True), ("qwen2", True)])
def test_grpo_with_launched_vllm_probe_passes_after_every_push(family, tied, tmp_path):
    model_dir = build_hf_model(tmp_path / "model", family, tied=tied)
    dump = tmp_path / "run"
    run_train(dump, "--training.steps", "4", "--model.hf_assets_path", str(model_dir), "--rollout.engine", "vllm",
              "--rollout.launch", "true", "--weight_sync.probe_every", "1", "--weight_sync.probe_tolerance", "1e-3",
              timeout=600)
    rows = read_metrics(dump)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["probe_engines_checked"] == 1 and r["probe_max_abs_diff"] < 1e-3 for r in rows), rows
    summary = json.loads((dump / "summary.json").read_text())
    assert summary["final_engine_version"] == 4 and summary["checksums_match"]
    assert json.loads((dump / "hf_final" / "config.json").read_text())["tie_word_embeddings"] is tied


@pytest.fixture(scope="module")
def tied_llama_server(tmp_path_factory):
    """A launched vLLM server on a tied Llama, and the handler of it."""
    import os

    from torchtitan_flux.engine.vllm_launch import resolve_launch_python
    from torchtitan_flux.engine.vllm import VllmEngine
    from torchtitan_flux.engine.vllm_launch import launch_servers

    need_vllm()
    root = tmp_path_factory.mktemp("vllm_tied")
    model_dir = build_hf_model(root / "model", "llama", tied=True)
    os.environ["VLLM_MAX_MODEL_LEN"] = "256"
    (server,) = launch_servers(1, str(model_dir), python=resolve_launch_python(".venv-vllm/bin/python"),
                               log_dir=str(root), timeout_s=600)
    events: queue.Queue = queue.Queue()
    handler = VllmEngine("vllm0", server.url, events, model_dir=str(model_dir), health_interval_s=1.0)
    try:
        handler.start()
        yield model_dir, handler, events
    finally:
        handler.close()
        server.stop()


def _push(handler, events, specs, weights, version, layout=None):
    """As the syncer pushes: HF names at the join, HF layout in the buckets (``layout``: the folder's)."""
    store = transport.connect_store("127.0.0.1", 0, 60, True)
    info = WeightGroupInfo("127.0.0.1", store.port, f"flux_ws/vllm0/{version}", "gloo", 60.0,
                           engine_specs(handler, specs, layout), 512 * 1024)
    handler.join_weight_group(info)
    pg = trainer_group(handler, store, info)
    push_like_syncer(handler, pg, transport.plan_buckets(specs, 512 * 1024), weights, version, layout)
    assert wait_event(events, WeightAck, timeout=120).version == version


def test_probe_catches_wrong_pushes(tied_llama_server):
    """Right push: the probe passes. A push with a tensor left out, and the old untying trainer (a separate
    ``lm_head`` pushed to a tied engine, which drops it): the probe fails naming the engine and version."""
    model_dir, handler, events = tied_llama_server
    weights, shape = trainer_weights(model_dir), weight_dict.ModelShape.from_hf_dir(model_dir)
    tokens = [1] + [3 + b for b in PROBE_TEXT.encode()][:60]
    seq = torch.tensor([tokens])
    gen = torch.Generator().manual_seed(0)
    trained = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
    specs = [transport.TensorSpec(n, tuple(v.shape), "float32") for n, v in trained.items()]

    _push(handler, events, specs, trained, 1)
    version, got = handler.score(tokens)
    expected = inference.score(as_pushed(layout_of(handler.model_dir), trained), shape, seq)[0]
    report = compare(handler.name, version, tokens, expected, got, 1e-3)
    assert version == 1 and report.max_abs_diff < 1e-3

    # a tensor left out: the engine keeps its version-1 value of it
    moved = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in trained.items()}
    left_out = "layers.1.feed_forward.w2.weight"
    partial = [s for s in specs if s.name != left_out]
    _push(handler, events, partial, moved, 2)
    version, got = handler.score(tokens)
    with pytest.raises(ProbeMismatch, match="engine vllm0 at version 2"):
        compare(handler.name, version, tokens,
                inference.score(as_pushed(layout_of(handler.model_dir), moved), shape, seq)[0], got, 1e-3)

    # the old behaviour: the trainer unties, trains a separate head and pushes it as lm_head.weight
    untied_shape = dataclasses_replace(shape, tied=False)
    untied = {**moved, "lm_head.weight": moved["tok_embeddings.weight"] + 0.2 * torch.randn(
        moved["tok_embeddings.weight"].shape, generator=gen)}
    untied_specs = specs + [transport.TensorSpec("lm_head.weight", tuple(untied["lm_head.weight"].shape), "float32")]
    untied_layout = _untied_layout(model_dir)  # the pre-fix trainer's names: lm_head.weight included
    _push(handler, events, untied_specs, untied, 3, untied_layout)
    version, got = handler.score(tokens)
    with pytest.raises(ProbeMismatch, match="engine vllm0 at version 3"):
        compare(handler.name, version, tokens, inference.score(as_pushed(untied_layout, untied), untied_shape, seq)[0],
                got, 1e-3)


def dataclasses_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


def _untied_layout(model_dir):
    from torchtitan_flux.models.hf_weights import HFLayout
    from torchtitan_flux.models.families import config_from_hf_dir

    config = config_from_hf_dir(model_dir)
    config.enable_weight_tying = False
    return HFLayout(config)
