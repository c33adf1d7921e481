"""Episodes against the run's limits and what a step reports of them: an opening longer than ``training.seq_len``
ends its episode and fits the layout (a step of nothing else stops the run in one line), a group whose openings share
no token lays out, and the ``episode/*`` metrics and warnings (``run/episode_checks.py``)."""

from __future__ import annotations

import logging

import pytest
import torch
from test_environments import QUESTION, Echo, _episode, _envs, _load, _scripted, chat, tok  # noqa: F401 - fixtures

from torchtitan_flux.data.rewards import Scores
from torchtitan_flux.data.tasks import Prompt
from torchtitan_flux.engine.base import GenerationRequest
from torchtitan_flux.rollout.batch import layout_batch
from torchtitan_flux.rollout.episode import Episode, EpisodeEnd, openings_too_long
from torchtitan_flux.rollout.episode_groups import episode_record, group_result
from torchtitan_flux.run.episode_checks import WARN_EVERY_STEPS, EpisodeWarnings, episode_metrics


def _layout(episodes: list[Episode]):
    prompt, result = group_result(7, episodes, 0, 0.1)
    request = GenerationRequest(req_id=7, step=1, prompt_ids=[prompt], group_size=len(episodes), max_new_tokens=8,
                                temperature=1.0, top_k=0, seed=0, dispatch_version=0)
    n = len(episodes)
    return layout_batch(1, [Prompt("x")], [prompt], [(request, result)], Scores([0.0] * n, {}), [""] * n, n, 0)


def test_an_opening_longer_than_the_episode_ends_it_and_lays_out_within_seq_len(monkeypatch, tok, chat):
    """The fifth sweep's item 2: such an episode kept its whole opening, and the first forward failed in RoPE.
    Mutations: the opening kept whole (the layout is longer than the limit), a turn generated anyway."""
    _envs(monkeypatch, Echo=Echo)
    env = _load("_envs:Echo")
    prompt_len = len(chat.opening([{"role": "user", "content": QUESTION["question"]}], []))
    generate, calls = _scripted(tok, ["hi"] * 3)
    ep = _episode(env, QUESTION, generate, chat, max_total_tokens=prompt_len - 3)
    assert (ep.end, ep.turns, calls, ep.env_rewards) == (EpisodeEnd.OPENING_TOO_LONG, 0, [], [])
    assert (len(ep.token_ids), ep.opening_tokens, sum(ep.loss_mask)) == (prompt_len - 3, prompt_len, 0)
    generate, _ = _scripted(tok, ["hi"] * 3)
    fits = _episode(env, QUESTION, generate, chat, max_total_tokens=prompt_len + 8)
    batch = _layout([ep, fits])
    assert batch.tokens.shape[1] <= prompt_len + 8
    assert batch.loss_mask[0].sum() == 0 and batch.loss_mask[1].sum() == sum(fits.loss_mask)
    assert openings_too_long([ep, fits], 3) is None
    error = openings_too_long([ep, ep], 3)
    assert str(error) == (f"every episode of step 3 opens with more tokens than training.seq_len = {prompt_len - 3} "
                          f"(the shortest opening: {prompt_len} tokens, rendered from the environment's init()); "
                          f"raise training.seq_len above {prompt_len} + rollout.max_new_tokens, or shorten the opening")


def _episode_of(tokens: list[int], model: list[int], opening: int) -> Episode:
    ep = Episode(list(tokens), list(model), [-0.5 * m for m in model], [3 if m else -1 for m in model], [])
    ep.prompt_tokens = ep.opening_tokens = opening
    return ep


def test_a_group_whose_openings_share_no_token_lays_out():
    """The fifth sweep's item 8: openings that differ at their first token gave an empty prompt, and layout_batch
    indexed position -1 (a crash). Mutation: the first token's prediction kept at position -1."""
    a = _episode_of([5, 6, 7, 8], [0, 0, 1, 1], 2)
    b = _episode_of([9, 6, 7], [0, 0, 1], 2)
    batch = _layout([a, b])
    assert batch.tokens.tolist() == [[5, 6, 7, 8], [9, 6, 7, 0]]
    assert batch.loss_mask.tolist() == [[0, 1, 1], [0, 1, 0]]  # position t predicts token t + 1
    assert batch.behaviour_logprobs.tolist() == [[0, -0.5, -0.5], [0, -0.5, 0]]
    assert batch.versions.tolist() == [3, 3]


