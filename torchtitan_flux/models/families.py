"""Trainer-side model families: a HF ``config.json`` -> a torchtitan 0.3.0 model config tree, its ``ModelSpec``
and its HF state-dict adapter.

The family comes from ``{hf_assets_path}/config.json`` alone (``hf.family``). ``llama`` (Llama 3.x, tied or not):
torchtitan's ``Llama3Model`` with complex (interleaved) RoPE and llama3 RoPE scaling, so its q/k rows are permuted
against HF's (torchtitan's ``Llama3StateDictAdapter`` does it); ``qwen3``: ``Qwen3Model`` with q/k norms and
cos/sin (HF-layout) RoPE; ``qwen2`` (Qwen2 / Qwen2.5): the same without q/k norms and with q/k/v biases. 0.3.0
does natively what 0.2.2 needed our own model classes for: tied embeddings (``enable_weight_tying``), an explicit
``head_dim``, the exact FFN width (``intermediate_size``) and biases (``Linear.Config(bias=True)``).

Attention is ``F.scaled_dot_product_attention``, causal (``ScaledDotProductAttention``), on every device: flex
attention has no backward on CPU, varlen needs CUDA, and the trainer packs no documents (one sequence per row).
q/k/v are three parameters (``fuse_qkv=False``): each is one HF tensor, so the weight push to the engines stays a
rename (plus llama's q/k permutation) with no split of a fused ``wqkv``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

try:  # torchtitan needs a few patches on CPU-only machines (e.g. no triton).
    from torchtitan_flux.patches import apply_patches as _apply_patches  # type: ignore[attr-defined]
except ImportError:
    _apply_patches = None
if _apply_patches is not None:
    _apply_patches()

import torch
from torch import nn

from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Decoder, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.common.param_init import depth_scaled_std
from torchtitan.models.llama3 import Llama3Model, Llama3StateDictAdapter, parallelize_llama
from torchtitan.models.llama3.model import Llama3TransformerBlock
from torchtitan.models.qwen3 import Qwen3Model, Qwen3StateDictAdapter, parallelize_qwen3
from torchtitan.models.qwen3.model import Qwen3TransformerBlock
from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_flux.models import hf

FLUX_FLAVOR = "hf"
# family (torchtitan_flux.models.hf.SUPPORTED) -> the ModelSpec name of that family
FAMILY_SPECS = {"llama": "flux_llama", "qwen3": "flux_qwen3", "qwen2": "flux_qwen2"}

# Initial values (torchtitan llama3's scheme): every weight is then overwritten by the HF folder's, except in the
# tiny random models scripts/model_assets.py draws.
_LINEAR_INIT = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
_NORM_INIT = {"weight": nn.init.ones_}
_EMBEDDING_INIT = {"weight": partial(nn.init.normal_, std=1.0)}


def _depth_init(layer_id: int) -> dict[str, Callable]:
    return {"weight": partial(nn.init.trunc_normal_, std=depth_scaled_std(0.02, layer_id)), "bias": nn.init.zeros_}


def _lm_head_init(dim: int) -> dict[str, Callable]:
    s = dim**-0.5
    return {"weight": partial(nn.init.trunc_normal_, std=s, a=-3 * s, b=3 * s), "bias": nn.init.zeros_}


class _LogitsFrom:
    """``forward(tokens, ..., logits_from=k)``: the logits of positions ``k:`` only, ``[B, L - k, V]``. GRPO needs
    logits only where a completion token is predicted; the prompt's positions before that would cost the output
    projection and the log-softmax over the whole vocabulary for nothing (TRL's ``logits_to_keep``; on the real model
    on CPU, ~20% of a training step). Every position still runs through the blocks (causal attention needs them).
    The slice is a pre-hook on this model's own ``lm_head`` for the one call (FSDP's hooks on it run first)."""

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, attention_masks=None, *,
                logits_from: int = 0) -> torch.Tensor:
        if not logits_from:
            return super().forward(tokens, positions, attention_masks)
        handle = self.lm_head.register_forward_pre_hook(lambda _m, a: (a[0][:, logits_from:], *a[1:]))
        try:
            return super().forward(tokens, positions, attention_masks)
        finally:
            handle.remove()


class FluxLlamaModel(_LogitsFrom, Llama3Model):
    """torchtitan's ``Llama3Model`` with ``logits_from``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Llama3Model.Config):
        pass


class FluxQwenModel(_LogitsFrom, Qwen3Model):
    """torchtitan's ``Qwen3Model`` with ``logits_from`` (Qwen3, and Qwen2 / Qwen2.5 without q/k norms)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Qwen3Model.Config):
        pass


class FluxQwenStateDictAdapter(Qwen3StateDictAdapter):
    """torchtitan's qwen3 adapter plus the Qwen2 q/k/v bias names."""

    def __init__(self, model_config: Qwen3Model.Config, hf_assets_path: str | None):
        super().__init__(model_config, hf_assets_path)
        for hf_p, tt_p in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv")):
            self.from_hf_map[f"model.layers.{{}}.self_attn.{hf_p}.bias"] = f"layers.{{}}.attention.qkv_linear.{tt_p}.bias"


