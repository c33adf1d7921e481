"""A torch-only forward with a KV cache for the supported families (Llama 3.x, Qwen3, Qwen2.5), for the
rollout engines. Must NOT import torchtitan (engine environments pin their own torch); torch >= 2.3 APIs only.

The math is copied from torchtitan's ``models/llama3/model/model.py`` and ``models/qwen3/model/model.py``
(Copyright (c) Meta Platforms, Inc. and affiliates, BSD-3-Clause license): logits match torchtitan's to rounding.

Weights are a plain ``dict[str, Tensor]`` in HF names and layout (``weight_dict``), looked up into a ``Model``
(``Model.of``: views, no copy) that keeps no reference to the dict, so an engine can swap the whole dict atomically
between requests (an engine looks its live version up once per version).

Generation is split as gpt-fast's ``generate.py``: ``prefill`` runs the prompts into a ``KVCache``, ``decode_step``
runs one token per sequence of that batch, ``sample`` draws the next tokens from the logits, and ``Completions``
keeps the tokens, logprobs and lengths.

Continuous batching (``engine/batcher.py``) keeps its sequences in a ``SlotCache`` instead, one row per sequence at
its own length: ``join_rows`` prefills newcomers into free rows (after K/V kept from an earlier request, where a
multi-turn turn has it: ``kept_rows``), ``decode_rows`` runs one token per row in use, ``drop_rows`` frees the rows of
finished sequences, and ``sample_with`` draws each row's token from ``counter_uniforms`` (its own key and position).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, NamedTuple

import torch
import torch.nn.functional as F

from torchtitan_flux.models.weight_dict import EMBEDDING, FINAL_NORM, ModelShape, layer_param_names, output_weight

__all__ = ["generate", "generate_on", "logits", "score", "forward_logits", "causal_logits", "prefill",
           "decode_step", "sample", "sample_with", "sample_rows", "counter_uniforms", "SlotCache", "kv_pool_bytes",
           "kept_rows", "join_rows", "decode_rows", "decode_and_sample", "decode_graph_bytes", "drop_rows"]


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


def _rope_tables(fc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A forward's RoPE rows as ``_rope`` reads them, cast once for all its layers: llama's complex rotations as
    they are; qwen's cos|sin rows split and cast to the activations' dtype."""
    if fc.is_complex():
        return fc
    hd = fc.shape[-1] // 2
    return fc[..., :hd].to(dtype), fc[..., hd:].to(dtype)


