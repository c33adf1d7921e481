"""One multi-turn episode on any engine: an environment (``data/environments.py``) and a ``generate`` callable
(docs/environments.md).

``run_episode`` renders the environment's opening messages with the model's chat template, has ``generate``
write the assistant's turn, parses the turn into a message, steps the environment with it, and appends the tokens
of the environment's reply after the generated tokens. The conversation's tokens are kept as generated: an
earlier turn is never re-rendered or re-tokenized, so the episode's final ``token_ids`` start with exactly the
first prompt and the first turn's tokens, and every token the model wrote is the one it sampled.

``generate(prompt_token_ids, max_new_tokens) -> (token_ids, logprobs, version)``, plain or async: the turn's
tokens (its stop token included when it stopped), their behaviour log-probs, and the policy version (one int, or
one per token). A turn *stopped* when its last token is a stop id (the model folder's EOS ids) or it is shorter
than its budget (the engine stopped it); otherwise it was cut at its budget.

Between turns (``ChatFormat.bridge``) the template renders the conversation with and without the environment's
reply; the difference, after the rest of the assistant turn's close that the model did not write (``\\n`` after
SmolLM2's ``<|im_end|>``), is tokenized on its own. A template that renders the earlier conversation differently
once the reply is appended is refused (one line). Tool calls are parsed from templates that use the Hermes
``<tool_call>{json}</tool_call>`` format (Qwen2.5, Qwen3); elsewhere the assistant message is the plain text.

Limits (``EpisodeLimits``; the episode says which ended it, ``Episode.end``):

* ``done``: the environment's ``step`` returned ``done=True``.
* ``max_turns``: the environment was stepped on the ``max_turns``-th turn and did not end the episode.
* ``max_tokens``: a turn was cut at its budget (``max_new_tokens``, or what ``max_total_tokens`` left): its tokens
  are kept (mask 1) and the environment is not stepped on it; or the environment's reply would leave no room for
  one generated token within ``max_total_tokens`` (a reply whose text alone cannot fit is known from a prefix of it,
  never rendered whole: ``ChatFormat.cannot_fit``); or the opening prompt alone leaves no room for one (no turn is
  generated).
* ``opening_too_long``: the opening prompt alone is longer than ``max_total_tokens``: no turn is generated, the
  environment is not stepped, and the episode's tokens are the opening cut at ``max_total_tokens`` (no loss on
  them: they are the prompt); ``Episode.opening_tokens`` is its full length. A step whose every episode ends so
  stops the run (``openings_too_long``).

At ``max_turns``, ``max_tokens`` and ``opening_too_long`` the episode is truncated. The tokens end with the last generated token: an
environment reply that no turn follows (at ``done``, ``max_turns``, or one that does not fit) is in ``messages``
and ``env_rewards`` only. ``token_ids`` never exceed ``max_total_tokens``.

Concurrency: ``run_episode`` is a coroutine; episodes run concurrently on one event loop, each environment on a
thread of its own. A plain ``generate`` blocks the loop while it runs (pass an async one to overlap episodes).
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Sequence

from torchtitan_flux.data.datasets import ChatTemplate
from torchtitan_flux.data.environments import (EnvironmentClass, Message, ParsedToolCall, ToolCallParseStatus,
                                               ToolSpec)
from torchtitan_flux.errors import UserCodeError
from torchtitan_flux.models.hf import tokenizer_settings

Generate = Callable[[list[int], int], Any]  # (prompt_token_ids, max_new_tokens) -> (token_ids, logprobs, version)

_SENTINEL = "FLUXSENTINEL7F3A"  # an assistant content no template rewrites: where the turn's close starts
PREFIX_CHARS_PER_TOKEN = 16  # more characters than any tokenizer's tokens hold on average (English: about 4)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)


@dataclass(frozen=True)
class EpisodeLimits:
    """The limits of one episode (what happens at each: the module docstring)."""

    max_turns: int = 4
    """Assistant turns at most; the environment is stepped on the last one and the episode ends ``max_turns``
    unless that step ends it."""

    max_new_tokens: int = 256
    """Tokens one assistant turn may generate; a turn cut there ends the episode ``max_tokens``."""

    max_total_tokens: int = 2048
    """Tokens of the whole episode (prompt, turns and environment replies; ``training.seq_len``): each turn's
    budget is capped by what is left, and a reply that leaves no room for a turn ends the episode ``max_tokens``."""


class EpisodeEnd(str, Enum):
    DONE = "done"
    MAX_TURNS = "max_turns"
    MAX_TOKENS = "max_tokens"
    OPENING_TOO_LONG = "opening_too_long"


@dataclass
class Episode:
    """One episode, its tokens aligned: ``loss_mask`` is 1 exactly on the model's tokens, which carry their
    behaviour ``logprobs`` and policy ``versions`` (0.0 and -1 elsewhere)."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    messages: list[Message]  # the opening messages, then each assistant turn and the environment's reply
    env_rewards: list[dict[str, float]] = field(default_factory=list)  # one per environment step
    turns: int = 0  # assistant turns generated
    end: EpisodeEnd = EpisodeEnd.DONE
    prompt_tokens: int = 0  # the opening prompt's tokens (the first of ``token_ids``)
    prompt_messages: int = 0  # the opening messages (the first of ``messages``)
    opening_tokens: int = 0  # the opening prompt as rendered: ``prompt_tokens``, but where it was cut (too long)

    @property
    def truncated(self) -> bool:
        return self.end is not EpisodeEnd.DONE

    def add(self, ids: list[int], logprobs: list[float] | None = None, versions: list[int] | None = None) -> None:
        """``ids`` appended: the model's (with their logprobs and versions, mask 1) or the template's (mask 0)."""
        self.token_ids += ids
        self.loss_mask += [0 if logprobs is None else 1] * len(ids)
        self.logprobs += [0.0] * len(ids) if logprobs is None else logprobs
        self.versions += [-1] * len(ids) if versions is None else versions


