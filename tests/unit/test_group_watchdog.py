"""``engine/group_watchdog.py`` with plain processes (the vLLM launch tests cannot run in the default suite): a
"server" in a session of its own with a child of its own (vLLM's engine core) dies, child included, when the process
that started it is SIGKILLed (the fifth sweep's item 5: only the API server had a parent-death signal)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from conftest import ROOT

from torchtitan_flux.engine.group_watchdog import GroupWatchdog

SERVER = ("import subprocess, sys, time\n"
          "core = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
          "print(core.pid, flush=True)\n"
          "time.sleep(120)\n")
TRAINER = ("import subprocess, sys, time\n"
           "from torchtitan_flux.engine.group_watchdog import GroupWatchdog\n"
           f"server = subprocess.Popen([sys.executable, '-c', {SERVER!r}], stdout=subprocess.PIPE, text=True,\n"
           "                          start_new_session=True)\n"
           "core = int(server.stdout.readline())\n"
           "watchdog = GroupWatchdog(server.pid)\n"
           "print(server.pid, core, flush=True)\n"
           "time.sleep(120)\n")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def _gone(pids: list[int], within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_a_server_group_dies_with_the_sigkilled_process_that_watched_it():
    """Mutation: no watchdog (the server and its child live on: the server is in a session of its own)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER], stdout=subprocess.PIPE, text=True, env=env)
    server, core = (int(x) for x in trainer.stdout.readline().split())
    try:
        assert _alive(server) and _alive(core)
        trainer.kill()
        trainer.wait()
        assert _gone([server, core]), "the server's group outlived the SIGKILLed trainer"
    finally:
        for pid in (server, core):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_close_ends_the_watchdog_and_what_is_left_of_the_group():
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    core = int(server.stdout.readline())
    watchdog = GroupWatchdog(server.pid)
    try:
        watchdog.close()
        assert watchdog.proc.returncode is not None
        server.wait(timeout=10)
        assert _gone([core])
    finally:
        for pid in (server.pid, core):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
