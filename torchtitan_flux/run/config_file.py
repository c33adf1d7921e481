"""The front end: ``--job.config_file X.toml`` plus ``--section.field value`` overrides -> ``GRPOTrainer.Config``.

torchtitan 0.3.0 has no TOML: its configs are Python registries parsed by tyro. We keep our users' contract
instead, with no tyro in between: the TOML's keys, then the command line's, are set one by one on a default
``GRPOTrainer.Config`` (torchtitan's ``Trainer.Config`` with our sections), each value converted to the field's
declared type. So every field of the tree is settable the same way, ours and 0.3.0's (``--parallelism.spmd_backend
partial_dtensor``, ``--compile.enable true``): booleans take ``true|false`` (bare: true), lists ``a,b`` or ``a b``
(a comma inside double quotes stays), ``""`` clears a list. An unknown key is one ``ConfigError`` line naming it and the
allowed names, and so is a value that is not of its field's declared type (``_typed``; a list of TOML tables becomes
the dataclasses it declares, ``optimizer.param_groups``' ``ParamGroupConfig``), except for the fields whose types
``validate_config`` (run/validation.py) checks: ours and ``LEFT_TO_VALIDATION``. Ranges and cross-field rules are
``validate_config``'s, in the same one-line form.

Keys of torchtitan 0.2.2's TOML layout that 0.3.0 moved are translated (``LEGACY``); ``[activation_checkpoint]
mode`` picks the config class (``AC_MODES``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import tomllib
import types
import typing
from typing import Any

from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

from torchtitan_flux.config import ADDED_TO_TORCHTITAN, MODEL_NAME, SECTIONS
from torchtitan_flux.errors import ConfigError

LEGACY = {"job.dump_folder": "dump_folder", "model.hf_assets_path": "hf_assets_path"}
"""0.2.2 keys -> the 0.3.0 field they set; every ``profiling.x`` is ``profiler.x``."""

FIXED = {"model.name": MODEL_NAME, "model.flavor": "hf", "job.description": None}
"""0.2.2 keys with nothing left to set: the model is read from ``hf_assets_path/config.json`` (the only value
allowed is the one given here); ``job.description`` (None: any value) labels the file only."""

AC_MODES = {"none": None, "full": FullAC.Config, "selective": SelectiveAC.Config}
"""``activation_checkpoint.mode`` -> 0.3.0's config class (None: no activation checkpointing)."""

LEFT_TO_VALIDATION = ("training.steps", "training.local_batch_size", "training.seq_len", "optimizer.name")
"""Fields outside our sections whose bad values ``validate_config`` names, in messages older than the front end's
type check: ``_typed`` leaves them to it, as it leaves every field of our sections (``config.SECTIONS``,
``config.ADDED_TO_TORCHTITAN``)."""


def load_config(argv: list[str], config: Any) -> Any:
    """``config`` (a default ``GRPOTrainer.Config``, handed in so that this module does not import the trainer) with
    the keys of ``--job.config_file`` (if given), then ``argv``'s overrides, set on it."""
    overrides = _parse_argv(argv)
    files = [v for k, v in overrides if k == "job.config_file"]
    if len(files) > 1:
        raise ConfigError(f"--job.config_file is given {len(files)} times; allowed: once")
    if files:
        (path,) = files[0] if len(files[0]) == 1 else (None,)
        if path is None:
            raise ConfigError(f"--job.config_file takes one value, given {len(files[0])}; allowed: a TOML file")
        for key, value in _read_toml(path, config):
            _set(config, key, value, path)
    for key, value in overrides:
        if key != "job.config_file":
            _set(config, key, value, None)
    return config


