"""Multi-turn groups on the rollout side (``rollout.environment``; ``rollout/episode_groups.py``): a group is G
episodes of one record, each turn one request the episodes' thread sends itself (through ``EnginePump.send_turn``,
answered through the pump's router: no main-thread pump needed); the finished group's environment tokens are out of
the loss; the environment's failures stop the wait in one line.

A ChatML tokenizer in SmolLM2's layout (tests/fakes/chatml_tokenizer.py), engines without processes that answer each
turn with scripted text: ``Rollouts``, the pump's router, the episodes' thread and the environments' threads are the
real ones."""

from __future__ import annotations

import queue
import sys
import time
import types
from dataclasses import dataclass

import pytest
import torch
from fakes.chatml_tokenizer import IM_END
from fakes.engines import FakeEngineBase
from test_environments import HFTokenizer

from torchtitan_flux.data.environments import (MessageEnv, MessageEnvInitOutput, MessageEnvStepOutput,
                                               configure_environment, load_environment)
from torchtitan_flux.data.rewards import ENV_REWARD_NAME, RewardFunc, environment_reward
from torchtitan_flux.data.tasks import Prompt
from torchtitan_flux.engine.base import EngineError, GenerationResult
from torchtitan_flux.errors import ConfigError, UserCodeError
from torchtitan_flux.rl.loss import group_advantages, grpo_loss, token_logprobs
from torchtitan_flux.rollout.episode import ChatFormat, EpisodeLimits
from torchtitan_flux.rollout.episode_groups import EpisodeGroups
from torchtitan_flux.rollout.groups import GroupState
from torchtitan_flux.rollout.pump import DEATH_NOTICE_S
from torchtitan_flux.rollout.rollouts import Rollouts

G, P = 2, 2


class Guess(MessageEnv):
    """Replies "again <n>" to each turn until the ``turns``-th, then done with ``env_rewards`` = {"len": length of
    the last turn's text}."""

    @dataclass(kw_only=True, slots=True)
    class Config(MessageEnv.Config):
        turns: int = 2
        fault: str = ""

    def __init__(self, config: Config, *, env_input: dict) -> None:
        self.config, self.record, self.n = config, env_input, 0

    async def init(self):
        return MessageEnvInitOutput(init_prompt_messages=[{"role": "user", "content": self.record["prompt"]}])

    async def step(self, completion_message):
        self.n += 1
        if self.config.fault == "raise":
            raise RuntimeError("the tool broke")
        if self.config.fault == "hang":
            time.sleep(30)
        if self.config.fault == "type":
            return {"done": True}
        if self.n >= self.config.turns:
            return MessageEnvStepOutput(done=True, env_rewards={"len": float(len(completion_message["content"]))})
        return MessageEnvStepOutput(env_messages=[{"role": "user", "content": f"again {self.n}"}])


class ScriptEngine(FakeEngineBase):
    """Answers every turn at once with the text ``reply(prompt_ids)`` then <|im_end|>, logprob -0.5 per token, on
    ``version``; records each request's prompt and generated ids. ``hold``: keeps requests (to die with them)."""

    def __init__(self, name, events, tok, hold=False, version=0):
        super().__init__(name, events)
        self.tok, self.hold, self.version = tok, hold, version
        self.requests, self.held = [], []
        self.generated: list[tuple[list[int], list[int]]] = []  # (prompt ids, generated ids) of each answered one

    def submit(self, req):
        self.requests.append(req)
        if self.hold:
            self.held.append(req)
            return
        prompt = req.prompt_ids[0]
        ids = self.tok.encode(f"answer {len(prompt) % 7} to {req.seed % 1000}", add_bos=False) + [IM_END]
        self.generated.append((prompt, ids))
        T = req.max_new_tokens
        tokens = torch.zeros(1, T, dtype=torch.int64)
        tokens[0, :len(ids)] = torch.tensor(ids)
        logprobs = torch.zeros(1, T)
        logprobs[0, :len(ids)] = -0.5
        self.events.put(GenerationResult(req.req_id, self.name, tokens, logprobs, torch.tensor([len(ids)]),
                                         self.version, self.version, 0.01))


