"""The example configs for real models parse and validate, and their models build on the meta device with the real
dimensions (``tests/fixtures/*/config.json`` are the published config.json files; no downloads)."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import ROOT

from torchtitan_flux.patches import apply_patches

apply_patches()


from torchtitan_flux.run.validation import validate_config  # noqa: E402
from torchtitan_flux.models.families import model_spec as model_spec_of  # noqa: E402
from torchtitan_flux.run.config_file import load_config
from torchtitan_flux.run.trainer import GRPOTrainer  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"


REAL_MODELS = [
    # published sizes: Qwen3-1.7B 1.72 B parameters (tied), Llama-3.2-1B 1.24 B (tied)
    ("qwen3-1.7b", "flux_qwen3", 1_720_574_976),
    ("llama-3.2-1b-instruct", "flux_llama", 1_235_814_400),
]


@pytest.mark.parametrize("fixture,spec,params", REAL_MODELS)
def test_the_real_models_build_on_meta_with_their_published_sizes(fixture, spec, params):
    """The model spec of a published config.json builds the model with its real dimensions (torchtitan 0.3.0's
    config tree: tying, head_dim and FFN width from the file)."""
    model_spec = model_spec_of(FIXTURES / fixture)
    assert model_spec.name == spec
    with torch.device("meta"):
        model = model_spec.model.build()
    assert sum(p.numel() for p in model.parameters()) == params  # a tied head is counted once
    assert model.lm_head.weight is model.tok_embeddings.weight


@pytest.mark.parametrize("toml,fixture", [("qwen3_1p7b_gsm8k_8gpu.toml", "qwen3-1.7b"),
                                          ("llama3p2_1b_gsm8k_8gpu.toml", "llama-3.2-1b-instruct")])
def test_example_config_parses_and_validates(toml, fixture, tmp_path):
    import shutil

    from model_assets import build_tokenizer
    from torchtitan.distributed.activation_checkpoint import FullAC

    shutil.copy(FIXTURES / fixture / "config.json", tmp_path / "config.json")
    build_tokenizer(tmp_path)  # validation wants a tokenizer; the real one is not needed to build the model
    # The configs launch vLLM from .venv-vllm, which the default suite does not need: any existing Python passes the
    # path check (that the launch Python exists is tested in test_config.py).
    args = ["--job.config_file", str(ROOT / "train_configs" / toml), "--model.hf_assets_path", str(tmp_path),
            "--rollout.launch_python", sys.executable]
    job = load_config(args, GRPOTrainer.Config())
    validate_config(job)
    assert job.training.mixed_precision_param == "bfloat16" and isinstance(job.activation_checkpoint, FullAC.Config)
    assert job.rollout.engine == "vllm" and job.weight_sync.probe_every > 0
