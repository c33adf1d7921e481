"""A push done the way ``WeightSyncer`` does it with an HTTP engine's hooks, for the engine tests."""

from __future__ import annotations

from datetime import timedelta

from torchtitan_flux import compat, transport


def push_like_syncer(handler, pg, plan, weights: dict, version: int) -> transport.FlatWeights:
    """``wire_tensor`` while copying into a staging buffer, ``wire_tensors`` for the broadcast list, between
    ``begin_update`` and ``finish_update``; returns the staging buffer."""
    staging = plan.allocate()
    for i, b in enumerate(plan.buckets):
        for s, view in zip(plan.specs[b.start : b.end], staging.bucket_views(i)):
            view.copy_(handler.wire_tensor(s.name, weights[s.name]))
    header = transport.encode_header(plan, version, list(range(len(plan.buckets))), transport.METHOD_FULL)
    handler.begin_update(version)
    works = [compat.broadcast(pg, t) for t in handler.wire_tensors(header, staging.flats)]
    for w in works:
        w.wait(timedelta(seconds=60))
    handler.finish_update(version)
    return staging
