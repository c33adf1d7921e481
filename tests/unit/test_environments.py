"""Environments in torchtitan 0.3.0's shape (``data/environments.py``) and the episode runner
(``rollout/episode.py``): loading by path, a raising / hanging / malformed environment as one line naming it,
tokens kept as generated across turns, the loss mask, the limits, and the two example environments."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import threading
import time
import types
from dataclasses import dataclass

import pytest
import tokenizers

from examples.environments import alphabet_sort, calculator
from fakes.chatml_tokenizer import IM_END  # <|im_end|>, the EOS, as in SmolLM2
from torchtitan_flux.data.environments import (MessageEnv, MessageEnvInitOutput, MessageEnvStepOutput, ParsedToolCall,
                                               ToolCallParseStatus, configure_environment, load_environment)
from torchtitan_flux.errors import ConfigError, UserCodeError
from torchtitan_flux.rollout.episode import ChatFormat, EpisodeEnd, EpisodeLimits, run_episode

FIELD, TIMEOUT_FIELD = "rollout.environment", "rollout.env_timeout_seconds"
QUESTION = {"question": "What is 23 * 47 + 18 * 9?", "answer": "1243"}


class HFTokenizer:
    """The model folder's tokenizer.json, with torchtitan's tokenizer's encode/decode signatures."""

    def __init__(self, model_dir):
        self.model_dir = model_dir
        self._tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def encode(self, text, add_bos=True, add_eos=False):
        assert not add_bos and not add_eos  # the template writes its own
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens=True):
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def tok(chatml_dir):
    return HFTokenizer(chatml_dir)


@pytest.fixture(scope="module")
def chat(tok, chatml_dir):
    return ChatFormat.from_model_dir(str(chatml_dir), tok)


def _load(spec, timeout_s=10.0):
    return load_environment(spec, FIELD, timeout_s, TIMEOUT_FIELD)


def _envs(monkeypatch, **classes):
    """``classes`` as the module ``_envs`` (``"_envs:Name"``)."""
    monkeypatch.setitem(sys.modules, "_envs", types.SimpleNamespace(**classes))


class Echo(MessageEnv):
    """Replies ``ok <n>`` to each turn; done after ``turns`` turns (never when None). Records what it was sent."""

    @dataclass(kw_only=True, slots=True)
    class Config(MessageEnv.Config):
        turns: int | None = None

    closed: list[str] = []

    def __init__(self, config: Config, *, env_input: dict) -> None:
        self.turns, self.record, self.seen = config.turns, env_input, []

    async def init(self):
        return MessageEnvInitOutput(init_prompt_messages=[{"role": "user", "content": self.record["question"]}])

    async def step(self, completion_message):
        self.seen.append(completion_message)
        n = len(self.seen)
        done = self.turns is not None and n >= self.turns
        return MessageEnvStepOutput(env_messages=[{"role": "user", "content": f"ok {n}"}], done=done,
                                    env_rewards={"turn": float(n)})

    async def close(self):
        Echo.closed.append(self.record["question"])


def _scripted(tok, texts, per_char=False, stop=True):
    """A ``generate`` writing ``texts`` in turn (each ending with <|im_end|>), recording its calls; turn k's tokens
    are of policy version k. ``per_char``: one token per character, a tokenization that re-tokenizing the text would
    change, and the versions as a list (one per token) instead of one int."""
    calls, script = [], iter(texts)

    async def generate(prompt, max_new_tokens):
        text = next(script)
        ids = [i for ch in text for i in tok.encode(ch, add_bos=False)] if per_char else tok.encode(text, add_bos=False)
        ids = (ids + [IM_END] if stop else ids)[:max_new_tokens]
        calls.append((list(prompt), max_new_tokens, ids))
        await asyncio.sleep(0)
        return ids, [-0.25 - 0.01 * k for k in range(len(ids))], [len(calls)] * len(ids) if per_char else len(calls)

    return generate, calls


def _episode(env, record, generate, chat, **limits):
    return asyncio.run(run_episode(env, record, generate, chat, EpisodeLimits(**limits)))


# ------------------------------------------------------------------------------------------------------ loading

