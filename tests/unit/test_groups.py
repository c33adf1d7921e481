"""``rollout/groups.py``: the group table is the one owner of every group's state. Its fields below the key are set
only by its transition methods (an AST scan of the whole package, as ``test_links.py`` does for the link table),
each transition accepts only the states the module docstring draws, and a checkpoint restores FINISHED groups in
their arrival order and TAKEN ones as taken."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_links import PACKAGE, _field_writes

from torchtitan_flux.data.tasks import Prompt
from torchtitan_flux.engine.base import GenerationRequest, GenerationResult
from torchtitan_flux.rollout.groups import Group, GroupState, GroupTable, eval_step


def test_only_the_group_table_sets_a_groups_fields():
    """Mutation: a policy or ``Rollouts`` writing ``group.result`` (or any field) itself."""
    fields = {f.name for f in dataclasses.fields(Group) if not f.init}
    assert {"state", "request", "result", "episodes", "opening", "completions", "scores"} <= fields
    owner = PACKAGE / "rollout" / "groups.py"
    assert len(_field_writes(owner, fields, set())) >= 8  # the scan sees the table's own writes
    elsewhere = [f"{p.relative_to(PACKAGE)}:{w}" for p in sorted(PACKAGE.rglob("*.py")) if p != owner
                 for w in _field_writes(p, fields, set()) if (p.relative_to(PACKAGE).as_posix(), w.split(": ")[1])
                 not in _OTHER_OBJECTS]
    assert not elsewhere, elsewhere


# fields of the same names on other objects: the link table's links, a batch's episodes
_OTHER_OBJECTS = {("sync/links.py", "link.state"), ("rollout/collect.py", "batch.episodes")}


def _request(req_id: int) -> GenerationRequest:
    return GenerationRequest(req_id, 1, [[1, 2]], 2, 3, 1.0, 0, 0, 0)


def _result(req_id: int) -> GenerationResult:
    return GenerationResult(req_id, "e0", torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3),
                            torch.ones(2, dtype=torch.long), 0, 0, 0.1)


def test_transitions_follow_the_drawn_life_and_refuse_the_rest():
    t = GroupTable()
    g = t.add(1, 0, Prompt("p"), [1, 2])
    assert g.state is GroupState.QUEUED and t.of_step(1) == [g]
    with pytest.raises(RuntimeError, match=r"group \(1, 0\) is queued; expected running"):
        t.finish(g, _result(0))
    with pytest.raises(RuntimeError, match="already in the table"):
        t.add(1, 0, Prompt("p"), [1, 2])
    t.start(g, _request(0))
    t.finish(g, _result(0))
    assert g.state is GroupState.FINISHED and g.result.req_id == 0 and g.trained_prompt_ids == [1, 2]
    t.requeue(g)  # stale: generated afresh
    assert g.state is GroupState.QUEUED and g.request is None and g.result is None
    t.start(g, _request(1))
    t.finish(g, _result(1), episodes=[], opening=[1])
    assert g.trained_prompt_ids == [1]  # a multi-turn group trains on its episodes' shared opening
    t.take(g)
    with pytest.raises(RuntimeError, match="is taken; cannot requeue"):
        t.requeue(g)
    t.drop(g)
    assert g.state is GroupState.DROPPED and t.of_step(1) == [] and g not in t
    assert eval_step(0) < 0 and eval_step(3) != eval_step(4)


def test_a_checkpoint_keeps_finished_groups_in_arrival_order_and_taken_ones():
    """Mutations: per-step state saving a step with a group still running (it would be trained short), or the
    restored groups losing their arrival order (streaming takes the oldest first, ties by arrival)."""
    t = GroupTable()
    groups = {(s, i): t.add(s, i, Prompt(f"p{s}{i}"), [s, i]) for s in (1, 2) for i in range(2)}
    for key in [(2, 1), (1, 0), (1, 1), (2, 0)]:
        t.start(groups[key], _request(key[0] * 10 + key[1]))
    for key in [(2, 1), (1, 0), (1, 1)]:  # (2, 0) still running
        t.finish(groups[key], _result(0))
    whole = t.state_dict(whole_steps_only=True)
    assert [(s, i) for s, i, *_ in whole["finished"]] == [(1, 0), (1, 1)]  # step 2 is not whole
    t.take(groups[(1, 0)])
    state = t.state_dict(whole_steps_only=False)
    assert [(s, i) for s, i, *_ in state["finished"]] == [(2, 1), (1, 1)]  # arrival order
    assert [(s, i) for s, i, *_ in state["taken"]] == [(1, 0)]
    restored = GroupTable()
    restored.load_state_dict(state)
    finished = sorted(restored.in_state(GroupState.FINISHED), key=lambda g: g.finished_order)
    assert [(g.step, g.index) for g in finished] == [(2, 1), (1, 1)]
    assert [(g.step, g.index) for g in restored.in_state(GroupState.TAKEN)] == [(1, 0)]
    assert restored.get(2, 0) is None  # running at the save: generated afresh
