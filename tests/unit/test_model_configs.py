"""The example configs for real models parse, validate and build their model on the meta device with the real
dimensions (``tests/fixtures/*/config.json`` are the published config.json files; no downloads)."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import ROOT

from torchtitan_flux.patches import apply_patches

apply_patches()

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.protocols.train_spec import get_train_spec  # noqa: E402

from torchtitan_flux.run.validation import validate_config  # noqa: E402
from torchtitan_flux.models.families import register_families, select_model  # noqa: E402
from torchtitan_flux.train import _normalise_argv  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"


@pytest.mark.parametrize("toml,fixture,spec,params", [
    # published sizes: Qwen3-1.7B 1.72 B parameters (tied), Llama-3.2-1B 1.24 B (tied)
    ("qwen3_1p7b_gsm8k_8gpu.toml", "qwen3-1.7b", "flux_qwen3", 1_720_574_976),
    ("llama3p2_1b_gsm8k_8gpu.toml", "llama-3.2-1b-instruct", "flux_llama", 1_235_814_400),
])
def test_example_config_builds_the_real_model_on_meta(toml, fixture, spec, params, tmp_path):
    import shutil

    from model_assets import build_tokenizer

    shutil.copy(FIXTURES / fixture / "config.json", tmp_path / "config.json")
    build_tokenizer(tmp_path)  # validation wants a tokenizer; the real one is not needed to build the model
    # The configs launch vLLM from .venv-vllm, which the default suite does not need: any existing Python passes the
    # path check (that the launch Python exists is tested in test_config.py).
    args = ["--job.config_file", str(ROOT / "train_configs" / toml), "--model.hf_assets_path", str(tmp_path),
            "--rollout.launch_python", sys.executable]
    job = ConfigManager().parse_args(_normalise_argv(args))
    validate_config(job)
    register_families()
    job = select_model(job)
    assert job.model.name == spec
    train_spec = get_train_spec(job.model.name)
    model_args = train_spec.model_args[job.model.flavor]
    model_args.update_from_config(job)
    with torch.device("meta"):
        model = train_spec.model_cls(model_args)
    assert sum(p.numel() for p in model.parameters()) == params  # a tied head is counted once
    assert model.output.weight is model.tok_embeddings.weight
    assert job.training.mixed_precision_param == "bfloat16" and job.activation_checkpoint.mode == "full"
    assert job.rollout.engine == "vllm" and job.weight_sync.probe_every > 0