def test_an_environment_loads_by_its_path_and_is_built_per_record_as_torchtitan_builds_it():
    env_class = _load("examples.environments.calculator:CalculatorEnv")
    assert env_class.cls is calculator.CalculatorEnv and isinstance(env_class.config, calculator.CalculatorEnv.Config)

    async def opening():
        env = await env_class.start(QUESTION)
        try:
            return await env.init()
        finally:
            await env.close()

    out = asyncio.run(opening())
    assert [m["role"] for m in out.init_prompt_messages] == ["system", "user"]
    assert out.init_prompt_messages[1]["content"] == QUESTION["question"] and out.tools == []
    # torchtitan's own way to build one: Config().build(env_input=...)
    built = alphabet_sort.AlphabetSortEnv.Config().build(env_input=alphabet_sort.records(1, seed=0)[0])
    assert isinstance(built, alphabet_sort.AlphabetSortEnv)


class _NoStep:
    @dataclass
    class Config:
        pass

    def __init__(self, config, *, env_input):
        pass

    async def init(self):
        pass


class _NoConfig:
    def __init__(self, config, *, env_input):
        pass

    async def init(self):
        pass

    async def step(self, message):
        pass


class _ConfigNeedsArgs(_NoConfig):
    @dataclass
    class Config:
        level: int


class _OldInit(_NoConfig):
    @dataclass
    class Config:
        pass

    def __init__(self, record):
        pass


class _Abstract(MessageEnv):
    async def init(self):
        pass


@pytest.mark.parametrize("spec, fragment", [
    ("_envs", "must be of the form 'package.module:attribute'"),
    ("_envs:Missing", "cannot be imported"),
    ("_envs:function", "is a function; allowed: a class with a nested dataclass Config"),
    ("_envs:NoStep", "has no step()"),
    ("_envs:Abstract", "leaves abstract: step; implement them"),
    ("_envs:NoConfig", "has no nested dataclass Config"),
    ("_envs:ConfigNeedsArgs", "its Config() raised TypeError"),
    ("_envs:OldInit", "its __init__ cannot take (config, *, env_input)"),
])
def test_a_class_not_in_torchtitans_shape_is_refused_naming_the_field(monkeypatch, spec, fragment):
    _envs(monkeypatch, function=lambda: None, NoStep=_NoStep, Abstract=_Abstract, NoConfig=_NoConfig,
          ConfigNeedsArgs=_ConfigNeedsArgs, OldInit=_OldInit)
    with pytest.raises(ConfigError) as e:
        _load(spec)
    assert str(e.value).startswith(f"{FIELD} = {spec!r}") and fragment in str(e.value), str(e.value)


# ------------------------------------------------------------------------------------------- user code failing

class _Faulty(Echo):
    """Echo whose ``init``/``step``/constructor misbehave as the record's ``fault`` says."""

    release = threading.Event()

    def __init__(self, config, *, env_input):
        if env_input["fault"] == "raise in __init__":
            raise KeyError("question")
        super().__init__(config, env_input=env_input)

    async def init(self):
        fault = self.record["fault"]
        if fault == "init returns a dict":
            return {"init_prompt_messages": [{"role": "user", "content": "hi"}]}
        if fault == "init returns no messages":
            return MessageEnvInitOutput(init_prompt_messages=[])
        if fault == "a tool without a name":
            return MessageEnvInitOutput(init_prompt_messages=[{"role": "user", "content": "hi"}], tools=[{}])
        if fault == "content parts":
            return MessageEnvInitOutput(init_prompt_messages=[{"role": "user", "content": [{"type": "text"}]}])
        return MessageEnvInitOutput(init_prompt_messages=[{"role": "user", "content": "hi"}])

    async def step(self, completion_message):
        fault = self.record["fault"]
        if fault == "raise in step":
            return 1 / 0
        if fault == "sys.exit in step":
            sys.exit(3)
        if fault == "hang (await)":
            await asyncio.sleep(3600)
        if fault == "hang (blocking the loop)":
            _Faulty.release.wait()
        if fault == "step returns a tuple":
            return [], True, {}
        if fault == "env_messages holds an int":
            return MessageEnvStepOutput(env_messages=[{"role": "user", "content": "a"}, 42])
        if fault == "an assistant reply":
            return MessageEnvStepOutput(env_messages=[{"role": "assistant", "content": "me"}])
        if fault == "done is a str":
            return MessageEnvStepOutput(done="yes")
        if fault == "a nan reward":
            return MessageEnvStepOutput(done=True, env_rewards={"score": float("nan")})
        return MessageEnvStepOutput(done=True)


