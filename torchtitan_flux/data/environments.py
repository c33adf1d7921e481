"""Environments for multi-turn episodes, in torchtitan 0.3.0's shape (``torchtitan.experiments.rl.environment``;
docs/environments.md).

A user's environment is a class named ``"package.module:Class"``, built once per episode from a dataset record:
``Class(Class.Config(), env_input=record)``, which is what torchtitan's ``Class.Config().build(env_input=record)``
does. It has ``async init() -> MessageEnvInitOutput`` (the opening messages and tool specs), ``async step(message)
-> MessageEnvStepOutput`` (the environment's reply messages, ``done``, ``env_rewards``) and optionally ``close()``;
plain (non-async) methods are accepted too. An environment written for torchtitan runs here once its imports read
``from torchtitan_flux.data.environments import MessageEnv, MessageEnvInitOutput, MessageEnvStepOutput`` (and
``Message``, ``ToolSpec``, ``ParsedToolCall`` instead of ``renderers``'). ``Message`` and ``ToolSpec`` have the
``renderers`` package's shapes (TypedDicts: plain dicts at run time); we do not depend on ``renderers``.

Environment code is user code: the class is checked when it is loaded (``ConfigError`` naming the field), and
each call (the constructor, ``init``, ``step``, ``close``) runs under a deadline and is checked: what it raises,
running past the deadline, or returning the wrong type is one ``UserCodeError`` line naming the environment, the
method and what was expected.

Concurrency: each episode's environment instance lives on a thread of its own running its own event loop
(``RunningEnvironment``), so an environment that blocks (``time.sleep`` in an ``async def``, CPU work) stalls only
itself; the caller awaits its calls from any event loop. Calls to one instance are made one at a time. A call that
misses its deadline is cancelled in the environment's loop; a thread cannot be killed, so an environment blocking
its loop stays behind (a daemon thread) and the run stops.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import inspect
import json
import math
import pickle
import threading
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, ClassVar, TypedDict

from typing_extensions import Required  # typing's from Python 3.11 (typing_extensions: torch's dependency)

from torchtitan_flux.errors import ConfigError, UserCodeError
from torchtitan_flux.user_code import describe_exception, import_spec


class ToolSpec(TypedDict):
    """A tool the assistant may call (OpenAI function-calling format), as ``renderers.ToolSpec``."""

    name: str
    description: str
    parameters: dict[str, Any]


class Message(TypedDict, total=False):
    """One message of a conversation, as ``renderers.Message`` (``role`` and ``content`` required). Episodes are
    text-only: ``content`` must be a str. The assistant messages an environment gets carry ``tool_calls`` (a list of
    ``ParsedToolCall``) when the model's chat format has tool calls and the turn made some."""

    role: Required[str]
    content: Required[Any]
    tool_calls: list[Any]
    tool_call_id: str
    name: str
    reasoning: str
    reasoning_content: str


class ToolCallParseStatus(str, Enum):
    """How a tool-call block parsed (the values of ``renderers.ToolCallParseStatus`` that our parser produces)."""

    OK = "ok"
    INVALID_JSON = "invalid_json"  # the block's body is not JSON
    UNCLOSED_BLOCK = "unclosed_block"  # the turn ended inside the block
    MISSING_NAME = "missing_name"  # JSON without a string "name"


@dataclass
class ParsedToolCall:
    """One tool-call block of an assistant turn, as ``renderers.ParsedToolCall`` (torchtitan 0.3.0 hands these to
    ``step`` in ``message["tool_calls"]``: environments read ``.name`` and ``.arguments``). ``token_span`` and
    ``id`` are always None here (a text parser; the Hermes format carries no call id)."""

    raw: str
    name: str | None = None
    arguments: dict[str, Any] | str | None = None
    token_span: tuple[int, int] | None = None
    status: ToolCallParseStatus = ToolCallParseStatus.OK
    id: str | None = None


@dataclass(kw_only=True, slots=True)
class MessageEnvInitOutput:
    """Initial messages + tool specs from ``MessageEnv.init`` (torchtitan 0.3.0's fields)."""

    init_prompt_messages: list[Message]
    """The opening messages (e.g. [system, user]); may include few-shot assistant turns."""

    tools: list[ToolSpec] = field(default_factory=list)
    """Tool schemas exposed to the assistant. Empty for tool-less envs."""


@dataclass(kw_only=True, slots=True)
class MessageEnvStepOutput:
    """The env's reply to the assistant's turn (torchtitan 0.3.0's fields)."""

    env_messages: list[Message] = field(default_factory=list)
    """The env's reply messages (tool / user). Empty when the episode ends with no follow-up."""

    done: bool = False
    """``True`` ends the episode."""

    env_rewards: dict[str, float] = field(default_factory=dict)
    """Optional reward signals for this step; how they are used is the reward side's choice. Empty if none."""

    def __post_init__(self) -> None:
        if any(isinstance(m, Mapping) and m.get("role") == "assistant" for m in self.env_messages):
            raise ValueError("MessageEnvStepOutput.env_messages may not contain assistant messages")


