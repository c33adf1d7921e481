r"""GRPO advantages, the clipped (optionally decoupled) policy loss, and token log-probabilities.

Pure torch (no torchtitan import), fully vectorised, no host syncs inside ``grpo_loss`` / ``token_logprobs``.

Notation: ``N`` completions (rows) of ``T`` positions; ``mask[i, t]`` is 1 on completion tokens and 0 on
prompt / padding positions; ``lp`` = trainer log-probabilities (with grad), ``mu`` = behaviour (rollout
engine) log-probabilities, ``prox`` = proximal log-probabilities (the trainer's policy before this step's
updates, computed without grad), ``ref`` = frozen reference policy log-probabilities; ``A_i`` the
advantage of row ``i`` (broadcast over its tokens).

Advantages (``group_advantages``), over group-contiguous rewards (``N = num_prompts * G``)
    ``A = r - mean_g(r)``; with ``std_normalize``: ``A = (r - mean_g(r)) / (std_g(r) + eps)``, ``std_g`` the
    **population** standard deviation (``correction=0``: divide by ``G``). Groups whose rewards are all exactly
    equal get advantage exactly 0 (not a round-off residue) and are counted.

Loss (``grpo_loss``)
    ratio  ``rho = exp(lp - mu)``                     and ``w = 1``           when ``proximal_logprobs`` is None
           ``rho = exp(lp - prox)``                   and
           ``w = min(exp(prox - mu), tis_cap)``       (detached)              otherwise (decoupled PPO, AReaL;
                                                                              truncated IS, Yao et al. 2025).
           With ``proximal_logprobs`` given and ``tis_cap <= 0``, ``w = 1`` (no behaviour correction).
    surrogate ``s = min(rho * A, clamp(rho, 1 - clip_low, 1 + clip_high) * A)``   (no dual clip)
    KL on sampled tokens, ``delta = ref - lp``:
           k1 = ``-delta`` (= lp - ref),  k2 = ``0.5 * delta**2``,  k3 = ``exp(delta) - delta - 1``
    per-token loss ``l = (-w * s + kl_coef * KL) * sample_weight_i``  (KL term only when ``kl_coef > 0``)
    "token":    ``loss = sum_{i,t} l * mask / num_tokens``           (``num_tokens`` default ``mask.sum()``)
    "sequence": ``loss = sum_i (sum_t l * mask / len_i) / num_sequences``   (default ``N``; empty rows -> 0)
    Pass the *global* token / sequence count (over data-parallel ranks and micro-batches) as
    ``num_tokens`` / ``num_sequences`` so the per-rank, per-micro-batch losses sum to the global mean.

Simplifications and numerical choices
    * Gradients flow only through ``logprobs``; every other input is detached.
    * Masked positions are replaced by 0 *before* any ``exp``, so padding may hold anything (``-inf``,
      garbage): it gets exactly zero gradient and never produces NaN.
    * Log-ratios are clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` (20, as verl does) before
      exponentiation; a token beyond that range gets zero gradient from the clamped term.
    * Default denominators are clamped to >= 1, so an all-padding batch gives loss 0, never NaN. Explicit
      python-number ``num_tokens`` / ``num_sequences`` must be > 0; explicit tensors are used as given
      (checking them would force a device sync).
    * ``mask`` may be bool or float; float values are used as per-token weights (pass 0/1).
    * Everything is computed in ``logprobs.dtype`` (pass float32 or float64 log-probabilities).

Metrics (detached 0-d tensors; means over this call's completion tokens, i.e. *local*, not global counts)
    ``clip_frac``: fraction of tokens where the clipped branch is the strict minimum (``clamp(rho) * A < rho * A``:
    clipping zeroes the gradient); ``kl``: mean k3 KL vs ``ref`` (0 without ``ref_logprobs``); ``ratio_mean``;
    ``is_weight_mean`` (1 without IS weight); ``is_weight_truncated_frac`` (tokens with ``exp(prox - mu) > tis_cap``).
    Staleness, for the adaptive controller, from the untruncated weight ``r = exp(pi - mu)``, ``pi`` = ``prox`` if
    given else ``lp``: ``behaviour_kl`` = ``mean(r - 1 - log r)`` (the k3 estimate of ``KL(mu || pi)``), ``iw_var``
    (population variance of ``r``), ``ess_fraction`` = ``(sum r)^2 / (n * sum r^2)`` in ``(0, 1]`` (1: on-policy, or
    no tokens).
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor

__all__ = ["KL_ESTIMATORS", "LOG_RATIO_CLAMP", "NORMALIZATIONS", "group_advantages", "grpo_loss", "token_logprobs"]

KL_ESTIMATORS = ("k1", "k2", "k3")
NORMALIZATIONS = ("token", "sequence")
LOG_RATIO_CLAMP = 20.0

Count = Union[int, float, Tensor]


def group_advantages(
    rewards: Tensor, group_size: int, std_normalize: bool = True, eps: float = 1e-4
) -> tuple[Tensor, int]:
    """``(advantages [N], number of zero-variance groups)`` of group-contiguous ``rewards`` ``[N]`` (module
    docstring). The advantages have ``rewards``' dtype (float32 for integer / bool rewards; statistics in
    float64); the count is a python int (one host sync)."""
    if not isinstance(rewards, Tensor) or rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor, got {getattr(rewards, 'shape', type(rewards))}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if eps < 0 or not math.isfinite(eps):
        raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
    n = rewards.numel()
    if n % group_size != 0:
        raise ValueError(f"number of rewards ({n}) is not a multiple of group_size ({group_size})")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    g = rewards.detach().to(torch.float64).view(-1, group_size)
    centred = g - g.mean(dim=1, keepdim=True)
    if std_normalize:
        std = g.std(dim=1, keepdim=True, correction=0)
        centred = centred / (std + eps)
    zero_var = g.amax(dim=1) == g.amin(dim=1)  # [num_groups]
    adv = torch.where(zero_var.unsqueeze(1), torch.zeros_like(centred), centred)
    return adv.reshape(-1).to(out_dtype), int(zero_var.sum().item())


def _check_shape(name: str, t: Optional[Tensor], shape: torch.Size) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.shape != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def _explicit_count(name: str, value: Count, like: Tensor) -> Union[float, Tensor]:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got shape {tuple(value.shape)}")
        return value.detach().reshape(()).to(device=like.device, dtype=like.dtype)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a positive number or a scalar tensor, got {value!r}")
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"{name} must be > 0 and finite, got {value!r}")
    return float(value)


def _bounded_exp(x: Tensor) -> Tensor:
    return torch.exp(x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def grpo_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    proximal_logprobs: Optional[Tensor] = None,
    ref_logprobs: Optional[Tensor] = None,
    sample_weights: Optional[Tensor] = None,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    normalization: str = "token",
    tis_cap: float = 0.0,
    num_tokens: Optional[Count] = None,
    num_sequences: Optional[Count] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped GRPO loss (see the module docstring for the exact formulas). Returns ``(loss, metrics)``.

    Shapes: ``logprobs``, ``behaviour_logprobs``, ``proximal_logprobs``, ``ref_logprobs``, ``mask``:
    ``[N, T]``; ``advantages``, ``sample_weights``: ``[N]``. Only ``logprobs`` receives gradients.
    """
    # ---- validation
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    if not isinstance(logprobs, Tensor) or logprobs.dim() != 2:
        raise ValueError(f"logprobs must be a 2-D [N, T] tensor, got {getattr(logprobs, 'shape', logprobs)}")
    if not logprobs.is_floating_point():
        raise ValueError(f"logprobs must be floating point, got {logprobs.dtype}")
    shape = logprobs.shape
    n_rows = shape[0]
    _check_shape("behaviour_logprobs", behaviour_logprobs, shape)
    _check_shape("mask", mask, shape)
    _check_shape("proximal_logprobs", proximal_logprobs, shape)
    _check_shape("ref_logprobs", ref_logprobs, shape)
    _check_shape("advantages", advantages, torch.Size([n_rows]))
    _check_shape("sample_weights", sample_weights, torch.Size([n_rows]))
    if behaviour_logprobs is None or advantages is None or mask is None:
        raise ValueError("behaviour_logprobs, advantages and mask are required")
    if kl_coef > 0 and ref_logprobs is None:  # (the values of clip_*, kl_coef, tis_cap: validate_config's)
        raise ValueError("kl_coef > 0 requires ref_logprobs")

    dtype = logprobs.dtype
    live = mask != 0  # bool [N, T]
    maskf = mask.to(dtype)
    zero = logprobs.new_zeros(())
    one = logprobs.new_ones(())
    mu = behaviour_logprobs.detach().to(dtype)
    adv = advantages.detach().to(dtype).unsqueeze(1)  # [N, 1]

    # ---- policy ratio (the only path with gradient) and IS weight
    anchor = mu if proximal_logprobs is None else proximal_logprobs.detach().to(dtype)
    ratio = _bounded_exp(torch.where(live, logprobs - anchor, zero))

    truncated = None
    if proximal_logprobs is None or tis_cap <= 0:
        w = None  # == 1
    else:
        w_raw = _bounded_exp(torch.where(live, anchor - mu, zero))
        w = w_raw.clamp(max=float(tis_cap))
        truncated = w_raw > tis_cap

    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    per_token = -surrogate if w is None else -(w * surrogate)

    # ---- KL penalty against the reference policy
    delta = None if ref_logprobs is None else torch.where(live, ref_logprobs.detach().to(dtype) - logprobs, zero)
    if kl_coef > 0:
        if kl_estimator == "k1":
            kl = -delta
        elif kl_estimator == "k2":
            kl = 0.5 * delta.square()
        else:
            kl = _bounded_exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * kl

    if sample_weights is not None:
        per_token = per_token * sample_weights.detach().to(dtype).unsqueeze(1)
    per_token = torch.where(live, per_token, zero) * maskf

    # ---- normalisation
    if normalization == "token":
        denom = (maskf.sum().clamp(min=1.0) if num_tokens is None
                 else _explicit_count("num_tokens", num_tokens, logprobs))
        loss = per_token.sum() / denom
    else:
        row_mean = per_token.sum(dim=1) / maskf.sum(dim=1).clamp(min=1.0)
        denom = (float(max(n_rows, 1)) if num_sequences is None
                 else _explicit_count("num_sequences", num_sequences, logprobs))
        loss = row_mean.sum() / denom

    # ---- metrics (detached, local masked means)
    with torch.no_grad():
        n_tok = maskf.sum()
        n_safe = n_tok.clamp(min=1.0)

        def mmean(x: Tensor) -> Tensor:
            return (torch.where(live, x, zero) * maskf).sum() / n_safe

        metrics: dict[str, Tensor] = {}
        metrics["clip_frac"] = mmean((clipped < unclipped).to(dtype))
        metrics["kl"] = zero.clone() if delta is None else mmean(_bounded_exp(delta) - delta - 1.0)  # k3
        metrics["ratio_mean"] = mmean(ratio.detach())
        metrics["is_weight_mean"] = one.clone() if w is None else mmean(w)
        metrics["is_weight_truncated_frac"] = zero.clone() if truncated is None else mmean(truncated.to(dtype))

        cur = logprobs.detach() if proximal_logprobs is None else anchor
        log_r = torch.where(live, cur - mu, zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        r = torch.exp(log_r)
        metrics["behaviour_kl"] = mmean(r - 1.0 - log_r)
        r_mean = mmean(r)
        metrics["iw_var"] = mmean((r - r_mean).square())
        sum_r = (r * maskf).sum()
        sum_r2 = (r.square() * maskf).sum()
        ess = sum_r.square() / (n_tok * sum_r2).clamp(min=torch.finfo(dtype).tiny)
        metrics["ess_fraction"] = torch.where(n_tok > 0, ess, one)
    return loss, metrics


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """``log_softmax(logits / temperature)`` at ``targets``: ``[N, T, V], [N, T] -> [N, T]``, differentiable,
    without materialising the full log-softmax. float16 / bfloat16 logits are upcast once to float32 (half-precision
    log-sum-exp is too coarse for importance ratios); float32 / float64 keep their dtype. Callers with very large
    ``N * T * V`` should call this on chunks of the sequence."""
    if not isinstance(logits, Tensor) or logits.dim() < 1 or not logits.is_floating_point():
        raise ValueError("logits must be a floating-point tensor [..., V]")
    if not isinstance(targets, Tensor) or targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets must have shape {tuple(logits.shape[:-1])}, got {tuple(getattr(targets, 'shape', ()))}"
        )
    if targets.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise ValueError(f"targets must be an integer tensor, got {targets.dtype}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be finite and > 0, got {temperature!r}")

    if logits.dtype in (torch.float16, torch.bfloat16):
        x = logits.float()  # fresh copy: safe to scale in place
        if temperature != 1.0:
            x = x.div_(temperature)
    else:
        x = logits if temperature == 1.0 else logits / temperature
    idx = targets.to(torch.int64).unsqueeze(-1)
    target_logit = x.gather(-1, idx).squeeze(-1)
    return target_logit - torch.logsumexp(x, dim=-1)
