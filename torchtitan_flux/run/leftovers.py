"""Processes the run's user code leaves behind (an environment's ``subprocess.Popen`` per step, an ``os.fork``):
found and stopped when the trainer process exits, with one line naming them.

``adopt_orphans`` makes the trainer process the subreaper of its descendants (``PR_SET_CHILD_SUBREAPER``), so a
process whose parent exits (a double fork) is reparented to the trainer, not to init, and is still found.
``stop_leftovers`` then SIGTERMs every descendant but ``multiprocessing``'s own helpers (the engines' fork server,
the resource tracker: the run's, which end with it), SIGKILLs what is left after a grace period, and reaps them.
Our engines and servers are stopped before, by the trainer's ``close``.

Concurrency: the main thread, at the start and at the very end of ``train.main``.
"""

from __future__ import annotations

import os
import signal
import time

from torchtitan_flux.engine.forkserver import prctl

PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans() -> None:
    """Reparent the orphans of this process's descendants to it (Linux; a no-op elsewhere)."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, of every process this user can read in /proc."""
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):  # gone meanwhile
            continue
        if state != "Z":  # exited, not yet reaped: nothing to stop
            out.setdefault(int(ppid), []).append(int(name))
    return out


def descendants(pid: int) -> list[int]:
    """The live descendants of ``pid``, parents first."""
    children, out, todo = _children(), [], [pid]
    while todo:
        kids = children.get(todo.pop(0), [])
        out += kids
        todo += kids
    return out


def _own_helpers() -> set[int]:
    """multiprocessing's helper processes of this process (their module-level pids; absent: none)."""
    from multiprocessing import forkserver, resource_tracker

    pids = {getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None),
            getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None)}
    return {p for p in pids if isinstance(p, int)}


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        return " ".join(a.decode(errors="replace") for a in argv if a)[:80] or "?"
    except OSError:
        return "?"


def stop_leftovers(grace_s: float = 2.0) -> list[str]:
    """Stop every descendant of this process but its multiprocessing helpers (and theirs): SIGTERM, SIGKILL after
    ``grace_s``, reaped. Returns ``"pid (command)"`` of each it found."""
    helpers = _own_helpers()
    skip = helpers | {d for h in helpers for d in descendants(h)}
    found = [p for p in descendants(os.getpid()) if p not in skip]
    names = [f"{p} ({_name(p)})" for p in found]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in found:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline and any(_reap(p) for p in found):
            time.sleep(0.05)
    return names


def _reap(pid: int) -> bool:
    """Whether ``pid`` still runs (reaping it when it is our child and has exited)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return False
    except ChildProcessError:  # not our child (a grandchild whose parent still runs): look it up
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