class RecordTask:
    """Prompts ``q{step}_{i}``; its own rewards are never used with an environment."""

    chat = False
    reward_funcs: list = []

    def prompts(self, seed, step, n):
        return [Prompt(f"q{step}_{i}", columns={"answer": str(i)}, add_bos=False) for i in range(n)]


@pytest.fixture(scope="module")
def tok(chatml_dir):
    return HFTokenizer(chatml_dir)


def make(tok, monkeypatch, *, turns=2, fault="", streaming=False, timeout_s=10.0, engines=1, hold=(),
         reward_funcs=None, max_in_flight=0):
    monkeypatch.setitem(sys.modules, "_mt_envs", types.SimpleNamespace(Guess=Guess))
    env = configure_environment(load_environment("_mt_envs:Guess", "rollout.environment", timeout_s,
                                                 "rollout.environment_timeout_seconds"),
                                [f"turns={turns}", f'fault="{fault}"'], "rollout.environment_args")
    events: queue.Queue = queue.Queue()
    chat = ChatFormat.from_model_dir(str(tok.model_dir), tok)
    limits = EpisodeLimits(max_turns=4, max_new_tokens=32, max_total_tokens=256)
    task = RecordTask()
    task.reward_funcs = [*(reward_funcs or []), RewardFunc(ENV_REWARD_NAME, environment_reward)]
    eng = [ScriptEngine(f"e{k}", events, tok, hold=k in hold) for k in range(engines)]
    sched = Rollouts(eng, events, task, tok, group_size=G, prompts_per_step=P, max_new_tokens=32, temperature=1.0,
                     top_k=0, seed=0, pad_id=0, streaming=streaming,
                     episodes=lambda raw, sender: EpisodeGroups(env, chat, limits, raw, max_in_flight, sender))
    return sched, eng


@pytest.mark.parametrize("streaming", [False, True])
def test_an_episode_keeps_earlier_turns_tokens_and_only_the_models_tokens_are_in_the_loss(tok, monkeypatch,
                                                                                          streaming):
    """Mutations: re-rendering the conversation between turns (a later prompt would not extend the earlier one);
    the loss mask on every token after the prompt (env tokens in the loss); logprobs / versions left on env
    tokens; a request of several sequences or one seeded alike for every episode."""
    sched, (engine,) = make(tok, monkeypatch, turns=3, streaming=streaming)
    try:
        batch = sched.collect(1, 0)
    finally:
        sched.drain(0)
    assert batch.tokens.shape[0] == P * G
    reqs = engine.requests
    assert len(reqs) == P * G * 3 and all(len(r.prompt_ids) == 1 and r.group_size == 1 for r in reqs)
    assert len({r.seed for r in reqs}) == len(reqs)  # every turn of every episode seeded apart
    turns = engine.generated
    for i in range(P * G):
        row = batch.tokens[i].tolist()
        mine = [(p, g) for p, g in turns if row[:len(p) + len(g)] == p + g]
        assert len(mine) == 3  # its three turns: each prompt is the row's prefix, followed by the generated ids
        mine.sort(key=lambda t: len(t[0]))
        first_prompt, first_gen = mine[0]
        assert row[:len(first_prompt) + len(first_gen)] == first_prompt + first_gen  # turn 1, exactly
        for (p0, g0), (p1, _) in zip(mine, mine[1:]):
            assert p1[:len(p0) + len(g0)] == p0 + g0  # a later turn's prompt extends the earlier turn unchanged
        model = torch.zeros(len(row), dtype=torch.bool)
        for p, g in mine:
            model[len(p):len(p) + len(g)] = True
        mask, behaviour, versions = batch.loss_mask[i], batch.behaviour_logprobs[i], batch.token_versions[i]
        # position t predicts token t + 1: the mask is 1 exactly where the next token is the model's
        assert mask.bool().tolist() == model[1:].tolist()
        assert torch.all(behaviour[mask.bool()] == -0.5) and torch.all(behaviour[~mask.bool()] == 0)
        assert torch.all(versions[mask.bool()] == 0) and torch.all(versions[~mask.bool()] == -1)
    assert batch.num_completion_tokens == sum(len(g) for _, g in turns)
    assert [e["end"] for e in batch.episodes] == ["done"] * (P * G) and batch.episodes[0]["turns"] == 3
    if streaming:  # the generated length counts the model's tokens only
        assert sched.policy.generated["generated_completion_len_mean"] == batch.num_completion_tokens / (P * G)
    assert batch.episodes[0]["messages"][1] == {"role": "user", "content": "again 1"}