def _rope(x: torch.Tensor, fc: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [B, S, heads, hd] real; fc (``_rope_tables``) [B or 1, S, 1, hd/2] complex (llama), or cos and sin, each
    [B or 1, S, 1, hd]. Llama: HF's q/k rows hold each head's rotation pairs as its two halves; they are rotated as
    torchtitan's llama3 rotates interleaved pairs, and the output stays interleaved: q and k share the order, so
    attention is unchanged and bit-identical to torchtitan's layout."""
    if isinstance(fc, tuple):
        cos, sin = fc
        hd = x.shape[-1]
        rotated = torch.cat((-x[..., hd // 2:], x[..., : hd // 2]), dim=-1)
        return x * cos + rotated * sin
    pairs = x.unflatten(-1, (2, -1)).transpose(-1, -2)  # [..., hd/2, 2]: (x[j], x[j + hd/2])
    xc = torch.view_as_complex(pairs.contiguous().float())
    return torch.view_as_real(xc * fc).flatten(3).type_as(x)


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list as a tensor on ``device`` without a synchronisation: on a GPU, from pinned memory, copied
    asynchronously (the caching host allocator keeps the pinned block until the copy is done)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class LayerWeights(NamedTuple):
    """One transformer block's tensors (None where the family has none: q/k/v biases, q/k norms)."""

    wq: torch.Tensor
    bq: torch.Tensor | None
    wk: torch.Tensor
    bk: torch.Tensor | None
    wv: torch.Tensor
    bv: torch.Tensor | None
    wo: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    gate: torch.Tensor
    down: torch.Tensor
    up: torch.Tensor
    attention_norm: torch.Tensor
    ffn_norm: torch.Tensor


_LAYER_NAMES = LayerWeights(  # each field's HF name after ``model.layers.{i}.``
    "self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
    "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.down_proj.weight", "mlp.up_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
)


@dataclass(frozen=True)
class Model:
    """What a forward reads, looked up once per call from a weight dict: the architecture and the tensors."""

    shape: ModelShape
    embedding: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    output: torch.Tensor

    @classmethod
    def of(cls, weights: Mapping[str, torch.Tensor], shape: ModelShape) -> "Model":
        """Look up ``weights`` (HF names); ValueError naming a missing one."""
        present = set(layer_param_names(shape))
        try:
            layers = [LayerWeights(*(weights[f"model.layers.{i}.{n}"] if n in present else None for n in _LAYER_NAMES))
                      for i in range(shape.n_layers)]
            return cls(shape, weights[EMBEDDING], layers, weights[FINAL_NORM], output_weight(weights, shape))
        except KeyError as e:
            raise ValueError(f"weights are missing {e.args[0]!r}") from None

    @property
    def device(self) -> torch.device:
        return self.embedding.device


def _attention(shape: ModelShape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
    """Attention of q [B, S, H, hd] over k, v [B, KV, T, hd] -> [B, S, H * hd] (see ``_forward_hidden``'s mask)."""
    B, S = q.shape[:2]
    H, KV, hd, rep = shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.n_rep
    # GQA without repeating K/V: the rep query heads of kv head g are folded into the query-length axis
    if S == 1:
        qg = q.view(B, KV, rep, hd)
    else:
        qg = q.view(B, S, KV, rep, hd).permute(0, 2, 3, 1, 4).reshape(B, KV, rep * S, hd)
    if S == 1 and mask.dtype != torch.bool:
        # decode step: explicit attention, additive mask (faster than SDPA's CPU kernels at these sizes)
        att = torch.matmul(qg, k.transpose(-1, -2)).mul_(1.0 / math.sqrt(hd)).add_(mask)
        o = torch.matmul(torch.softmax(att, dim=-1), v)
    else:
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
    if S == 1:
        return o.reshape(B, 1, H * hd)
    return o.view(B, KV, rep, S, hd).permute(0, 3, 1, 2, 4).reshape(B, S, H * hd)


def _block(shape: ModelShape, w: LayerWeights, x: torch.Tensor, fc: torch.Tensor | tuple, mask: torch.Tensor,
           cache: tuple[torch.Tensor, torch.Tensor] | None, start: int | torch.Tensor) -> torch.Tensor:
    """One transformer block on x [B, S, dim]; with ``cache``, K/V are written at ``start:start+S`` (``start`` a
    tensor [B] or [B, S]: each token's own slot) and attention reads the first ``mask.shape[-1]`` slots."""
    B, S = x.shape[:2]
    eps = shape.norm_eps
    h = _rms_norm(x, w.attention_norm, eps)
    q = F.linear(h, w.wq, w.bq).view(B, S, shape.n_heads, shape.head_dim)
    k = F.linear(h, w.wk, w.bk).view(B, S, shape.n_kv_heads, shape.head_dim)
    v = F.linear(h, w.wv, w.bv).view(B, S, shape.n_kv_heads, shape.head_dim)
    if w.q_norm is not None:
        q, k = _rms_norm(q, w.q_norm, eps), _rms_norm(k, w.k_norm, eps)
    q, k = _rope(q, fc), _rope(k, fc)
    if cache is None:
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    else:
        kc, vc = cache
        if isinstance(start, torch.Tensor):  # each token's own slot: [B] (S == 1) or [B, S]
            rows = torch.arange(B, device=x.device)[:, None]
            slots = start.view(B, S)
            kc[rows, :, slots], vc[rows, :, slots] = k, v
        else:
            kc[:, :, start:start + S] = k.transpose(1, 2)
            vc[:, :, start:start + S] = v.transpose(1, 2)
        k, v = kc[:, :, : mask.shape[-1]], vc[:, :, : mask.shape[-1]]
    x = x + F.linear(_attention(shape, q, k, v, mask), w.wo)
    h = _rms_norm(x, w.ffn_norm, eps)
    return x + F.linear(F.silu(F.linear(h, w.gate)) * F.linear(h, w.up), w.down)


def _forward_hidden(model: Model, tokens: torch.Tensor, fc: torch.Tensor, mask: torch.Tensor,
                    caches: list[tuple[torch.Tensor, torch.Tensor]] | None, start: int | torch.Tensor) -> torch.Tensor:
    """Final-norm hidden states [B, S, dim] of ``tokens`` [B, S]; ``fc``: their RoPE rows [B or 1, S, 1, ...];
    ``mask``: bool (True = attend) to [B, n_kv, rep * S, T], or (S == 1 only) 0/-inf [B, 1, 1, T]. With
    ``caches``, K/V of the S tokens are written at ``start:start+S`` (``start`` a tensor [B] or [B, S]: each
    token's own slot) and attention reads the first T slots."""
    x = F.embedding(tokens, model.embedding)
    fc = _rope_tables(fc, x.dtype)
    for i, layer in enumerate(model.layers):
        x = _block(model.shape, layer, x, fc, mask, None if caches is None else caches[i], start)
    return _rms_norm(x, model.norm, model.shape.norm_eps)


def logits(model: Model, hidden: torch.Tensor) -> torch.Tensor:
    """The next-token logits (float32) of final hidden states [..., dim]."""
    return F.linear(hidden, model.output).float()


def forward_logits(weights: Mapping[str, torch.Tensor], shape: ModelShape, tokens: torch.Tensor) -> torch.Tensor:
    """``causal_logits`` of the model of ``weights`` (HF names)."""
    return causal_logits(Model.of(weights, shape), tokens)


def causal_logits(model: Model, tokens: torch.Tensor) -> torch.Tensor:
    """Causal logits [B, L, vocab] (float32) of ``tokens`` [B, L], positions 0..L-1 (no cache)."""
    shape = model.shape
    tokens = torch.as_tensor(tokens).to(model.device)
    L = tokens.shape[1]
    with torch.no_grad():
        fc = _freqs_cis(shape, L, model.device)[:L].view(1, L, 1, -1)
        mask = torch.ones(L, L, dtype=torch.bool, device=model.device).tril_().repeat(shape.n_rep, 1)[None, None]
        return logits(model, _forward_hidden(model, tokens, fc, mask, None, 0))


def score(weights: Mapping[str, torch.Tensor], shape: ModelShape, sequences: torch.Tensor,
          temperature: float = 1.0) -> torch.Tensor:
    """Teacher-forced logprobs [B, L-1] (float32) of ``sequences[:, 1:]`` under ``log_softmax(logits /
    temperature)`` (temperature <= 0: 1). Rows may be right-padded (padded positions are meaningless)."""
    logits = forward_logits(weights, shape, sequences)[:, :-1]
    if temperature and temperature > 0:
        logits = logits / temperature
    tgt = torch.as_tensor(sequences).to(logits.device)[:, 1:]
    return torch.log_softmax(logits, dim=-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)


# ------------------------------------------------------------------------------------ generation


@dataclass
class KVCache:
    """The decode state of a batch of sequences, left-padded to one length: per layer K and V
    [B, n_kv, capacity, hd], the additive attention mask over the slots [B, 1, 1, capacity] (-inf at a prompt pad),
    each row's next RoPE position [B], and how many slots are filled (``length``, the same for every row)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor
    positions: torch.Tensor
    length: int


def _left_pad(prompts: list[tuple[int, ...]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded to the longest: tokens [U, P] and pad counts [U]."""
    P = max(len(p) for p in prompts)
    flat = [pad_id] * (len(prompts) * P)
    for u, p in enumerate(prompts):
        flat[u * P + P - len(p): (u + 1) * P] = p
    tokens = torch.tensor(flat, dtype=torch.long).view(len(prompts), P).to(device)
    return tokens, P - torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)


def _empty_cache(shape: ModelShape, rows: int, capacity: int, dtype: torch.dtype, device: torch.device,
                 zeros: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, uninitialised K and V [rows, n_kv, capacity, hd] (``zeros``: zero)."""
    size = (rows, shape.n_kv_heads, capacity, shape.head_dim)
    new = torch.zeros if zeros else torch.empty
    return [(new(size, dtype=dtype, device=device), new(size, dtype=dtype, device=device))
            for _ in range(shape.n_layers)]


def _prefill_mask(valid: torch.Tensor, rep: int) -> torch.Tensor:
    """Bool prefill mask [U, 1, rep * P, P] of keys ``valid`` [U, P]: causal over real tokens; a pad attends only to
    itself (and is never attended)."""
    P = valid.shape[1]
    ar = torch.arange(P, device=valid.device)
    causal = ar[None, :] <= ar[:, None]  # [P(query), P(key)]
    eye = torch.eye(P, dtype=torch.bool, device=valid.device)[None]
    return ((causal[None] & valid[:, None, :]) | eye).repeat(1, rep, 1).unsqueeze(1)


def prefill(model: Model, prompts: list[list[int]], pad_id: int, capacity: int,
            freqs: torch.Tensor) -> tuple[torch.Tensor, KVCache]:
    """Run the prompts (left-padded; positions start at 0 at each row's first real token) into a new ``KVCache`` of
    ``capacity`` slots; returns the last prompt token's hidden state [B, dim] and the cache. GRPO batches repeat
    each prompt G times: each distinct prompt runs once and its cache rows are copied."""
    shape, device, dtype = model.shape, model.device, model.embedding.dtype
    uniq: dict[tuple[int, ...], int] = {}
    inverse = [uniq.setdefault(tuple(p), len(uniq)) for p in prompts]
    tokens, pads = _left_pad(list(uniq), pad_id, device)
    U, P = tokens.shape
    ar = torch.arange(P, device=device)
    fc = freqs[(ar[None, :] - pads[:, None]).clamp_(min=0)].unsqueeze(2)  # [U, P, 1, ...]
    valid = ar[None, :] >= pads[:, None]  # [U, P]
    caches = _empty_cache(shape, U, capacity, dtype, device)
    h = _forward_hidden(model, tokens, fc, _prefill_mask(valid, shape.n_rep), caches, 0)[:, -1]
    if U != len(prompts) or inverse != list(range(U)):
        rows = torch.tensor(inverse, dtype=torch.long, device=device)
        caches = [(kc.index_select(0, rows), vc.index_select(0, rows)) for kc, vc in caches]
        h, valid = h.index_select(0, rows), valid.index_select(0, rows)
    mask = torch.zeros(len(prompts), 1, 1, capacity, dtype=dtype, device=device)
    mask[:, 0, 0, :P].masked_fill_(~valid, float("-inf"))
    positions = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
    return h, KVCache(caches, mask, positions, P)


def decode_step(model: Model, cache: KVCache, tokens: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """One token per row of the cache's batch (``tokens`` [B]), at each row's next position: its K/V go to slot
    ``cache.length``, and the cache advances by one. Returns the final hidden states [B, dim]."""
    B = tokens.shape[0]
    fc = freqs[cache.positions].view(B, 1, 1, -1)
    mask = cache.mask[..., : cache.length + 1]
    h = _forward_hidden(model, tokens.view(B, 1), fc, mask, cache.layers, cache.length)[:, 0]
    cache.positions += 1
    cache.length += 1
    return h


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (``>>`` on int64 is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _splitmix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (multiplication wraps modulo 2^64, on CPU and CUDA)."""
    z = z + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def counter_uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """[rows, 1] float32 uniforms in [0, 1), each a hash of its row's ``keys`` and ``counters`` (int64 [rows], on
    the device): a row's draw depends on nothing else, takes no generator state and no host round trip."""
    z = _splitmix64(_splitmix64(keys) ^ counters)
    return (_shr(z, 40).float() * 2.0 ** -24).view(-1, 1)


def sample(logits: torch.Tensor, temperature: float, top_k: int,
           generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_with`` uniforms drawn from ``generator`` (on the logits' device; none when greedy)."""
    u = None if temperature == 0 else torch.rand(logits.shape[0], 1, generator=generator, device=logits.device)
    return sample_with(logits, temperature, top_k, u)


def sample_with(logits: torch.Tensor, temperature: float, top_k: int,
                uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` [B, V] (float32), and its logprob, both [B, 1]: from ``softmax(logits /
    temperature)`` (``top_k > 0``: its ``top_k`` largest logits; ``temperature == 0``: greedy, ``uniforms`` unused);
    the logprob is ``log_softmax(logits / temperature)`` over the full vocabulary (greedy: ``log_softmax(logits)``).
    ``uniforms`` [B, 1] in [0, 1): one per row, the inverse-CDF draw."""
    if temperature == 0:
        tok = logits.argmax(dim=-1, keepdim=True)
        return tok, torch.log_softmax(logits, dim=-1).gather(1, tok)
    scaled = logits / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    # inverse-CDF sampling (~10x faster than torch.multinomial here)
    if top_k:  # over the top_k tokens only, in vocabulary order: no zero-probability token can be reached (a
        # parallel cumsum over the whole vocabulary can step up by an ulp at one)
        index = torch.topk(scaled, top_k, dim=-1).indices.sort(dim=-1).values
        cdf = torch.softmax(scaled.gather(1, index), dim=-1).cumsum_(dim=-1)
    else:
        cdf = logp.exp().cumsum_(dim=-1)
    j = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True).clamp_(max=cdf.shape[-1] - 1)
    tok = index.gather(1, j) if top_k else j
    return tok, logp.gather(1, tok)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, uniforms: torch.Tensor,
                k_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_with`` with each row's own settings, as device tensors (no branch on a value, no host read: a
    captured decode step samples with it): ``temperature`` [B] float32 (0: greedy), ``top_k`` [B] int64 (0: the
    whole vocabulary), ``uniforms`` [B, 1]. ``k_max``: the largest ``top_k`` among the rows that matter (0: none);
    a row's ``top_k`` is clamped to it, so rows of any setting (a padded row's) draw a valid token. Bit-equal to
    ``sample_with`` for rows whose ``top_k`` is 0 or ``k_max``, to rounding for the others (their softmax spans
    ``k_max`` entries, the ones past their ``top_k`` at -inf). The temperature divides as eager ``logits / t`` does
    on each device (CUDA multiplies by the reciprocal of a host scalar)."""
    vocab = logits.shape[-1]
    greedy = temperature == 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    scaled = logits * (1.0 / t) if logits.is_cuda else logits / t
    logp = torch.log_softmax(scaled, dim=-1)
    cdf = logp.exp().cumsum_(dim=-1)
    tok = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True).clamp_(max=vocab - 1)
    if k_max:
        k = top_k.clamp(min=0, max=k_max)[:, None]
        top = torch.topk(scaled, k_max, dim=-1).indices  # largest first: a row's top k are the first k
        index = torch.where(torch.arange(k_max, device=logits.device)[None, :] < k, top, vocab).sort(dim=-1).values
        outside = index == vocab  # past the row's top k: sorted last, never drawn
        cdf_k = torch.softmax(scaled.gather(1, index.clamp(max=vocab - 1)).masked_fill_(outside, float("-inf")),
                              dim=-1).cumsum_(dim=-1)
        j = torch.searchsorted(cdf_k, uniforms * cdf_k[:, -1:], right=True)
        j = torch.minimum(j, (k - 1).clamp(min=0))
        tok = torch.where(k > 0, index.gather(1, j).clamp(max=vocab - 1), tok)
    tok = torch.where(greedy[:, None], logits.argmax(dim=-1, keepdim=True), tok)
    return tok, logp.gather(1, tok)


@dataclass
class Completions:
    """What ``generate`` returns, one column per decode step: tokens and logprobs [B, N] (``pad_id`` and 0 once a row
    stopped), lengths [B] (the stop token included); which rows stopped, after emitting one of ``stop_ids``."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    lengths: torch.Tensor
    done: torch.Tensor
    stop_ids: torch.Tensor
    pad_id: int

    @classmethod
    def empty(cls, rows: int, steps: int, eos_id: int | list[int], pad_id: int, device: torch.device) -> "Completions":
        return cls(torch.full((rows, steps), pad_id, dtype=torch.long, device=device),
                   torch.zeros((rows, steps), dtype=torch.float32, device=device),
                   torch.zeros(rows, dtype=torch.long, device=device),
                   torch.zeros(rows, dtype=torch.bool, device=device),
                   torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id), dtype=torch.long, device=device),
                   pad_id)

    def add(self, t: int, tok: torch.Tensor, logprob: torch.Tensor) -> torch.Tensor:
        """Step ``t``'s sample (``tok``, ``logprob`` [B, 1]) recorded; returns its tokens [B], ``pad_id`` if stopped."""
        tok = tok.squeeze(1).masked_fill_(self.done, self.pad_id)
        self.tokens[:, t] = tok
        self.logprobs[:, t] = logprob.squeeze(1).masked_fill_(self.done, 0.0)
        self.lengths += ~self.done
        self.done |= torch.isin(tok, self.stop_ids)
        return tok


def generate(weights: Mapping[str, torch.Tensor], shape: ModelShape, prompts: list[list[int]], *,
             max_new_tokens: int, temperature: float, top_k: int = 0, eos_id: int | list[int], pad_id: int,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``generate_on`` the model of ``weights`` (HF names)."""
    return generate_on(Model.of(weights, shape), prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                       top_k=top_k, eos_id=eos_id, pad_id=pad_id, generator=generator)


def generate_on(model: Model, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, top_k: int = 0,
                eos_id: int | list[int], pad_id: int,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample completions for token-id prompts with a KV cache (``prefill``, then ``sample`` and ``decode_step``
    per token; see ``sample`` for ``temperature`` and ``top_k``). A row stops after emitting ``eos_id`` (an id or a
    list); later slots hold ``pad_id``, logprob 0. Returns (tokens, logprobs) [B, max_new_tokens] and lengths [B]
    (eos included) on the model's device."""
    shape = model.shape
    steps = max(int(max_new_tokens), 0)
    out = Completions.empty(len(prompts), steps, eos_id, pad_id, model.device)
    if not prompts or steps == 0:
        return out.tokens, out.logprobs, out.lengths
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if min(len(p) for p in prompts) == 0:
        raise ValueError("every prompt needs at least one token")
    top_k = int(top_k) if top_k and 0 < top_k < shape.vocab_size else 0
    capacity = max(len(p) for p in prompts) + steps
    with torch.no_grad():
        freqs = _freqs_cis(shape, capacity, model.device)
        h, cache = prefill(model, prompts, pad_id, capacity, freqs)
        for t in range(steps):
            tok = out.add(t, *sample(logits(model, h), temperature, top_k, generator))
            if t == steps - 1 or bool(out.done.all()):
                break
            h = decode_step(model, cache, tok, freqs)
    return out.tokens, out.logprobs, out.lengths


# ------------------------------------------------------------------------------------ continuous batching


@dataclass
class SlotCache:
    """The decode state of continuous batching: rows of sequences, each at its own length, in a pool allocated once
    (``allocate``: its memory is fixed from then on). Per layer K and V [rows, n_kv, slots, hd]; ``lengths``
    [rows]: each row's filled slots, which is also its next token's RoPE position (a row's prompt starts at slot 0:
    no padding). The rows in use are the prefix ``[:rows]`` (``drop_rows`` keeps it so, moving one row into each
    freed one). Slots past a row's length hold finite values (zeros, an earlier sequence's K/V) and are masked."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    lengths: torch.Tensor
    rows: int

    @classmethod
    def allocate(cls, model: Model, rows: int, slots: int) -> "SlotCache":
        """A pool of ``rows`` rows of ``slots`` slots (``kv_pool_bytes``), zeros."""
        return cls(_empty_cache(model.shape, rows, slots, model.embedding.dtype, model.device, zeros=True),
                   torch.zeros(rows, dtype=torch.long, device=model.device), 0)

    @property
    def slots(self) -> int:
        return self.layers[0][0].shape[2]

    @property
    def capacity(self) -> int:
        """Rows in the pool."""
        return self.layers[0][0].shape[0]


def kv_pool_bytes(shape: ModelShape, rows: int, slots: int, itemsize: int) -> int:
    """Bytes of a ``SlotCache`` of ``rows`` x ``slots`` in a dtype of ``itemsize`` bytes."""
    return 2 * shape.n_layers * rows * shape.n_kv_heads * slots * shape.head_dim * itemsize


KeptRows = list[tuple[torch.Tensor, torch.Tensor]]
"""A sequence's K/V kept from an earlier request: per layer K and V [n_kv, slots, hd] (``kept_rows``)."""


def kept_rows(cache: SlotCache, row: int, slots: int) -> KeptRows:
    """Copies of the K/V of the first ``slots`` slots of ``row`` in use (its sequence's first ``slots`` tokens)."""
    return [(kc[row, :, :slots].clone(), vc[row, :, :slots].clone()) for kc, vc in cache.layers]


@torch.no_grad()
def join_rows(model: Model, cache: SlotCache, prompts: list[list[int]], pad_id: int, capacity: int,
              kept: list[KeptRows | None] | None = None) -> torch.Tensor:
    """Prefill ``prompts`` into the rows ``[rows, rows + len(prompts))`` of ``cache``, each to be decoded up to
    ``capacity`` slots (ValueError past the pool's rows or slots); returns their last prompt token's hidden state [len(prompts), dim]. ``kept[i]``: the K/V of
    the first tokens of prompt ``i`` (``kept_rows``, fewer slots than the prompt has tokens), which are not run
    again: the prompt's other tokens are, at their positions, attending to them. Prompts with the same tokens and
    nothing kept (a group's) run once, and their K/V is copied to each of their rows."""
    n = len(prompts)
    kept = kept or [None] * n
    if min(len(p) for p in prompts) == 0:
        raise ValueError("every prompt needs at least one token")
    starts = [0 if k is None else k[0][0].shape[1] for k in kept]
    if any(start >= len(p) for start, p in zip(starts, prompts)):
        raise ValueError("kept K/V must leave at least one prompt token to run")
    runs: dict[tuple, int] = {}  # (tokens, i if kept else -1) -> its index among the runs
    inverse = [runs.setdefault((tuple(p), i if k is not None else -1), len(runs))
               for i, (p, k) in enumerate(zip(prompts, kept))]
    first_of = {u: inverse.index(u) for u in range(len(runs))}  # a prompt of each run
    width = max(len(p) for p in prompts)
    if cache.rows + n > cache.capacity or max(capacity, width) > cache.slots:
        raise ValueError(f"{n} sequences of up to {max(capacity, width)} tokens do not fit in the KV pool's free "
                         f"rows ({cache.capacity - cache.rows} of {cache.slots} slots)")
    device, shape = model.device, model.shape
    # each run's tokens after what is kept, right-padded to S; its K/V written at slots start + j
    S = max(len(prompts[first_of[u]]) - starts[first_of[u]] for u in first_of)
    T = max(starts) + S  # the slots a run's tokens reach (width when nothing is kept)
    flat = [pad_id] * (len(runs) * S)
    for u, i in first_of.items():
        flat[u * S: u * S + len(prompts[i]) - starts[i]] = prompts[i][starts[i]:]
    tokens = to_device(flat, device).view(len(runs), S)
    start = to_device([starts[first_of[u]] for u in first_of], device)
    slots = start[:, None] + torch.arange(S, device=device)[None, :]  # [runs, S]: also the RoPE positions
    fc = _freqs_cis(shape, T, device)[slots].unsqueeze(2)
    attend = torch.arange(T, device=device)[None, None, :] <= slots[:, :, None]  # causal over the slots
    mask = attend.repeat(1, shape.n_rep, 1).unsqueeze(1)  # [runs, 1, rep * S, T]
    # zeros: a slot no query attends still enters attention's product with V (0 x NaN would be NaN)
    layers = _empty_cache(shape, len(runs), T, model.embedding.dtype, device, zeros=True)
    for u, i in first_of.items():
        for (k, v), (kk, kv) in zip(layers, kept[i] or []):
            k[u, :, : starts[i]], v[u, :, : starts[i]] = kk, kv
    h = _forward_hidden(model, tokens, fc, mask, layers, slots)
    last = to_device([len(prompts[i]) - starts[i] - 1 for i in first_of.values()], device)
    h = h[torch.arange(len(runs), device=device), last]
    rows = to_device(inverse, device)
    first, end = cache.rows, cache.rows + n
    for (kc, vc), (k, v) in zip(cache.layers, layers):
        kc[first:end, :, :width], vc[first:end, :, :width] = k[rows, :, :width], v[rows, :, :width]
    cache.lengths[first:end] = to_device([len(p) for p in prompts], device)
    cache.rows = end
    return h.index_select(0, rows)


@torch.no_grad()
def decode_rows(model: Model, cache: SlotCache, tokens: torch.Tensor, width: int) -> torch.Tensor:
    """One token per row in use (``tokens`` [rows]), each at its row's next slot and position; every row advances
    by one. ``width``: the longest row's length after this step (the caller knows it: no host read here). Returns
    the final hidden states [rows, dim]."""
    n = cache.rows
    positions = cache.lengths[:n]
    beyond = torch.arange(width, device=model.device)[None, :] > positions[:, None]  # [n, width]
    mask = torch.zeros(n, 1, 1, width, dtype=model.embedding.dtype, device=model.device)
    mask.masked_fill_(beyond.view(n, 1, 1, width), float("-inf"))
    fc = _freqs_cis(model.shape, width, model.device)[positions].view(n, 1, 1, -1)
    layers = [(kc[:n], vc[:n]) for kc, vc in cache.layers]
    h = _forward_hidden(model, tokens.view(n, 1), fc, mask, layers, positions)[:, 0]
    positions += 1
    return h


@torch.no_grad()
def decode_and_sample(model: Model, cache: SlotCache, freqs: torch.Tensor, rows: int, width: int, k_max: int,
                      active: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor, keys: torch.Tensor,
                      temperature: torch.Tensor, top_k: torch.Tensor) -> None:
    """A whole decode step on static buffers, what a CUDA graph captures (``engine/graphs.py``): ``decode_rows`` of
    the first ``rows`` rows of the pool over ``width`` slots, then each row's next token sampled with its own
    settings and draw (``sample_rows``, ``counter_uniforms`` of its key and new length), written in place:
    ``tokens`` (read as this step's input first), ``logprobs``. Every argument tensor is of the pool's capacity
    [capacity], and ``freqs`` a RoPE table of the pool's slots, so no address depends on the step. Rows
    past those in use (``active`` False) are padding: they run at position 0 of their own (free) row, which is all
    they write, and keep their length; no row reads another row. No host read, no host-to-device copy, no
    allocation outside the caching allocator, no branch on a device value."""
    live = active[:rows]
    positions = cache.lengths[:rows] * live
    beyond = torch.arange(width, device=positions.device)[None, :] > positions[:, None]
    mask = torch.zeros(rows, 1, 1, width, dtype=model.embedding.dtype, device=positions.device)
    mask.masked_fill_(beyond.view(rows, 1, 1, width), float("-inf"))
    fc = freqs[positions].view(rows, 1, 1, -1)
    layers = [(kc[:rows], vc[:rows]) for kc, vc in cache.layers]
    h = _forward_hidden(model, tokens[:rows].view(rows, 1), fc, mask, layers, positions)[:, 0]
    cache.lengths[:rows] += live
    uniforms = counter_uniforms(keys[:rows], cache.lengths[:rows])
    tok, logp = sample_rows(logits(model, h), temperature[:rows], top_k[:rows], uniforms, k_max)
    tokens[:rows], logprobs[:rows] = tok.view(-1), logp.view(-1)


def decode_graph_bytes(shape: ModelShape, rows: int, slots: int, itemsize: int) -> int:
    """An estimate of what captured decode steps hold beyond the KV pool (``engine/decoding.py``): one static copy
    of the weights, the per-row buffers, the graphs' private pool: twice the scratch of the largest bucket
    (``rows`` x ``slots``; the smaller buckets, powers of two, together need less than it again), and as much again
    cached on the capture stream by the buckets' eager warm-ups (its blocks fit no larger bucket, and none can be
    released while a capture runs: docs/gpu.md, rule 15), that scratch
    being the sampling's float32 [rows, vocab] tensors (logits, scaled, logprobs, their cumulative sum, top-k
    scratch: 6), attention's [rows, heads, slots] scores (4, float32 at most) and a block's activations. What a
    GPU run's peak shows against it: docs/gpu.md, rule 15."""
    d, hd, ffn = shape.dim, shape.head_dim, shape.intermediate_size
    q, kv = shape.n_heads * hd, shape.n_kv_heads * hd
    layer = d * q + 2 * d * kv + q * d + 3 * d * ffn + 2 * d + 2 * hd + q + 2 * kv
    weights = (shape.vocab_size * d * (1 if shape.tied else 2) + shape.n_layers * layer + d) * itemsize
    per_row = 8 + 4 + 8 + 4 + 8 + 1  # tokens, logprobs, keys, temperature, top_k, in use
    scratch = rows * (6 * shape.vocab_size * 4 + 4 * shape.n_heads * slots * 4 + 8 * (d + ffn + q) * itemsize)
    return weights + rows * per_row + 4 * scratch


def drop_rows(cache: SlotCache, done: list[bool]) -> list[int]:
    """Free the rows in use marked ``done``, keeping the rows in use a prefix: the last ones move into the freed
    rows. Returns, for each row in use now, its row before (for the caller's per-row state)."""
    keep = len(done) - sum(done)
    holes = [r for r in range(keep) if done[r]]
    movers = [r for r in range(keep, len(done)) if not done[r]]
    order = list(range(keep))
    for hole, mover in zip(holes, movers):
        order[hole] = mover
    if holes:
        dst, src = (to_device(rows, cache.lengths.device) for rows in (holes, movers))
        for kc, vc in cache.layers:
            kc[dst], vc[dst] = kc[src], vc[src]
        cache.lengths[dst] = cache.lengths[src]
    cache.rows = keep
    return order
