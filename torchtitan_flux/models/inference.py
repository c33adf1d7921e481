"""A torch-only forward with a KV cache for the supported families (Llama 3.x, Qwen3, Qwen2.5), for the
rollout engines. Must NOT import torchtitan (engine environments pin their own torch); torch >= 2.3 APIs only.

The math is copied from torchtitan's ``models/llama3/model/model.py`` and ``models/qwen3/model/model.py``
(Copyright (c) Meta Platforms, Inc. and affiliates, BSD-3-Clause license): logits match torchtitan's to rounding.

Weights are a plain ``dict[str, Tensor]`` in torchtitan names (``weight_dict``). Every function takes the dict as
an argument and keeps no reference to it, so an engine can swap the whole dict atomically between requests.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.nn.functional as F

from torchtitan_flux.models.weight_dict import ModelShape, layer_param_names, output_weight

__all__ = ["generate", "score", "forward_logits"]


def precompute_freqs_cis(shape: ModelShape, end: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """RoPE table of ``end`` positions: llama, [end, head_dim // 2] complex64 rotations with llama3 frequency
    scaling (torchtitan llama3's); qwen, [end, 2 * head_dim] float32 cos|sin (torchtitan qwen3's rope cache)."""
    dim = shape.head_dim
    freqs = 1.0 / (shape.rope_theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    if shape.rotate_half:
        angles = torch.outer(torch.arange(end, dtype=freqs.dtype), freqs).float()
        angles = torch.cat([angles, angles], dim=-1)
        return torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)
    scaling_factor = shape.rope_scaling_factor
    low_freq_factor = shape.rope_low_freq_factor
    high_freq_factor = shape.rope_high_freq_factor
    original_max_position_embeddings = shape.rope_original_max_position_embeddings
    wavelen = 2 * math.pi / freqs
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    freqs = torch.where(wavelen > low_freq_wavelen, freqs / scaling_factor, freqs)
    smooth_factor = ((original_max_position_embeddings / wavelen - low_freq_factor)
                     / (high_freq_factor - low_freq_factor))
    smoothed_freqs = (1 - smooth_factor) * freqs / scaling_factor + smooth_factor * freqs
    is_medium_freqs = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    freqs = torch.where(is_medium_freqs, smoothed_freqs, freqs)
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs).to(device)


_FREQS_CACHE: dict[tuple, torch.Tensor] = {}


def _freqs_cis(shape: ModelShape, end: int, device: torch.device) -> torch.Tensor:
    """Cached RoPE table covering at least ``end`` positions (positions are independent of the length)."""
    key = (shape.rotate_half, shape.head_dim, shape.rope_theta, shape.rope_scaling_factor, shape.rope_low_freq_factor,
           shape.rope_high_freq_factor, shape.rope_original_max_position_embeddings, str(device))
    fc = _FREQS_CACHE.get(key)
    if fc is None or fc.shape[0] < end:
        n = max(end, shape.max_position_embeddings, 1)
        n = 1 << (n - 1).bit_length()
        fc = precompute_freqs_cis(shape, n, device)
        if len(_FREQS_CACHE) > 16:
            _FREQS_CACHE.clear()
        _FREQS_CACHE[key] = fc
    return fc


_HAS_RMS_NORM = hasattr(F, "rms_norm")


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if _HAS_RMS_NORM:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w


def _rope(x: torch.Tensor, fc: torch.Tensor) -> torch.Tensor:
    """x [B, S, heads, hd] real; fc [B or 1, S, 1, hd/2] complex (llama), or [B or 1, S, 1, 2 * hd] cos|sin."""
    if not fc.is_complex():
        hd = x.shape[-1]
        cos, sin = fc[..., :hd].to(x.dtype), fc[..., hd:].to(x.dtype)
        rotated = torch.cat((-x[..., hd // 2:], x[..., : hd // 2]), dim=-1)
        return x * cos + rotated * sin
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * fc).flatten(3).type_as(x)


_LAYER_SLOTS = (  # per-layer tuple layout read by _forward_hidden (None where the family has no such tensor)
    "attention.wq.weight", "attention.wq.bias", "attention.wk.weight", "attention.wk.bias",
    "attention.wv.weight", "attention.wv.bias", "attention.wo.weight",
    "attention.q_norm.weight", "attention.k_norm.weight",
    "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight",
    "attention_norm.weight", "ffn_norm.weight",
)


def _layers(weights: Mapping[str, torch.Tensor], shape: ModelShape) -> list[tuple[torch.Tensor | None, ...]]:
    present = set(layer_param_names(shape))
    try:
        return [
            tuple(weights[f"layers.{i}.{p}"] if p in present else None for p in _LAYER_SLOTS)
            for i in range(shape.n_layers)
        ]
    except KeyError as e:
        raise ValueError(f"weights are missing {e.args[0]!r}") from None


def _forward_hidden(weights: Mapping[str, torch.Tensor], layers: list[tuple[torch.Tensor, ...]], shape: ModelShape,
                    tokens: torch.Tensor, fc: torch.Tensor, mask: torch.Tensor,
                    caches: list[tuple[torch.Tensor, torch.Tensor]] | None, start: int) -> torch.Tensor:
    """Final-norm hidden states [B, S, dim] of ``tokens`` [B, S]; ``fc``: their RoPE rows [B or 1, S, 1, ...];
    ``mask``: bool (True = attend) to [B, n_kv, rep * S, T], or (S == 1 only) 0/-inf [B, 1, 1, T]. With
    ``caches``, K/V of the S tokens are written at ``start:start+S`` and attention reads ``[:start+S]``."""
    B, S = tokens.shape
    H, KV, hd, rep, eps = shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.n_rep, shape.norm_eps
    scale = 1.0 / math.sqrt(hd)
    x = F.embedding(tokens, weights["tok_embeddings.weight"])
    for li, (wq, bq, wk, bk, wv, bv, wo, qn, kn, w1, w2, w3, an, fn) in enumerate(layers):
        h = _rms_norm(x, an, eps)
        q = F.linear(h, wq, bq).view(B, S, H, hd)
        k = F.linear(h, wk, bk).view(B, S, KV, hd)
        v = F.linear(h, wv, bv).view(B, S, KV, hd)
        if qn is not None:
            q, k = _rms_norm(q, qn, eps), _rms_norm(k, kn, eps)
        q, k = _rope(q, fc), _rope(k, fc)
        if caches is not None:
            kc, vc = caches[li]
            kc[:, :, start:start + S] = k.transpose(1, 2)
            vc[:, :, start:start + S] = v.transpose(1, 2)
            k = kc[:, :, : start + S]
            v = vc[:, :, : start + S]
        else:
            k = k.transpose(1, 2)
            v = v.transpose(1, 2)
        # GQA without repeating K/V: the rep query heads of kv head g are folded into the query-length axis
        if S == 1:
            qg = q.view(B, KV, rep, hd)
        else:
            qg = q.view(B, S, KV, rep, hd).permute(0, 2, 3, 1, 4).reshape(B, KV, rep * S, hd)
        if S == 1 and mask.dtype != torch.bool:
            # decode step: explicit attention, additive mask (faster than SDPA's CPU kernels at these sizes)
            att = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale).add_(mask)
            o = torch.matmul(torch.softmax(att, dim=-1), v)
        else:
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
        if S == 1:
            o = o.reshape(B, 1, H * hd)
        else:
            o = o.view(B, KV, rep, S, hd).permute(0, 3, 1, 2, 4).reshape(B, S, H * hd)
        x = x + F.linear(o, wo)
        h = _rms_norm(x, fn, eps)
        x = x + F.linear(F.silu(F.linear(h, w1)) * F.linear(h, w3), w2)
    return _rms_norm(x, weights["norm.weight"], eps)


def forward_logits(weights: Mapping[str, torch.Tensor], shape: ModelShape, tokens: torch.Tensor) -> torch.Tensor:
    """Causal logits [B, L, vocab] (float32) of ``tokens`` [B, L], positions 0..L-1 (no cache)."""
    tokens = torch.as_tensor(tokens)
    device = weights["tok_embeddings.weight"].device
    tokens = tokens.to(device)
    B, L = tokens.shape
    with torch.no_grad():
        fc = _freqs_cis(shape, L, device)[:L].view(1, L, 1, -1)
        mask = torch.ones(L, L, dtype=torch.bool, device=device).tril_().repeat(shape.n_rep, 1)[None, None]
        h = _forward_hidden(weights, _layers(weights, shape), shape, tokens, fc, mask, None, 0)
        return F.linear(h, output_weight(weights, shape)).float()


def score(weights: Mapping[str, torch.Tensor], shape: ModelShape, sequences: torch.Tensor,
          temperature: float = 1.0) -> torch.Tensor:
    """Teacher-forced logprobs [B, L-1] (float32) of ``sequences[:, 1:]`` under ``log_softmax(logits /
    temperature)`` (temperature <= 0: 1). Rows may be right-padded (padded positions are meaningless)."""
    logits = forward_logits(weights, shape, sequences)[:, :-1]
    if temperature and temperature > 0:
        logits = logits / temperature
    tgt = torch.as_tensor(sequences).to(logits.device)[:, 1:]
    return torch.log_softmax(logits, dim=-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)


def generate(weights: Mapping[str, torch.Tensor], shape: ModelShape, prompts: list[list[int]], *,
             max_new_tokens: int, temperature: float, top_k: int = 0, eos_id: int | list[int], pad_id: int,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample completions for token-id prompts with a KV cache (prompts left-padded, pads never attended), from
    ``softmax(logits / temperature)`` (``top_k > 0``: its ``top_k`` largest logits; ``temperature == 0``: greedy).
    A token's logprob is ``log_softmax(logits / temperature)`` over the FULL vocabulary (what the trainer
    recomputes; greedy: ``log_softmax(logits)``). A row stops after emitting ``eos_id`` (an id or a list); later
    slots hold ``pad_id``, logprob 0. Positions start at 0 at each row's first real token.
    Returns (tokens, logprobs) [B, max_new_tokens] and lengths [B] (eos included) on the weights' device."""
    emb = weights["tok_embeddings.weight"]
    device, dtype = emb.device, emb.dtype
    B, N = len(prompts), int(max_new_tokens)
    out_tokens = torch.full((B, max(N, 0)), pad_id, dtype=torch.long, device=device)
    out_lp = torch.zeros((B, max(N, 0)), dtype=torch.float32, device=device)
    lengths = torch.zeros(B, dtype=torch.long, device=device)
    if B == 0 or N <= 0:
        return out_tokens, out_lp, lengths
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    plens = [len(p) for p in prompts]
    if min(plens) == 0:
        raise ValueError("every prompt needs at least one token")
    P = max(plens)
    T = P + N
    KV, hd, rep = shape.n_kv_heads, shape.head_dim, shape.n_rep
    layers = _layers(weights, shape)
    out_w = output_weight(weights, shape)
    greedy = temperature == 0
    eos_one = isinstance(eos_id, int) or len(eos_id) == 1
    if eos_one:
        eos_id = int(eos_id if isinstance(eos_id, int) else eos_id[0])
    else:
        eos_ids = torch.tensor(list(eos_id), dtype=torch.long, device=device)
    top_k = int(top_k) if top_k and 0 < top_k < shape.vocab_size else 0

    with torch.no_grad():
        # GRPO batches repeat each prompt G times: prefill each distinct prompt once, then copy its KV rows
        uniq: dict[tuple[int, ...], int] = {}
        inverse = [uniq.setdefault(tuple(p), len(uniq)) for p in prompts]
        uprompts = list(uniq)
        U = len(uprompts)

        # left-padded prompt batch [U, P]
        flat = [pad_id] * (U * P)
        for u, p in enumerate(uprompts):
            flat[u * P + P - len(p): (u + 1) * P] = p
        tokens = torch.tensor(flat, dtype=torch.long).view(U, P).to(device)
        upad = P - torch.tensor([len(p) for p in uprompts], dtype=torch.long, device=device)
        ar = torch.arange(P, device=device)
        positions = (ar[None, :] - upad[:, None]).clamp_(min=0)  # [U, P], 0 at the first real token
        fc_all = _freqs_cis(shape, T, device)
        fc = fc_all[positions].unsqueeze(2)  # [U, P, 1, hd/2]
        ukey_valid = ar[None, :] >= upad[:, None]  # [U, P]
        causal = ar[None, :] <= ar[:, None]  # [P(query), P(key)]
        eye = torch.eye(P, dtype=torch.bool, device=device)[None]
        pmask = (causal[None] & ukey_valid[:, None, :]) | eye  # pads attend only to themselves
        pmask = pmask.repeat(1, rep, 1).unsqueeze(1)  # [U, 1, rep*P, P]

        ucaches = [(torch.empty(U, KV, T, hd, dtype=dtype, device=device),
                    torch.empty(U, KV, T, hd, dtype=dtype, device=device)) for _ in range(shape.n_layers)]
        h = _forward_hidden(weights, layers, shape, tokens, fc, pmask, ucaches, 0)[:, -1]
        if U == B and inverse == list(range(B)):
            caches, key_valid = ucaches, ukey_valid
        else:
            inv = torch.tensor(inverse, dtype=torch.long, device=device)
            caches = [(kc.index_select(0, inv), vc.index_select(0, inv)) for kc, vc in ucaches]
            del ucaches
            h = h.index_select(0, inv)
            key_valid = ukey_valid.index_select(0, inv)

        # additive decode mask over the whole cache: prompt pads -inf, everything generated 0
        dmask = torch.zeros(B, 1, 1, T, dtype=dtype, device=device)
        dmask[:, 0, 0, :P].masked_fill_(~key_valid, float("-inf"))

        done = torch.zeros(B, dtype=torch.bool, device=device)
        pos = torch.tensor(plens, dtype=torch.long, device=device)  # position of the next token of each row
        for t in range(N):
            logits = F.linear(h, out_w).float()  # [B, V]
            if greedy:
                tok = logits.argmax(dim=-1, keepdim=True)
                lp = torch.log_softmax(logits, dim=-1).gather(1, tok)
            else:
                scaled = logits / temperature
                logp = torch.log_softmax(scaled, dim=-1)
                if top_k:
                    kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
                    probs = torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)
                else:
                    probs = logp.exp()
                # inverse-CDF sampling, one uniform per row (~10x faster than torch.multinomial here);
                # zero-probability tokens are never chosen
                cdf = probs.cumsum_(dim=-1)
                u = torch.rand(B, 1, generator=generator, device=device).mul_(cdf[:, -1:])
                tok = torch.searchsorted(cdf, u, right=True).clamp_(max=shape.vocab_size - 1)
                lp = logp.gather(1, tok)
            tok = tok.squeeze(1).masked_fill_(done, pad_id)
            out_tokens[:, t] = tok
            out_lp[:, t] = lp.squeeze(1).masked_fill_(done, 0.0)
            lengths += ~done
            done |= (tok == eos_id) if eos_one else torch.isin(tok, eos_ids)
            if t == N - 1 or bool(done.all()):
                break
            fc = fc_all[pos].view(B, 1, 1, -1)
            h = _forward_hidden(weights, layers, shape, tok.view(B, 1), fc, dmask[..., : P + t + 1], caches,
                                P + t)[:, 0]
            pos += 1
    return out_tokens, out_lp, lengths
