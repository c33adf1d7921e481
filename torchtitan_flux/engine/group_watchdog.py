"""``GroupWatchdog``: a process group that dies with this process, however this process dies.

``PR_SET_PDEATHSIG`` reaches only the child that set it: a launched vLLM server's API server dies with the trainer,
but its engine core and workers (its children, in its process group) would outlive a SIGKILLed trainer. The
watchdog is a small process of its own session that reads a pipe from this process; the pipe's end closes when this
process exits or is killed (the kernel closes its descriptors), and the watchdog then SIGKILLs the whole group.
``close()`` (after the group was stopped) ends the watchdog the same way.

Concurrency: ``close`` from any one thread; the pipe's write end is close-on-exec, so no program this process
starts holds it open (a ``fork`` without exec does, until that child exits: embedded engines die with the trainer).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys

_WATCH = ("import os, signal, sys\n"
          "sys.stdin.buffer.read()\n"  # returns at EOF: the watched process closed its end, or died
          "try:\n"
          "    os.killpg(int(sys.argv[1]), signal.SIGKILL)\n"
          "except (ProcessLookupError, PermissionError):\n"
          "    pass\n")


class GroupWatchdog:
    """SIGKILLs process group ``pgid`` when this process dies or ``close()`` is called (the module docstring)."""

    def __init__(self, pgid: int):
        self.pgid = pgid
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", _WATCH, str(pgid)], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def close(self, timeout_s: float = 5.0) -> None:
        """End the watchdog (it kills what is left of the group first). Idempotent."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout_s)
