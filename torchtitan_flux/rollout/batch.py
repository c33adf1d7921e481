"""Finished engine requests -> a training batch: ``CompletionScorer`` decodes their completions and scores them
on the reward pool, ``layout_batch`` lays the step's samples out for teacher forcing as a ``RolloutBatch``.

Concurrency: ``CompletionScorer``'s methods run on the scheduler's main thread; only the reward functions run on
the ``RewardScorer``'s pool, as a ``Future`` waited on when the batch is built. ``layout_batch``: any thread.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from torchtitan_flux.data.rewards import ENV_REWARDS_COLUMN, EPISODE_END_COLUMN, RewardScorer, reward_inputs
from torchtitan_flux.engine.base import GenerationRequest, GenerationResult


@dataclass
class RolloutBatch:
    """One training step's samples (B = prompts * group_size), laid out for teacher forcing."""

    step: int
    tokens: torch.Tensor  # [B, L] int64: prompt + completion, right-padded
    loss_mask: torch.Tensor  # [B, L-1] float32: 1 where position t predicts a completion token t+1
    behaviour_logprobs: torch.Tensor  # [B, L-1] float32, aligned with loss_mask
    rewards: torch.Tensor  # [B] float32
    versions: torch.Tensor  # [B] int64: engine policy version of each sample's oldest token
    token_versions: torch.Tensor  # [B, L-1] int64, aligned with loss_mask: the version of each completion token, -1
    # elsewhere (every token of a sample has its version unless the engine updated weights mid-generation)
    dispatch_version: int  # trainer version when the step's prompts were dispatched
    newest_seen: int  # newest version any engine had received when its part finished
    gen_time_s: float  # max engine-side generation time over the step's parts
    generation_wait_s: float = 0.0  # how long the trainer's collection of it waited on the engines (the
    # throughput law's starvation; ``WaitNotes.waited_s``)
    completions: list[str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)  # one per prompt (not per completion)
    reward_values: dict[str, list] = field(default_factory=dict)  # reward function -> value per completion
    reward_metrics: dict[str, float] = field(default_factory=dict)  # rewards/<name>/mean, /std
    episodes: list[dict] = field(default_factory=list)  # multi-turn: each sample's episode (``episode_record``)

    @property
    def num_completion_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def token_version_gaps(self, trainer_version: int) -> torch.Tensor:
        """``trainer_version`` minus the version of each completion token (float, flat); minus each sample's where
        no sample has a completion token."""
        tokens = self.loss_mask > 0
        if not tokens.any():
            return (trainer_version - self.versions).float()
        return (trainer_version - self.token_versions[tokens]).float()


def conversation_text(messages: list[dict]) -> str:
    """Messages as text, one ``[role] content`` line each (``completions.jsonl``, the reward functions' texts)."""
    return "\n".join(f"[{m['role']}] {m['content']}" for m in messages)


class CompletionScorer:
    """Decodes finished results and scores them with the training task's reward functions on a pool of
    ``reward_workers`` threads (the training step's rollouts and the held-out evaluation's alike)."""

    def __init__(self, task, tokenizer, reward_workers: int, reward_timeout_s: float = 300.0):
        self.tokenizer = tokenizer
        self.pool = RewardScorer(task.reward_funcs, reward_workers, reward_timeout_s)
        self.wait = self.pool.wait  # a submitted batch's scores, under the reward deadline (RewardScorer.wait)

    def submit(self, task, prompts: list, results: list[GenerationResult],
               group_size: int) -> tuple[list[str], Future]:
        """Decode ``results`` (``group_size`` completions per prompt, in prompt order; special tokens skipped) and
        hand them, with ``task``'s reward columns, to the pool: (the completion texts, a future of their scores)."""
        ids = [row[:c].tolist() for r in results for row, c in zip(r.tokens, r.lengths.tolist())]
        completions = [self.tokenizer.decode(x, skip_special_tokens=True) for x in ids]
        prompts, texts, columns = reward_inputs(task, prompts, completions, group_size)
        return completions, self.pool.submit(prompts, texts, ids, columns)

    def submit_episodes(self, task, prompts: list, groups: list[list]) -> tuple[list[str], Future]:
        """Multi-turn groups (``groups[i]``: the ``episodes.Episode``s of ``prompts[i]``) to the pool, in TRL's
        conversational format: ``prompts`` the opening messages, ``completions`` the messages after them (the
        assistant's turns and the environment's replies), ``completion_ids`` the tokens after the opening; besides
        the prompts' columns, ``env_rewards`` (each episode's, one dict per environment step) and ``episode_end``
        ("done", "max_turns", "max_tokens"). (The conversations as text, a future of their scores.)"""
        episodes = [ep for g in groups for ep in g]
        rows = [p for p, g in zip(prompts, groups) for _ in g]
        p_in = [ep.messages[: ep.prompt_messages] for ep in episodes]
        c_in = [ep.messages[ep.prompt_messages:] for ep in episodes]
        keys = list(dict.fromkeys(k for p in prompts for k in p.columns))
        columns = {k: [p.columns.get(k) for p in rows] for k in keys}
        columns[ENV_REWARDS_COLUMN] = [ep.env_rewards for ep in episodes]
        columns[EPISODE_END_COLUMN] = [ep.end.value for ep in episodes]
        ids = [ep.token_ids[ep.prompt_tokens:] for ep in episodes]
        texts = [conversation_text(c) for c in c_in]
        return texts, self.pool.submit(p_in, c_in, ids, columns)

    def close(self) -> None:
        self.pool.close()