class ChatFormat:
    """A model's chat template and tokenizer (``encode(text, add_bos=, add_eos=)``, ``decode(ids)``), in tokens:
    the opening prompt, an assistant turn parsed into a message, and the tokens of an environment's reply."""

    def __init__(self, template: ChatTemplate, tokenizer: Any, stop_ids: Sequence[int], name: str):
        self.template = template
        self.tokenizer = tokenizer
        self.stop_ids = frozenset(stop_ids)
        self.name = name  # the model folder, for errors
        self.tool_calls = "<tool_call>" in template.source  # the Hermes format (Qwen2.5, Qwen3)

    @classmethod
    def from_model_dir(cls, model_dir: str, tokenizer: Any) -> "ChatFormat":
        """The folder's chat template (``ConfigError`` without one) and its EOS ids as stop ids."""
        return cls(ChatTemplate(model_dir), tokenizer, tokenizer_settings(model_dir)["eos_token_ids"], model_dir)

    def _render(self, messages: list[Message], tools: list[ToolSpec], add_generation_prompt: bool) -> str:
        return self.template.render([_for_template(m) for m in messages], add_generation_prompt=add_generation_prompt,
                                    tools=[{"type": "function", "function": t} for t in tools] or None)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_bos=False, add_eos=False)  # the template writes its own BOS

    def opening(self, messages: list[Message], tools: list[ToolSpec]) -> list[int]:
        """The first prompt: ``messages`` rendered with the generation prompt."""
        return self._encode(self._render(messages, tools, add_generation_prompt=True))

    def parse(self, token_ids: list[int]) -> Message:
        """The assistant message of a turn: its text (the stop token dropped) and, in the Hermes format, its tool
        calls (``ParsedToolCall``; the text outside the blocks is the content)."""
        ids = token_ids[:-1] if token_ids and token_ids[-1] in self.stop_ids else token_ids
        text = self.tokenizer.decode(ids)
        if not (self.tool_calls and "<tool_call>" in text):
            return {"role": "assistant", "content": text}
        calls = [_tool_call(m.group(0), m.group(1), bool(m.group(2))) for m in _TOOL_CALL.finditer(text)]
        return {"role": "assistant", "content": _TOOL_CALL.sub("", text).strip(), "tool_calls": calls}

    def cannot_fit(self, messages: list[Message], room: int) -> bool:
        """Whether the contents of ``messages`` alone take more than ``room`` tokens, read from a prefix of each
        (``PREFIX_CHARS_PER_TOKEN`` characters per token of room), so that a reply of megabytes is never rendered
        or tokenized whole; one token per message is allowed for a prefix's cut merging differently."""
        chars = room * PREFIX_CHARS_PER_TOKEN
        return sum(len(self._encode(m["content"][:chars])) for m in messages) > room + len(messages)

    def bridge(self, before: list[Message], assistant: Message, env_messages: list[Message],
               tools: list[ToolSpec], last_token: int) -> list[int]:
        """The tokens after the turn ``assistant`` (which followed the conversation ``before``; its final generated
        token is ``last_token``) up to the next turn's generation prompt: the rest of the turn's close, the
        environment's ``env_messages``, the generation prompt."""
        closed = self._render([*before, {"role": "assistant", "content": _SENTINEL}], tools, False)
        if _SENTINEL not in closed:
            raise ValueError(f"the chat template of {self.name} does not write an assistant message's content "
                             "verbatim; multi-turn episodes need one that does")
        close = closed[closed.rindex(_SENTINEL) + len(_SENTINEL):]
        base = self._render([*before, assistant], tools, False)
        full = self._render([*before, assistant, *env_messages], tools, True)
        if not full.startswith(base):
            at = next((i for i, (a, b) in enumerate(zip(base, full)) if a != b), min(len(base), len(full)))
            raise ValueError(f"the chat template of {self.name} renders the conversation differently once the "
                             f"environment's reply is appended (from character {at}: {base[at:at + 40]!r} becomes "
                             f"{full[at:at + 40]!r}); multi-turn episodes need a template that only appends")
        ids = self._encode(close + full[len(base):])
        # the model wrote the close's first token when it stopped on it (SmolLM2's <|im_end|>)
        return ids[1:] if ids and last_token in self.stop_ids and ids[0] == last_token else ids


