"""Workloads of the benchmarks that a run imports by name (``rollout.task = "benchmarks.workloads:heavy_tail"``,
``rollout.environment = "benchmarks.workloads:LatencyEnv"``, with the repository root as the working directory, as
``benchmarks/common.run_training`` runs it).

``heavy_tail``: the heavy-tailed generation of ``benchmarks/streaming.py``. Each prompt asks for its own number
``L`` of digits, drawn from a Pareto distribution (``P(L > x) = (MIN_LEN / x) ** ALPHA``, rounded up) clipped to
``[MIN_LEN, rollout.max_new_tokens]``: with ``ALPHA`` 1 and ``MIN_LEN`` 4 the median is 8 tokens, the 90th
percentile about 40, and one prompt in ``max_new_tokens / 4`` is clipped at the budget. ``L`` is the prompt's generation
budget (``Prompt.max_new_tokens``), so the engine stops each group at its own length where a request holds one
group, and a request of several prompts runs to its longest one's (today's batched dispatch). The reward is the
share of the first ``L`` completion tokens that are digits (``length_digits_reward``, a TRL-style function that
also serves as ``rollout.reward_funcs`` where a config names another reward: each prompt carries ``target_len`` and
the tokenizer's ``digit_ids`` as columns): a completion shorter than ``L`` scores at most ``len / L``, so producing
the whole answer is the only way to 1; what comes after the first ``L`` tokens is not scored, so a longer request
budget neither helps nor hurts.

Prompts: ``"<3-8 letters> <L>:"`` (the digits task's, plus the length), or with ``rollout.apply_chat_template``
(the real model) the model's chat template around ``"Write exactly <L> digits (0-9) in a row, with no spaces and
nothing else."``. A pure function of (seed, step), like every task (``torchtitan_flux/data/tasks.py``).
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import string
from dataclasses import dataclass

from torchtitan_flux.data import rewards as R
from torchtitan_flux.data.environments import MessageEnv, MessageEnvInitOutput, MessageEnvStepOutput
from torchtitan_flux.data.tasks import Prompt, Task

MIN_LEN = 4  # the shortest answer, in tokens
ALPHA = 1.0  # the Pareto tail index: smaller, heavier


def pareto_length(rng: random.Random, min_len: int, max_len: int, alpha: float) -> int:
    """One length from ``P(L > x) = (min_len / x) ** alpha``, rounded up, clipped to ``[min_len, max_len]``."""
    u = 1.0 - rng.random()  # (0, 1]
    return max(min_len, min(max_len, math.ceil(min_len * u ** (-1.0 / alpha))))


def digit_ids(tokenizer) -> frozenset[int]:
    """The token ids of the ten digits, where each is one token (byte and Llama-style tokenizers)."""
    ids = [tokenizer.encode(str(d), add_bos=False, add_eos=False) for d in range(10)]
    return frozenset(x[0] for x in ids if len(x) == 1)


class HeavyTailTask(Task):
    """Prompts asking for a heavy-tailed number of digits (see the module docstring)."""

    name = "heavy_tail"

    def __init__(self, max_len: int, digits: frozenset[int], *, min_len: int = MIN_LEN, alpha: float = ALPHA,
                 template=None):
        if not digits:
            raise ValueError("heavy_tail: the tokenizer has no single-token digits; allowed: one that encodes each "
                             "digit as one token")
        if not 1 <= min_len <= max_len or alpha <= 0:
            raise ValueError(f"heavy_tail: min_len {min_len}, max_len {max_len}, alpha {alpha}; allowed: "
                             "1 <= min_len <= max_len (rollout.max_new_tokens), alpha > 0")
        super().__init__([R.RewardFunc("length_digits_reward", length_digits_reward)])
        self.max_len, self.min_len, self.alpha = max_len, min_len, alpha
        self.digits, self.template = sorted(digits), template

    def draws(self, seed: int, step: int, n: int) -> list[tuple[str, int]]:
        """(letters, target length) of each of ``step``'s ``n`` prompts: what ``prompts`` is made of."""
        rng = random.Random(seed * 1_000_003 + step)
        return [("".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8))),
                 pareto_length(rng, self.min_len, self.max_len, self.alpha)) for _ in range(n)]

    def lengths(self, seed: int, step: int, n: int) -> list[int]:
        """The ``n`` target lengths of ``step`` (those ``prompts`` gives)."""
        return [L for _, L in self.draws(seed, step, n)]

    def prompts(self, seed: int, step: int, n: int) -> list[Prompt]:
        out = []
        for letters, L in self.draws(seed, step, n):
            cols = {"target_len": L, "digit_ids": self.digits}
            if self.template is None:
                out.append(Prompt(f"{letters} {L}:", columns=cols, max_new_tokens=L))
            else:  # the letters keep prompts of one length apart, as in the plain form
                text = self.template.render([{"role": "user", "content": ask(L, letters)}], add_generation_prompt=True)
                out.append(Prompt(text, columns=cols, add_bos=False, max_new_tokens=L))
        return out