def layout_batch(step: int, prompts: list, prompt_ids: list[list[int]],
                 parts: list[tuple[GenerationRequest, GenerationResult]], scores, completions: list[str],
                 group_size: int, pad_id: int) -> RolloutBatch:
    """Step ``step``'s batch: prompt + completion rows (right-padded with ``pad_id``), the loss mask and behaviour
    logprobs aligned with the positions that predict the model's completion tokens (a result's ``model_mask`` leaves
    a multi-turn episode's environment tokens out: no loss, no KL), rewards (``scores``, a
    ``rewards.Scores``), per-token policy versions and each sample's oldest. ``parts`` are (request, result) in
    prompt order."""
    G = group_size
    width = max(r.tokens.shape[1] for _, r in parts)  # requests of one step may have different budgets
    tokens = torch.cat([F.pad(r.tokens, (0, width - r.tokens.shape[1]), value=pad_id) for _, r in parts])
    logprobs = torch.cat([F.pad(r.logprobs, (0, width - r.logprobs.shape[1])) for _, r in parts])
    lengths = torch.cat([r.lengths for _, r in parts])
    token_versions = torch.cat([F.pad(r.versions_per_token(), (0, width - r.tokens.shape[1]), value=-1)
                                for _, r in parts])
    model = torch.cat([F.pad(torch.ones(r.tokens.shape, dtype=torch.bool) if r.model_mask is None else r.model_mask,
                             (0, width - r.tokens.shape[1])) for _, r in parts])
    versions = torch.cat([torch.full((r.tokens.shape[0],), r.version) for _, r in parts])
    prompt_ids = [ids for ids in prompt_ids for _ in range(G)]
    B = len(prompt_ids)
    plen = torch.tensor([len(x) for x in prompt_ids])
    L = int((plen + lengths).max().item())
    seq = torch.full((B, L), pad_id, dtype=torch.int64)
    mask = torch.zeros(B, L - 1)
    behaviour = torch.zeros(B, L - 1)
    by_token = torch.full((B, L - 1), -1, dtype=torch.int64)
    for i in range(B):
        p, c = len(prompt_ids[i]), int(lengths[i])
        seq[i, :p] = torch.tensor(prompt_ids[i], dtype=torch.int64)
        seq[i, p : p + c] = tokens[i, :c]
        mine = model[i, :c]  # the model's tokens: all of them, but for a multi-turn episode's environment tokens
        # no prompt (a multi-turn group whose openings share no token): the first token, an opening's, is predicted
        # from nothing, so no position predicts it
        first = 1 if p == 0 else 0
        at = slice(p - 1 + first, p - 1 + c)
        mask[i, at] = mine[first:].float()
        behaviour[i, at] = torch.where(mine, logprobs[i, :c], 0.0)[first:]
        by_token[i, at] = torch.where(mine, token_versions[i, :c], -1)[first:]
        if mine.any():  # a sample's version is its oldest token's (the request's own may be older: its other samples')
            versions[i] = token_versions[i, :c][mine].min()
    return RolloutBatch(
        step=step, tokens=seq, loss_mask=mask, behaviour_logprobs=behaviour,
        rewards=torch.tensor(scores.total, dtype=torch.float32), versions=versions, token_versions=by_token,
        dispatch_version=min(q.dispatch_version for q, _ in parts),
        newest_seen=max(r.newest_seen for _, r in parts),
        gen_time_s=max(r.gen_time_s for _, r in parts), completions=completions,
        prompts=[p.text for p in prompts], reward_values=scores.per_func, reward_metrics=scores.metrics(),
    )
