"""``Rollouts`` dispatch (``rollout/dispatch.py``, ``split.py``): prompts split in proportion to the EMA of
measured engine speed, with a dead zone against jitter (``rollout.dispatch_dead_zone``) and an imbalance cap
(``rollout.dispatch_max_share``).

Fake engines only (``fakes.engines``, no processes): each answers a request at once, through the engines' event
queue, with a ``gen_time_s`` that corresponds to its configured rate (completions/s), optionally jittered."""

from __future__ import annotations

import queue
import re

from fakes.engines import FakeEngine
from fakes.tasks import FakeTask
from fakes.stub_tokenizers import FakeTokenizer

from torchtitan_flux.rollout.split import SpeedSplit
from torchtitan_flux.engine.base import EngineError
from torchtitan_flux.rollout.rollouts import Rollouts

G = 4


def make(rates, *, prompts=16, dead_zone=0.1, max_share=0.75, jitter=0.0):
    events: queue.Queue = queue.Queue()
    engines = [FakeEngine(f"e{i}", r, events, jitter=jitter, seed=i) for i, r in enumerate(rates)]
    sched = Rollouts(
        engines, events, FakeTask(), FakeTokenizer(), group_size=G, prompts_per_step=prompts, max_new_tokens=1,
        temperature=1.0, top_k=0, seed=0, pad_id=0, dead_zone=dead_zone, max_share=max_share,
    )
    return sched, engines


def step(sched, engines, k: int) -> list[int]:
    """Dispatch step ``k``, let every result arrive; prompts each engine got for it."""
    before = [sum(e.received) for e in engines]
    sched.dispatch(k, 0)
    while sched.pump.has_events():
        sched.pump.pump(0)
    sched.discard(k)
    return [sum(e.received) - b for e, b in zip(engines, before)]


def test_split_is_proportional_to_measured_speed():
    sched, engines = make([10.0, 20.0, 10.0], prompts=40, dead_zone=0.0)
    assert step(sched, engines, 1) == [14, 13, 13]  # no measurement yet: even
    for k in range(2, 40):
        counts = step(sched, engines, k)
    assert counts == [10, 20, 10]
    assert abs(sched.pump.split.speed["e1"] / sched.pump.split.speed["e0"] - 2.0) < 1e-3
    # with the default dead zone the split settles within it of the proportional one
    sched, engines = make([10.0, 20.0, 10.0], prompts=40)
    for k in range(1, 40):
        counts = step(sched, engines, k)
    assert sum(counts) == 40 and all(abs(c - t) <= 0.1 * t + 1 for c, t in zip(counts, [10, 20, 10]))


def test_dead_zone_keeps_the_split_under_jitter():
    sched, engines = make([10.0, 10.0], prompts=64, jitter=0.05)
    splits = [step(sched, engines, k) for k in range(1, 60)]
    assert all(s == [32, 32] for s in splits)  # 5% jitter never reshuffles work
    # without the dead zone the same jitter does move prompts around (so the check above means something)
    sched, engines = make([10.0, 10.0], prompts=64, jitter=0.05, dead_zone=0.0)
    splits = [step(sched, engines, k) for k in range(1, 60)]
    assert len({tuple(s) for s in splits}) > 1
    # a real change in speed (e1 becomes 2x faster) is outside the dead zone: the split follows it
    sched, engines = make([10.0, 10.0], prompts=60, jitter=0.05)
    for k in range(1, 10):
        step(sched, engines, k)
    engines[1].rate = 20.0
    for k in range(10, 50):
        counts = step(sched, engines, k)
    assert 36 <= counts[1] <= 44 and sum(counts) == 60


def test_speed_split_alone_dead_zone_cap_and_replacement():
    """``SpeedSplit`` without a scheduler: the split follows the measured speed, keeps its shares inside the dead
    zone, caps the fastest engine, and a replacement engine inherits the dead one's speed."""
    split = SpeedSplit(["a", "b"], dead_zone=0.1, max_share=0.75)
    assert split.split(10, ["a", "b"]) == [5, 5]  # no measurement yet: even
    split.speed.update(a=1.05, b=1.0)  # 5% faster: inside the dead zone, the shares in force are kept
    assert split.split(10, ["a", "b"]) == [5, 5]
    split.observe("b", 40, 1.0)  # b: 0.8 * 1.0 + 0.2 * 40 = 8.8 completions/s
    assert abs(split.speed["b"] - 8.8) < 1e-9 and split.fastest(["a", "b"]) == "b"
    assert split.split(8, ["a", "b"]) == [2, 6]  # 8.8 / 9.85 = 0.89 of the speed, capped at 0.75
    assert split.split(8, ["b"]) == [8]  # alone: no cap
    split.replace("b", "b2")
    assert split.speed == {"a": 1.05, "b2": 8.8}