def ask(length: int, letters: str) -> str:
    """The real model's request for ``length`` digits."""
    return f"Write exactly {length} digits (0-9) in a row, with no spaces and nothing else. Tag: {letters}."


_TARGET = re.compile(r"Write exactly (\d+) digits|^[a-z]+ (\d+):$")


def target_of(text: str) -> int | None:
    """The target length a ``heavy_tail`` prompt's text asks for (None: not such a prompt): how a benchmark reads
    the trained prompts of the completions table (``completions.jsonl`` keeps their text)."""
    m = _TARGET.search(text)
    return int(m.group(1) or m.group(2)) if m else None


def length_digits_reward(completions, completion_ids, target_len, digit_ids, **_) -> list[float]:
    """Per completion: the share of its first ``L`` tokens (``L``: its prompt's ``target_len``) that are digits (one
    of its prompt's ``digit_ids``)."""
    return [sum(t in set(d) for t in ids[:L]) / L for ids, L, d in zip(completion_ids, target_len, digit_ids)]


def heavy_tail(job_config, tokenizer, dataset_path, dataset_split, field_name) -> HeavyTailTask:
    """``rollout.task = "benchmarks.workloads:heavy_tail"``: lengths up to ``rollout.max_new_tokens``; chat prompts
    with ``rollout.apply_chat_template``."""
    template = None
    if job_config.rollout.apply_chat_template:
        from torchtitan_flux.data.datasets import ChatTemplate

        template = ChatTemplate(job_config.hf_assets_path)
    return HeavyTailTask(job_config.rollout.max_new_tokens, digit_ids(tokenizer), template=template)


# ---------------------------------------------------------------------------------------------- environments

class LatencyEnv(MessageEnv):
    """A multi-turn environment that takes ``delay_ms`` to answer each turn, as a tool behind a network call would
    (``asyncio.sleep``: the episode waits, no core is busy): the record's prompt opens the episode, each assistant
    turn gets ``"more <n>"`` back until ``turns`` turns, then the episode ends with ``env_rewards = {"digits": the
    last turn's share of digit characters}`` (the digits task's reward, over a conversation)."""

    @dataclass(kw_only=True, slots=True)
    class Config(MessageEnv.Config):
        delay_ms: float = 0.0
        """How long each ``step`` takes, in milliseconds."""
        turns: int = 3
        """Assistant turns per episode (``rollout.max_turns`` must allow them)."""

    def __init__(self, config: Config, *, env_input: dict) -> None:
        self.config, self.prompt, self.n = config, env_input["prompt"], 0

    async def init(self) -> MessageEnvInitOutput:
        return MessageEnvInitOutput(init_prompt_messages=[{"role": "user", "content": self.prompt}])

    async def step(self, completion_message) -> MessageEnvStepOutput:
        await asyncio.sleep(self.config.delay_ms / 1000)
        self.n += 1
        if self.n < self.config.turns:
            return MessageEnvStepOutput(env_messages=[{"role": "user", "content": f"more {self.n}"}])
        text = completion_message["content"]
        digits = sum(c.isdigit() for c in text) / max(1, len(text))
        return MessageEnvStepOutput(done=True, env_rewards={"digits": digits})
