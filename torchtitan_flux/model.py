"""Trainer-side model plumbing: the ``flux_llama3`` TrainSpec, HF config -> torchtitan args, HF weight I/O.

* ``FluxLlamaArgs``: torchtitan ``TransformerModelArgs`` whose ``update_from_config`` reads
  ``{model.hf_assets_path}/config.json`` (a HF ``LlamaConfig``), so ``--model.name flux_llama3
  --model.flavor hf --model.hf_assets_path DIR`` trains whatever Llama lives in DIR.
* ``register_flux_model()``: registers that TrainSpec (idempotent).
* ``load_hf_weights`` / ``export_hf_weights``: HF safetensors <-> a (possibly FSDP2-sharded) torchtitan
  model via ``torch.distributed.checkpoint.state_dict`` with full state dicts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:  # torchtitan 0.2.2 needs a few patches on CPU-only machines (e.g. no triton).
    from torchtitan_flux.patches import apply_patches as _apply_patches  # type: ignore[attr-defined]
except ImportError:
    _apply_patches = None
if _apply_patches is not None:
    _apply_patches()

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from torchtitan.models.llama3 import Llama3StateDictAdapter, TransformerModelArgs
from torchtitan.models.llama3.model.args import RoPEScalingArgs

FLUX_MODEL_NAME = "flux_llama3"
FLUX_FLAVOR = "hf"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Non-weight files copied by export_hf_weights so the exported folder is itself a loadable model dir.
ASSET_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


# --------------------------------------------------------------------------------------------------
# HF config -> torchtitan args
# --------------------------------------------------------------------------------------------------


def torchtitan_ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Hidden size of torchtitan's llama3 ``FeedForward`` (``TransformerBlock`` passes ``4 * dim``)."""
    hidden_dim = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden_dim = int(ffn_dim_multiplier * hidden_dim)
    return multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)


def solve_ffn_args(dim: int, intermediate_size: int) -> tuple[int, float | None]:
    """(multiple_of, ffn_dim_multiplier) making torchtitan's FFN hidden dim exactly ``intermediate_size``.

    Prefers torchtitan's conventional values (256/None; 1024 or 4096 with 1.3 as in Llama-3), then
    ``multiple_of = intermediate_size`` (with a multiplier shrinking the base size when needed).
    """
    if int(intermediate_size) != intermediate_size or intermediate_size <= 0 or dim <= 0:
        raise ValueError(
            f"cannot reproduce intermediate_size={intermediate_size!r} with hidden_size={dim!r}: "
            "both must be positive integers"
        )
    intermediate_size = int(intermediate_size)
    base = int(2 * (4 * dim) / 3)
    candidates: list[tuple[int, float | None]] = [
        (256, None),
        (1024, 1.3),
        (4096, 1.3),
        (4096, 1.2),
        (intermediate_size, None),
    ]
    if base > 0:
        candidates += [
            (intermediate_size, (intermediate_size + 0.5) / base),
            (intermediate_size, intermediate_size / base),
        ]
    for multiple_of, mult in candidates:
        if torchtitan_ffn_hidden_dim(dim, multiple_of, mult) == intermediate_size:
            return multiple_of, mult
    raise ValueError(
        f"cannot choose multiple_of/ffn_dim_multiplier so that torchtitan's FeedForward hidden dim "
        f"equals intermediate_size={intermediate_size} for hidden_size={dim}"
    )


def _rope_scaling_from_hf(cfg: dict[str, Any]) -> RoPEScalingArgs:
    rs = cfg.get("rope_scaling")
    if rs is None:
        rope_type = "default"
    else:
        rope_type = rs.get("rope_type", rs.get("type", "default"))
    if rope_type == "default":
        # torchtitan always applies llama3-style scaling; factor 1 makes it the identity.
        return RoPEScalingArgs(scaling_factor=1.0, low_freq_factor=1.0, high_freq_factor=4.0)
    if rope_type != "llama3":
        raise ValueError(
            f"config.json rope_scaling type {rope_type!r} is not supported (only 'llama3' or none)"
        )
    d = RoPEScalingArgs()
    return RoPEScalingArgs(
        scaling_factor=float(rs.get("factor", d.scaling_factor)),
        low_freq_factor=float(rs.get("low_freq_factor", d.low_freq_factor)),
        high_freq_factor=float(rs.get("high_freq_factor", d.high_freq_factor)),
        original_max_position_embeddings=int(
            rs.get("original_max_position_embeddings", d.original_max_position_embeddings)
        ),
    )