@pytest.mark.parametrize("fault, message", [
    ("raise in __init__", "__init__ raised KeyError: 'question'"),
    ("raise in step", "step() raised ZeroDivisionError: division by zero"),
    ("sys.exit in step", "step() raised SystemExit: 3"),
    ("init returns a dict", "init() returned {'init_prompt_messages': [{'role': 'user', 'content': 'hi'}]} (dict); "
                            "expected MessageEnvInitOutput(init_prompt_messages=[...], tools=[...]) from "
                            "torchtitan_flux.data.environments"),
    ("init returns no messages", "init() returned init_prompt_messages = [] (list); expected init_prompt_messages, "
                                 "a non-empty list of messages"),
    ("a tool without a name", "init() returned tools[0] = {} (dict); expected a ToolSpec dict"),
    ("content parts", "init() returned init_prompt_messages[0] = {'role': 'user', 'content': [{'type': 'text'}]} "
                      "(dict); expected a message dict {'role': str, 'content': str} (text only)"),
    ("step returns a tuple", "step() returned ([], True, {}) (tuple); expected MessageEnvStepOutput("),
    ("env_messages holds an int", "step() returned env_messages[1] = 42 (int); expected a message dict"),
    ("an assistant reply", "step() raised ValueError: MessageEnvStepOutput.env_messages may not contain assistant "
                           "messages"),
    ("done is a str", "step() returned done = 'yes' (str); expected done, a bool"),
    ("a nan reward", "step() returned env_rewards has {'score': nan} (dict); expected env_rewards of str keys and "
                     "finite numbers"),
])
def test_an_environment_that_raises_or_returns_the_wrong_type_is_one_line_naming_it(monkeypatch, tok, chat, fault,
                                                                                      message):
    _envs(monkeypatch, Faulty=_Faulty)
    Echo.closed.clear()
    generate, _ = _scripted(tok, ["hello"])
    with pytest.raises(UserCodeError) as e:
        _episode(_load("_envs:Faulty"), {"question": fault, "fault": fault}, generate, chat)
    text = str(e.value)
    assert text.startswith(f"environment '_envs:Faulty': {message}") and "\n" not in text, text
    # close() ran whenever the instance was built
    assert Echo.closed == ([] if fault == "raise in __init__" else [fault])


@pytest.mark.parametrize("fault", ["hang (await)", "hang (blocking the loop)"])
def test_a_hanging_environment_is_one_line_naming_it_at_its_deadline(monkeypatch, tok, chat, fault):
    _envs(monkeypatch, Faulty=_Faulty)
    monkeypatch.setattr(_Faulty, "release", threading.Event())
    generate, _ = _scripted(tok, ["hello"])
    t0 = time.monotonic()
    try:
        with pytest.raises(UserCodeError) as e:
            _episode(_load("_envs:Faulty", timeout_s=0.3), {"question": fault, "fault": fault}, generate, chat)
    finally:
        _Faulty.release.set()  # the blocked thread (left behind by the runner) may end now
    assert str(e.value) == (f"environment '_envs:Faulty': step() did not return within {TIMEOUT_FIELD} = 0.3 s; "
                            "the run stops (its thread cannot be stopped)")
    assert time.monotonic() - t0 < 5


# ---------------------------------------------------------------------------------------------- the episodes

