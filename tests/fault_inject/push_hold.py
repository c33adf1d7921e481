"""The push hold of ``FLUX_FAULT_PUSH_HOLD`` (sitecustomize.py, in torchrun children) and of
``test_livelock.held_push`` (in-process): one definition for both."""

import time


def held_push(original, version: int, seconds: float, held: list):
    """``Pusher.push`` whose first regular push of a version >= ``version`` stays in flight after its bytes went
    out until two more due steps were coalesced (at most ``seconds``); the held version is appended to ``held``."""

    def push(self, v, only=None):
        out = original(self, v, only)
        if v >= version and only is None and not held:
            held.append(v)
            coalesced, deadline = self.table.stats.coalesced, time.monotonic() + seconds
            while self.table.stats.coalesced < coalesced + 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        return out

    return push
