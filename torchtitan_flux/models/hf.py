"""The one reader of Hugging Face model folders, shared by the trainer and every rollout engine.

Reads ``config.json``, ``generation_config.json``, ``tokenizer_config.json`` and the safetensors weights (one
file or the shards of an index). Torch-only, no torchtitan: engines import it. Supported families
(``SUPPORTED``), tied or untied, GQA, any even ``head_dim``: ``llama`` (Llama 3.0-3.2, ``rope_scaling`` none or
``llama3``), ``qwen3`` (dense), ``qwen2`` (Qwen2 / Qwen2.5). Everything else (MoE, sliding windows, other RoPE
scalings or activations) is refused in one line naming the field, before any weights are read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# family -> HF ``architectures`` names of that family
SUPPORTED: dict[str, tuple[str, ...]] = {"llama": ("LlamaForCausalLM",), "qwen3": ("Qwen3ForCausalLM",),
                                         "qwen2": ("Qwen2ForCausalLM",)}


def _read_json(path: Path) -> Any:
    """A JSON file of the folder; ValueError naming it when it is not UTF-8 JSON (a corrupt or partial download)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); allowed: the file as published (re-download it)") from None


def read_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    """``hf_dir/config.json`` as a dict (FileNotFoundError naming the path if absent, ValueError if corrupt)."""
    path = Path(hf_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"HF model config not found: {path}")
    cfg = _read_json(path)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} holds a JSON {type(cfg).__name__}; allowed: a JSON object (a HF config.json)")
    return cfg


def family(cfg: dict[str, Any], where: str = CONFIG_FILE) -> str:
    """The supported family of a HF config (``model_type``, else ``architectures``); ValueError otherwise."""
    model_type = cfg.get("model_type")
    if model_type in SUPPORTED:
        return model_type
    for arch in cfg.get("architectures") or ():
        for fam, names in SUPPORTED.items():
            if arch in names:
                return fam
    supported = ", ".join(f"{f} ({'/'.join(a)})" for f, a in SUPPORTED.items())
    raise ValueError(f"{where}: model_type {model_type!r} / architectures {cfg.get('architectures')!r} is not "
                     f"supported; supported families: {supported}")


