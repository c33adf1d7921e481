"""The GRPO gradient of one batch on this rank: advantages, micro-batched forward and backward, metric sums.

Each rank takes its contiguous slice of the rows in micro-batches of ``training.local_batch_size`` sequences;
every micro-batch's loss is normalised by the *global* token (or sequence) count, so the gradients FSDP sums
across ranks are the whole batch's. Logits are computed from a micro-batch's first completion-predicting position
on (``logits_from``): the prompt positions before it carry no loss. ``BatchGradient.reduce`` sums the loss and its
metrics over the ranks and builds the batch's ``StalenessSample`` for the controller from those very figures.
Clipping and the optimizer step stay in ``train_on``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from torchtitan_flux.config import Grpo
from torchtitan_flux.rl import loss as grpo
from torchtitan_flux.rl.controller import StalenessSample
from torchtitan_flux.rollout.batch import RolloutBatch


@dataclass
class BatchGradient:
    """What one rank's backward passes over its slice leave besides the gradients."""

    loss: torch.Tensor
    """This rank's loss, summed over its micro-batches (detached, a scalar on the training device)."""
    metric_sums: dict[str, torch.Tensor]
    """Each loss metric summed over micro-batches, weighted by the micro-batch's completion tokens."""
    num_tokens: torch.Tensor
    """Completion tokens of the whole batch (all ranks): the metrics' denominator."""
    zero_variance_groups: int
    """Groups whose rewards are all equal (advantage 0)."""
    version_gap: torch.Tensor
    """The trainer's version minus each completion token's policy version (float, not clamped, flat:
    ``RolloutBatch.token_version_gaps``): the staleness sample's."""

    def reduce(self, world: int) -> ReducedBatch:
        """Every rank, after its backward passes: the loss and the metric sums all-reduced over the ``world`` ranks,
        the metrics' token means, and the staleness sample made of them (the same on every rank)."""
        keys = sorted(self.metric_sums)
        stats = torch.stack([self.loss] + [self.metric_sums[k] for k in keys])
        if world > 1:
            dist.all_reduce(stats)
        means = {k: (stats[i + 1] / self.num_tokens.clamp(min=1)).item() for i, k in enumerate(keys)}
        sample = StalenessSample(
            behaviour_kl=means["behaviour_kl"], iw_var=means["iw_var"], ess_fraction=means["ess_fraction"],
            version_gap_mean=self.version_gap.mean().item(), version_gap_max=self.version_gap.max().item(),
        )
        return ReducedBatch(stats[0].item(), means, sample)


@dataclass(frozen=True)
class ReducedBatch:
    """The whole batch's figures, on every rank (``BatchGradient.reduce``)."""

    loss: float
    """The loss, summed over the ranks."""
    means: dict[str, float]
    """Each loss metric's mean over the batch's completion tokens (``loss.grpo_loss``'s metrics), for the logs."""
    staleness: StalenessSample
    """What the controller reads (``OffPolicyControl.control``)."""


def first_loss_position(loss_mask: torch.Tensor) -> int:
    """The first position (column of ``loss_mask``, ``[N, L-1]``) that predicts a completion token in any row; 0
    when none does."""
    cols = loss_mask.any(dim=0).nonzero()
    return int(cols[0]) if len(cols) else 0


def backward_on_batch(model: torch.nn.Module, ref_model: torch.nn.Module | None, batch: RolloutBatch, g: Grpo, *,
                      trained_steps: int, rank: int, world: int, micro_batch: int, device: torch.device,
                      train_context: Callable[[], AbstractContextManager]) -> BatchGradient:
    """Accumulate the GRPO loss's gradient of ``batch`` on this rank's slice (``trained_steps``: optimizer steps
    done before this one, for the samples' version gaps)."""
    adv, zero_groups = grpo.group_advantages(batch.rewards, g.group_size, std_normalize=g.advantage_std_normalize)
    version_gap = batch.token_version_gaps(trained_steps)
    gap = (trained_steps - batch.versions).clamp(min=0).float()
    weights = (1.0 + gap) ** -g.staleness_discount if g.staleness_discount > 0 else None
    num_tokens = batch.loss_mask.sum()
    rows = batch.tokens.shape[0] // world
    lo = rank * rows
    sums: dict[str, torch.Tensor] = {}
    loss_total = torch.zeros((), device=device)
    for s in range(lo, lo + rows, micro_batch):
        sl = slice(s, min(s + micro_batch, lo + rows))
        # positions before ``t0`` predict no completion token in this micro-batch: no logits for them
        t0 = first_loss_position(batch.loss_mask[sl])
        tokens = batch.tokens[sl].to(device)
        mask = batch.loss_mask[sl, t0:].to(device)
        targets = tokens[:, t0 + 1 :]
        with train_context():
            logits = model(tokens, logits_from=t0)
            logprobs = grpo.token_logprobs(logits[:, :-1].float(), targets, g.temperature)
            del logits
            ref = None
            if ref_model is not None:
                with torch.no_grad():
                    ref = grpo.token_logprobs(ref_model(tokens, logits_from=t0)[:, :-1].float(), targets,
                                              g.temperature)
            loss, m = grpo.grpo_loss(
                logprobs, batch.behaviour_logprobs[sl, t0:].to(device), adv[sl].to(device), mask,
                proximal_logprobs=logprobs.detach() if g.tis_cap > 0 else None,
                ref_logprobs=ref, sample_weights=None if weights is None else weights[sl].to(device),
                clip_low=g.clip_low, clip_high=g.clip_high, kl_coef=g.kl_coef, kl_estimator=g.kl_estimator,
                normalization=g.loss_normalization, tis_cap=g.tis_cap,
                num_tokens=num_tokens, num_sequences=batch.tokens.shape[0],
            )
        loss.backward()
        loss_total += loss.detach()
        ntok = mask.sum()
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + v.detach() * ntok
    return BatchGradient(loss_total, sums, num_tokens, zero_groups, version_gap)
