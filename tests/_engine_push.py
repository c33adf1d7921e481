"""Shared by the engine tests: the trainer's weights of a HF folder (torchtitan names and layout) and what every engine
receives of them (HF names and layout), a push done the way ``WeightSyncer`` does it, and waiting for an event."""

from __future__ import annotations

import functools
import queue
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_flux import compat
from torchtitan_flux.models import families, hf_weights

from torchtitan_flux.wire import transport
from torchtitan_flux.engine.base import EngineError


def trainer_model(model_dir) -> nn.Module:
    """The trainer's model of a HF folder (torchtitan names and layout; a tied head is one parameter), fp32, eval."""
    config = families.config_from_hf_dir(model_dir)
    model = config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    hf_weights.load_hf_weights(model, model_dir, config)
    return model.eval()


def trainer_weights(model_dir) -> dict[str, torch.Tensor]:
    """The trainer's parameters of a HF folder: clean torchtitan names, in push order."""
    return {n: p.detach().clone() for n, p in trainer_model(model_dir).named_parameters()}


@functools.lru_cache(maxsize=None)
def layout_of(model_dir) -> hf_weights.HFLayout:
    """The HF names and layout every engine of the model in ``model_dir`` loads (what the syncer maps to)."""
    return hf_weights.HFLayout.from_hf_dir(str(model_dir))


def engine_specs(handler, specs: list, layout=None) -> list:
    """A join's parameter list as the syncer sends it to ``handler``: under HF names (``layout``: the folder's)."""
    return (layout or layout_of(str(handler.model_dir))).hf_specs(specs)


def as_pushed(layout, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Trainer parameters (torchtitan names) as every engine receives them: HF names and layout, what
    ``inference`` runs. ``layout``: an ``HFLayout`` (``layout_of``)."""
    names = layout.hf_names(list(weights), [tuple(t.shape) for t in weights.values()])
    return {h: layout.wire_tensor(n, t) for h, (n, t) in zip(names, weights.items())}


def push_like_syncer(handler, pg, plan, weights: dict, version: int, layout=None) -> transport.FlatWeights:
    """The layout's ``wire_tensor`` (``layout``: the folder's) while copying into a staging buffer, ``wire_tensors``
    for the broadcast list, between ``begin_update`` and ``finish_update``; returns the staging buffer."""
    staging = plan.allocate()
    for i, b in enumerate(plan.buckets):
        for s, view in zip(plan.specs[b.start : b.end], staging.bucket_views(i)):
            view.copy_((layout or layout_of(str(handler.model_dir))).wire_tensor(s.name, weights[s.name]))
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


def gloo_pair(prefix: str):
    """Two ranks of one gloo weight-sync group, built on two threads of this process (rank 0, rank 1)."""
    store = dist.HashStore()
    out = [None, None]

    def build(rank):
        out[rank] = compat.new_weight_sync_group("gloo", dist.PrefixStore(prefix, store), rank, 2,
                                                 timedelta(seconds=30))

    ts = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out