def test_environment_tokens_get_zero_gradient(tok, monkeypatch):
    """Mutation: a mask that keeps the environment's tokens (their logits would get gradient)."""
    sched, _ = make(tok, monkeypatch, turns=2)
    try:
        batch = sched.collect(1, 0)
    finally:
        sched.drain(0)
    rewards = batch.rewards + torch.arange(len(batch.rewards)) * 0.1  # nonzero advantages in every group
    adv, _ = group_advantages(rewards, G)
    B, L1 = batch.loss_mask.shape
    logits = torch.randn(B, L1, 64, requires_grad=True)
    targets = (batch.tokens[:, 1:] % 64)
    lp = token_logprobs(logits, targets)
    on_policy = torch.where(batch.loss_mask.bool(), lp.detach(), batch.behaviour_logprobs)  # ratio 1: no clipping
    loss, _ = grpo_loss(lp, on_policy, adv, batch.loss_mask)
    loss.backward()
    per_position = logits.grad.abs().sum(-1)
    env = (batch.loss_mask == 0)
    assert torch.all(per_position[env] == 0)
    assert torch.all(per_position[batch.loss_mask == 1] > 0)
    # there are environment tokens between model tokens (not only the prompt and the padding)
    first, last = batch.loss_mask[0].nonzero()[0].item(), batch.loss_mask[0].nonzero()[-1].item()
    assert (batch.loss_mask[0, first:last] == 0).any()


def test_the_environments_rewards_and_reward_functions_over_the_conversation_are_combined(tok, monkeypatch):
    """Mutations: env_rewards not summed into the total; reward functions given text instead of message lists;
    the weight not applied."""
    seen = {}

    def turns_reward(prompts, completions, completion_ids, env_rewards, episode_end, answer, **_):
        seen.update(prompts=prompts, completions=completions, env_rewards=env_rewards, end=episode_end, answer=answer)
        return [float(sum(m["role"] == "assistant" for m in c)) for c in completions]

    sched, _ = make(tok, monkeypatch, turns=2, reward_funcs=[RewardFunc("turns", turns_reward, 10.0)])
    try:
        batch = sched.collect(1, 0)
    finally:
        sched.drain(0)
    assert seen["prompts"][0] == [{"role": "user", "content": "q1_0"}]
    assert [m["role"] for m in seen["completions"][0]] == ["assistant", "user", "assistant"]
    assert seen["end"] == ["done"] * (P * G) and seen["answer"] == ["0", "0", "1", "1"]
    last_len = [float(len(c[-1]["content"])) for c in seen["completions"]]
    assert seen["env_rewards"][0] == [{}, {"len": last_len[0]}]
    assert batch.reward_values[ENV_REWARD_NAME] == last_len
    assert batch.rewards.tolist() == pytest.approx([20.0 + x for x in last_len])


@pytest.mark.parametrize("fault,fragment", [
    ("raise", "step() raised RuntimeError: the tool broke"),
    ("type", "step() returned {'done': True} (dict); expected MessageEnvStepOutput"),
    ("hang", "step() did not return within rollout.environment_timeout_seconds = 0.5 s"),
])
def test_a_failing_environment_stops_the_wait_in_one_line_naming_it(tok, monkeypatch, fault, fragment):
    """Mutations: the group's failure dropped (the wait would never end); raised from ``pump`` itself (a
    checkpoint's pumping would fail); the environment not named."""
    sched, _ = make(tok, monkeypatch, fault=fault, timeout_s=0.5)
    try:
        sched.dispatch(1, 0)
        deadline = time.monotonic() + 10
        while sched.episode_failure is None and time.monotonic() < deadline:
            sched.pump.pump(0.05)  # pumping (as a checkpoint's wait does) keeps the failure, raises nothing
        with pytest.raises(UserCodeError) as err:
            sched.collect(1, 0)
    finally:
        sched.drain(0)
    line = str(err.value)
    assert "\n" not in line and line.startswith("environment '_mt_envs:Guess': ") and fragment in line


