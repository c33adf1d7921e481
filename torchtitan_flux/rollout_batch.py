"""``RolloutBatch``: one training step's samples laid out for teacher forcing, and ``layout_batch``, which builds it
from the step's finished engine requests and rewards. Pure tensor layout: no engine calls, any thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from torchtitan_flux.engine.base import GenerationRequest, GenerationResult


@dataclass
class RolloutBatch:
    """One training step's samples (B = prompts * group_size), laid out for teacher forcing."""

    step: int
    tokens: torch.Tensor  # [B, L] int64: prompt + completion, right-padded
    loss_mask: torch.Tensor  # [B, L-1] float32: 1 where position t predicts a completion token t+1
    behaviour_logprobs: torch.Tensor  # [B, L-1] float32, aligned with loss_mask
    rewards: torch.Tensor  # [B] float32
    versions: torch.Tensor  # [B] int64: engine policy version that generated each sample
    dispatch_version: int  # trainer version when the step's prompts were dispatched
    newest_seen: int  # newest version any engine had received when its part finished
    gen_time_s: float  # max engine-side generation time over the step's parts
    completions: list[str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)  # one per prompt (not per completion)
    reward_values: dict[str, list] = field(default_factory=dict)  # reward function -> value per completion
    reward_metrics: dict[str, float] = field(default_factory=dict)  # rewards/<name>/mean, /std

    @property
    def num_completion_tokens(self) -> int:
        return int(self.loss_mask.sum().item())


def layout_batch(step: int, prompts: list, prompt_ids: list[list[int]],
                 parts: list[tuple[GenerationRequest, GenerationResult]], scores, completions: list[str],
                 group_size: int, pad_id: int) -> RolloutBatch:
    """Step ``step``'s batch: prompt + completion rows (right-padded with ``pad_id``), the loss mask and behaviour
    logprobs aligned with the positions that predict completion tokens, rewards (``scores``, a
    ``rewards.Scores``) and per-sample policy versions. ``parts`` are (request, result) in prompt order."""
    G = group_size
    tokens = torch.cat([r.tokens for _, r in parts])
    logprobs = torch.cat([r.logprobs for _, r in parts])
    lengths = torch.cat([r.lengths for _, r in parts])
    versions = torch.cat([torch.full((r.tokens.shape[0],), r.version) for _, r in parts])
    prompt_ids = [ids for ids in prompt_ids for _ in range(G)]
    B = len(prompt_ids)
    plen = torch.tensor([len(x) for x in prompt_ids])
    L = int((plen + lengths).max().item())
    seq = torch.full((B, L), pad_id, dtype=torch.int64)
    mask = torch.zeros(B, L - 1)
    behaviour = torch.zeros(B, L - 1)
    for i in range(B):
        p, c = len(prompt_ids[i]), int(lengths[i])
        seq[i, :p] = torch.tensor(prompt_ids[i])
        seq[i, p : p + c] = tokens[i, :c]
        mask[i, p - 1 : p - 1 + c] = 1.0
        behaviour[i, p - 1 : p - 1 + c] = logprobs[i, :c]
    return RolloutBatch(
        step=step, tokens=seq, loss_mask=mask, behaviour_logprobs=behaviour,
        rewards=torch.tensor(scores.total, dtype=torch.float32), versions=versions,
        dispatch_version=min(q.dispatch_version for q, _ in parts),
        newest_seen=max(r.newest_seen for _, r in parts),
        gen_time_s=max(r.gen_time_s for _, r in parts), completions=completions,
        prompts=[p.text for p in prompts], reward_values=scores.per_func, reward_metrics=scores.metrics(),
    )