class MessageEnv(abc.ABC):
    """Base of a user's environment, as torchtitan 0.3.0's ``MessageEnv`` (subclassing it is optional: any class
    with ``Config``, ``__init__(config, *, env_input)``, ``init`` and ``step`` loads). A subclass defines a nested
    ``@dataclass(kw_only=True, slots=True) class Config(MessageEnv.Config)`` of static parameters; ``build(**kwargs)``
    on it constructs the subclass, as torchtitan's ``Configurable`` does."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Static env params; the per-episode record is passed to ``build(env_input=...)``."""

        _owner: ClassVar[type | None] = None

        def build(self, **kwargs: Any) -> Any:
            """The owning class built on a copy of this config: ``Owner(config=copy, **kwargs)``."""
            if self._owner is None:
                raise NotImplementedError(f"{type(self).__qualname__} has no owner class; define Config inside a "
                                          "MessageEnv subclass")
            return self._owner(config=dataclasses.replace(self), **kwargs)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        config = cls.__dict__.get("Config")
        if isinstance(config, type) and issubclass(config, MessageEnv.Config):
            config._owner = cls

    @abc.abstractmethod
    async def init(self) -> MessageEnvInitOutput:
        """The opening conversation and tools."""

    @abc.abstractmethod
    async def step(self, completion_message: Message) -> MessageEnvStepOutput:
        """The environment's reply to the assistant's turn ``completion_message``."""

    async def close(self) -> None:
        """Release env-owned resources. Default no-op."""


@dataclass(frozen=True)
class EnvironmentClass:
    """A user's environment class, loaded and checked by ``load_environment``; ``start(record)`` builds one."""

    spec: str  # "package.module:Class", as the config names it
    cls: type
    config: Any  # cls.Config(), built once; each episode gets a copy
    timeout_s: float  # the deadline of each call into the environment
    timeout_field: str  # the config field that sets it (named in the error)

    async def start(self, record: Any) -> "RunningEnvironment":
        """An instance for one episode, built from the dataset ``record`` on a thread of its own."""
        env = RunningEnvironment(self)
        try:
            await env.construct(record)
        except BaseException:
            await env.close()
            raise
        return env


