"""The front end: ``--job.config_file X.toml`` plus ``--section.field value`` overrides -> ``GRPOTrainer.Config``.

torchtitan 0.3.0 has no TOML: its configs are Python registries parsed by tyro. We keep our users' contract
instead, with no tyro in between: the TOML's keys, then the command line's, are set one by one on a default
``GRPOTrainer.Config`` (torchtitan's ``Trainer.Config`` with our sections), each value converted to the field's
declared type. So every field of the tree is settable the same way, ours and 0.3.0's (``--parallelism.spmd_backend
partial_dtensor``, ``--compile.enable true``): booleans take ``true|false`` (bare: true), lists ``a,b`` or ``a b``
(a comma inside double quotes stays), ``""`` clears a list. An unknown key is one ``ConfigError`` line naming it and the allowed names; a value of the
wrong type or out of range is ``validate_config``'s (run/validation.py), in the same one-line form.

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

from torchtitan_flux.config import MODEL_NAME
from torchtitan_flux.errors import ConfigError

LEGACY = {"job.dump_folder": "dump_folder", "model.hf_assets_path": "hf_assets_path"}
"""0.2.2 keys -> the 0.3.0 field they set; every ``profiling.x`` is ``profiler.x``."""

FIXED = {"model.name": MODEL_NAME, "model.flavor": "hf", "job.description": None}
"""0.2.2 keys with nothing left to set: the model is read from ``hf_assets_path/config.json`` (the only value
allowed is the one given here); ``job.description`` (None: any value) labels the file only."""

AC_MODES = {"none": None, "full": FullAC.Config, "selective": SelectiveAC.Config}
"""``activation_checkpoint.mode`` -> 0.3.0's config class (None: no activation checkpointing)."""


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
    """Set ``key`` (a 0.2.2 or 0.3.0 ``section.field``) to ``value``: a TOML value from file ``source`` as it is, or
    the command line's strings (``source`` None) read as the field's type. Types and ranges are
    ``validate_config``'s to check, with the messages of every other bad value."""
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
    setattr(parent, name, value if source is not None else _from_cli(key, value, hint))


def _resolve(config: Any, key: str, given: str, source: str | None) -> tuple[Any, str, Any]:
    """The object holding ``key``'s field, the field's name and its declared type; a ``ConfigError`` naming
    ``given`` (the key as written) and the allowed names when there is no such field."""
    obj, parts = config, key.split(".")
    for i, part in enumerate(parts):
        names = ({f.name for f in dataclasses.fields(obj) if not f.name.startswith("_")}
                 if dataclasses.is_dataclass(obj) else set())
        if part not in names:
            section = ".".join(given.split(".")[:i]) if i else ""
            names = (names | {"job", "model", "profiling"}) - {"model_spec"} if not i else names  # 0.2.2's too
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
