"""The rollout engines' view of a model: its architecture (``ModelShape``, from ``config.json``) and its weights as
a plain ``dict[str, Tensor]`` in torchtitan names (``load_hf_weights_dict``, ``check_weights``), which
``inference.py`` runs. Must NOT import torchtitan (it runs in engine environments).

Names: ``tok_embeddings.weight``, ``layers.{i}.attention.wq.weight``, ..., ``norm.weight``, ``output.weight`` (a
tied model has none). Llama q/k rows are in torchtitan's RoPE layout (permuted back on load); Qwen keeps HF's.
"""

from __future__ import annotations

import os
import re
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
    # llama3 RoPE scaling (factor 1.0 == no scaling), as torchtitan's RoPEScalingArgs.
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
        """RoPE on the two halves of a head (HF/qwen layout) rather than on interleaved pairs (torchtitan llama3)."""
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


def layer_param_names(shape: ModelShape) -> tuple[str, ...]:
    """One layer's parameter names, in torchtitan's ``named_parameters`` order for the family."""
    if shape.family == "llama":
        attn = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wo.weight")
    else:  # torchtitan's qwen3 Attention registers q_norm / k_norm first
        attn = ("attention.q_norm.weight", "attention.k_norm.weight") if shape.qk_norm else ()
        for p in ("wq", "wk", "wv"):
            attn += (f"attention.{p}.weight",) + ((f"attention.{p}.bias",) if shape.qkv_bias else ())
        attn += ("attention.wo.weight",)
    return attn + ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight",
                   "attention_norm.weight", "ffn_norm.weight")


def weight_names(shape: ModelShape) -> list[str]:
    """All weight names, in torchtitan's ``named_parameters`` order (a tied model has no ``output.weight``)."""
    names = ["tok_embeddings.weight"]
    for i in range(shape.n_layers):
        names += [f"layers.{i}.{p}" for p in layer_param_names(shape)]
    names += ["norm.weight"] + ([] if shape.tied else ["output.weight"])
    return names


def weight_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Name -> shape, in ``weight_names`` order."""
    d, hd, h, kv, f = shape.dim, shape.head_dim, shape.n_heads, shape.n_kv_heads, shape.intermediate_size
    per_layer = {
        "attention.q_norm.weight": (hd,), "attention.k_norm.weight": (hd,),
        "attention.wq.weight": (h * hd, d), "attention.wq.bias": (h * hd,),
        "attention.wk.weight": (kv * hd, d), "attention.wk.bias": (kv * hd,),
        "attention.wv.weight": (kv * hd, d), "attention.wv.bias": (kv * hd,),
        "attention.wo.weight": (d, h * hd),
        "feed_forward.w1.weight": (f, d), "feed_forward.w2.weight": (d, f), "feed_forward.w3.weight": (f, d),
        "attention_norm.weight": (d,), "ffn_norm.weight": (d,),
    }
    out: dict[str, tuple[int, ...]] = {}
    for name in weight_names(shape):
        if name.startswith("layers."):
            out[name] = per_layer[name.split(".", 2)[2]]
        elif name == "norm.weight":
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


# HF -> torchtitan names (as torchtitan's Llama3StateDictAdapter / Qwen3StateDictAdapter.from_hf, plus the
# qwen2 biases of ``torchtitan_flux.models.families``).
_FROM_HF = {
    "model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
    "self_attn.q_proj.weight": "attention.wq.weight", "self_attn.q_proj.bias": "attention.wq.bias",
    "self_attn.k_proj.weight": "attention.wk.weight", "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.weight": "attention.wv.weight", "self_attn.v_proj.bias": "attention.wv.bias",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_norm.weight": "attention.q_norm.weight", "self_attn.k_norm.weight": "attention.k_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight", "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _reverse_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    dim1, dim2 = w.shape
    return w.view(n_heads, 2, dim1 // n_heads // 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def hf_to_weights(hf_sd: Mapping[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """HF state dict -> torchtitan-named weights (llama: q/k rows permuted back; tied: no ``output.weight``)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_sd.items():
        m = _HF_LAYER.match(key)
        if m is None:
            if key not in _FROM_HF:
                raise ValueError(f"unexpected HF weight {key!r}")
            out[_FROM_HF[key]] = value
            continue
        layer, rest = m.group(1), m.group(2)
        if rest.endswith("rotary_emb.inv_freq"):
            continue
        if rest not in _FROM_HF:
            raise ValueError(f"unexpected HF weight {key!r}")
        if shape.family == "llama" and rest == "self_attn.q_proj.weight":
            value = _reverse_permute(value, shape.n_heads)
        elif shape.family == "llama" and rest == "self_attn.k_proj.weight":
            value = _reverse_permute(value, shape.n_kv_heads)
        out[f"layers.{layer}.{_FROM_HF[rest]}"] = value.contiguous()
    if shape.tied:
        out.pop("output.weight", None)
    order = {k: i for i, k in enumerate(weight_names(shape))}
    return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))


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
    """The output projection: ``output.weight``, or the token embedding of a tied model."""
    return weights["tok_embeddings.weight" if shape.tied else "output.weight"]
