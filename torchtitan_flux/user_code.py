"""The one importer of user code named in the config (``"package.module:attribute"``: reward functions, tasks,
environments, custom controllers, step callbacks), the step-callback adapter, and ``call_with_deadline``, which runs
user code mid-run. Import failures are ``ConfigError`` lines naming the field, raised at validation, before any
work; user code that raises, calls ``sys.exit()`` or hangs mid-run is a ``UserCodeError`` naming it (the run stops
with that one line, after checkpointing the step).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sysconfig
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from torchtitan_flux.errors import ConfigError, RolloutWaitInterrupted, UserCodeError

WAIT_SLICE_S = 0.1  # call_with_deadline waits in slices this long, so that a signal's handler runs between them


@dataclass(frozen=True)
class StepResult:
    """What a one-argument step callback gets: the step and its metrics (the ``metrics.jsonl`` row)."""

    step: int
    metrics: dict[str, Any]


def step_callback(fn: Any, name: str = "the step callback", timeout_s: float = 300.0) -> Any:
    """``fn`` as ``callback(step, metrics)``: ``fn(step, metrics)`` as it is, ``fn(result)`` given a
    ``StepResult``; ``ConfigError`` naming ``name`` for any other. It runs as user code (``call_with_deadline``,
    ``metrics.step_callback_timeout_seconds``): whatever it raises, ``SystemExit`` included (else a silent exit 0),
    or running past ``timeout_s``, comes out as a ``UserCodeError`` naming ``name``."""
    call = _two_argument_form(fn, name)

    def guarded(step: int, metrics: dict[str, Any]) -> None:
        call_with_deadline(name, call, step, metrics, timeout_s=timeout_s,
                           field="metrics.step_callback_timeout_seconds")

    return guarded


def call_with_deadline(what: str, fn: Callable, *args: Any, timeout_s: float, field: str,
                       interrupted: Callable[[], bool] = lambda: False, passthrough: tuple[type, ...] = ()) -> Any:
    """``fn(*args)`` run as user code on a thread of its own while the caller waits: whatever it raises
    (``SystemExit`` and ``KeyboardInterrupt`` included; ``passthrough`` types as they are) is a ``UserCodeError``
    naming ``what``, and so is running past ``timeout_s`` (the config ``field``; a thread cannot be killed, so the
    run stops and the thread is left behind, a daemon). The wait is in slices of ``WAIT_SLICE_S``, so a signal's
    handler runs; ``interrupted()`` turning true (a first signal) ends it with ``RolloutWaitInterrupted``."""
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - reported below, naming the user code
            outcome["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="flux-user-code", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not done.wait(WAIT_SLICE_S):
        if interrupted():
            raise RolloutWaitInterrupted(f"interrupted while waiting for {what}")
        if time.monotonic() > deadline:
            raise UserCodeError(f"{what} did not return within {field} = {timeout_s:g} s; the run stops (its "
                                "thread cannot be stopped)")
    if "error" in outcome:
        if isinstance(outcome["error"], passthrough):
            raise outcome["error"]
        raise UserCodeError(f"{what} raised {describe_exception(outcome['error'])}") from outcome["error"]
    return outcome["value"]


def describe_exception(e: BaseException, hint: str = "") -> str:
    """``Type: message`` of ``e`` on one line, also when its ``str()`` raises (user code's exceptions may), then
    ``; hint`` when given, then the innermost frame of its traceback in a user's file, ``(my_env.py:74)``
    (``user_frame``)."""
    try:
        text = str(e)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the failure it describes
        text = "(its message cannot be read)"
    first = text.strip().splitlines()[0][:300] if text.strip() else ""
    out = f"{type(e).__name__}: {first}" if first else type(e).__name__
    where = user_frame(e)
    return out + (f"; {hint}" if hint else "") + (f" ({where})" if where else "")


_PACKAGE = os.path.dirname(os.path.realpath(__file__))
_LIBRARIES = tuple({os.path.realpath(p) for k, p in sysconfig.get_paths().items()
                    if k in ("stdlib", "platstdlib", "purelib", "platlib")})


def user_frame(e: BaseException) -> str | None:
    """``file.py:line`` of the innermost frame of ``e``'s traceback in a user's file: not this package's, the
    standard library's or an installed package's (their frames are below the user's call); None without one."""
    found = None
    for frame, line in traceback.walk_tb(e.__traceback__):
        path = frame.f_code.co_filename
        if path.startswith("<"):  # <frozen ...>, <string>
            continue
        path = os.path.realpath(path)
        if path.startswith(_PACKAGE + os.sep) or path.startswith(tuple(lib + os.sep for lib in _LIBRARIES)):
            continue
        found = f"{os.path.basename(path)}:{line}"
    return found


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


class _ExitCalled(BaseException):
    """``os._exit(code)`` called while a user module was imported."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


@contextlib.contextmanager
def _exit_refused():
    """``os._exit`` raises ``_ExitCalled`` instead of ending the process, while a user module is imported (at
    validation, on the main thread, before any thread of ours runs): an exit there would end the run with no line."""
    real = os._exit

    def refuse(code: int) -> None:
        raise _ExitCalled(code)

    os._exit = refuse
    try:
        yield
    finally:
        os._exit = real


def import_spec(name: str, spec: str, callable_: bool = True) -> Any:
    """The object ``spec`` names (``attribute`` may be dotted), or a ``ConfigError`` naming the field ``name``."""
    mod, sep, attr = spec.partition(":")
    if not sep or not mod or not attr:
        raise ConfigError(f"{name} = {spec!r} must be of the form 'package.module:attribute'")
    try:
        with _exit_refused():
            obj = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except _ExitCalled as e:
        raise ConfigError(f"{name} = {spec!r} cannot be imported: it called os._exit({e.code}) at import (the run "
                          "would end silently); allowed: a module that only defines things when imported") from None
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{name} = {spec!r} cannot be imported: {e}") from e
    except (Exception, SystemExit) as e:  # the module itself failed (sys.exit("reason") at import included)
        raise ConfigError(f"{name} = {spec!r} cannot be imported: {type(e).__name__}: {e}") from e
    if callable_ and not callable(obj):
        raise ConfigError(f"{name} = {spec!r} is not callable")
    return obj
