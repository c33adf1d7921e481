"""Streaming admission (``rollout.streaming_admission``) in ``Rollouts`` (``rollout/collect.py``): a step trains on the first groups
to finish among all those in flight, fresh enough by their oldest token; stale groups are regenerated, unfinished
ones carried over or restarted, and a checkpoint keeps what was taken.

Fake engines only (``fakes.engines.HeldEngine``): each holds its requests until the test finishes them, in any
order, with any version."""

from __future__ import annotations

import queue

import pytest
import torch
from fakes.engines import HeldEngine, prompt_of
from fakes.stub_tokenizers import FakeTokenizer

from torchtitan_flux.data.rewards import RewardFunc
from torchtitan_flux.data.tasks import Prompt
from torchtitan_flux.rollout.batch import layout_batch
from torchtitan_flux.errors import RolloutWaitInterrupted
from torchtitan_flux.rollout.rollouts import Rollouts

G, P, T = 2, 4, 8


class LengthTask:
    """Prompts ``p{step}_{i}``; the reward is the completion's length."""

    chat = False
    reward_funcs = [RewardFunc("length", lambda completions, completion_ids, **kw: [float(len(c)) for c in
                                                                                    completion_ids])]

    def prompts(self, seed, step, n):
        return [Prompt(f"p{step}_{i}") for i in range(n)]


def make(carry_over: bool = True) -> tuple[Rollouts, HeldEngine]:
    events: queue.Queue = queue.Queue()
    engine = HeldEngine("e0", events)
    sched = Rollouts([engine], events, LengthTask(), FakeTokenizer(), group_size=G, prompts_per_step=P,
                             max_new_tokens=T, temperature=1.0, top_k=0, seed=0, pad_id=0, streaming=True,
                             carry_over=carry_over)
    return sched, engine


def drain(sched: Rollouts) -> None:
    while sched.pump.has_events():
        sched.pump.pump(0)


def prompts_of(batch) -> list[str]:
    return batch.prompts


def test_a_step_takes_the_first_groups_to_finish_among_every_step_in_flight():
    sched, engine = make()
    sched.dispatch(1, 0)
    sched.dispatch(2, 0)
    sched.dispatch(2, 0)  # once per step
    assert len(engine.requests) == 2 * P and all(len(r.prompt_ids) == 1 for r in engine.requests)  # a group each
    for step, i, length in [(2, 0, 1), (1, 3, 2), (2, 1, 3), (1, 0, 4)]:  # the short ones finish first
        engine.finish(engine.held_for(step, i), length)
    batch = sched.collect(1, 0)
    assert prompts_of(batch) == ["p1_0", "p1_3", "p2_0", "p2_1"]  # ordered by (step, prompt) in the batch
    assert sched.policy.generated == {"generated_completion_len_mean": 2.5, "generated_reward_mean": 2.5}
    assert batch.rewards.tolist() == [4.0, 4.0, 2.0, 2.0, 1.0, 1.0, 3.0, 3.0]  # each group's own scores
    assert batch.loss_mask.sum().item() == G * (4 + 2 + 1 + 3)
    # step 2 trains on what is left, and nothing is dispatched twice
    for step, i in [(1, 1), (2, 3), (1, 2), (2, 2)]:
        engine.finish(engine.held_for(step, i), 5)
    batch = sched.collect(2, 1)
    assert sched.policy.generated["generated_completion_len_mean"] == 5.0
    assert sorted(prompts_of(batch)) == ["p1_1", "p1_2", "p2_2", "p2_3"]
    assert len(engine.requests) == 2 * P and not engine.held


def test_a_group_staler_than_the_bound_by_its_oldest_token_is_regenerated_not_trained():
    sched, engine = make()
    sched.dispatch(1, 0, min_version=0)
    for i in range(P - 1):
        engine.finish(engine.held_for(1, i), 3, version=1)
    # the last group's oldest token is version 0 (its later tokens came after an in-flight update)
    engine.finish(engine.held_for(1, P - 1), 3, version=0, token_versions=[0, 1, 1])
    drain(sched)
    sched.interrupt()  # collect takes the three fresh groups, regenerates the stale one, then would wait: stop it
    with pytest.raises(RolloutWaitInterrupted):
        sched.collect(1, 1, pin_version=1, min_version=1)
    sched.interrupted = False
    again = engine.held_for(1, P - 1)
    assert again.min_version == 1 and again.pin_version == 1 and sched.policy.stale_samples == G
    engine.finish(again, 2, version=1)
    batch = sched.collect(1, 1, pin_version=1, min_version=1)  # the interrupted wait lost none of the three
    assert prompts_of(batch) == [f"p1_{i}" for i in range(P)] and batch.versions.min().item() == 1
    assert batch.loss_mask.sum().item() == G * (3 * 3 + 2)