def hf_config_to_args_fields(cfg: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """``TransformerModelArgs`` field values for a HF ``LlamaConfig`` dict (raises ValueError if unsupported)."""
    model_type = cfg.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"{where}: model_type {model_type!r} is not supported (only 'llama')")
    try:
        dim = int(cfg["hidden_size"])
        n_layers = int(cfg["num_hidden_layers"])
        n_heads = int(cfg["num_attention_heads"])
        vocab_size = int(cfg["vocab_size"])
        intermediate_size = cfg["intermediate_size"]
    except KeyError as e:
        raise ValueError(f"{where}: missing required field {e.args[0]!r}") from None
    n_kv_heads = int(cfg.get("num_key_value_heads") or n_heads)
    if dim % n_heads != 0:
        raise ValueError(f"{where}: hidden_size {dim} is not divisible by num_attention_heads {n_heads}")
    if n_heads % n_kv_heads != 0:
        raise ValueError(
            f"{where}: num_attention_heads {n_heads} not divisible by num_key_value_heads {n_kv_heads}"
        )
    head_dim = cfg.get("head_dim")
    if head_dim is not None and int(head_dim) != dim // n_heads:
        raise ValueError(
            f"{where}: head_dim {head_dim} != hidden_size/num_attention_heads = {dim // n_heads}; "
            "torchtitan's llama3 requires head_dim == dim // n_heads"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {cfg.get('hidden_act')!r} is not supported (only 'silu')")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key, False):
            raise ValueError(f"{where}: {key}=true is not supported by torchtitan's llama3")
    multiple_of, ffn_dim_multiplier = solve_ffn_args(dim, intermediate_size)
    eos = cfg.get("eos_token_id", 0)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else 0
    return dict(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=vocab_size,
        multiple_of=multiple_of,
        ffn_dim_multiplier=ffn_dim_multiplier,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rope_scaling_args=_rope_scaling_from_hf(cfg),
        attn_type="sdpa",
        attn_mask_type="causal",
        eos_id=int(eos if eos is not None else 0),
    )


def read_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"HF model config not found: {path}")
    with open(path) as f:
        return json.load(f)


@dataclass
class FluxLlamaArgs(TransformerModelArgs):
    """torchtitan llama3 args filled from ``{job_config.model.hf_assets_path}/config.json``."""

    def apply_hf_config(self, cfg: dict[str, Any], where: str = "config.json") -> "FluxLlamaArgs":
        for k, v in hf_config_to_args_fields(cfg, where).items():
            setattr(self, k, v)
        return self

    @classmethod
    def from_hf_dir(cls, hf_dir: str | os.PathLike, max_seq_len: int | None = None) -> "FluxLlamaArgs":
        args = cls().apply_hf_config(read_hf_config(hf_dir), str(Path(hf_dir) / "config.json"))
        if max_seq_len is not None:
            args.max_seq_len = int(max_seq_len)
        return args

    def update_from_config(self, job_config, **kwargs) -> None:
        hf_dir = job_config.model.hf_assets_path
        self.apply_hf_config(read_hf_config(hf_dir), str(Path(hf_dir) / "config.json"))
        # max_seq_len from training.seq_len (and torchtitan's own checks).
        super().update_from_config(job_config, **kwargs)


def register_flux_model():
    """Register the ``flux_llama3`` TrainSpec (flavor ``hf``); idempotent. Returns the spec."""
    from torchtitan.models import llama3
    from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

    spec = dataclasses.replace(
        llama3.get_train_spec(),
        model_args={FLUX_FLAVOR: FluxLlamaArgs()},
        build_dataloader_fn=None,
        build_validator_fn=None,
        pipelining_fn=None,
    )
    try:
        register_train_spec(FLUX_MODEL_NAME, spec)
    except ValueError:
        pass  # already registered (register_train_spec raises on duplicates)
    return get_train_spec(FLUX_MODEL_NAME)


# --------------------------------------------------------------------------------------------------
# HF weights <-> model
# --------------------------------------------------------------------------------------------------

_WRAPPER_PREFIXES = re.compile(r"(_orig_mod\.|_checkpoint_wrapped_module\.|_fsdp_wrapped_module\.)")


def _clean_fqn(name: str) -> str:
    name = _WRAPPER_PREFIXES.sub("", name)
    return name[len("module."):] if name.startswith("module.") else name


def _expected_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Model state-dict FQNs -> global shapes (DTensor ``.shape`` is global)."""
    return {_clean_fqn(k): tuple(v.shape) for k, v in model.state_dict().items()}


def hf_weight_files(hf_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files of a HF folder: every shard in the index if present, else model.safetensors."""
    d = Path(hf_dir)
    index = d / INDEX_FILE
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        if not names:
            raise ValueError(f"{index} has an empty weight_map")
        files = [d / n for n in names]
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"safetensors shard(s) listed in {index} not found: {missing}")
        return files
    single = d / WEIGHTS_FILE
    if not single.is_file():
        raise FileNotFoundError(f"HF weights not found: {single} (and no {INDEX_FILE} in {d})")
    return [single]