def test_earlier_turns_tokens_stay_as_generated_and_only_the_models_tokens_are_in_the_loss(monkeypatch, tok, chat):
    """Turns generated one token per character (re-tokenizing them would merge tokens): every later prompt, and
    the final ids, start with exactly the earlier prompt + generated ids; the mask is 1 on those ids only."""
    _envs(monkeypatch, Echo=Echo)
    texts = ["CALC: 23*47", "CALC: 18*9", "ANSWER: 1243"]
    generate, calls = _scripted(tok, texts, per_char=True)
    env = dataclasses.replace(_load("_envs:Echo"), config=Echo.Config(turns=3))
    ep = _episode(env, QUESTION, generate, chat)

    assert (ep.end, ep.turns, ep.truncated) == (EpisodeEnd.DONE, 3, False)
    assert [m["content"] for m in ep.messages if m["role"] == "assistant"] == texts  # parsed: the stop token dropped
    first_prompt, _, first_ids = calls[0]
    assert first_prompt == chat.opening([{"role": "user", "content": QUESTION["question"]}], [])
    assert ep.token_ids[:len(first_prompt) + len(first_ids)] == first_prompt + first_ids
    for (prompt, _, ids), (next_prompt, _, _) in zip(calls, calls[1:]):
        assert next_prompt[:len(prompt) + len(ids)] == prompt + ids
    assert calls[0][2] != tok.encode(texts[0], add_bos=False) + [IM_END]  # the test's premise: not canonical

    generated = [i for k, (prompt, _, ids) in enumerate(calls) for i in range(len(prompt), len(prompt) + len(ids))]
    assert [k for k, m in enumerate(ep.loss_mask) if m] == generated
    assert [ep.token_ids[k] for k in generated] == [t for _, _, ids in calls for t in ids]
    assert [ep.logprobs[k] for k in generated] == [-0.25 - 0.01 * j for _, _, ids in calls for j in range(len(ids))]
    assert all(ep.logprobs[k] == 0.0 and ep.versions[k] == -1 for k, m in enumerate(ep.loss_mask) if not m)
    assert [ep.versions[k] for k in generated] == [turn for turn, (_, _, ids) in enumerate(calls, 1) for _ in ids]

    # what the template writes between the turns is exactly its rendering of the conversation
    rendered = chat.template.render(ep.messages[:-2], add_generation_prompt=True)  # up to the last turn
    assert tok.decode(ep.token_ids, skip_special_tokens=False) == rendered + texts[-1] + "<|im_end|>"
    assert ep.env_rewards == [{"turn": 1.0}, {"turn": 2.0}, {"turn": 3.0}]
    assert ep.messages[-1] == {"role": "user", "content": "ok 3"}  # the final reply: in the messages, not the tokens


def test_the_limits_end_the_episode_with_their_reason(monkeypatch, tok, chat):
    _envs(monkeypatch, Echo=Echo)
    env = _load("_envs:Echo")  # never done

    # max_turns: the environment is stepped on the last turn, then the episode ends
    generate, calls = _scripted(tok, ["one", "two", "three"])
    ep = _episode(env, QUESTION, generate, chat, max_turns=2)
    assert (ep.end, ep.turns, len(calls), len(ep.env_rewards), ep.truncated) == (EpisodeEnd.MAX_TURNS, 2, 2, 2, True)
    assert ep.token_ids[-1] == IM_END and ep.loss_mask[-1] == 1  # no reply tokens after the last turn
    assert sorted({v for v, m in zip(ep.versions, ep.loss_mask) if m}) == [1, 2]  # one version per turn

    # max_new_tokens: a turn cut at its budget keeps its tokens; the environment is not stepped on it
    generate, calls = _scripted(tok, ["short", "a much longer answer than four tokens"])
    ep = _episode(env, QUESTION, generate, chat, max_new_tokens=4)
    assert (ep.end, ep.turns, len(ep.env_rewards)) == (EpisodeEnd.MAX_TOKENS, 2, 1)
    assert [len(ids) for _, _, ids in calls] == [len(tok.encode("short", add_bos=False)) + 1, 4]
    assert ep.loss_mask[-4:] == [1] * 4
    assert ep.token_ids[-4:] == calls[-1][2] and IM_END not in calls[-1][2]
    assert ep.messages[-1]["role"] == "assistant"  # the cut turn, parsed

    # max_total_tokens: each budget is what is left; a reply that leaves no room ends the episode
    prompt_len = len(chat.opening([{"role": "user", "content": QUESTION["question"]}], []))
    generate, calls = _scripted(tok, ["hi"] * 10)
    ep = _episode(env, QUESTION, generate, chat, max_new_tokens=100, max_total_tokens=prompt_len + 40)
    assert ep.end is EpisodeEnd.MAX_TOKENS and len(ep.token_ids) <= prompt_len + 40
    assert calls[0][1] == 40 and all(b == prompt_len + 40 - len(p) for p, b, _ in calls)
    assert ep.token_ids[-1] == IM_END  # ended before a reply that would not fit
    assert len(ep.env_rewards) == ep.turns  # that reply's step ran: its rewards and messages are kept

    # a cap the opening prompt alone reaches: no turn
    generate, calls = _scripted(tok, ["hi"])
    ep = _episode(env, QUESTION, generate, chat, max_total_tokens=prompt_len)
    assert (ep.end, ep.turns, calls, sum(ep.loss_mask)) == (EpisodeEnd.MAX_TOKENS, 0, [], 0)