def test_a_turn_on_an_engine_that_dies_is_redispatched(tok, monkeypatch):
    """Mutation: turn requests not in the re-dispatch (the episode would wait forever)."""
    sched, (dying, healthy) = make(tok, monkeypatch, engines=2, hold={0})
    try:
        sched.dispatch(1, 0)
        deadline = time.monotonic() + 10
        while not dying.held and time.monotonic() < deadline:
            sched.pump.pump(0.05)
        assert dying.held
        dying.is_alive = False
        dying.events.put(EngineError(dying.name, "killed", fatal=True))
        batch = sched.collect(1, 0)
    finally:
        sched.drain(0)
    assert sched.pump.redispatched >= 1 and batch.tokens.shape[0] == P * G
    assert {r.seed for r in dying.held} <= {r.seed for r in healthy.requests}  # the same turns, generated there


def test_episodes_run_their_turns_while_nobody_pumps_and_groups_wait_for_pump(tok, monkeypatch):
    """What goes on while a step trains (the main thread computes, nobody pumps): every turn of every episode is
    sent by the episodes' thread and answered through the router, with no ``pump``; the groups' ends and every other
    event wait, in order, for ``pump``. Mutations: turns' results routed to the main queue (the episodes would stall
    at their first turn), or groups finished by the router (a group scored while the trainer computes: the state
    check)."""
    sched, (engine,) = make(tok, monkeypatch, turns=3)
    try:
        engine.events.put(EngineError(engine.name, "a note", fatal=False))
        sched.dispatch(1, 0)
        deadline = time.monotonic() + 10
        while len(engine.requests) < P * G * 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(engine.requests) == P * G * 3  # three turns of each episode, with no pump
        deadline = time.monotonic() + 10
        def main():  # the main queue's events but the turns' speeds
            return [type(ev).__name__ for ev in list(sched.pump.events.queue) if type(ev).__name__ != "TurnTimed"]

        while len(main()) < 1 + P and time.monotonic() < deadline:
            time.sleep(0.01)  # the groups' ends reach the main queue (beside the turns' speeds)
        assert main() == ["EngineError"] + ["GroupEnded"] * P
        assert all(g.state is GroupState.RUNNING for g in sched.table.of_step(1))  # nothing finished without pump
        batch = sched.collect(1, 0)
    finally:
        sched.drain(0)
    assert batch.tokens.shape[0] == P * G and len(engine.requests) == P * G * 3  # nothing generated again


def test_a_turn_sent_while_no_engine_is_alive_is_parked_until_pump_sees_one(tok, monkeypatch):
    """The episodes' thread never waits for a restart: a turn with no engine alive is parked, and sent by ``pump``
    once one is. Mutation: no aliveness check (the turn would go to the dead engine and the episode wait forever)."""
    sched, (engine,) = make(tok, monkeypatch)
    try:
        engine.is_alive = False
        sched.dispatch(1, 0)
        deadline = time.monotonic() + 10
        while len(sched.pump._parked) < P * G and time.monotonic() < deadline:
            time.sleep(0.01)  # every episode's first turn, parked
        assert engine.requests == [] and len(sched.pump._parked) == P * G
        engine.is_alive = True  # a restart, as pump would see it
        t0 = time.monotonic()
        batch = sched.collect(1, 0)
        assert time.monotonic() - t0 < DEATH_NOTICE_S / 2
    finally:
        sched.drain(0)
    assert batch.tokens.shape[0] == P * G


