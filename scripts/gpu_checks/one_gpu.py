"""The one-GPU number: Qwen3-0.6B's configuration (596 M parameters, random bf16 weights, Qwen3's 151,936-token
vocabulary with the byte-level test tokenizer, whose ids are a subset) trained colocated on one GPU with async weight
updates, as ``gpu_smoke.py``'s ``train`` part runs the tiny model.

Keys (``one_gpu_`` prefix): ``params``; ``blocked_ms_p50`` / ``blocked_ms_p99`` (the main thread's time in weight sync
per step, ``weight_sync_s``: the snapshot plus any wait for the previous push; the goal is p99 < 10 ms);
``snapshot_ms_p50``, ``push_ms_p50`` / ``push_ms_p99`` (the push thread's time per push, overlapped with the next
step); ``steps_per_s``, ``checksums_equal`` (must be 1: the engine's bytes are the trainer's); ``probe_max_abs_diff``
(the logprob probe's worst difference; its tolerance is 2.0 here, not 0.1: on the first GPU run, 2026-11-27, random
weights of std 0.02 and one rewarded step, whose AdamW moves every weight by about lr in the direction of its
gradient's sign, below half a bf16 step for most weights, gave 0.70 at version 20 against 0.02 at version 10: the bf16
copy does not see the update the fp32 trainer does). Percentiles are over the steps after the first two (the first
pushes join and resync the engine); with 30 steps p99 is the worst step. A one-GPU push is a device-to-device copy
over CUDA IPC, not the NCCL broadcast across GPUs the anchors' figures time: docs/benchmarks.md says so beside them.
CPU twin (``--cpu``): 4 steps of a 2-layer, 64-wide Qwen3 (4,096 tokens): the code path, figures of no meaning.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gpu_checks.common import report

QWEN3_0P6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936)  # Qwen/Qwen3-0.6B's config.json
CPU_TWIN = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, vocab_size=4096)  # Qwen3's vocabulary costs 25 s a step here


def build_model_dir(out: Path, device: torch.device) -> Path:
    """A HF Qwen3 folder (config.json, model.safetensors in bf16, the byte-level tokenizer) of Qwen3-0.6B's shape
    on a GPU, of the CPU twin's on CPU; weights drawn on ``device`` (std 0.02, norms 1)."""
    from safetensors.torch import save_file

    from model_assets import BOS_ID, EOS_ID, PAD_ID, build_tokenizer

    shape = QWEN3_0P6B if device.type == "cuda" else CPU_TWIN
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu",
               max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
               attention_bias=False, use_sliding_window=False, torch_dtype="bfloat16", bos_token_id=BOS_ID,
               eos_token_id=EOS_ID, pad_token_id=PAD_ID, **shape)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    h, i, hd, vocab = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"], shape["vocab_size"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return (0.02 * torch.randn(*size, generator=gen, device=device)).to(torch.bfloat16).cpu()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    w = {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": ones(h)}
    for n in range(shape["num_hidden_layers"]):
        p = f"model.layers.{n}."
        w.update({p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
                  p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
                  p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
                  p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd),
                  p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
                  p + "mlp.down_proj.weight": rand(h, i)})
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    build_tokenizer(out, model_max_length=2048)
    report("one_gpu_params", sum(t.numel() for t in w.values()))
    return out


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def report_pushes(dump: Path) -> None:
    """The blocked and push times of a finished run's ``metrics.jsonl`` (after its first two steps)."""
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()][2:]
    blocked = [1e3 * r["weight_sync_s"] for r in rows]
    # ``weight_push_s`` is the last completed push's: a coalesced step repeats it (none at ``async_ratio`` 1 so far)
    pushes = [1e3 * r["weight_push_s"] for r in rows if r["weight_push_s"] > 0]
    report("one_gpu_steps_measured", len(rows))
    report("one_gpu_blocked_ms_p50", round(_percentile(blocked, 0.5), 2))
    report("one_gpu_blocked_ms_p99", round(_percentile(blocked, 0.99), 2))
    report("one_gpu_snapshot_ms_p50", round(_percentile([1e3 * r["weight_snapshot_s"] for r in rows], 0.5), 2))
    report("one_gpu_push_ms_p50", round(_percentile(pushes, 0.5), 2) if pushes else 0.0)
    report("one_gpu_push_ms_p99", round(_percentile(pushes, 0.99), 2) if pushes else 0.0)
    probes = [r["probe_max_abs_diff"] for r in rows if "probe_max_abs_diff" in r]
    report("one_gpu_probe_max_abs_diff", round(max(probes), 4) if probes else "none")