def test_cap_holds_with_a_10x_faster_engine():
    sched, engines = make([100.0, 10.0], prompts=16)
    splits = [step(sched, engines, k) for k in range(1, 30)]
    assert all(s[0] <= 12 for s in splits)  # never above 0.75 * 16
    assert splits[-1] == [12, 4]
    speed = sched.pump.split.speed
    assert abs(speed["e0"] / speed["e1"] - 10.0) < 0.1  # the speed is measured, only the split capped
    # three engines: the fast one is capped, the excess is spread over the others by speed
    # (100 / 140 = 0.71 of the speed; cap 0.6: e0 gets 0.6, the other 0.4 splits 1:3)
    sched, engines = make([100.0, 10.0, 30.0], prompts=32, dead_zone=0.0, max_share=0.6)
    for k in range(1, 30):
        counts = step(sched, engines, k)
    assert counts == [19, 3, 10]
    # a step is dispatched once: a second call (a later admission reaching it again) sends nothing
    before = [sum(e.received) for e in engines]
    sched.dispatch(30, 0)
    sched.dispatch(30, 0)
    got = [sum(e.received) - b for e, b in zip(engines, before)]
    assert sum(got) == 32 and max(got) <= 0.6 * 32 + 1


def test_a_lone_engine_gets_everything():
    sched, engines = make([100.0, 10.0], prompts=16)
    engines[1].is_alive = False
    assert step(sched, engines, 1) == [16, 0]


def test_a_dead_engines_share_goes_to_the_others():
    sched, engines = make([10.0, 10.0, 20.0], prompts=16)
    for k in range(1, 20):
        counts = step(sched, engines, k)
    assert counts == [4, 4, 8]
    engines[2].is_alive = False  # dead before the next dispatch: left out of the split
    assert step(sched, engines, 20) == [8, 8, 0]
    engines[2].is_alive = True  # back: the engine set changed, so the split is recomputed despite the dead zone
    assert step(sched, engines, 21) == [4, 4, 8]


def test_engine_dying_with_work_in_flight():
    sched, engines = make([10.0, 10.0, 10.0], prompts=12)
    engines[2].answer = False
    sched.dispatch(1, 0)
    assert [sum(e.received) for e in engines] == [4, 4, 4]
    while sched.pump.has_events():
        sched.pump.pump(0)
    engines[2].is_alive = False
    engines[2].events.put(EngineError("e2", "server gone", fatal=True))
    sched.pump.pump(0)  # with no fleet a dead engine is dropped: e2 goes, its 4 prompts re-dispatched to the others
    assert [e.name for e in sched.engines] == ["e0", "e1"] and sched.pump.redispatched == 1
    while sched.pump.has_events():
        sched.pump.pump(0)
    assert all(g.result is not None for g in sched.table.of_step(1))
    sched.discard(1)
    before = [sum(e.received) for e in engines[:2]]
    sched.dispatch(2, 0)
    got = [sum(e.received) - b for e, b in zip(engines[:2], before)]
    assert sum(got) == 12 and min(got) >= 4  # the dead engine's third is shared by the two left


def test_checkpoint_state_when_the_last_engine_dies_with_work_in_flight():
    """A stop because no engine is left checkpoints what has finished: ``state_dict`` must neither raise while it
    waits (the dead engine's death event arrives during the wait) nor wait out its timeout for work nobody will
    finish. Found on a real vLLM server killed mid-run: the checkpoint of the last step was lost to NoEngineLeft."""
    import time

    sched, engines = make([10.0], prompts=4)
    sched.dispatch(1, 0)  # answered at once
    engines[0].answer = False
    sched.dispatch(2, 0)  # in flight when the engine dies
    engines[0].is_alive = False
    engines[0].events.put(EngineError("e0", "server gone", fatal=True))
    t0 = time.monotonic()
    state = sched.state_dict(timeout=30.0)
    assert time.monotonic() - t0 < 5.0
    assert {g[0] for g in state["groups"]["finished"]} == {1}  # step 2 is generated afresh on resume


def test_a_stuck_engine_is_reported_every_wait_note_while_collect_waits(monkeypatch, caplog):
    """Before: ``collect`` waited silently for an engine that never answered."""
    import threading
    import time

    from torchtitan_flux.rollout import waiting as rollout

    monkeypatch.setattr(rollout, "WAIT_NOTE_S", 0.2)
    sched, (fast, stuck) = make([1.0, 1.0], prompts=4)
    stuck.answer = False
    sched.dispatch(3, 0, pin_version=2)
    stuck_req = next(f.request for f in sched.pump.in_flight() if f.engine is stuck)

    def answer_late():  # the stuck engine answers after ~3 notes, so collect returns
        time.sleep(0.7)
        stuck.answer = True
        stuck.submit(stuck_req)

    threading.Thread(target=answer_late, daemon=True).start()
    with caplog.at_level("WARNING", logger="torchtitan_flux"):
        batch = sched.collect(3, 0, pin_version=2)
    assert batch.tokens.shape[0] == 4 * G
    notes = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert 2 <= len(notes) <= 4, notes
    assert re.fullmatch(r"step 3: waiting 0 s for rollouts, none arrived for 0 s; e0 \(alive\): nothing in flight; "
                        r"e1 \(alive\): 1 requests, 8 completions of steps 3 on weight version 2, the oldest sent 0 s "
                        r"ago", notes[0]), notes[0]


