"""A torch-only forward with a KV cache for the supported families (Llama 3.x, Qwen3, Qwen2.5), for the
rollout engines. Must NOT import torchtitan (engine environments pin their own torch); torch >= 2.3 APIs only.

The math is copied from torchtitan's ``models/llama3/model/model.py`` and ``models/qwen3/model/model.py``
(Copyright (c) Meta Platforms, Inc. and affiliates, BSD-3-Clause license): logits match torchtitan's to rounding.

Weights are a plain ``dict[str, Tensor]`` in HF names and layout (``weight_dict``). Every function takes the dict as
an argument and keeps no reference to it, so an engine can swap the whole dict atomically between requests.

Generation is split as gpt-fast's ``generate.py``: ``prefill`` runs the prompts into a ``KVCache``, ``decode_step``
runs one token per sequence of that batch, ``sample`` draws the next tokens from the logits, and ``Completions``
keeps the tokens, logprobs and lengths.

Continuous batching (``engine/batcher.py``) keeps its sequences in a ``SlotCache`` instead, one row per sequence at
its own length: ``join_rows`` prefills newcomers into free rows, ``decode_rows`` runs one token per row in use, and
``drop_rows`` frees the rows of finished sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from torchtitan_flux.models.weight_dict import EMBEDDING, FINAL_NORM, ModelShape, layer_param_names, output_weight

__all__ = ["generate", "score", "forward_logits", "prefill", "decode_step", "sample", "SlotCache", "join_rows",
           "decode_rows", "drop_rows"]


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
    """x [B, S, heads, hd] real; fc [B or 1, S, 1, hd/2] complex (llama), or [B or 1, S, 1, 2 * hd] cos|sin.
    Llama: HF's q/k rows hold each head's rotation pairs as its two halves; they are rotated as torchtitan's llama3
    rotates interleaved pairs, and the output stays interleaved: q and k share the order, so attention is
    unchanged and bit-identical to torchtitan's layout."""
    if not fc.is_complex():
        hd = x.shape[-1]
        cos, sin = fc[..., :hd].to(x.dtype), fc[..., hd:].to(x.dtype)
        rotated = torch.cat((-x[..., hd // 2:], x[..., : hd // 2]), dim=-1)
        return x * cos + rotated * sin
    pairs = x.unflatten(-1, (2, -1)).transpose(-1, -2)  # [..., hd/2, 2]: (x[j], x[j + hd/2])
    xc = torch.view_as_complex(pairs.contiguous().float())
    return torch.view_as_real(xc * fc).flatten(3).type_as(x)


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


def _block(shape: ModelShape, w: LayerWeights, x: torch.Tensor, fc: torch.Tensor, mask: torch.Tensor,
           cache: tuple[torch.Tensor, torch.Tensor] | None, start: int | torch.Tensor) -> torch.Tensor:
    """One transformer block on x [B, S, dim]; with ``cache``, K/V are written at ``start:start+S`` (``start`` [B]:
    S == 1, row b's at ``start[b]``) and attention reads the first ``mask.shape[-1]`` slots."""
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
        if isinstance(start, torch.Tensor):
            rows = torch.arange(B, device=x.device)
            kc[rows, :, start], vc[rows, :, start] = k[:, 0], v[:, 0]
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
    ``caches``, K/V of the S tokens are written at ``start:start+S`` (``start`` [B]: one token per row, at its own
    slot) and attention reads the first T slots."""
    x = F.embedding(tokens, model.embedding)
    for i, layer in enumerate(model.layers):
        x = _block(model.shape, layer, x, fc, mask, None if caches is None else caches[i], start)
    return _rms_norm(x, model.norm, model.shape.norm_eps)


def forward_logits(weights: Mapping[str, torch.Tensor], shape: ModelShape, tokens: torch.Tensor) -> torch.Tensor:
    """Causal logits [B, L, vocab] (float32) of ``tokens`` [B, L], positions 0..L-1 (no cache)."""
    model = Model.of(weights, shape)
    tokens = torch.as_tensor(tokens).to(model.device)
    L = tokens.shape[1]
    with torch.no_grad():
        fc = _freqs_cis(shape, L, model.device)[:L].view(1, L, 1, -1)
        mask = torch.ones(L, L, dtype=torch.bool, device=model.device).tril_().repeat(shape.n_rep, 1)[None, None]
        return F.linear(_forward_hidden(model, tokens, fc, mask, None, 0), model.output).float()


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


def _empty_cache(shape: ModelShape, rows: int, capacity: int, dtype: torch.dtype,
                 device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, uninitialised K and V [rows, n_kv, capacity, hd]."""
    size = (rows, shape.n_kv_heads, capacity, shape.head_dim)
    return [(torch.empty(size, dtype=dtype, device=device), torch.empty(size, dtype=dtype, device=device))
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


def _uniforms(rows: int, generator: torch.Generator | Sequence[torch.Generator] | None,
              device: torch.device) -> torch.Tensor:
    """[rows, 1] uniforms in [0, 1): drawn from ``generator`` (on ``device``), or one from each of a list of CPU
    generators, one per row (each row's draw then depends on its own generator only)."""
    if isinstance(generator, Sequence):
        return torch.cat([torch.rand(1, generator=g) for g in generator]).view(rows, 1).to(device)
    return torch.rand(rows, 1, generator=generator, device=device)


def sample(logits: torch.Tensor, temperature: float, top_k: int,
           generator: torch.Generator | Sequence[torch.Generator] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` [B, V] (float32), and its logprob, both [B, 1]: from ``softmax(logits /
    temperature)`` (``top_k > 0``: its ``top_k`` largest logits; ``temperature == 0``: greedy); the logprob is
    ``log_softmax(logits / temperature)`` over the full vocabulary (greedy: ``log_softmax(logits)``). ``generator``:
    one for the batch, or a list of CPU generators, one per row (``_uniforms``)."""
    if temperature == 0:
        tok = logits.argmax(dim=-1, keepdim=True)
        return tok, torch.log_softmax(logits, dim=-1).gather(1, tok)
    scaled = logits / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    if top_k:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        probs = torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)
    else:
        probs = logp.exp()
    # inverse-CDF sampling, one uniform per row (~10x faster than torch.multinomial here); zero-probability tokens
    # are never chosen
    cdf = probs.cumsum_(dim=-1)
    u = _uniforms(logits.shape[0], generator, logits.device).mul_(cdf[:, -1:])
    tok = torch.searchsorted(cdf, u, right=True).clamp_(max=logits.shape[-1] - 1)
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
    """Sample completions for token-id prompts with a KV cache (``prefill``, then ``sample`` and ``decode_step``
    per token; see ``sample`` for ``temperature`` and ``top_k``). A row stops after emitting ``eos_id`` (an id or a
    list); later slots hold ``pad_id``, logprob 0. Returns (tokens, logprobs) [B, max_new_tokens] and lengths [B]
    (eos included) on the weights' device."""
    model = Model.of(weights, shape)
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
            tok = out.add(t, *sample(F.linear(h, model.output).float(), temperature, top_k, generator))
            if t == steps - 1 or bool(out.done.all()):
                break
            h = decode_step(model, cache, tok, freqs)
    return out.tokens, out.logprobs, out.lengths


# ------------------------------------------------------------------------------------ continuous batching


@dataclass
class SlotCache:
    """The decode state of continuous batching: rows of sequences, each at its own length. Per layer K and V
    [rows allocated, n_kv, capacity, hd]; ``lengths`` [rows allocated]: each row's filled slots, which is also its
    next token's RoPE position (a row's prompt starts at slot 0: no padding). The rows in use are the prefix
    ``[:rows]`` (``drop_rows`` keeps it so). Slots past a row's length hold finite values (zeros, an earlier
    sequence's K/V, copies of its prompt's) and are masked. Rows and capacity grow on demand (``_reserve``); the
    caller bounds the rows."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    lengths: torch.Tensor
    rows: int

    @classmethod
    def empty(cls, model: Model) -> "SlotCache":
        return cls(_empty_cache(model.shape, 0, 0, model.embedding.dtype, model.device),
                   torch.zeros(0, dtype=torch.long, device=model.device), 0)


def _reserve(cache: SlotCache, rows: int, capacity: int) -> None:
    """Grow ``cache`` to at least ``rows`` rows of ``capacity`` slots (capacity to a power of two), keeping its
    contents; new slots are zeros."""
    kc = cache.layers[0][0]
    have_rows, have_capacity = kc.shape[0], kc.shape[2]
    if rows <= have_rows and capacity <= have_capacity:
        return
    rows, capacity = max(rows, have_rows), max(1 << (capacity - 1).bit_length(), have_capacity)
    grown = []
    for old_k, old_v in cache.layers:
        size = (rows, old_k.shape[1], capacity, old_k.shape[3])
        new_k, new_v = (torch.zeros(size, dtype=old_k.dtype, device=old_k.device) for _ in range(2))
        new_k[:have_rows, :, :have_capacity], new_v[:have_rows, :, :have_capacity] = old_k, old_v
        grown.append((new_k, new_v))
    cache.layers = grown
    cache.lengths = torch.cat([cache.lengths, cache.lengths.new_zeros(rows - have_rows)])


@torch.no_grad()
def join_rows(model: Model, cache: SlotCache, prompts: list[list[int]], pad_id: int, capacity: int) -> torch.Tensor:
    """Prefill ``prompts`` (``prefill``) into the rows ``[rows, rows + len(prompts))`` of ``cache``, which grows to
    ``capacity`` slots if shorter; returns their last prompt token's hidden state [len(prompts), dim]."""
    if min(len(p) for p in prompts) == 0:
        raise ValueError("every prompt needs at least one token")
    first, last, P = cache.rows, cache.rows + len(prompts), max(len(p) for p in prompts)
    _reserve(cache, last, capacity)
    h, fresh = prefill(model, prompts, pad_id, P, _freqs_cis(model.shape, capacity, model.device))
    lengths = torch.tensor([len(p) for p in prompts], device=model.device)
    # left-padded to slot 0: slot j of row i takes slot j + pad_i (past the prompt: its last token's, masked)
    source = (torch.arange(P, device=model.device)[None, :] + (P - lengths)[:, None]).clamp_(max=P - 1)
    for (kc, vc), (fk, fv) in zip(cache.layers, fresh.layers):
        index = source[:, None, :, None].expand(-1, fk.shape[1], -1, fk.shape[3])
        kc[first:last, :, :P], vc[first:last, :, :P] = fk.gather(2, index), fv.gather(2, index)
    cache.lengths[first:last] = lengths
    cache.rows = last
    return h


@torch.no_grad()
def decode_rows(model: Model, cache: SlotCache, tokens: torch.Tensor) -> torch.Tensor:
    """One token per row in use (``tokens`` [rows]), each at its row's next slot and position; every row advances
    by one. Returns the final hidden states [rows, dim]."""
    n = cache.rows
    positions = cache.lengths[:n]
    width = int(positions.max()) + 1
    beyond = torch.arange(width, device=model.device)[None, :] > positions[:, None]  # [n, width]
    mask = torch.zeros(n, 1, 1, width, dtype=model.embedding.dtype, device=model.device)
    mask.masked_fill_(beyond.view(n, 1, 1, width), float("-inf"))
    fc = _freqs_cis(model.shape, width, model.device)[positions].view(n, 1, 1, -1)
    layers = [(kc[:n], vc[:n]) for kc, vc in cache.layers]
    h = _forward_hidden(model, tokens.view(n, 1), fc, mask, layers, positions)[:, 0]
    positions += 1
    return h


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
        dst, src = (torch.tensor(rows, device=cache.lengths.device) for rows in (holes, movers))
        for kc, vc in cache.layers:
            kc[dst], vc[dst] = kc[src], vc[src]
        cache.lengths[dst] = cache.lengths[src]
    cache.rows = keep
    return order
