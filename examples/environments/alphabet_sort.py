# Ported from torchtitan 0.3.0 (the wheel on PyPI): torchtitan/experiments/rl/examples/alphabet_sort/env.py,
# data.py (the sampling) and rubric.py (the scoring). Changes: the imports (torchtitan_flux.data.environments for
# torchtitan.experiments.rl.environment and renderers); a record may be a dict (a dataset row) as well as an
# AlphabetSortSample; the names come from a built-in pool instead of a Hugging Face dataset
# (kalomaze/alphabetic-arxiv-authors-it1); the reward takes TRL's signature (completions as message lists) instead of
# torchtitan's RewardFn over a Rollout. The original's license:
#
# BSD 3-Clause License
#
# (c) Meta Platforms, Inc. and affiliates.
#
# Redistribution and use in source and binary forms, with or without modification,
# are permitted provided that the following conditions are met:
#
# 1. Redistributions of source code must retain the above copyright notice,this list
# of conditions and the following disclaimer.
#
# 2. Redistributions in binary form must reproduce the above copyright notice, this
# list of conditions and the following disclaimer in the documentation
# and/or other materials provided with the distribution.
#
# 3. Neither the name of the copyright holder nor the names of its contributors may
# be used to endorse or promote products derived from this software without specific
# prior written permission.
#
# THIS SOFTWARE IS PROVIDED BY THE COPYRIGHT HOLDERS AND CONTRIBUTORS “AS IS” AND ANY
# EXPRESS OR IMPLIED WARRANTIES, INCLUDING, BUT NOT LIMITED TO, THE IMPLIED WARRANTIES
# OF MERCHANTABILITY AND FITNESS FOR A PARTICULAR PURPOSE ARE DISCLAIMED. IN NO EVENT
# SHALL THE COPYRIGHT HOLDER OR CONTRIBUTORS BE LIABLE FOR ANY DIRECT, INDIRECT,
# INCIDENTAL, SPECIAL, EXEMPLARY, OR CONSEQUENTIAL DAMAGES (INCLUDING, BUT NOT LIMITED
# TO, PROCUREMENT OF SUBSTITUTE GOODS OR SERVICES; LOSS OF USE, DATA, OR PROFITS; OR
# BUSINESS INTERRUPTION) HOWEVER CAUSED AND ON ANY THEORY OF LIABILITY, WHETHER IN
# CONTRACT, STRICT LIABILITY, OR TORT (INCLUDING NEGLIGENCE OR OTHERWISE) ARISING IN
# ANY WAY OUT OF THE USE OF THIS SOFTWARE, EVEN IF ADVISED OF THE POSSIBILITY OF SUCH
# DAMAGE.
"""torchtitan 0.3.0's AlphabetSort, ported (docs/environments.md): sort a list of names, turn by turn.

``AlphabetSortEnv`` asks the model to sort the first batch of names; each later step adds a batch and asks for the
whole list re-sorted, the new names marked ``// new name!``; when no batches are left the episode ends.
``records(n, seed)`` makes the dataset rows; ``alphabet_sort_reward`` scores an episode: per turn, how close the
model's ``<alphabetical_sorted>`` (turn 0) or ``<combined_alphabetical_sorted>`` block is to the expected list
(difflib's ratio to the power 4), averaged over the expected turns.
"""

from __future__ import annotations

import difflib
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from torchtitan_flux.data.environments import Message, MessageEnv, MessageEnvInitOutput, MessageEnvStepOutput

_FIRST = ("Ana", "Bob", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kofi", "Lena", "Marc",
          "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Yara", "Zoltan")
_LAST = ("Abe", "Beck", "Chardin", "Dorn", "Eklund", "Fabbri", "Gupta", "Horvat", "Ito", "Jensen", "Kowal",
         "Lindqvist", "Mensah", "Novak", "Okafor", "Petit", "Quiroga", "Rossi", "Sato", "Tanaka", "Ueda", "Varga",
         "Weber", "Xu", "Zhou")


class _Author(NamedTuple):
    # CamelCase name shown to the model + its lowercased (first, last) sort keys.
    display: str  # "MarcChardin"
    first: str  # "marc"
    last: str  # "chardin"


