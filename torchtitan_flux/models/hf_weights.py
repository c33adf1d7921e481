"""HF weights <-> torchtitan models, trainer side, through each family's state-dict adapter (``families.py``):
``load_hf_weights`` (checked key by key and shape by shape first), ``export_hf_weights`` (a loadable HF folder; a
tied model stays tied), and ``HFLayout`` (the HF names and layout every engine is pushed).

Simplifications: every rank reads the whole files on load (then keeps its shards); export gathers the full state
dict to rank 0's CPU and writes one ``model.safetensors`` (no sharded export).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

# first: importing ``families`` applies the CPU patches torchtitan needs before it is imported
from torchtitan_flux.models.families import config_from_hf_dir, state_dict_adapter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from torchtitan.models.common import ComplexRoPE

from torchtitan_flux.models import hf

# Non-weight files copied by export_hf_weights so the exported folder is itself a loadable model dir.
ASSET_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


class HFLayout:
    """Names and tensor layout of torchtitan parameters as every engine loads them: HF's (the embedded engine's
    forward, vLLM, SGLang). The one place the trainer's parameter names meet the engines'."""

    # the parameters whose rows ``to_hf`` permutes when RoPE is complex (interleaved): llama's q and k
    PERMUTED = ("attention.qkv_linear.wq.weight", "attention.qkv_linear.wk.weight")

    def __init__(self, model_config):
        self.adapter = state_dict_adapter(model_config)
        self.permuted = isinstance(model_config.layers[0].attention.rope, ComplexRoPE.Config)

    @classmethod
    def from_hf_dir(cls, hf_dir: str | os.PathLike) -> "HFLayout":
        return cls(config_from_hf_dir(hf_dir))

    def hf_names(self, names: list[str], shapes: list[tuple[int, ...]]) -> list[str]:
        """HF names of torchtitan parameter names, in order (``to_hf`` on meta tensors: no data is touched)."""
        meta = {n: torch.empty(s, device="meta") for n, s in zip(names, shapes)}
        try:
            out = list(self.adapter.to_hf(meta))
        except KeyError as e:
            raise ValueError(f"parameter {e.args[0]!r} has no HF name") from None
        if len(out) != len(names):
            raise ValueError(f"{len(names)} parameters map to {len(out)} HF names (a tied output projection "
                             "is not a parameter of its own and has no HF name)")
        return out

    def hf_specs(self, specs: list) -> list:
        """A push's parameter list (``transport.TensorSpec``s of clean torchtitan names) under HF names, in order."""
        names = self.hf_names([s.name for s in specs], [s.shape for s in specs])
        return [dataclasses.replace(s, name=n) for s, n in zip(specs, names)]

    def wire_tensor(self, name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A torchtitan parameter in HF layout (llama: q/k rows permuted by ``to_hf``; otherwise unchanged, as is).
        ``dtype``: a tensor that is rewritten is cast to it first (the snapshot's wire dtype: its copies then hold
        wire bytes, not the parameter's)."""
        if not self.permuted or not name.endswith(self.PERMUTED):
            return tensor
        if dtype is not None and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        (out,) = self.adapter.to_hf({name: tensor}).values()
        return out


def build_reference_model(model_spec, parallel_dims, config, device) -> nn.Module:
    """A frozen copy of the initial policy (for the KL penalty): built from ``model_spec`` and parallelised like the
    policy (``config``: the trainer's ``Trainer.Config``), then loaded from ``config.hf_assets_path``. Collective
    under FSDP: every rank calls it."""
    with torch.device("meta"):
        ref = model_spec.model.build()
    ref = model_spec.parallelize_fn(ref, parallel_dims=parallel_dims, training=config.training,
                                    parallelism=config.parallelism, compile_config=config.compile,
                                    ac_config=config.activation_checkpoint, dump_folder=config.dump_folder)
    ref.to_empty(device=device)
    with torch.no_grad():
        ref.init_weights(buffer_device=None)
    load_hf_weights(ref, config.hf_assets_path, model_spec.model)
    return ref.eval().requires_grad_(False)


def load_hf_weights(model: nn.Module, hf_dir: str | os.PathLike, model_config) -> None:
    """Load HF safetensors from ``hf_dir`` into ``model`` (plain or FSDP2); FileNotFoundError naming a missing
    file, or ValueError listing missing / unexpected keys and shape mismatches."""
    hf_dir = Path(hf_dir)
    files = hf.weight_files(hf_dir)
    hf_sd = hf.read_state_dict(hf_dir)
    if model_config.enable_weight_tying:  # some tied checkpoints store lm_head anyway: the embedding is the projection
        hf_sd.pop("lm_head.weight", None)

    meta = {hf.clean_name(k): torch.empty(v.shape, device="meta") for k, v in model.state_dict().items()}  # global
    expected = {k: tuple(v.shape) for k, v in state_dict_adapter(model_config).to_hf(meta).items()}
    missing = sorted(set(expected) - set(hf_sd))
    unexpected = sorted(set(hf_sd) - set(expected))
    mismatched = [f"{k}: file {tuple(hf_sd[k].shape)} vs model {expected[k]}"
                  for k in sorted(set(expected) & set(hf_sd)) if tuple(hf_sd[k].shape) != expected[k]]
    if missing or unexpected or mismatched:
        where = ", ".join(str(p) for p in files)
        parts = []
        if missing:
            parts.append(f"missing keys {missing}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected}")
        if mismatched:
            parts.append(f"shape mismatches [{'; '.join(mismatched)}]")
        raise ValueError(f"HF weights in {where} do not match the model built from config.json: " + "; ".join(parts))

    sd = state_dict_adapter(model_config).from_hf(hf_sd)
    set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, strict=True))


def export_hf_weights(model: nn.Module, out_dir: str | os.PathLike, model_config, hf_assets_dir: str | os.PathLike,
                      *, barrier: bool = True) -> Path | None:
    """Write ``model`` as a HF folder (``model.safetensors`` + config/tokenizer copied from ``hf_assets_dir``).
    Every rank calls it (gathers the full state dict); rank 0 writes and gets the folder, others None. With
    ``barrier`` all ranks wait for the write."""
    from safetensors.torch import save_file

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = Path(out_dir)
    result: Path | None = None
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        sd = {hf.clean_name(k): (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in sd.items()}
        hf_sd = state_dict_adapter(model_config).to_hf(sd)
        hf_sd = {k: v.detach().to("cpu").contiguous() for k, v in hf_sd.items()}
        out.mkdir(parents=True, exist_ok=True)
        src = Path(hf_assets_dir)
        # A stale index / shards / build record would shadow or misdescribe the new weights.
        for stale in [out / hf.INDEX_FILE, out / "flux_build.json", *out.glob("model-*-of-*.safetensors")]:
            stale.unlink(missing_ok=True)
        tmp = out / (hf.WEIGHTS_FILE + ".tmp")
        save_file(hf_sd, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / hf.WEIGHTS_FILE)
        if src.resolve() != out.resolve():
            for name in ASSET_FILES:
                if (src / name).is_file():
                    shutil.copyfile(src / name, out / name)
        cfg_path = out / "config.json"
        if cfg_path.is_file():
            cfg = json.loads(cfg_path.read_text())
            dtypes = {v.dtype for v in hf_sd.values()}
            cfg["tie_word_embeddings"] = model_config.enable_weight_tying  # a tied model stays tied (no lm_head)
            if len(dtypes) == 1:
                cfg["torch_dtype"] = str(next(iter(dtypes))).replace("torch.", "")
            cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
        result = out
    if barrier and distributed:
        dist.barrier()
    return result