def test_turns_waiting_for_an_engine_that_never_comes_back_end_the_wait(tok, monkeypatch):
    """No engine alive and none restarted: the parked turns end the wait with ``NoEngineLeft`` after
    ``DEATH_NOTICE_S``, as a dispatch would (the run checkpoints and stops), not a silent wait forever; and an
    engine's death that leaves none stops it at once. Mutation: parked turns never given up (the wait hangs)."""
    from torchtitan_flux.errors import NoEngineLeft
    from torchtitan_flux.rollout import pump

    monkeypatch.setattr(pump, "DEATH_NOTICE_S", 0.5)
    sched, (engine,) = make(tok, monkeypatch)
    try:
        engine.is_alive = False  # stopped answering, no death reported (nor a restart)
        sched.dispatch(1, 0)
        t0 = time.monotonic()
        with pytest.raises(NoEngineLeft, match="no rollout engine is alive"):
            sched.collect(1, 0)
        assert time.monotonic() - t0 < 5.0
    finally:
        sched.drain(0)
    sched, (engine,) = make(tok, monkeypatch)
    try:
        engine.is_alive = False
        engine.events.put(EngineError(engine.name, "killed", fatal=True))  # the last engine, not replaced
        with pytest.raises(NoEngineLeft, match="every rollout engine died"):
            sched.collect(1, 0)
    finally:
        sched.drain(0)


def test_episodes_in_flight_are_capped(tok, monkeypatch):
    """Mutation: the semaphore ignored (all four episodes would hold a turn at once)."""
    sched, (engine,) = make(tok, monkeypatch, hold={0}, max_in_flight=1)
    try:
        sched.dispatch(1, 0)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            sched.pump.pump(0.05)
        assert len(engine.held) == 1
    finally:
        sched.drain(0)


def test_environment_args_set_the_config_and_are_checked(monkeypatch):
    """Mutations: an unknown name or a value of the wrong type accepted silently."""
    monkeypatch.setitem(sys.modules, "_mt_envs", types.SimpleNamespace(Guess=Guess))
    env = load_environment("_mt_envs:Guess", "rollout.environment", 1.0, "rollout.environment_timeout_seconds")
    assert configure_environment(env, ["turns=5", "fault=hang"], "rollout.environment_args").config.turns == 5
    with pytest.raises(ConfigError, match=r"rollout.environment_args has 'steps=5'; allowed: 'name=value' with "
                                          r"name one of \['fault', 'turns'\]"):
        configure_environment(env, ["steps=5"], "rollout.environment_args")
    with pytest.raises(ConfigError, match=r"rollout.environment_args sets turns = 'many' \(str\); allowed: int"):
        configure_environment(env, ["turns=many"], "rollout.environment_args")


class Optionals(Guess):
    """A ``Config`` typed as torchtitan 0.3.0's configs are: ``X | None`` fields."""

    @dataclass(kw_only=True, slots=True)
    class Config(MessageEnv.Config):
        limit: int | None = None
        label: str | None = "x"
        scale: float | None = None


def test_environment_args_set_fields_typed_x_or_none(monkeypatch):
    """``X | None`` fields (``types.UnionType``) could not be set, with a message that allowed only what was refused
    (the fifth sweep). Mutations: a union's arms not tried (every value refused), or ``None`` accepted for a plain
    field."""
    monkeypatch.setitem(sys.modules, "_mt_envs", types.SimpleNamespace(Optionals=Optionals))
    env = load_environment("_mt_envs:Optionals", "rollout.environment", 1.0, "rollout.environment_timeout_seconds")
    config = configure_environment(env, ["limit=3", "label=null", "scale=2"], "rollout.environment_args").config
    assert (config.limit, config.label, config.scale) == (3, None, 2.0) and isinstance(config.scale, float)
    with pytest.raises(ConfigError, match=r"rollout.environment_args sets limit = 'many' \(str\); allowed: "
                                          r"int \| None \(the type of _mt_envs:Optionals's Config.limit\)"):
        configure_environment(env, ["limit=many"], "rollout.environment_args")
    with pytest.raises(ConfigError, match=r"sets limit = True \(bool\); allowed: int \| None"):
        configure_environment(env, ["limit=true"], "rollout.environment_args")
    monkeypatch.setitem(sys.modules, "_mt_envs", types.SimpleNamespace(Guess=Guess))
    guess = load_environment("_mt_envs:Guess", "rollout.environment", 1.0, "rollout.environment_timeout_seconds")
    with pytest.raises(ConfigError, match=r"sets turns = None \(NoneType\); allowed: int "):
        configure_environment(guess, ["turns=null"], "rollout.environment_args")


CALCULATOR = "examples.environments.calculator:CalculatorEnv"