HERMES = ("{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
          "<|im_end|>\n{% endif %}{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
          "{{ m.content }}\n</tool_response><|im_end|>\n{% elif m.role == 'assistant' %}<|im_start|>assistant\n"
          "{{ m.content }}{% for tc in m.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ tc.function.name }}\", "
          "\"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% else %}"
          "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{%- endfor %}"
          "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class _Search(Echo):
    """A torchtitan-style tool env: answers each ``search`` call with a tool message, done without calls."""

    async def init(self):
        tool = {"name": "search", "description": "look up", "parameters": {"type": "object"}}
        return MessageEnvInitOutput(init_prompt_messages=[{"role": "user", "content": "Who wrote Hamlet?"}],
                                    tools=[tool])

    async def step(self, completion_message):
        self.seen.append(completion_message)
        calls = completion_message.get("tool_calls") or []
        if not calls:
            return MessageEnvStepOutput(done=True, env_rewards={"calls": float(len(self.seen) - 1)})
        return MessageEnvStepOutput(env_messages=[{"role": "tool", "content": f"results for {tc.arguments['q']}"}
                                                  for tc in calls if tc.status == "ok"])


def test_tool_calls_are_parsed_in_the_hermes_format_and_answered(monkeypatch, tmp_path, tok):
    model = tmp_path / "qwenish"
    model.mkdir()
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": HERMES}))
    (model / "config.json").write_text(json.dumps({"eos_token_id": IM_END}))
    hermes = ChatFormat.from_model_dir(str(model), tok)
    assert hermes.tool_calls
    call = '<tool_call>\n{"name": "search", "arguments": {"q": "Hamlet author"}}\n</tool_call>'
    _envs(monkeypatch, Search=_Search)
    generate, calls = _scripted(tok, ["Let me look. " + call, "Shakespeare."])
    ep = _episode(_load("_envs:Search"), QUESTION, generate, hermes)

    assert (ep.end, ep.turns, ep.env_rewards) == (EpisodeEnd.DONE, 2, [{}, {"calls": 1.0}])
    first = ep.messages[1]
    assert first["content"] == "Let me look." and first["tool_calls"] == [
        ParsedToolCall(raw=call, name="search", arguments={"q": "Hamlet author"})]
    assert ep.messages[2] == {"role": "tool", "content": "results for Hamlet author"}
    assert '<tools>{"type": "function", "function": {"name": "search"' in tok.decode(calls[0][0], False)
    reply = tok.decode(calls[1][0][len(calls[0][0]) + len(calls[0][2]):], False)
    assert reply == "\n<|im_start|>user\n<tool_response>\nresults for Hamlet author\n</tool_response><|im_end|>\n" \
                    "<|im_start|>assistant\n"
    assert [c.status for c in hermes.parse(tok.encode('<tool_call>{"q": 1}</tool_call> <tool_call>nope</tool_call>'
                                                      ' <tool_call>{"name": "x"', add_bos=False))["tool_calls"]] == [
        ToolCallParseStatus.MISSING_NAME, ToolCallParseStatus.INVALID_JSON, ToolCallParseStatus.UNCLOSED_BLOCK]


def test_a_template_that_rewrites_the_conversation_is_refused_in_one_line(monkeypatch, tmp_path, tok):
    model = tmp_path / "rewrites"
    model.mkdir()
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}{% if loop.last %} (latest){% endif %}\n{{ m.content }}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    _envs(monkeypatch, Echo=Echo)
    generate, _ = _scripted(tok, ["one", "two"])
    with pytest.raises(ValueError) as e:
        _episode(_load("_envs:Echo"), QUESTION, generate, ChatFormat.from_model_dir(str(model), tok))
    assert str(e.value).startswith(f"the chat template of {model} renders the conversation differently once the "
                                   "environment's reply is appended") and "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------ the example envs