def test_a_samples_version_is_its_oldest_tokens_and_each_token_keeps_its_own():
    sched, engine = make()
    sched.dispatch(1, 0)
    for i in range(P):
        engine.finish(engine.held_for(1, i), 4, version=2, token_versions=[2, 2, 3, 3] if i == 0 else None)
    batch = sched.collect(1, 3, min_version=0)
    assert batch.versions.tolist() == [2] * (G * P)
    row = batch.token_versions[0][batch.loss_mask[0] > 0]
    assert row.tolist() == [2, 2, 3, 3]
    assert (batch.token_versions[batch.loss_mask == 0] == -1).all()
    gaps = batch.token_version_gaps(3)
    assert gaps.max().item() == 1 and gaps.min().item() == 0
    assert gaps.mean().item() == 28 / 32  # per token: group 0's rows have two tokens one version younger
    assert batch.versions.float().sub(3).abs().mean().item() == 1.0  # per sample (oldest token): 1


def test_without_carry_over_a_steps_unfinished_groups_restart_and_with_it_they_stay():
    for carry_over in (True, False):
        sched, engine = make(carry_over)
        sched.dispatch(1, 0)
        sched.dispatch(2, 0)
        first = {(r.step, prompt_of(r)): r.req_id for r in engine.requests}
        for step, i in [(1, 0), (1, 1), (2, 0), (2, 1)]:
            engine.finish(engine.held_for(step, i), 2)
        sched.collect(1, 0)
        now = {(r.step, prompt_of(r)): r.req_id for r in engine.held.values()}
        restarted = {k for k in now if now[k] != first[k]}
        if carry_over:
            assert not restarted and sched.policy.restarted_groups == 0
        else:  # step 1's own unfinished groups start afresh; step 2's stay
            assert restarted == {(1, 2), (1, 3)} and sched.policy.restarted_groups == 2


def test_a_checkpoint_keeps_the_taken_prompts_and_the_finished_groups_not_trained_yet():
    sched, engine = make()
    sched.dispatch(1, 0)
    sched.dispatch(2, 0)
    for step, i in [(1, 0), (2, 0), (1, 1), (2, 1), (2, 2)]:
        engine.finish(engine.held_for(step, i), 3)
    sched.collect(1, 0)  # takes p1_0, p2_0, p1_1, p2_1; p2_2 is finished, not taken
    drain(sched)
    state = sched.state_dict(timeout=0.0)
    resumed, engine2 = make()
    resumed.load_state_dict(state)
    resumed.dispatch(1, 1)  # a restored step older than admission: its prompts neither taken nor finished
    resumed.dispatch(2, 1)
    sent = sorted((r.step, prompt_of(r)) for r in engine2.requests)
    assert sent == [(1, 2), (1, 3), (2, 3)]  # p2_2 is restored finished; the taken ones are never sent again
    for r in list(engine2.held.values()):
        engine2.finish(r, 1)
    batch = resumed.collect(2, 1)
    assert sorted(prompts_of(batch)) == ["p1_2", "p1_3", "p2_2", "p2_3"]


def test_layout_takes_each_samples_oldest_token_and_pads_token_versions():
    from torchtitan_flux.data.rewards import Scores
    from torchtitan_flux.engine.base import GenerationRequest, GenerationResult

    req = GenerationRequest(0, 1, [[1, 2]], 2, 3, 1.0, 0, 0, 0)
    tokens = torch.tensor([[5, 5, 5], [5, 0, 0]])
    res = GenerationResult(0, "e", tokens, torch.zeros(2, 3), torch.tensor([3, 1]), 4, 5, 0.0,
                           token_versions=torch.tensor([[5, 5, 6], [4, -1, -1]]))
    batch = layout_batch(1, [Prompt("x")], [[1, 2]], [(req, res)], Scores([0.0, 0.0], {}), ["", ""], 2, 0)
    assert batch.versions.tolist() == [5, 4]
    assert batch.token_versions.tolist() == [[-1, 5, 5, 6], [-1, 4, -1, -1]]


def test_among_the_finished_groups_the_oldest_is_taken_first():
    """A group of the step ahead (fresher) that finished first waits; the older one would go stale by the next
    step. (Taking in arrival order fails this.)"""
    sched, engine = make()
    sched.dispatch(1, 0)
    sched.dispatch(2, 0)
    engine.finish(engine.held_for(2, 0), 2, version=1)  # fresher, first to finish
    for i in range(P):
        engine.finish(engine.held_for(1, i), 2, version=0)
    batch = sched.collect(1, 1, min_version=0)
    assert prompts_of(batch) == [f"p1_{i}" for i in range(P)] and batch.versions.max().item() == 0
