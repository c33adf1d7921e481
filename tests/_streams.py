"""A CPU stand-in for ``wire.cuda_rules.on_stream``: CPU has no streams, so tests give the code under test stand-in
stream objects and record which one is current when a call of interest runs."""

from __future__ import annotations

import contextlib
import threading


class StreamRecorder:
    """``on_stream`` to monkeypatch over ``cuda_rules.on_stream``; ``current``: the stream current on this thread."""

    def __init__(self):
        self._local = threading.local()

    @property
    def current(self):
        return getattr(self._local, "s", None)

    @contextlib.contextmanager
    def on_stream(self, s):
        prev, self._local.s = self.current, s
        try:
            yield
        finally:
            self._local.s = prev