def test_the_calculator_computes_and_rewards_only_the_right_final_answer(tok, chat):
    assert calculator.calculate("12*37") == "= 444"
    assert calculator.calculate("(1081 + 162) * 2 =") == "= 2486"
    assert calculator.calculate("7/2") == "= 3.5" and calculator.calculate("-3 - -4") == "= 1"
    assert calculator.calculate("1/0") == "= error: division by zero"
    assert calculator.calculate("__import__('os').system('true')") == "= error: only integers, + - * / and parentheses"
    assert calculator.calculate("99999999999*99999999999*99999999999") == "= error: a number beyond 30 digits"
    assert calculator.calculate("12 times 3") == "= error: not an expression"
    for record in calculator.problems(20, seed=1):
        a, b, op, c, d = record["question"].removeprefix("What is ").removesuffix("?").replace("*", "").split()
        assert int(record["answer"]) == int(a) * int(b) + (1 if op == "+" else -1) * int(c) * int(d)

    env = _load("examples.environments.calculator:CalculatorEnv")
    for texts, end, reward in [
        (["I'll compute. CALC: 23*47", "CALC: 18 * 9", "CALC: 1081+162", "ANSWER: 1,243."], EpisodeEnd.DONE, 1.0),
        (["ANSWER: 1242"], EpisodeEnd.DONE, 0.0),  # wrong
        (["It is about 1200."], EpisodeEnd.DONE, 0.0),  # neither a call nor an answer
        (["CALC: 1+1"] * 4, EpisodeEnd.MAX_TURNS, None),
    ]:
        generate, calls = _scripted(tok, texts)
        ep = _episode(env, QUESTION, generate, chat, max_turns=4)
        assert ep.end is end and ep.env_rewards[-1].get("correct") == reward, (texts, ep)
    assert [m["content"] for m in ep.messages if m["role"] == "user"][1:] == ["= 2"] * 4


def test_the_alphabet_sort_port_asks_turn_by_turn_and_scores_like_torchtitan():
    rows = alphabet_sort.records(50, seed=3)
    assert json.loads(json.dumps(rows)) == rows  # dataset rows
    record = next(r for r in rows if len(r["new_names_per_turn"]) == 3)
    sample = alphabet_sort.AlphabetSortSample.from_record(record)
    names = [n for turn in sample.new_names_per_turn for n in turn]
    key = {a.display: (a.first, a.last) if sample.sort_by_first_name else (a.last, a.first)
           for a in alphabet_sort.AUTHORS}
    assert [n.removesuffix(" // new name!") for n in sample.expected_names[-1]] == sorted(names, key=key.get)

    async def run():
        env = alphabet_sort.AlphabetSortEnv.Config().build(env_input=record)
        opening = await env.init()
        steps = [await env.step({"role": "assistant", "content": "x"}) for _ in range(3)]
        return opening, steps

    opening, steps = asyncio.run(run())
    assert ", ".join(sample.new_names_per_turn[0]) in opening.init_prompt_messages[0]["content"]
    assert [s.done for s in steps] == [False, False, True]
    assert "<combined_alphabetical_sorted>" in steps[0].env_messages[0]["content"]
    assert "Follow the same format as before." in steps[1].env_messages[0]["content"]

    def answer(turn, names):
        tag = "alphabetical_sorted" if turn == 0 else "combined_alphabetical_sorted"
        return {"role": "assistant", "content": f"<{tag}>\n" + "\n".join(names) + f"\n</{tag}>"}

    perfect = [answer(t, names) for t, names in enumerate(sample.expected_names)]
    swapped = [answer(t, names[::-1]) for t, names in enumerate(sample.expected_names)]
    reward = alphabet_sort.alphabet_sort_reward([perfect, swapped, perfect[:1], []], [sample.expected_names] * 4)
    assert reward[0] == 1.0 and reward[1] < 1.0 and reward[3] == 0.0
    assert reward[2] == pytest.approx(1 / 3)  # an episode that ended early: one of three turns
    assert alphabet_sort.score_sorted_list("no block", expected_names=["A"], xml_tag="alphabetical_sorted",
                                           similarity_power=4) == 0.0
    assert alphabet_sort.records(5, seed=3) == rows[:5]


