"""The one importer of user code named in the config (``"package.module:attribute"``: reward functions, tasks,
custom controllers, step callbacks), and the step-callback adapter. Failures are ``ConfigError`` lines naming the
field, raised at validation, before any work; a step callback that raises or calls ``sys.exit()`` mid-run is a
``UserCodeError`` naming it (the run stops with that one line, after checkpointing the step).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

from torchtitan_flux.errors import ConfigError
from torchtitan_flux.errors import UserCodeError


@dataclass(frozen=True)
class StepResult:
    """What a one-argument step callback gets: the step and its metrics (the ``metrics.jsonl`` row)."""

    step: int
    metrics: dict[str, Any]


def step_callback(fn: Any, name: str = "the step callback") -> Any:
    """``fn`` as ``callback(step, metrics)``: ``fn(step, metrics)`` as it is, ``fn(result)`` given a
    ``StepResult``; ``ConfigError`` naming ``name`` for any other. Whatever it raises, ``SystemExit`` included
    (else a silent exit 0), comes out as a ``UserCodeError`` naming ``name``."""
    call = _two_argument_form(fn, name)

    def guarded(step: int, metrics: dict[str, Any]) -> None:
        try:
            call(step, metrics)
        except (Exception, SystemExit) as e:
            raise UserCodeError(f"{name} raised {type(e).__name__}: {e}") from e

    return guarded


def _two_argument_form(fn: Any, name: str) -> Any:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (some builtins): take the two-argument form
        return fn
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if any(p.kind == p.VAR_POSITIONAL for p in params) or len(required) <= 2 <= len(positional):
        return fn
    if len(required) <= 1 <= len(positional):
        return lambda step, metrics: fn(StepResult(step, metrics))
    raise ConfigError(f"{name} takes {len(required)} required arguments; allowed: fn(result) or fn(step, metrics)")


def import_spec(name: str, spec: str, callable_: bool = True) -> Any:
    """The object ``spec`` names (``attribute`` may be dotted), or a ``ConfigError`` naming the field ``name``."""
    mod, sep, attr = spec.partition(":")
    if not sep or not mod or not attr:
        raise ConfigError(f"{name} = {spec!r} must be of the form 'package.module:attribute'")
    try:
        obj = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{name} = {spec!r} cannot be imported: {e}") from e
    except (Exception, SystemExit) as e:  # the module itself failed (sys.exit("reason") at import included)
        raise ConfigError(f"{name} = {spec!r} cannot be imported: {type(e).__name__}: {e}") from e
    if callable_ and not callable(obj):
        raise ConfigError(f"{name} = {spec!r} is not callable")
    return obj