def _parse_argv(argv: list[str]) -> list[tuple[str, list[str]]]:
    """``--a.b v``, ``--a.b=v`` and ``--a.b v1 v2`` (a list) as ``("a.b", [values])``, in order."""
    out: list[tuple[str, list[str]]] = []
    closed = True  # the last key took its value with "="
    for a in argv:
        if a.startswith("--") and len(a) > 2 and not _is_number(a):
            key, eq, val = a[2:].partition("=")
            out.append((key.replace("-", "_"), [val] if eq else []))
            closed = bool(eq)
        elif not closed:
            out[-1][1].append(a)
        else:
            raise ConfigError(f"{a!r} on the command line follows no --section.field; allowed: --section.field value")
    return out


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _read_toml(path: str, defaults: Any) -> list[tuple[str, Any]]:
    """The file's ``section.field`` keys (nested tables joined with dots) and values; a ``ConfigError`` naming it
    when it cannot be read."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"job.config_file = {path!r}: {e.strerror}; allowed: a readable TOML file") from None
    if raw.startswith(b"\xef\xbb\xbf"):  # tomllib's error would be "Invalid statement (at line 1, column 1)"
        raise ConfigError(f"job.config_file = {path!r} starts with a UTF-8 byte-order mark; allowed: UTF-8 "
                          "without one (save it again without the BOM)")
    try:
        doc = tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"job.config_file = {path!r}: TOML syntax error: {e}; allowed: valid TOML") from None

    def flat(d: dict, prefix: str) -> list[tuple[str, Any]]:
        out = []
        for k, v in d.items():
            if isinstance(v, dict) and not _is_dict_field(defaults, f"{prefix}{k}"):
                out += flat(v, f"{prefix}{k}.")
            else:
                out.append((f"{prefix}{k}", v))
        return out

    return flat(doc, "")


def _is_dict_field(defaults: Any, key: str) -> bool:
    """Whether ``key`` names a field of ``defaults`` whose value is a dict (a TOML table sets it whole)."""
    try:
        _, _, hint = _resolve(defaults, key, key, None)
    except ConfigError:
        return False
    return typing.get_origin(hint) is dict or hint is dict


def _set(config: Any, key: str, value: Any, source: str | None) -> None:
    """Set ``key`` (a 0.2.2 or 0.3.0 ``section.field``) to ``value``: a TOML value from file ``source``, or the
    command line's strings (``source`` None) read as the field's type; either checked against that type (``_typed``)
    unless ``validate_config`` checks it. Ranges are ``validate_config``'s."""
    if key in FIXED:
        allowed = FIXED[key]
        given = value[0] if source is None and len(value) == 1 else value
        if allowed is not None and given != allowed:
            raise ConfigError(f"{key} = {given!r} is not allowed; allowed: {allowed!r} (the model is read from "
                              "model.hf_assets_path/config.json)")
        return
    if key == "activation_checkpoint.mode":
        mode = value[0] if source is None and len(value) == 1 else value
        if mode not in AC_MODES:
            raise ConfigError(f"{key} = {mode!r} is not allowed; allowed values: "
                              f"{' | '.join(repr(m) for m in AC_MODES)}")
        config.activation_checkpoint = AC_MODES[mode]() if AC_MODES[mode] else None
        return
    target = LEGACY.get(key, "profiler." + key.removeprefix("profiling.") if key.startswith("profiling.") else key)
    parent, name, hint = _resolve(config, target, key, source)
    value = value if source is not None else _from_cli(key, value, hint)
    setattr(parent, name, value if _type_checked_by_validation(target) else _typed(key, value, hint))


def _type_checked_by_validation(key: str) -> bool:
    """Whether ``validate_config`` checks the type of field ``key``: every field of our sections and of those we add
    to torchtitan's, and ``LEFT_TO_VALIDATION``."""
    section, _, name = key.partition(".")
    added = {f.name for f in dataclasses.fields(ADDED_TO_TORCHTITAN[section])} if section in ADDED_TO_TORCHTITAN else ()
    return section in SECTIONS or name in added or key in LEFT_TO_VALIDATION


_SCALARS = {bool: ("true | false", "booleans"), int: ("an integer", "integers"), float: ("a number", "numbers"),
            str: ("a string", "strings"), type(None): ("unset", "unset")}
"""The scalar types of config fields, and their allowed values in words (one, many)."""


def _typed(key: str, value: Any, hint: Any) -> Any:
    """``value`` if it is of type ``hint`` (an int is a number, a boolean is not an int), with a TOML table made the
    dataclass ``hint`` names (``_table``); else a ``ConfigError`` line naming ``key`` (the item, in a list), the value
    and the allowed values."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for option in args:
            with contextlib.suppress(ConfigError):
                return _typed(key, value, option)
    elif origin is typing.Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
    elif origin is list and isinstance(value, list):
        return [_typed(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    elif origin is tuple and isinstance(value, (list, tuple)) and len(value) == len(args):
        return tuple(_typed(f"{key}[{i}]", v, t) for i, (v, t) in enumerate(zip(value, args)))
    elif (origin is dict or hint is dict) and isinstance(value, dict):
        return {k: _typed(f"{key}.{k}", v, (args or (str, Any))[1]) for k, v in value.items()}
    elif dataclasses.is_dataclass(hint) and isinstance(value, dict):
        return _table(key, value, hint)
    elif hint in _SCALARS and isinstance(value, (int, float) if hint is float else hint) and (
            hint is bool or not isinstance(value, bool)):
        return value
    values = " values" if origin is typing.Literal else ""
    raise ConfigError(f"{key} = {value!r} is not allowed; allowed{values}: {_describe(hint)}")


def _table(key: str, table: dict, cls: type) -> Any:
    """TOML table ``table`` as dataclass ``cls``, each value checked against its field's type; an unknown or a missing
    required key is one ``ConfigError`` line naming it and the allowed keys."""
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    required = [f.name for f in dataclasses.fields(cls)
                if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for problem, keys in (("unknown", set(table) - set(fields)), ("missing", set(required) - set(table))):
        if keys:
            raise ConfigError(f"{key}: {problem} key(s) {{{', '.join(map(repr, sorted(keys)))}}}; allowed: "
                              f"{', '.join(fields)} (required: {', '.join(required) or 'none'})")
    hints = typing.get_type_hints(cls)
    return cls(**{k: _typed(f"{key}.{k}", v, hints[k]) for k, v in table.items()})


def _describe(hint: Any, many: bool = False) -> str:
    """The values of type ``hint`` in words, as ``_typed``'s errors give them (``many``: the items of a list)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return " | ".join(map(repr, args))
    if origin in (typing.Union, types.UnionType):
        text = " | ".join(_describe(a, many) for a in args)
        return f"({text})" if many else text
    if origin in (list, tuple) or dataclasses.is_dataclass(hint) or origin is dict or hint is dict:
        noun = "lists" if origin in (list, tuple) else "tables"
        what = (f" of {_describe(args[0], True)}" if origin is list else
                f" [{', '.join(_describe(a) for a in args)}]" if origin is tuple else
                f" (keys: {', '.join(f.name for f in dataclasses.fields(hint))})" if dataclasses.is_dataclass(hint)
                else "")
        return (noun if many else f"a {noun[:-1]}") + what
    if hint in _SCALARS:
        return _SCALARS[hint][many]
    return "anything" if hint is Any else f"{getattr(hint, '__name__', hint)} (built in Python, not settable here)"