AUTHORS = tuple(_Author(f + la, f.lower(), la.lower()) for f in _FIRST for la in _LAST)


@dataclass(frozen=True, kw_only=True, slots=True)
class AlphabetSortSample:
    """The names shown and the expected sorted answer for each turn of one AlphabetSort problem."""

    new_names_per_turn: tuple[tuple[str, ...], ...]  # [num_turns][new_names]
    expected_names: tuple[tuple[str, ...], ...]  # [num_turns][sorted_names]
    sort_by_first_name: bool

    @classmethod
    def from_record(cls, record: dict) -> "AlphabetSortSample":
        """A dataset row (lists, as JSON has them) as a sample."""
        return cls(new_names_per_turn=tuple(tuple(t) for t in record["new_names_per_turn"]),
                   expected_names=tuple(tuple(t) for t in record["expected_names"]),
                   sort_by_first_name=bool(record["sort_by_first_name"]))


class AlphabetSortEnv(MessageEnv):
    """Runs one AlphabetSort sample as a chat: ask the model to sort a list of names, turn by turn.

    `init` asks the model to sort the first batch of names. Each later `step` introduces a new
    batch of names and asks the model to re-sort the whole list so far, marking the new ones. When
    no batches are left, `step` ends the rollout (so a single-turn sample ends at the first step).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(MessageEnv.Config):
        pass

    def __init__(self, config: Config, *, env_input: AlphabetSortSample | dict) -> None:
        self._env_input = (env_input if isinstance(env_input, AlphabetSortSample)
                           else AlphabetSortSample.from_record(env_input))

    async def init(self) -> MessageEnvInitOutput:
        """Ask the model to sort the first batch of names."""
        # init asks for turn 0; step asks for turns 1, 2, ... in order
        self._next_turn = 1
        sort_type = "FIRST" if self._env_input.sort_by_first_name else "LAST"
        names = ", ".join(self._env_input.new_names_per_turn[0])
        prompt = (
            f"Sort these names in alphabetical order by {sort_type} name: {names}\n\n"
            "Use exactly this format:\n"
            "<alphabetical_sorted>\nName1\nName2\n...\n</alphabetical_sorted>"
        )
        return MessageEnvInitOutput(init_prompt_messages=[{"role": "user", "content": prompt}])

    async def step(self, completion_message: Message) -> MessageEnvStepOutput:
        """Introduce the next batch of new names to re-sort, or end the rollout if none are left."""
        del completion_message  # advance to the next names regardless of the model's reply
        if self._next_turn >= len(self._env_input.new_names_per_turn):
            return MessageEnvStepOutput(done=True)
        turn = self._next_turn
        self._next_turn += 1
        sort_type = "FIRST" if self._env_input.sort_by_first_name else "LAST"
        names = ", ".join(self._env_input.new_names_per_turn[turn])
        prompt = (
            f"Now sort ALL of these names alphabetically by {sort_type} name: {names}\n\n"
            "These are in addition to the prior list. Mark any NEW names (that weren't in the "
            "prior list) with `// new name!` at the end."
        )
        if turn == 1:
            # The first re-sort shows the combined format with one new name tagged.
            prompt += (
                "\n\nUse exactly this format:\n"
                "<combined_alphabetical_sorted>\nName1\nName2 // new name!\n...\n"
                "</combined_alphabetical_sorted>"
            )
        else:
            prompt += " Follow the same format as before."
        return MessageEnvStepOutput(env_messages=[{"role": "user", "content": prompt}])


def sample(rng: random.Random, max_turns: int = 3, max_names_per_turn: int = 5) -> AlphabetSortSample:
    """One sample: the turn count and names drawn, then for each turn the names shown and the expected sorted
    answer over everything seen so far (torchtitan's ``AlphabetSortDataset._sample``)."""
    num_turns = rng.randint(1, max_turns)

    # Draw how many names each turn introduces, then draw them all at once (without
    # replacement) so a name never repeats within or across turns.
    name_counts_per_turn = [rng.randint(1, max_names_per_turn) for _ in range(num_turns)]
    sampled_authors = rng.sample(AUTHORS, k=sum(name_counts_per_turn))
    sort_by_first_name = rng.choice([True, False])

    def name_sort_key(author: _Author) -> tuple[str, str]:
        # Sort by the chosen part, then the other part — so names sharing the chosen part
        # (e.g. two "Ana"s sorted by first name) land in a fixed order, not the draw order.
        return (author.first, author.last) if sort_by_first_name else (author.last, author.first)

    new_names_per_turn: list[tuple[str, ...]] = []
    expected_names: list[tuple[str, ...]] = []
    seen: list[_Author] = []
    start = 0
    for turn_idx, count in enumerate(name_counts_per_turn):
        new_authors = sampled_authors[start : start + count]
        start += count
        seen.extend(new_authors)

        # Show this turn's new names in random order.
        shown_names = [author.display for author in new_authors]
        rng.shuffle(shown_names)
        new_names_per_turn.append(tuple(shown_names))

        # Expected answer: every name seen so far, sorted; tag the names new this turn with
        # "// new name!", except turn 0 where every name is new so none is tagged.
        new_this_turn: set[_Author] = set(new_authors) if turn_idx > 0 else set()
        expected_names.append(tuple(
            f"{author.display} // new name!" if author in new_this_turn else author.display
            for author in sorted(seen, key=name_sort_key)
        ))

    return AlphabetSortSample(new_names_per_turn=tuple(new_names_per_turn), expected_names=tuple(expected_names),
                              sort_by_first_name=sort_by_first_name)


def records(n: int, seed: int, max_turns: int = 3, max_names_per_turn: int = 5) -> list[dict]:
    """``n`` samples as dataset rows (dicts of lists, as a JSONL file holds them)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        s = sample(rng, max_turns, max_names_per_turn)
        rows.append({"new_names_per_turn": [list(t) for t in s.new_names_per_turn],
                     "expected_names": [list(t) for t in s.expected_names], "sort_by_first_name": s.sort_by_first_name})
    return rows


def alphabet_sort_reward(completions: list[list[Message]], expected_names: list, similarity_power: int = 4,
                         **kwargs) -> list[float]:
    """Per episode, the average over its expected turns of how well each assistant turn sorted its list
    (``score_sorted_list``); an episode that ends early is penalized (torchtitan's ``RewardAlphabetSort``)."""
    out = []
    for messages, expected in zip(completions, expected_names):
        turns = [m for m in messages if m["role"] == "assistant"]
        scores = [score_sorted_list(m.get("content") or "", expected_names=names,
                                    xml_tag="alphabetical_sorted" if i == 0 else "combined_alphabetical_sorted",
                                    similarity_power=similarity_power)
                  for i, (m, names) in enumerate(zip(turns, expected))]
        # Divide by the number of EXPECTED turns, not the answered ones, so a rollout
        # that ends early (a perfect turn 0 but a missing follow-up) is penalized.
        out.append(sum(scores) / len(expected) if expected else 0.0)
    return out


def score_sorted_list(response_text: str, *, expected_names: Sequence[str], xml_tag: str,
                      similarity_power: int) -> float:
    """Reward in [0, 1] for how closely the model's `<xml_tag>` block matches `expected_names`.

    A difflib similarity ratio over the lowercased lines, raised to `similarity_power` so only
    near-perfect orderings score near 1.0; an absent block scores 0.0.
    """
    predicted = _answer_lines(response_text, xml_tag=xml_tag)
    if not predicted:
        return 0.0
    predicted_text = "\n".join(line.lower() for line in predicted)
    expected_text = "\n".join(line.lower() for line in expected_names)
    similarity = difflib.SequenceMatcher(None, predicted_text, expected_text).ratio()
    return similarity**similarity_power


def _answer_lines(text: str, *, xml_tag: str) -> list[str]:
    """The non-empty lines inside the model's last `<xml_tag>` block, or [] if absent."""
    blocks = re.findall(rf"<\s*{xml_tag}\s*>(.*?)</\s*{xml_tag}\s*>", text, re.DOTALL | re.IGNORECASE)
    if not blocks:
        return []
    return [line.strip() for line in blocks[-1].splitlines() if line.strip()]
