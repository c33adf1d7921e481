"""The front end: ``--job.config_file X.toml`` plus ``--section.field value`` overrides -> ``GRPOTrainer.Config``.

torchtitan 0.3.0 has no TOML: its configs are Python registries parsed by tyro. We keep our users' contract
instead, with no tyro in between: the TOML's keys, then the command line's, are set one by one on a default
``GRPOTrainer.Config`` (torchtitan's ``Trainer.Config`` with our sections), each value converted to the field's
declared type. So every field of the tree is settable the same way, ours and 0.3.0's (``--parallelism.spmd_backend
partial_dtensor``, ``--compile.enable true``): booleans take ``true|false``, lists take ``a,b`` or ``a b`` (``""``
clears one), and bad input is one ``ConfigError`` line naming the field and what is allowed.

Keys of torchtitan 0.2.2's TOML layout that 0.3.0 moved are translated (``LEGACY``); ``[activation_checkpoint]
mode`` picks the config class (``AC_MODES``).
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from typing import Any

from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

from torchtitan_flux.config import MODEL_NAME
from torchtitan_flux.errors import ConfigError
from torchtitan_flux.run.trainer import GRPOTrainer

LEGACY = {"job.dump_folder": "dump_folder", "model.hf_assets_path": "hf_assets_path"}
"""0.2.2 keys -> the 0.3.0 field they set; every ``profiling.x`` is ``profiler.x``."""

FIXED = {"model.name": MODEL_NAME, "model.flavor": "hf", "job.description": None}
"""0.2.2 keys with nothing left to set: the model is read from ``hf_assets_path/config.json`` (the only value
allowed is the one given here); ``job.description`` (None: any value) labels the file only."""

AC_MODES = {"none": None, "full": FullAC.Config, "selective": SelectiveAC.Config}
"""``activation_checkpoint.mode`` -> 0.3.0's config class (None: no activation checkpointing)."""


_DEFAULTS = GRPOTrainer.Config()  # the tree the field types are read from


def load_config(argv: list[str]) -> GRPOTrainer.Config:
    """The config of ``--job.config_file`` (if given) with ``argv``'s overrides applied after it."""
    overrides = _parse_argv(argv)
    files = [v for k, v in overrides if k == "job.config_file"]
    if len(files) > 1:
        raise ConfigError(f"job.config_file is given {len(files)} times; allowed: once")
    settings = _read_toml(files[0][0]) if files else []
    config = GRPOTrainer.Config()
    for key, value in settings + [(k, v) for k, v in overrides if k != "job.config_file"]:
        _set(config, key, value)
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


def _read_toml(path: str) -> list[tuple[str, Any]]:
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
            if isinstance(v, dict) and not _is_dict_field(f"{prefix}{k}"):
                out += flat(v, f"{prefix}{k}.")
            else:
                out.append((f"{prefix}{k}", v))
        return out

    return flat(doc, "")


def _is_dict_field(key: str) -> bool:
    """Whether ``key`` names a field whose value is a dict (a TOML table sets it whole)."""
    try:
        _, _, hint = _resolve(_DEFAULTS, key)
    except ConfigError:
        return False
    return typing.get_origin(hint) is dict or hint is dict


def _set(config: GRPOTrainer.Config, key: str, value: Any) -> None:
    """Set ``key`` (a 0.2.2 or 0.3.0 ``section.field``) to ``value`` (TOML-typed, or the command line's strings)."""
    if key in FIXED:
        allowed = FIXED[key]
        given = value[0] if isinstance(value, list) and len(value) == 1 else value
        if allowed is not None and given != allowed:
            raise ConfigError(f"{key} = {given!r}; allowed: {allowed!r} (the model is read from "
                              "hf_assets_path/config.json)")
        return
    if key == "activation_checkpoint.mode":
        mode = value[0] if isinstance(value, list) and len(value) == 1 else value
        if mode not in AC_MODES:
            raise ConfigError(f"{key} = {mode!r}; allowed: {' | '.join(AC_MODES)}")
        config.activation_checkpoint = AC_MODES[mode]() if AC_MODES[mode] else None
        return
    key = LEGACY.get(key, "profiler." + key.removeprefix("profiling.") if key.startswith("profiling.") else key)
    parent, name, hint = _resolve(config, key)
    setattr(parent, name, _convert(key, value, hint))


