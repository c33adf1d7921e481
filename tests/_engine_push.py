"""Shared by the HTTP engine tests: a push done the way ``WeightSyncer`` does it, and waiting for an event."""

from __future__ import annotations

import queue
import time
from datetime import timedelta

from torchtitan_flux import compat

from torchtitan_flux.sync import transport
from torchtitan_flux.engine.base import EngineError


def push_like_syncer(handler, pg, plan, weights: dict, version: int) -> transport.FlatWeights:
    """``wire_tensor`` while copying into a staging buffer, ``wire_tensors`` for the broadcast list, between
    ``begin_update`` and ``finish_update``; returns the staging buffer."""
    staging = plan.allocate()
    for i, b in enumerate(plan.buckets):
        for s, view in zip(plan.specs[b.start : b.end], staging.bucket_views(i)):
            view.copy_(handler.wire_tensor(s.name, weights[s.name]))
    header = transport.encode_header(plan, version)
    handler.begin_update(version)
    works = [compat.broadcast(pg, t) for t in handler.wire_tensors(header, staging.flats)]
    for w in works:
        w.wait(timedelta(seconds=60))
    handler.finish_update(version)
    return staging


def wait_event(events: queue.Queue, kind, timeout: float = 60.0):
    """The next event of type ``kind`` from a handler's queue; an ``EngineError`` on the way fails the test."""
    end = time.monotonic() + timeout
    while True:
        ev = events.get(timeout=max(0.01, end - time.monotonic()))
        if isinstance(ev, kind):
            return ev
        if isinstance(ev, EngineError):
            raise AssertionError(f"engine error: {ev}")