def read_hf_state_dict(hf_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for path in hf_weight_files(hf_dir):
        sd.update(load_file(str(path), device="cpu"))
    return sd


def _hf_shapes_for(model_shapes: dict[str, tuple[int, ...]], model_args) -> dict[str, tuple[int, ...]]:
    adapter = Llama3StateDictAdapter(model_args, None)
    meta = {k: torch.empty(s, device="meta") for k, s in model_shapes.items()}
    return {k: tuple(v.shape) for k, v in adapter.to_hf(meta).items()}


def load_hf_weights(model: nn.Module, hf_dir: str | os.PathLike, model_args) -> None:
    """Load HF Llama safetensors from ``hf_dir`` into a torchtitan llama3 ``model`` (plain or FSDP2/DTensor).

    Every rank reads the full files and keeps its own shards. Raises FileNotFoundError naming the
    missing file, or ValueError listing missing / unexpected keys and shape mismatches (e.g. a vocab size
    in config.json that differs from the weights).
    """
    hf_dir = Path(hf_dir)
    files = hf_weight_files(hf_dir)
    hf_sd = read_hf_state_dict(hf_dir)
    hf_sd = {k: v for k, v in hf_sd.items() if not k.endswith("rotary_emb.inv_freq")}
    if "lm_head.weight" not in hf_sd and "model.embed_tokens.weight" in hf_sd:
        cfg_path = hf_dir / "config.json"
        tie = False
        if cfg_path.is_file():
            with open(cfg_path) as f:
                tie = bool(json.load(f).get("tie_word_embeddings", False))
        if tie:  # tied embeddings: torchtitan's llama3 has a separate output projection
            hf_sd["lm_head.weight"] = hf_sd["model.embed_tokens.weight"]

    model_shapes = _expected_shapes(model)
    expected = _hf_shapes_for(model_shapes, model_args)
    missing = sorted(set(expected) - set(hf_sd))
    unexpected = sorted(set(hf_sd) - set(expected))
    mismatched = [
        f"{k}: file {tuple(hf_sd[k].shape)} vs model {expected[k]}"
        for k in sorted(set(expected) & set(hf_sd))
        if tuple(hf_sd[k].shape) != expected[k]
    ]
    if missing or unexpected or mismatched:
        where = ", ".join(str(p) for p in files)
        parts = []
        if missing:
            parts.append(f"missing keys {missing}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected}")
        if mismatched:
            parts.append(f"shape mismatches [{'; '.join(mismatched)}]")
        raise ValueError(
            f"HF weights in {where} do not match the model built from config.json: " + "; ".join(parts)
        )

    sd = Llama3StateDictAdapter(model_args, None).from_hf(hf_sd)
    set_model_state_dict(
        model, sd, options=StateDictOptions(full_state_dict=True, strict=True)
    )


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def export_hf_weights(
    model: nn.Module,
    out_dir: str | os.PathLike,
    model_args,
    hf_assets_dir: str | os.PathLike,
    *,
    barrier: bool = True,
) -> Path | None:
    """Write ``model`` as a HF Llama folder (``model.safetensors`` + config/tokenizer copied from
    ``hf_assets_dir``). Must be called on every rank (gathers the full state dict); rank 0 writes.
    Returns the folder on rank 0, None elsewhere. With ``barrier`` all ranks wait for the write.
    """
    from safetensors.torch import save_file

    sd = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    out = Path(out_dir)
    result: Path | None = None
    if _rank() == 0:
        sd = {_clean_fqn(k): (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in sd.items()}
        hf_sd = Llama3StateDictAdapter(model_args, None).to_hf(sd)
        hf_sd = {k: v.detach().to("cpu").contiguous() for k, v in hf_sd.items()}
        out.mkdir(parents=True, exist_ok=True)
        src = Path(hf_assets_dir)
        # A stale index / shards / build record would shadow or misdescribe the new weights.
        for stale in [out / INDEX_FILE, out / "flux_build.json", *out.glob("model-*-of-*.safetensors")]:
            stale.unlink(missing_ok=True)
        tmp = out / (WEIGHTS_FILE + ".tmp")
        save_file(hf_sd, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / WEIGHTS_FILE)
        if src.resolve() != out.resolve():
            for name in ASSET_FILES:
                if (src / name).is_file():
                    shutil.copyfile(src / name, out / name)
        cfg_path = out / "config.json"
        if cfg_path.is_file():
            with open(cfg_path) as f:
                cfg = json.load(f)
            dtypes = {v.dtype for v in hf_sd.values()}
            cfg["tie_word_embeddings"] = False  # lm_head is written separately
            if len(dtypes) == 1:
                cfg["torch_dtype"] = str(next(iter(dtypes))).replace("torch.", "")
            with open(cfg_path, "w") as f:
                json.dump(cfg, f, indent=2)
                f.write("\n")
        result = out
    if barrier and dist.is_available() and dist.is_initialized():
        dist.barrier()
    return result