def test_a_prompt_budget_sets_its_requests_max_new_tokens_and_one_over_the_config_is_refused():
    """``Prompt.max_new_tokens``: a request generates the largest budget among its prompts (0: rollout.max_new_tokens);
    a budget above rollout.max_new_tokens (which training.seq_len was checked against) is a one-line error naming
    the task (``UserCodeError``: the run stops on every rank; a single trainer process checkpoints its last step
    first)."""
    import pytest

    from torchtitan_flux.data.tasks import Prompt, Task
    from torchtitan_flux.errors import UserCodeError

    class Budgets(Task):
        name = "budgets"

        def __init__(self, budgets):
            super().__init__(FakeTask.reward_funcs)
            self.budgets = budgets

        def prompts(self, seed, step, n):
            return [Prompt(f"p{i}", max_new_tokens=self.budgets[i % len(self.budgets)]) for i in range(n)]

    def scheduler(budgets, engines=1):
        events: queue.Queue = queue.Queue()
        fakes = [FakeEngine(f"e{i}", 10.0, events) for i in range(engines)]
        return Rollouts(fakes, events, Budgets(budgets), FakeTokenizer(), group_size=G, prompts_per_step=4,
                                max_new_tokens=32, temperature=1.0, top_k=0, seed=0, pad_id=0)

    def requests(budgets, engines=1):
        sched = scheduler(budgets, engines)
        sched.dispatch(1, 0)
        return sorted({id(g.request): g.request.max_new_tokens for g in sched.table.of_step(1)}.values())

    assert requests([0]) == [32]  # no budget: the config's
    assert requests([8]) == [8]
    assert requests([4, 8, 0, 4]) == [32]  # one request: its largest
    assert requests([4, 4, 16, 16], engines=2) == [4, 16]  # prompts 0-1 on one engine, 2-3 on the other
    # their results (4 and 16 wide) make one batch: the narrower is padded, its completion tokens kept
    batch = scheduler([4, 4, 16, 16], engines=2).collect(1, 0)
    assert batch.tokens.shape[0] == 4 * G and int(batch.loss_mask.sum()) == 4 * G  # one token each (lengths 1)
    assert (batch.tokens == 5).sum(dim=1).tolist() == [1] * (4 * G)
    with pytest.raises(UserCodeError, match=r"task 'budgets': prompts\(seed=0, step=1, n=4\): prompt 0 has "
                                          r"max_new_tokens 33; allowed: an integer from 0 \(rollout.max_new_tokens\) "
                                          r"to rollout.max_new_tokens = 32"):
        requests([33])


def test_reconnects_to_a_dying_server_are_capped_like_restarts(caplog):
    """The fourth GPU review's finding 2: a server wedged after an aborted push takes each new join and dies at the
    next push; reconnects were not counted against ``rollout.max_engine_restarts``, so that looped forever."""
    from types import SimpleNamespace

    from torchtitan_flux.rollout.engines import EngineFleet

    class Server:
        reconnects = True

        def __init__(self):
            self.name = "vllm0"

        def close(self):
            pass

        def reconnect(self):
            return Server()

    events: queue.Queue = queue.Queue()
    fleet = SimpleNamespace(stops=SimpleNamespace(signal=None), _restart_times={}, restarts=0, events=events,
                            _reconnect=lambda dead, index, nth: dead.reconnect(),
                            job_config=SimpleNamespace(rollout=SimpleNamespace(max_engine_restarts=3)))
    engine = Server()
    for _ in range(3):
        placeholder = EngineFleet.replace(fleet, engine, 0)  # reconnected on a thread of its own
        engine = events.get(timeout=5).engine
        assert engine is not None and placeholder.dead is not engine
    with caplog.at_level("ERROR", logger="torchtitan_flux"):
        assert EngineFleet.replace(fleet, engine, 0) is None
    assert fleet.restarts == 3 and "not reconnected again" in caplog.text


def test_the_fakes_and_every_engine_kinds_handler_have_the_rollout_face():
    """The rollout side uses an engine through ``rollout.pump.RolloutEngine`` only; the process-free fakes of these
    tests implement exactly that face, and so does every real handler (so the fakes cannot drift from what they stand
    in for). Mutation: a member added to the face that a handler lacks."""
    import typing

    from fakes.engines import FakeEngineBase, HeldEngine

    from torchtitan_flux.engine.kinds import ENGINE_KINDS
    from torchtitan_flux.rollout.pump import RolloutEngine
    from torchtitan_flux.rollout.reconnect import Reconnecting

    face = set(typing.get_type_hints(RolloutEngine)) | {
        n for n, v in vars(RolloutEngine).items() if callable(v) and not n.startswith("_")}
    assert face == {"name", "reconnects", "alive", "submit", "kill"}
    handlers = {kind.handler_class(gpu) for kind in ENGINE_KINDS.values() for gpu in (False, True)}
    for cls in [FakeEngineBase, FakeEngine, HeldEngine, Reconnecting, *handlers]:
        missing = {m for m in face - {"name"} if not hasattr(cls, m)}
        assert not missing, (cls.__name__, missing)
    assert isinstance(FakeEngine("e", 1.0, queue.Queue()), RolloutEngine)
