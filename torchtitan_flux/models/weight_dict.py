"""The rollout engines' view of a model: its architecture (``ModelShape``, from ``config.json``) and its weights as
a plain ``dict[str, Tensor]`` in Hugging Face names and layout (``load_hf_weights_dict``, ``check_weights``), which
``inference.py`` runs. Must NOT import torchtitan (it runs in engine environments).

Names and layout are those of the HF folder, and of every push (the trainer maps its parameters to them:
``torchtitan_flux.models.hf_weights.HFLayout``): ``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.q_proj.weight``, ..., ``model.norm.weight``, ``lm_head.weight`` (a tied model has none).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from torchtitan_flux.models import hf


@dataclass(frozen=True)
class ModelShape:
    """Architecture of a model of a supported family: what the forward needs besides the weights."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    intermediate_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # llama3 RoPE scaling (factor 1.0 == no scaling), as torchtitan's RoPE.Config llama scaling fields.
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    max_position_embeddings: int = 2048
    family: str = "llama"
    head_size: int = 0  # 0: dim // n_heads
    qk_norm: bool = False  # RMSNorm of each q/k head before RoPE (qwen3)
    qkv_bias: bool = False  # biases on the q/k/v projections (qwen2)
    tied: bool = False  # the output projection is the token embedding (no ``output.weight``)

    def __post_init__(self) -> None:
        if not self.head_size and self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} not divisible by n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    @property
    def n_rep(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def rotate_half(self) -> bool:
        """Qwen's RoPE (rotate-half, cos|sin table, in the weights' dtype) rather than llama3's (complex rotations
        of each pair, in float32, as torchtitan's llama3)."""
        return self.family != "llama"

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "ModelShape":
        """From a HF ``config.json`` dict of a supported family (see ``torchtitan_flux.models.hf``)."""
        a = hf.architecture(dict(cfg))
        rs = a["rope_scaling"]
        same = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "intermediate_size", "norm_eps",
                "rope_theta", "max_position_embeddings", "family", "qk_norm", "qkv_bias", "tied")
        return cls(
            **{k: a[k] for k in same},
            rope_scaling_factor=rs["factor"],
            rope_low_freq_factor=rs["low_freq_factor"],
            rope_high_freq_factor=rs["high_freq_factor"],
            rope_original_max_position_embeddings=rs["original_max_position_embeddings"],
            head_size=a["head_dim"] if a["head_dim"] * a["n_heads"] != a["dim"] else 0,
        )

    @classmethod
    def from_hf_dir(cls, hf_dir: str | os.PathLike) -> "ModelShape":
        return cls.from_hf_config(hf.read_config(hf_dir))


EMBEDDING, FINAL_NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


def layer_param_names(shape: ModelShape) -> tuple[str, ...]:
    """One layer's weight names after ``model.layers.{i}.``, in the order the trainer pushes them (torchtitan's
    parameter order; an engine lays out its buffers from the join's list, so the order is not part of the wire)."""
    attn: tuple[str, ...] = ()
    for p in ("q_proj", "k_proj", "v_proj"):
        attn += (f"self_attn.{p}.weight",) + ((f"self_attn.{p}.bias",) if shape.qkv_bias else ())
    attn += ("self_attn.o_proj.weight",)
    if shape.qk_norm:
        attn += ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
    return attn + ("mlp.gate_proj.weight", "mlp.down_proj.weight", "mlp.up_proj.weight", "input_layernorm.weight",
                   "post_attention_layernorm.weight")


def weight_names(shape: ModelShape) -> list[str]:
    """All weight names, in the order the trainer pushes them (a tied model has no ``lm_head.weight``)."""
    names = [EMBEDDING]
    for i in range(shape.n_layers):
        names += [f"model.layers.{i}.{p}" for p in layer_param_names(shape)]
    return names + [FINAL_NORM] + ([] if shape.tied else [LM_HEAD])


def weight_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Name -> shape, in ``weight_names`` order."""
    d, hd, h, kv, f = shape.dim, shape.head_dim, shape.n_heads, shape.n_kv_heads, shape.intermediate_size
    per_layer = {
        "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
        "self_attn.q_proj.weight": (h * hd, d), "self_attn.q_proj.bias": (h * hd,),
        "self_attn.k_proj.weight": (kv * hd, d), "self_attn.k_proj.bias": (kv * hd,),
        "self_attn.v_proj.weight": (kv * hd, d), "self_attn.v_proj.bias": (kv * hd,),
        "self_attn.o_proj.weight": (d, h * hd),
        "mlp.gate_proj.weight": (f, d), "mlp.down_proj.weight": (d, f), "mlp.up_proj.weight": (f, d),
        "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
    }
    out: dict[str, tuple[int, ...]] = {}
    for name in weight_names(shape):
        if name.startswith("model.layers."):
            out[name] = per_layer[name.split(".", 3)[3]]
        elif name == FINAL_NORM:
            out[name] = (d,)
        else:
            out[name] = (shape.vocab_size, d)
    return out


def check_weights(weights: Mapping[str, torch.Tensor], shape: ModelShape) -> None:
    """Raise ValueError naming missing / unexpected names and shape mismatches."""
    expected = weight_shapes(shape)
    missing = [k for k in expected if k not in weights]
    unexpected = sorted(k for k in weights if k not in expected)
    bad = [f"{k}: {tuple(weights[k].shape)} != {s}" for k, s in expected.items()
           if k in weights and tuple(weights[k].shape) != s]
    if missing or unexpected or bad:
        raise ValueError(f"weights do not match {shape}: missing={missing} unexpected={unexpected} shapes={bad}")


def hf_to_weights(hf_sd: Mapping[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """A HF state dict -> the engine's weights: the same names and tensors in push order, less what the forward
    does not read (RoPE tables; a tied model's ``lm_head.weight``, which some tied checkpoints store anyway)."""
    names = weight_names(shape)
    ignored = {k for k in hf_sd if k.endswith("rotary_emb.inv_freq") or (shape.tied and k == LM_HEAD)}
    unexpected = sorted(set(hf_sd) - set(names) - ignored)
    if unexpected:
        raise ValueError(f"unexpected HF weights {unexpected}")
    return {k: hf_sd[k].contiguous() for k in names if k in hf_sd}


def load_hf_weights_dict(hf_dir: str | os.PathLike, shape: ModelShape | None = None, dtype: torch.dtype | None = None,
                         device: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], ModelShape]:
    """Read a HF folder of a supported family (model.safetensors or the shards of its index) -> (weights, shape)."""
    if shape is None:
        shape = ModelShape.from_hf_dir(hf_dir)
    weights = hf_to_weights(hf.read_state_dict(hf_dir, device), shape)
    if dtype is not None:
        weights = {k: v.to(dtype) for k, v in weights.items()}
    check_weights(weights, shape)
    return weights, shape


def output_weight(weights: Mapping[str, torch.Tensor], shape: ModelShape) -> torch.Tensor:
    """The output projection: ``lm_head.weight``, or the token embedding of a tied model."""
    return weights[EMBEDDING if shape.tied else LM_HEAD]