def _record(turns: int, steps: int, end: str) -> dict:
    return {"turns": turns, "env_rewards": [{}] * steps, "end": end, "messages": []}


def test_episode_metrics_are_the_means_and_shares_of_a_steps_episodes():
    eps = [_record(2, 2, "done"), _record(3, 3, "max_turns"), _record(1, 0, "max_tokens"),
           _record(0, 0, "opening_too_long")]
    m = episode_metrics(eps)
    assert m == {"episode/turns_mean": 1.5, "episode/env_steps_mean": 1.25, "episode/end_done_frac": 0.25,
                 "episode/end_max_turns_frac": 0.25, "episode/end_max_tokens_frac": 0.25,
                 "episode/end_opening_too_long_frac": 0.25}
    real = Episode([1, 2], [0, 1], [0.0, -1.0], [-1, 0], [], env_rewards=[{"a": 1.0}], turns=1)
    assert episode_metrics([episode_record(real)])["episode/env_steps_mean"] == 1.0


def test_episodes_never_stepped_are_warned_once_then_every_n_steps_naming_the_fields(caplog):
    warnings = EpisodeWarnings(max_new_tokens=16, seq_len=384, stop_ids=[2])
    unstepped = [_record(1, 0, "max_tokens")] * 3 + [_record(1, 1, "done")]
    stepped = [_record(1, 1, "done")] * 4
    with caplog.at_level(logging.WARNING, logger="torchtitan_flux"):
        for step in range(1, WARN_EVERY_STEPS + 3):
            eps = stepped if step == 2 else unstepped
            warnings.check(step, eps, episode_metrics(eps))
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(":")[0] for line in lines] == ["step 1", f"step {WARN_EVERY_STEPS + 1}"]
    assert "75% of the episodes ended before their environment was ever stepped" in lines[0]
    for field in ("rollout.max_new_tokens (now 16", "training.seq_len (now 384", "eos_token_id", "now [2]"):
        assert field in lines[0]


@pytest.mark.parametrize("steps", [1, 3])
def test_openings_too_long_are_warned_once(caplog, steps):
    warnings = EpisodeWarnings(max_new_tokens=16, seq_len=128, stop_ids=[2])
    eps = [_record(0, 0, "opening_too_long"), _record(1, 1, "done")]
    with caplog.at_level(logging.WARNING, logger="torchtitan_flux"):
        for step in range(1, steps + 1):
            warnings.check(step, eps, episode_metrics(eps))
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("step 1: 50% of the episodes opened with more tokens than training.seq_len = 128")


def test_the_waiting_note_says_how_many_episodes_wait_on_their_environment():
    """The fifth sweep's item 8: with every episode inside its environment the note said only 'nothing in flight'.
    Mutation: episodes with a turn at an engine counted as waiting on the environment."""
    import time
    from types import SimpleNamespace

    from torchtitan_flux.rollout.pump import InFlight
    from torchtitan_flux.rollout.waiting import waiting_note

    engine = SimpleNamespace(name="engine0", alive=lambda: True)
    request = GenerationRequest(req_id=1, step=4, prompt_ids=[[1, 2]], group_size=1, max_new_tokens=8,
                                temperature=1.0, top_k=0, seed=0, dispatch_version=0)
    turn = InFlight(request, engine, turn=object())
    note = waiting_note(4, 31.0, [engine], [turn], time.monotonic() - 31.0, episodes_running=5)
    assert note.endswith("; 4 of 5 episodes waiting on their environment (each call bounded by "
                         "rollout.environment_timeout_seconds)")
    assert "waiting on their environment" not in waiting_note(4, 31.0, [engine], [], time.monotonic() - 31.0)