def _for_template(m: Message) -> dict:
    """``m`` as chat templates read it: parsed tool calls in OpenAI's format."""
    if not m.get("tool_calls"):
        return dict(m)
    return {**m, "tool_calls": [
        {"type": "function", "function": {"name": c.name, "arguments": c.arguments or {}}}
        if isinstance(c, ParsedToolCall) else c
        for c in m["tool_calls"] if not isinstance(c, ParsedToolCall) or c.name is not None]}  # failed parses: none


def _tool_call(raw: str, body: str, closed: bool) -> ParsedToolCall:
    if not closed:
        return ParsedToolCall(raw=raw, status=ToolCallParseStatus.UNCLOSED_BLOCK)
    try:
        obj = json.loads(body)
    except ValueError:
        return ParsedToolCall(raw=raw, status=ToolCallParseStatus.INVALID_JSON)
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
        return ParsedToolCall(raw=raw, status=ToolCallParseStatus.MISSING_NAME)
    return ParsedToolCall(raw=raw, name=obj["name"], arguments=obj.get("arguments", {}))


async def _generate(generate: Generate, prompt: list[int], budget: int) -> tuple[list[int], list[float], list[int]]:
    out = generate(list(prompt), budget)
    if inspect.isawaitable(out):
        out = await out
    ids, logprobs, version = out
    ids, logprobs = [int(t) for t in ids], [float(x) for x in logprobs]
    versions = [int(version)] * len(ids) if isinstance(version, int) else [int(v) for v in version]
    if not 1 <= len(ids) <= budget or len(logprobs) != len(ids) or len(versions) != len(ids):
        raise ValueError(f"generate returned {len(ids)} tokens, {len(logprobs)} logprobs and {len(versions)} "
                         f"versions for a budget of {budget}; expected 1..{budget} tokens, one logprob and one "
                         "version (or one version for all) per token")
    return ids, logprobs, versions