def eos_token_ids(cfg: dict[str, Any]) -> list[int]:
    """``eos_token_id`` as a list (HF allows an int or a list, e.g. Llama-3.x-Instruct); [] when unset."""
    eos = cfg.get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def _token_text(tok: Any) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken dict ({"content": ...})."""
    return tok.get("content") if isinstance(tok, dict) else tok


def pad_id(tokenizer, hf_dir: str | os.PathLike) -> int:
    """The padding id: the tokenizer's ``<|pad|>`` token, else ``tokenizer_settings``' ``pad_token_id``."""
    pad = tokenizer.tokenizer.token_to_id("<|pad|>") if hasattr(tokenizer, "tokenizer") else None
    return tokenizer_settings(hf_dir)["pad_token_id"] if pad is None else pad


def tokenizer_settings(hf_dir: str | os.PathLike) -> dict[str, Any]:
    """What the data layer needs from the folder: special tokens, ``add_bos_token`` (None: tokenizer.json decides),
    ``chat_template`` (``chat_template.jinja`` wins), ``eos_token_ids`` (config.json's, then generation_config's),
    ``pad_token_id`` (config.json, generation_config, first EOS id, or 0), ``generation`` (generation_config)."""
    d = Path(hf_dir)
    tok_cfg: dict[str, Any] = {}
    if (d / TOKENIZER_CONFIG_FILE).is_file():
        tok_cfg = _read_json(d / TOKENIZER_CONFIG_FILE)
    cfg = read_config(d) if (d / CONFIG_FILE).is_file() else {}
    gen = _read_json(d / GENERATION_CONFIG_FILE) if (d / GENERATION_CONFIG_FILE).is_file() else {}
    eos = eos_token_ids(cfg)
    eos += [e for e in eos_token_ids(gen) if e not in eos]
    pad = cfg.get("pad_token_id", gen.get("pad_token_id"))
    if pad is None:
        pad = eos[0] if eos else 0
    template = tok_cfg.get("chat_template")
    if (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text()
    return {
        **{k: _token_text(tok_cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token")},
        "add_bos_token": tok_cfg.get("add_bos_token"), "chat_template": template,
        "eos_token_ids": eos, "pad_token_id": int(pad), "generation": gen,
    }


def _rope_scaling(cfg: dict[str, Any], fam: str, where: str) -> dict[str, float]:
    """llama3 RoPE scaling knobs (factor 1 == none), as torchtitan's ``RoPE.Config`` llama scaling fields."""
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}  # transformers 4 / 5 spelling
    rope_type = rs.get("rope_type", rs.get("type", "default")) if rs else "default"
    if rope_type == "default":
        return dict(factor=1.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    if rope_type != "llama3" or fam != "llama":
        raise ValueError(f"{where}: rope_scaling type {rope_type!r} is not supported for {fam} "
                         "(only 'llama3' for llama, or none)")
    return dict(
        factor=float(rs.get("factor", 8.0)),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
    )


def architecture(cfg: dict[str, Any], where: str = CONFIG_FILE) -> dict[str, Any]:
    """Family-neutral architecture of a HF config; ValueError naming the field for anything unsupported."""
    fam = family(cfg, where)
    try:
        dim = int(cfg["hidden_size"])
        n_layers = int(cfg["num_hidden_layers"])
        n_heads = int(cfg["num_attention_heads"])
        vocab_size = int(cfg["vocab_size"])
        intermediate_size = int(cfg["intermediate_size"])
    except KeyError as e:
        raise ValueError(f"{where}: missing required field {e.args[0]!r}") from None
    n_kv_heads = int(cfg.get("num_key_value_heads") or n_heads)
    if n_heads % n_kv_heads:
        raise ValueError(f"{where}: num_attention_heads {n_heads} not divisible by num_key_value_heads {n_kv_heads}")
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if dim % n_heads:
            raise ValueError(f"{where}: hidden_size {dim} is not divisible by num_attention_heads {n_heads}")
        head_dim = dim // n_heads
    head_dim = int(head_dim)
    if head_dim % 2:
        raise ValueError(f"{where}: head_dim {head_dim} must be even for RoPE")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {cfg.get('hidden_act')!r} is not supported (only 'silu')")
    if cfg.get("mlp_bias", False):
        raise ValueError(f"{where}: mlp_bias=true is not supported")
    if fam in ("llama", "qwen3") and cfg.get("attention_bias", False):
        raise ValueError(f"{where}: attention_bias=true is not supported for {fam}")
    if cfg.get("use_sliding_window", False):
        raise ValueError(f"{where}: use_sliding_window=true is not supported (full attention only)")
    return dict(
        family=fam, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
        vocab_size=vocab_size, intermediate_size=intermediate_size,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6 if fam != "llama" else 1e-5)),
        rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        rope_scaling=_rope_scaling(cfg, fam, where),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tied=bool(cfg.get("tie_word_embeddings", False)), qk_norm=fam == "qwen3", qkv_bias=fam == "qwen2",
    )


def weight_files(hf_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files of a HF folder: every shard in the index if present, else model.safetensors."""
    d = Path(hf_dir)
    index = d / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
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


def read_state_dict(hf_dir: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors by HF name (no ``inv_freq``); ValueError naming a corrupt file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for path in weight_files(hf_dir):
        try:
            sd.update(load_file(str(path), device=str(device)))
        except SafetensorError as e:
            raise ValueError(f"{path} cannot be read as safetensors ({e}): truncated or corrupt; allowed: the file "
                             "as published (re-download it)") from None
    return {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}


# segments wrappers insert into ``named_parameters()`` names; removed wherever they appear
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.", "_fsdp_module.",
                    "_offload_wrapped_module.")


def clean_name(name: str) -> str:
    """``layers.1._checkpoint_wrapped_module.attention.qkv_linear.wq.weight`` ->
    ``layers.1.attention.qkv_linear.wq.weight``."""
    for seg in WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    return name.removeprefix("module.") if name.startswith("module.") else name