@pytest.mark.parametrize("overrides,fragment", [
    (("--rollout.max_turns", "3"), "rollout.max_turns = 3 is out of range; allowed: 4 (the default) unless "
                                   "rollout.environment is set"),
    (("--rollout.environment", "examples.environments.calculator:Nope"), "rollout.environment"),
    (("--rollout.environment", CALCULATOR, "--rollout.environment_args", "digits=3"),
     "rollout.environment_args has 'digits=3'; allowed: 'name=value' with name one of"),
    (("--rollout.environment_reward_weight", "nan"), "rollout.environment_reward_weight = nan is out of range; "
                                                     "allowed: a finite number"),
    (("--rollout.environment", CALCULATOR), "renders conversations with the model's chat template: "
                                            "model.hf_assets_path = './assets/tiny-llama' has no chat_template (in "
                                            "tokenizer_config.json or chat_template.jinja); a 'messages' dataset or "
                                            "rollout.apply_chat_template = true needs one; for the tiny debug model "
                                            "use its chat variant, which scripts/setup.sh builds "
                                            "(--model.hf_assets_path ./assets/tiny-chat)"),
])
def test_multi_turn_config_errors_name_the_field(overrides, fragment):
    """Mutations: a multi-turn field read silently without an environment; an environment loaded unchecked; a
    model folder that cannot run episodes found only mid-run."""
    from conftest import DEBUG_TOML

    from torchtitan_flux.patches import apply_patches

    apply_patches()

    from torchtitan_flux.run.validation import validate_config
    from torchtitan_flux.run.config_file import load_config
    from torchtitan_flux.run.trainer import GRPOTrainer

    jc = load_config(["--job.config_file", str(DEBUG_TOML), *overrides], GRPOTrainer.Config())
    with pytest.raises(ConfigError) as err:
        validate_config(jc)
    assert fragment in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("streaming", [False, True])
def test_a_checkpoint_keeps_finished_groups_with_their_episodes(tok, monkeypatch, streaming):
    """Mutations: the episodes left out of the saved parts (a restored group could not be scored as a
    conversation), or the restored group's prompt taken from the record's text instead of its opening."""
    sched, _ = make(tok, monkeypatch, streaming=streaming)
    try:
        sched.dispatch(1, 0)
        deadline = time.monotonic() + 10
        while sched.table.in_state(GroupState.RUNNING) and time.monotonic() < deadline:
            sched.pump.pump(0.05)
        state = sched.state_dict(timeout=5.0)
        expected = sched.collect(1, 0)
    finally:
        sched.drain(0)
    resumed, (engine,) = make(tok, monkeypatch, streaming=streaming)
    try:
        resumed.load_state_dict(state)
        batch = resumed.collect(1, 0)
    finally:
        resumed.drain(0)
    assert engine.requests == []  # nothing generated again
    assert torch.equal(batch.tokens, expected.tokens) and torch.equal(batch.loss_mask, expected.loss_mask)
    assert batch.episodes == expected.episodes and batch.rewards.tolist() == expected.rewards.tolist()


def test_the_calculators_worked_examples_follow_its_protocol():
    """Mutations: an example whose calculator replies or answer are wrong (the model would learn them), or the
    examples placed after the question."""
    import asyncio

    from examples.environments.calculator import EXAMPLE_SEED, CalculatorEnv, calculate, problems

    record = problems(1, seed=5)[0]
    opening = asyncio.run(CalculatorEnv(CalculatorEnv.Config(examples=2), env_input=record).init())
    messages = opening.init_prompt_messages
    assert [m["role"] for m in messages[:2]] == ["system", "user"] and messages[-1]["content"] == record["question"]
    shots = messages[1:-1]
    assert len(shots) == 2 * 8
    for i, m in enumerate(shots):
        if m["role"] == "assistant" and m["content"].startswith("CALC: "):
            assert shots[i + 1] == {"role": "user", "content": calculate(m["content"][6:])}
    answers = [m["content"] for m in shots if m["content"].startswith("ANSWER: ")]
    assert answers == [f"ANSWER: {r['answer']}" for r in problems(2, seed=EXAMPLE_SEED)]