async def run_episode(env_class: EnvironmentClass, record: Any, generate: Generate, chat: ChatFormat,
                      limits: EpisodeLimits) -> Episode:
    """One episode of ``env_class`` built from ``record`` (the module docstring). What the environment raises,
    returns wrongly or hangs on is its ``UserCodeError``; its ``close()`` runs in every case (after a failure,
    what close itself raises is dropped: the first failure is the one reported)."""
    env = await env_class.start(record)
    try:
        episode = await _run(env, generate, chat, limits)
    except BaseException:
        try:
            await env.close()
        except Exception:  # noqa: BLE001 - the failure being raised is the one to report
            pass
        raise
    await env.close()
    return episode


async def _run(env: Any, generate: Generate, chat: ChatFormat, limits: EpisodeLimits) -> Episode:
    opening = await env.init()
    messages, tools = list(opening.init_prompt_messages), list(opening.tools)
    episode = Episode([], [], [], [], messages)
    opening_ids = chat.opening(messages, tools)
    episode.opening_tokens, episode.prompt_messages = len(opening_ids), len(messages)
    if len(opening_ids) > limits.max_total_tokens:
        opening_ids, episode.end = opening_ids[: limits.max_total_tokens], EpisodeEnd.OPENING_TOO_LONG
    episode.add(opening_ids)
    episode.prompt_tokens = len(opening_ids)
    if episode.end is EpisodeEnd.OPENING_TOO_LONG:
        return episode
    while True:
        budget = min(limits.max_new_tokens, limits.max_total_tokens - len(episode.token_ids))
        if budget < 1:
            episode.end = EpisodeEnd.MAX_TOKENS
            return episode
        ids, logprobs, versions = await _generate(generate, episode.token_ids, budget)
        episode.add(ids, logprobs, versions)
        episode.turns += 1
        assistant = chat.parse(ids)
        before = list(messages)
        messages.append(assistant)
        if ids[-1] not in chat.stop_ids and len(ids) == budget:  # cut at its budget
            episode.end = EpisodeEnd.MAX_TOKENS
            return episode
        reply = await env.step(dict(assistant))
        messages.extend(reply.env_messages)
        episode.env_rewards.append(dict(reply.env_rewards))
        if reply.done:
            episode.end = EpisodeEnd.DONE
            return episode
        if episode.turns >= limits.max_turns:
            episode.end = EpisodeEnd.MAX_TURNS
            return episode
        if chat.cannot_fit(reply.env_messages, limits.max_total_tokens - len(episode.token_ids)):
            episode.end = EpisodeEnd.MAX_TOKENS  # known from a prefix: a huge reply is never rendered whole
            return episode
        bridge = chat.bridge(before, assistant, reply.env_messages, tools, ids[-1])
        if len(episode.token_ids) + len(bridge) >= limits.max_total_tokens:
            episode.end = EpisodeEnd.MAX_TOKENS
            return episode
        episode.add(bridge)


def openings_too_long(episodes: list[Episode], step: int) -> UserCodeError | None:
    """The error that stops the run when every one of ``episodes`` (step ``step``'s) opened with more tokens than
    ``max_total_tokens`` (``training.seq_len``; such an episode's tokens are its opening cut at that limit, so their
    count is the limit): nothing of the step could be trained on. Else None."""
    if not episodes or any(ep.end is not EpisodeEnd.OPENING_TOO_LONG for ep in episodes):
        return None
    shortest = min(ep.opening_tokens for ep in episodes)
    return UserCodeError(f"every episode of step {step} opens with more tokens than training.seq_len = "
                         f"{len(episodes[0].token_ids)} (the shortest opening: {shortest} tokens, rendered from the "
                         f"environment's init()); raise training.seq_len above {shortest} + rollout.max_new_tokens, "
                         "or shorten the opening")