def _rope(a: dict[str, Any], max_seq_len: int):
    """llama: complex (interleaved) RoPE with llama3 scaling when the config has it; qwen: cos/sin RoPE."""
    if a["family"] != "llama":
        return CosSinRoPE.Config(dim=a["head_dim"], max_seq_len=max_seq_len, theta=a["rope_theta"])
    rs = a["rope_scaling"]
    return ComplexRoPE.Config(
        dim=a["head_dim"], max_seq_len=max_seq_len, theta=a["rope_theta"],
        scaling="llama" if rs["factor"] != 1.0 else "none", scaling_factor=rs["factor"],
        low_freq_factor=rs["low_freq_factor"], high_freq_factor=rs["high_freq_factor"],
        original_max_position_embeddings=rs["original_max_position_embeddings"],
    )


def model_config(cfg: dict[str, Any], where: str = "config.json", max_seq_len: int | None = None) -> Decoder.Config:
    """The torchtitan model config tree of a HF config dict (``FluxLlamaModel.Config`` or ``FluxQwenModel.Config``);
    ValueError naming the field for anything unsupported (``hf.architecture``). ``max_seq_len``: the RoPE cache's
    length (default ``max_position_embeddings``; the trainer sets ``training.seq_len``)."""
    a = hf.architecture(cfg, where)
    llama = a["family"] == "llama"
    dim, n_layers = a["dim"], a["n_layers"]
    rope = _rope(a, max_seq_len or a["max_position_embeddings"])
    qk_norm = RMSNorm.Config(normalized_shape=a["head_dim"], eps=a["norm_eps"], param_init=_NORM_INIT)
    block = Llama3TransformerBlock.Config if llama else Qwen3TransformerBlock.Config
    layers = []
    for layer_id in range(n_layers):
        attention = make_gqa_config(
            dim=dim, n_heads=a["n_heads"], n_kv_heads=a["n_kv_heads"], head_dim=a["head_dim"],
            wqkv_param_init=_LINEAR_INIT, wo_param_init=_depth_init(layer_id),
            inner_attention=ScaledDotProductAttention.Config(), rope=rope, fuse_qkv=False,
            qk_norm=qk_norm if a["qk_norm"] else None,
        )
        if a["qkv_bias"]:
            attention.qkv_linear.wq.bias = attention.qkv_linear.wkv.bias = True
        layers.append(block(
            attention_norm=RMSNorm.Config(normalized_shape=dim, eps=a["norm_eps"], param_init=_NORM_INIT),
            ffn_norm=RMSNorm.Config(normalized_shape=dim, eps=a["norm_eps"], param_init=_NORM_INIT),
            attention=attention,
            feed_forward=make_ffn_config(dim=dim, hidden_dim=a["intermediate_size"], w1_param_init=_LINEAR_INIT,
                                         w2w3_param_init=_depth_init(layer_id)),
        ))
    vocab = a["vocab_size"]
    return (FluxLlamaModel if llama else FluxQwenModel).Config(
        dim=dim, vocab_size=vocab, enable_weight_tying=a["tied"],
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, eps=a["norm_eps"], param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_lm_head_init(dim)),
        layers=layers,
    )


def config_from_hf_dir(hf_dir: str | os.PathLike, max_seq_len: int | None = None) -> Decoder.Config:
    """``model_config`` of the folder's ``config.json``."""
    return model_config(hf.read_config(hf_dir), str(Path(hf_dir) / hf.CONFIG_FILE), max_seq_len)


def state_dict_adapter(config: Decoder.Config, hf_assets_path: str | None = None):
    """The family's HF <-> torchtitan state-dict adapter for ``config`` (names and llama's q/k layout)."""
    if isinstance(config, Qwen3Model.Config):
        return FluxQwenStateDictAdapter(config, hf_assets_path)
    return Llama3StateDictAdapter(config, hf_assets_path)


def model_spec(hf_dir: str | os.PathLike) -> ModelSpec:
    """The ``ModelSpec`` of a HF folder's family (name ``FAMILY_SPECS[family]``, flavor ``hf``); ValueError naming
    the supported families for any other model, before anything is built."""
    config = config_from_hf_dir(hf_dir)
    llama = isinstance(config, Llama3Model.Config)
    fam = hf.family(hf.read_config(hf_dir))
    return ModelSpec(
        name=FAMILY_SPECS[fam], flavor=FLUX_FLAVOR, model=config,
        parallelize_fn=parallelize_llama if llama else parallelize_qwen3, pipelining_fn=None,
        post_optimizer_build_fn=None,
        state_dict_adapter=Llama3StateDictAdapter if llama else FluxQwenStateDictAdapter,
    )
