"""``ENGINE_KINDS``: the values of ``rollout.engine`` and what each one is, the one place the trainer tells engine
kinds apart (``tests/unit/test_engine_kinds.py`` fails on a comparison with a kind's name anywhere else).

Imports nothing heavy: the entry point reads it before torch and torchtitan are imported (``train.py``), and
engines import ``engine/`` in environments without torchtitan. A kind names its handler class by import path; the
class is imported only when an engine of that kind is built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class EngineKind:
    """One value of ``rollout.engine``."""

    name: str
    """The value of ``rollout.engine``."""

    handler: str
    """The ``EngineHandler`` class of its engines, "package.module:Class"."""

    gpu_handler: str | None
    """The handler class when the trainer is on a GPU, "package.module:Class"; None: ``handler``."""

    server: bool
    """Its engines are servers reached over HTTP, at ``rollout.urls`` or the ones ``rollout.launch`` starts (one
    engine per URL). False: engine processes rank 0 forks, ``rollout.num_engines`` of them, and no URLs."""

    launchable: bool
    """``rollout.launch = true`` starts its servers on this machine."""

    serial: bool
    """An engine serves one request at a time unless ``rollout.continuous_batching`` (``serves_serially``)."""

    borrowable_cores: bool
    """The trainer may compute on an engine's CPU threads while it holds no request
    (``rollout.borrow_idle_engine_cores``); its handler has ``threads`` and ``idle()``."""

    colocatable: bool
    """``rollout.colocated = true`` may put its engines on the trainer's device."""

    in_flight_updates: bool
    """``rollout.in_flight_weight_updates`` applies pushes mid-generation on its engines (embedded: with
    ``rollout.continuous_batching``; vLLM: ``/pause?mode=keep``). False: docs/engines.md says why not."""

    sampled_checksums: bool
    """Its handler takes ``verify_every`` and ``final_version``: the engine hashes what it received on the pushes
    ``weight_sync.verify_every`` samples."""

    def local(self, launch: bool) -> bool:
        """Whether its engines run on this machine (placed on ``rollout.engine_devices``; on CPU, their threads
        come out of the trainer's cores): processes rank 0 forks, or servers ``rollout.launch`` starts."""
        return not self.server or (launch and self.launchable)

    def serves_serially(self, continuous_batching: bool) -> bool:
        """Whether its engines serve one request at a time, which makes the auto ``off_policy.max_pipeline_depth``
        1: a serial kind unless ``rollout.continuous_batching`` is on."""
        return self.serial and not continuous_batching

    def handler_class(self, trainer_on_gpu: bool) -> type:
        """The handler class of its engines (imported now)."""
        module, _, name = (self.gpu_handler if trainer_on_gpu and self.gpu_handler else self.handler).partition(":")
        return getattr(importlib.import_module(module), name)


ENGINE_KINDS: dict[str, EngineKind] = {
    "embedded": EngineKind(
        name="embedded", handler="torchtitan_flux.engine.embedded:EmbeddedEngine", gpu_handler=None, server=False,
        launchable=False, serial=True, borrowable_cores=True, colocatable=True, in_flight_updates=True,
        sampled_checksums=False,
    ),
    "vllm": EngineKind(
        name="vllm", handler="torchtitan_flux.engine.vllm:VllmEngine",
        gpu_handler="torchtitan_flux.engine.vllm_nccl:VllmNcclEngine",  # vLLM's own NCCL engines
        server=True, launchable=True, serial=False, borrowable_cores=False, colocatable=False, in_flight_updates=True,
        sampled_checksums=True,
    ),
    "sglang": EngineKind(
        name="sglang", handler="torchtitan_flux.engine.sglang:SglangEngine", gpu_handler=None, server=True,
        launchable=False, serial=False, borrowable_cores=False, colocatable=False, in_flight_updates=False,
        sampled_checksums=False,
    ),
}


def engine_kind(name: str) -> EngineKind:
    """The kind ``rollout.engine = name`` names."""
    if name not in ENGINE_KINDS:
        raise ValueError(f"rollout.engine = {name!r} is not an engine kind; allowed: {kind_names(lambda k: True)}")
    return ENGINE_KINDS[name]


def kind_names(where: Callable[[EngineKind], bool]) -> str:
    """The kinds ``where`` holds for, as a config value's allowed values: "'vllm' | 'sglang'"."""
    return " | ".join(repr(k.name) for k in ENGINE_KINDS.values() if where(k))