def _resolve(config: Any, key: str, given: str, source: str | None) -> tuple[Any, str, Any]:
    """The object holding ``key``'s field, the field's name and its declared type; a ``ConfigError`` naming
    ``given`` (the key as written) and the allowed names when there is no such field."""
    obj, parts = config, key.split(".")
    for i, part in enumerate(parts):
        names = ({f.name for f in dataclasses.fields(obj) if not f.name.startswith("_")}
                 if dataclasses.is_dataclass(obj) else set())
        names -= {"model_spec"} if not i else set()  # built from hf_assets_path's config.json
        if part not in names:
            section = ".".join(given.split(".")[:i]) if i else ""
            names = names | {"job", "model", "profiling"} if not i else names  # 0.2.2's too
            allowed = ", ".join(sorted(names)) or "none (it is a single value)"
            where = f"job.config_file = {source!r}: " if source is not None else f"--{given}: "
            if not i and source is not None:
                raise ConfigError(f"{where}unknown section(s) {{{part!r}}}; allowed: {allowed}")
            raise ConfigError(f"{where}unknown key(s) {{{part!r}}} in [{section or 'the top level'}]; allowed: "
                              f"{allowed}")
        if i == len(parts) - 1:
            return obj, part, typing.get_type_hints(type(obj))[part]
        obj = getattr(obj, part)
    raise AssertionError(key)


def _from_cli(key: str, values: list[str], hint: Any) -> Any:
    """The command line's strings as ``hint``'s type where they read as one, else as given (validation then names
    a value of the wrong type): ``true|false`` for booleans, ``a,b`` or ``a b`` for lists of numbers, ``""`` for
    the empty list."""
    if _list_item(hint) is not None:
        item = _list_item(hint)
        if values == [""]:
            return []
        if len(values) == 1 and item in (int, float):
            values = [v.strip() for v in values[0].split(",") if v.strip()]
        elif len(values) == 1:  # JSON values (environment_args) may hold a quoted comma
            values = split_outside_quotes(values[0])
        return [_scalar(v, item) for v in values]
    if not values and bool in (typing.get_args(hint) or (hint,)):  # a bare boolean, as torchtitan's flags
        return True
    if len(values) != 1:
        raise ConfigError(f"--{key} takes one value, given {len(values)} ({' '.join(values) or 'none'}); allowed: "
                          "--section.field value")
    return _scalar(values[0], hint)


def _list_item(hint: Any) -> Any:
    """The item type of a list field (through ``X | None``), else None."""
    for t in typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,):
        if typing.get_origin(t) is list:
            return (typing.get_args(t) or (Any,))[0]
    return None


def _scalar(text: str, hint: Any) -> Any:
    """``text`` as the first of ``hint``'s types it reads as (a string last), else ``text``."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    for t in sorted(options, key=lambda t: t is str):
        if t is bool and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if t is type(None) and text in ("None", "none"):
            return None
        if t in (int, float):
            with contextlib.suppress(ValueError):
                return t(text)
        if t is str or typing.get_origin(t) is typing.Literal:
            return text
    return text


def split_outside_quotes(text: str) -> list[str]:
    """``text`` split at each comma outside a double-quoted part (``\\"`` inside one escapes the quote)."""
    parts, current, quoted, escaped = [], [], False, False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\" and quoted:
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == "," and not quoted:
            parts.append("".join(current))
            current = []
            continue
        current.append(ch)
    parts.append("".join(current))
    return parts