class _Flood(Echo):
    """Replies with ``Config.reply_chars`` characters (a tool that dumps a whole file)."""

    @dataclass(kw_only=True, slots=True)
    class Config(MessageEnv.Config):
        reply_chars: int = 2_000_000

    def __init__(self, config: Config, *, env_input: dict) -> None:
        super().__init__(Echo.Config(), env_input=env_input)
        self.reply_chars = config.reply_chars

    async def step(self, completion_message):
        return MessageEnvStepOutput(env_messages=[{"role": "user", "content": "word " * (self.reply_chars // 5)}])


def test_a_reply_of_megabytes_ends_the_episode_without_being_rendered_whole(monkeypatch, tok, chatml_dir):
    """The fifth sweep's item 6: a 2 MB reply was rendered and tokenized in full before the length check (a step
    ~100x slower). Mutation: the length known only from the whole reply's tokens."""
    longest = [0]

    class Recording(HFTokenizer):
        def encode(self, text, add_bos=True, add_eos=False):
            longest[0] = max(longest[0], len(text))
            return super().encode(text, add_bos, add_eos)

    chat = ChatFormat.from_model_dir(str(chatml_dir), Recording(chatml_dir))
    _envs(monkeypatch, Flood=_Flood)
    generate, calls = _scripted(tok, ["hi", "again"])
    ep = _episode(_load("_envs:Flood"), QUESTION, generate, chat, max_total_tokens=400)
    assert (ep.end, ep.turns, len(ep.messages[-1]["content"])) == (EpisodeEnd.MAX_TOKENS, 1, 2_000_000)
    assert longest[0] < 10_000, longest[0]
    generate, calls = _scripted(tok, ["hi", "again"])  # a reply that fits is still appended as rendered
    short = configure_environment(_load("_envs:Flood"), ["reply_chars=50"], FIELD)
    ep = _episode(short, QUESTION, generate, chat, max_total_tokens=400, max_turns=2)
    assert ep.turns == 2 and "word word" in chat.tokenizer.decode(ep.token_ids)


class _Unpicklable(Echo):
    async def step(self, completion_message):
        return MessageEnvStepOutput(env_messages=[{"role": "user", "content": "ok", "handle": threading.Lock()}])


def test_a_message_value_a_checkpoint_cannot_keep_is_one_line_naming_the_environment_and_key(monkeypatch, tok,
                                                                                              chat):
    """The fifth sweep's item 3: an extra key that cannot be pickled crashed the checkpoint save and left a torn
    step folder. Mutation: messages checked for their role and content only."""
    _envs(monkeypatch, Unpicklable=_Unpicklable)
    generate, _ = _scripted(tok, ["hi"])
    with pytest.raises(UserCodeError) as err:
        _episode(_load("_envs:Unpicklable"), QUESTION, generate, chat)
    assert str(err.value).startswith("environment '_envs:Unpicklable': step() returned env_messages[0]['handle'] = "
                                     "<unlocked _thread.lock object at ")
    assert str(err.value).endswith("(lock); expected message values a checkpoint can keep (plain data: str, "
                                   "numbers, lists, dicts)")


class _NeedsPrompt(Echo):
    def __init__(self, config: Echo.Config, *, env_input: dict) -> None:
        self.prompt = env_input["prompt"]  # the record has no such column


class _FailsDeep(Echo):
    async def step(self, completion_message):
        return json.loads("{not json")  # raised inside the standard library, called from this file


def test_user_code_errors_end_with_the_users_frame_and_a_keyerror_lists_the_records_keys(monkeypatch, tok, chat):
    """Mutations: the frame left out, or the innermost frame taken (json's, not the user's); a KeyError without the
    record's keys."""
    _envs(monkeypatch, NeedsPrompt=_NeedsPrompt, FailsDeep=_FailsDeep)
    generate, _ = _scripted(tok, ["hi"])
    with pytest.raises(UserCodeError) as err:
        _episode(_load("_envs:NeedsPrompt"), QUESTION, generate, chat)
    line = _NeedsPrompt.__init__.__code__.co_firstlineno + 1
    assert str(err.value) == ("environment '_envs:NeedsPrompt': __init__ raised KeyError: 'prompt'; the record's keys: "
                              f"['answer', 'question'] (test_environments.py:{line})")
    generate, _ = _scripted(tok, ["hi"])
    with pytest.raises(UserCodeError) as err:
        _episode(_load("_envs:FailsDeep"), QUESTION, generate, chat)
    line = _FailsDeep.step.__code__.co_firstlineno + 1
    assert str(err.value).startswith("environment '_envs:FailsDeep': step() raised JSONDecodeError: ")
    assert str(err.value).endswith(f" (test_environments.py:{line})")


class _UndecoratedConfig(MessageEnv):
    class Config(MessageEnv.Config):  # inherits MessageEnv.Config's dataclass-ness, not a dataclass of its own
        turns: int = 2

    async def init(self):
        return MessageEnvInitOutput(init_prompt_messages=[{"role": "user", "content": "hi"}])

    async def step(self, completion_message):
        return MessageEnvStepOutput(done=True)


def test_an_environment_config_that_is_not_a_dataclass_is_refused_in_one_line(monkeypatch):
    """Mutation: only dataclasses.is_dataclass checked (true for a subclass of one): environment_args then said the
    class has no Config fields."""
    _envs(monkeypatch, Undecorated=_UndecoratedConfig)
    with pytest.raises(ConfigError) as err:
        _load("_envs:Undecorated")
    assert str(err.value) == ("rollout.environment = '_envs:Undecorated': its Config is not a dataclass (it only "
                              "inherits from one), so its fields ['turns'] cannot be set; allowed: decorate it with "
                              "@dataclass(kw_only=True, slots=True)")


class _OddValues(Echo):
    """``Config.kind``: "numpy" and "tensor" rewards (accepted, as reward functions' are), "surrogate" text."""

    @dataclass(kw_only=True, slots=True)
    class Config(MessageEnv.Config):
        kind: str = "numpy"

    def __init__(self, config: Config, *, env_input: dict) -> None:
        super().__init__(Echo.Config(), env_input=env_input)
        self.kind = config.kind

    async def step(self, completion_message):
        import numpy as np
        import torch

        if self.kind == "surrogate":
            return MessageEnvStepOutput(env_messages=[{"role": "user", "content": "bad \udcff byte"}])
        value = np.float32(0.5) if self.kind == "numpy" else torch.tensor(0.25)
        return MessageEnvStepOutput(done=True, env_rewards={"r": value, "n": np.int64(2)})


def test_numpy_and_tensor_rewards_are_taken_and_unencodable_text_is_one_line_naming_the_call(monkeypatch, tok, chat):
    """The fifth sweep's item 8: env_rewards refused the 0-d tensors and numpy scalars reward functions accept; text
    with a lone surrogate failed in the tokenizer, naming neither the method nor the message. Mutations: the
    scalars refused or kept as they are (not floats); the text let through."""
    _envs(monkeypatch, Odd=_OddValues)
    for kind, want in (("numpy", 0.5), ("tensor", 0.25)):
        generate, _ = _scripted(tok, ["hi"])
        env = configure_environment(_load("_envs:Odd"), [f"kind={kind}"], FIELD)
        ep = _episode(env, QUESTION, generate, chat)
        assert ep.env_rewards == [{"r": want, "n": 2.0}] and all(type(v) is float for v in ep.env_rewards[0].values())
    generate, _ = _scripted(tok, ["hi"])
    with pytest.raises(UserCodeError) as err:
        _episode(configure_environment(_load("_envs:Odd"), ["kind=surrogate"], FIELD), QUESTION, generate, chat)
    assert str(err.value) == ("environment '_envs:Odd': step() returned env_messages[0]['content'] has 'bad \\udcff "
                              "byte' (str); expected text that encodes as UTF-8 (the tokenizer's input); character 4 "
                              "is '\\udcff'")