def load_environment(spec: str, field_name: str, timeout_s: float, timeout_field: str) -> EnvironmentClass:
    """The class ``spec`` names, checked for torchtitan's shape; ``ConfigError`` naming ``field_name`` otherwise."""
    cls = import_spec(field_name, spec)
    where = f"{field_name} = {spec!r}"
    shape = ("a class with a nested dataclass Config, __init__(config, *, env_input), async init() and async "
             "step(message)")
    if not isinstance(cls, type):
        raise ConfigError(f"{where} is a {type(cls).__name__}; allowed: {shape} (docs/environments.md)")
    missing = [m for m in ("init", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(f"{where} has no {' or '.join(f'{m}()' for m in missing)}; allowed: {shape}")
    if inspect.isabstract(cls):
        raise ConfigError(f"{where} leaves abstract: {', '.join(sorted(cls.__abstractmethods__))}; implement them")
    config_cls = getattr(cls, "Config", None)
    if not (isinstance(config_cls, type) and dataclasses.is_dataclass(config_cls)):
        raise ConfigError(f"{where} has no nested dataclass Config; allowed: {shape} (an empty "
                          "'@dataclass(kw_only=True, slots=True) class Config(MessageEnv.Config): pass' will do)")
    fields = {f.name for f in dataclasses.fields(config_cls)}
    own = [n for n in vars(config_cls).get("__annotations__", {}) if n not in fields]
    if own:  # a subclass of a dataclass without @dataclass: its own fields are plain class attributes
        raise ConfigError(f"{where}: its Config is not a dataclass (it only inherits from one), so its fields "
                          f"{own} cannot be set; allowed: decorate it with @dataclass(kw_only=True, slots=True)")
    try:
        config = config_cls()
    except Exception as e:  # noqa: BLE001 - user code: reported naming it
        raise ConfigError(f"{where}: its Config() raised {describe_exception(e)}; allowed: a Config whose fields "
                          "all have defaults") from e
    try:
        inspect.signature(cls).bind(config, env_input=None)
    except TypeError as e:
        raise ConfigError(f"{where}: its __init__ cannot take (config, *, env_input) ({e}); allowed: {shape}") from None
    except ValueError:  # no signature to read (a C-level constructor): its first call will tell
        pass
    return EnvironmentClass(spec, cls, config, timeout_s, timeout_field)


def configure_environment(env_class: EnvironmentClass, args: list[str], field_name: str) -> EnvironmentClass:
    """``env_class`` with its ``Config`` fields set from ``args`` (``config_args``); ``ConfigError`` naming
    ``field_name``."""
    values = config_args(type(env_class.config), args, field_name, env_class.spec)
    try:
        config = dataclasses.replace(env_class.config, **values)
    except Exception as e:  # noqa: BLE001 - user code (a __post_init__): reported naming the field
        raise ConfigError(f"{field_name}: {env_class.spec}'s Config({', '.join(values)}) raised "
                          f"{describe_exception(e)}") from e
    return dataclasses.replace(env_class, config=config)


def config_args(config_cls: type, args: list[str], field_name: str, owner: str,
                exclude: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The values ``args`` ("name=value", the value read as JSON when it parses, else as the plain string) give the
    dataclass ``config_cls``'s fields (of ``owner``; those in ``exclude`` not settable), each checked against the
    field's type; ``ConfigError`` naming ``field_name`` and the allowed names or type."""
    fields = {f.name: f for f in dataclasses.fields(config_cls) if f.init and f.name not in exclude}
    try:
        hints = typing.get_type_hints(config_cls)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: its values are not type-checked
        hints = {}
    values: dict[str, Any] = {}
    for arg in args:
        name, eq, text = arg.partition("=")
        name = name.strip()
        if not eq or name not in fields:
            raise ConfigError(f"{field_name} has {arg!r}; allowed: 'name=value' with name one of "
                              f"{sorted(fields) or '(none: ' + owner + ' has no Config fields)'}")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        want = hints.get(name)
        ok, value = _fits(value, want)
        if not ok:
            allowed = want.__name__ if isinstance(want, type) else str(want).replace("typing.", "")
            raise ConfigError(f"{field_name} sets {name} = {value!r} ({type(value).__name__}); allowed: {allowed} "
                              f"(the type of {owner}'s Config.{name})")
        values[name] = value
    return values


def _fits(value: Any, want: Any) -> tuple[bool, Any]:
    """Whether ``value`` (read from ``environment_args``) is of type ``want``, and the value to set: an int for a
    float field becomes a float; a union (``X | None``, ``Optional[X]``) takes a value any of its arms takes; a bool is
    no int; a ``Literal`` takes one of its values; a generic (``list[int]``) is checked by its origin; what is not a
    plain type (``Any``) takes anything."""
    if typing.get_origin(want) is typing.Literal:
        return value in typing.get_args(want), value
    if typing.get_origin(want) in (typing.Union, types.UnionType):
        for arm in typing.get_args(want):
            ok, fitted = _fits(value, arm)
            if ok:
                return True, fitted
        return False, value
    if want is type(None):
        return value is None, value
    plain = typing.get_origin(want) or want
    if not isinstance(plain, type) or plain is Any:
        return True, value
    if plain is float and isinstance(value, int) and not isinstance(value, bool):
        return True, float(value)
    return isinstance(value, plain) and not (isinstance(value, bool) and plain is not bool), value


def loop_thread(name: str) -> asyncio.AbstractEventLoop:
    """A new event loop running on a daemon thread of its own (``name``) until ``loop.stop()`` (called with
    ``call_soon_threadsafe``); then what still runs on it is cancelled, awaited, and the loop closed."""
    loop = asyncio.new_event_loop()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
            tasks = asyncio.all_tasks(loop)  # what the environments or episodes left running
            for t in tasks:
                t.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

    threading.Thread(target=serve, name=name, daemon=True).start()
    return loop


class RunningEnvironment:
    """One episode's environment instance, on its own thread and event loop (the module docstring). Each method
    runs the environment's under the deadline and checks what it returns."""

    def __init__(self, env_class: EnvironmentClass):
        self.env_class = env_class
        self.name = f"environment {env_class.spec!r}"
        self._env: Any = None
        self._record: Any = None  # the episode's env_input (its keys name a KeyError's choices)
        self._stuck = False  # a call missed its deadline: the loop may be blocked, close() is not attempted
        self._loop = loop_thread("flux-env")

    async def _call(self, method: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` (awaited if it returns an awaitable) on the environment's loop, under the
        deadline; what it raises is a ``UserCodeError`` naming ``method``."""

        async def run() -> tuple[bool, Any]:
            try:
                out = fn(*args, **kwargs)
                if inspect.isawaitable(out):
                    out = await out
                return True, out
            except BaseException as e:  # noqa: BLE001 - SystemExit included: reported below, naming the env
                return False, e

        future = asyncio.run_coroutine_threadsafe(run(), self._loop)
        timeout = self.env_class.timeout_s
        try:
            ok, value = await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except asyncio.TimeoutError:
            self._stuck = True
            raise UserCodeError(f"{self.name}: {method} did not return within {self.env_class.timeout_field} = "
                                f"{timeout:g} s; the run stops (its thread cannot be stopped)") from None
        if not ok:
            hint = (f"the record's keys: {sorted(map(str, self._record))}"
                    if isinstance(value, KeyError) and isinstance(self._record, Mapping) else "")
            raise UserCodeError(f"{self.name}: {method} raised {describe_exception(value, hint)}") from value
        return value

    async def construct(self, record: Any) -> None:
        """Builds the instance: ``Class(copy of Config(), env_input=record)``."""
        config = dataclasses.replace(self.env_class.config)
        self._record = record
        self._env = await self._call("__init__", self.env_class.cls, config, env_input=record)

    async def init(self) -> MessageEnvInitOutput:
        out = await self._call("init()", self._env.init)
        if not isinstance(out, MessageEnvInitOutput):
            self._wrong("init()", out, "MessageEnvInitOutput(init_prompt_messages=[...], tools=[...]) from "
                                       "torchtitan_flux.data.environments")
        messages = out.init_prompt_messages
        if not isinstance(messages, list) or not messages:
            self._wrong("init()", messages, "init_prompt_messages, a non-empty list of messages",
                        "init_prompt_messages =")
        for i, m in enumerate(messages):
            self._check_message("init()", f"init_prompt_messages[{i}]", m)
        if not isinstance(out.tools, list):
            self._wrong("init()", out.tools, "tools, a list of ToolSpec dicts", "tools =")
        for i, t in enumerate(out.tools):
            if not (isinstance(t, Mapping) and isinstance(t.get("name"), str) and t["name"]):
                self._wrong("init()", t, "a ToolSpec dict {'name': str, 'description': str, 'parameters': dict}",
                            f"tools[{i}] =")
        return out

    async def step(self, message: Message) -> MessageEnvStepOutput:
        out = await self._call("step()", self._env.step, message)
        if not isinstance(out, MessageEnvStepOutput):
            self._wrong("step()", out, "MessageEnvStepOutput(env_messages=[...], done=..., env_rewards={...}) from "
                                       "torchtitan_flux.data.environments")
        if not isinstance(out.env_messages, list):
            self._wrong("step()", out.env_messages, "env_messages, a list of messages", "env_messages =")
        for i, m in enumerate(out.env_messages):
            self._check_message("step()", f"env_messages[{i}]", m)
            if m["role"] == "assistant":
                self._wrong("step()", m, "a tool / user message (the assistant's turns come from the model)",
                            f"env_messages[{i}] =")
        if not isinstance(out.done, bool):
            self._wrong("step()", out.done, "done, a bool", "done =")
        if not isinstance(out.env_rewards, dict):
            self._wrong("step()", out.env_rewards, "env_rewards, a dict of str to float", "env_rewards =")
        rewards = {}
        for k, v in out.env_rewards.items():
            if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:  # numpy / torch scalars, as reward functions may
                v = v.item()
            if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                self._wrong("step()", {k: v}, "env_rewards of str keys and finite numbers (float, int, numpy scalar, "
                                              "0-d tensor)", "env_rewards has")
            rewards[k] = float(v)
        out.env_rewards = rewards  # plain floats: episodes are checkpointed and logged with them
        return out

    async def close(self) -> None:
        """The environment's ``close()`` (when it has one), then its thread ends. After a missed deadline only the
        thread is told to end (the loop may be blocked)."""
        try:
            if not self._stuck and self._env is not None and callable(getattr(self._env, "close", None)):
                await self._call("close()", self._env.close)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)

    def _check_message(self, method: str, where: str, m: Any) -> None:
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            self._wrong(method, m, "a message dict {'role': str, 'content': str} (text only)", f"{where} =")
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate (text decoded with errors="surrogateescape", say)
            self._wrong(method, m["content"][max(0, e.start - 20): e.end + 20], "text that encodes as UTF-8 (the "
                        f"tokenizer's input); character {e.start} is {m['content'][e.start]!r}", f"{where}['content'] has")
        for key, value in m.items():  # episodes are checkpointed with their messages: refused here, not at the save
            try:
                pickle.dumps(value)
            except Exception:  # noqa: BLE001 - whatever pickling raises, the value cannot be kept
                self._wrong(method, value, "message values a checkpoint can keep (plain data: str, numbers, lists, "
                                           "dicts)", f"{where}[{key!r}] =")

    def _wrong(self, method: str, value: Any, expected: str, what: str = "") -> None:
        text = repr(value)
        text = text if len(text) <= 120 else text[:117] + "..."
        raise UserCodeError(f"{self.name}: {method} returned {what + ' ' if what else ''}{text} "
                            f"({type(value).__name__}); expected {expected}")