def _resolve(config: Any, key: str) -> tuple[Any, str, Any]:
    """The object holding ``key``'s field, the field's name and its declared type."""
    obj, parts = config, key.split(".")
    for i, part in enumerate(parts):
        hints = typing.get_type_hints(type(obj)) if dataclasses.is_dataclass(obj) else {}
        hints = {f.name: hints[f.name] for f in dataclasses.fields(obj) if not f.name.startswith("_")} if hints \
            else {}
        if part not in hints:
            where = ".".join(parts[:i]) or "the top level"
            allowed = ", ".join(sorted(hints)) or "none (it is not a section)"
            raise ConfigError(f"{key}: no field {part!r} in {where}; allowed: {allowed}")
        if i == len(parts) - 1:
            return obj, part, hints[part]
        obj = getattr(obj, part)
    raise AssertionError(key)


def _convert(key: str, value: Any, hint: Any) -> Any:
    """``value`` as ``hint``: a TOML value checked, or the command line's strings parsed."""
    cli = isinstance(value, list) and all(isinstance(v, str) for v in value) and not _is_list(hint)
    if cli:
        if len(value) != 1:
            raise ConfigError(f"{key} takes one value, given {len(value)}: {' '.join(value)!r}")
        value = value[0]
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    errors = []
    for option in sorted(options, key=lambda t: t is str):  # a string last: "3" is a number where one is allowed
        try:
            return _as(value, option, cli)
        except (TypeError, ValueError) as e:
            errors.append(str(e))
    raise ConfigError(f"{key} = {value!r}; allowed: {' or '.join(errors)}")


def _is_list(hint: Any) -> bool:
    origins = [typing.get_origin(t) for t in (typing.get_args(hint) or (hint,))] + [typing.get_origin(hint)]
    return list in origins or hint is list


def _as(value: Any, t: Any, cli: bool) -> Any:
    """``value`` as type ``t``; ValueError saying what ``t`` allows."""
    origin = typing.get_origin(t)
    if t is type(None):
        if value is None or (cli and value in ("None", "none")):
            return None
        raise ValueError("none")
    if origin is typing.Literal:
        choices = typing.get_args(t)
        if value in choices:
            return value
        raise ValueError(" | ".join(str(c) for c in choices))
    if t is bool:
        if isinstance(value, bool):
            return value
        if cli and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ValueError("true | false")
    if t in (int, float):
        if isinstance(value, bool):
            raise ValueError(f"a{'n integer' if t is int else ' number'}")
        if isinstance(value, (int, float)) and not cli:
            if t is int and not float(value).is_integer():
                raise ValueError("an integer")
            return t(value)
        try:
            return t(value)
        except (TypeError, ValueError):
            raise ValueError(f"a{'n integer' if t is int else ' number'}") from None
    if t is str:
        if isinstance(value, str):
            return value
        raise ValueError("a string")
    if origin is list or t is list:
        (item,) = typing.get_args(t) or (Any,)
        if isinstance(value, list) and value == [""]:
            return []  # --x.y "": the empty list
        if isinstance(value, list) and cli is False and all(isinstance(v, str) for v in value) and len(value) == 1:
            value = [v.strip() for v in value[0].split(",") if v.strip()] if "," in value[0] and item in (
                int, float) else value
        if not isinstance(value, list):
            raise ValueError(f"a list of {getattr(item, '__name__', item)}")
        strings = all(isinstance(v, str) for v in value)
        return [v if item is Any else _as(v, item, strings and item is not str) for v in value]
    if origin is dict or t is dict:
        if isinstance(value, dict):
            return value
        raise ValueError("a table")
    if t is Any:
        return value
    raise ValueError(f"a {getattr(t, '__name__', t)} (not settable from a TOML file)")
