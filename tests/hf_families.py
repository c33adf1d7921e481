"""Tiny random HF models of every supported family, built locally with ``transformers`` (no downloads).

head_dim 32 (vLLM's CPU attention needs >= 32), vocab 259 with the byte-level tokenizer of
``model_assets`` so that the digits task and the engines can use them. Weights are re-drawn with
large enough values that a wrong layout, a dropped tensor or an untied head changes the logits clearly.
"""

from __future__ import annotations

from pathlib import Path

import torch

import model_assets as assets

# (family, tied) cases every family test runs
CASES = [("llama", False), ("llama", True), ("qwen3", False), ("qwen3", True), ("qwen2", False), ("qwen2", True)]


def hf_config(family: str, tied: bool):
    import transformers

    common = dict(
        vocab_size=assets.VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        bos_token_id=assets.BOS_ID,
        eos_token_id=assets.EOS_ID,
        pad_token_id=assets.PAD_ID,
        torch_dtype="float32",
    )
    if family == "llama":  # head_dim 16 would be too small for vLLM: heads of 32, llama3 RoPE scaling
        # tied: 2 heads of 32 (head_dim == hidden_size / heads, every Llama 3.x release); untied: 4 heads of 32
        # (attention 128 wide on a 64-wide residual), the "any head_dim" case torchtitan's llama3 does not derive.
        common.update(num_attention_heads=2 if tied else 4, num_key_value_heads=1 if tied else 2, rope_theta=500000.0)
        return transformers.LlamaConfig(
            **common, head_dim=32,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64},
        )
    if family == "qwen3":  # head_dim 32 != hidden_size / heads (16): Qwen3's explicit head_dim
        return transformers.Qwen3Config(**common, head_dim=32, rope_theta=1000000.0)
    if family == "qwen2":
        common.update(num_attention_heads=2, num_key_value_heads=1)
        return transformers.Qwen2Config(**common, rope_theta=1000000.0)
    raise ValueError(family)


def hf_model_class(family: str):
    import transformers

    return {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
            "qwen2": transformers.Qwen2ForCausalLM}[family]


def build_hf_model(out: str | Path, family: str, tied: bool, seed: int = 0) -> Path:
    """Write a tiny random ``family`` model (+ the byte-level tokenizer) to ``out``; returns ``out``."""
    out = Path(out)
    torch.manual_seed(seed)
    model = hf_model_class(family)(hf_config(family, tied)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.save_pretrained(out, safe_serialization=True)
    assets.build_tokenizer(out, model_max_length=256)
    return out


def hf_logits(model_dir: str | Path, family: str, tokens: torch.Tensor) -> torch.Tensor:
    model = hf_model_class(family).from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits.float()
