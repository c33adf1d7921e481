"""Component-level harness for the weight-sync tests: trainer-side pieces wired the way ``FluxTrainer`` wires them,
without torchrun or torchtitan.

* the "policy" is a plain ``nn.Module`` whose parameters are the tiny llama's weights under torchtitan names
  (``tok_embeddings.weight``, ``layers.0.attention.wq.weight``, ...), so the real ``EmbeddedEngine`` child process
  can generate with whatever it receives;
* the engines are the trainer's own ``EngineFleet`` (embedded engines on CPU), built from the real config
  sections;
* one ``WeightSyncer(is_sender=True)`` (gloo, loopback, port 0), a ``RolloutScheduler`` on the digits task with a
  byte tokenizer (``fakes.stub_tokenizers``), ``WeightSyncer(pump=scheduler.pump)`` and an ``on_engine_dead``
  that does what ``FluxTrainer._on_engine_dead`` does (``EngineFleet.restart``, then
  ``WeightSyncer.replace_engine``).
"""

from __future__ import annotations

import queue
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
from conftest import FIGURES
from fakes.stub_tokenizers import ByteTokenizer
from torch import nn

import model_assets as assets

from torchtitan_flux.models import weight_dict
from torchtitan_flux.config import OffPolicy, Rollout, WeightSync
from torchtitan_flux.rollout.fleet import EngineFleet
from torchtitan_flux.rollout.scheduler import RolloutScheduler
from torchtitan_flux.data.tasks import DigitsTask
from torchtitan_flux.sync.syncer import WeightSyncer


def module_from_weights(weights: dict[str, torch.Tensor]) -> nn.Module:
    """An ``nn.Module`` whose ``named_parameters()`` are exactly ``weights`` (same names, same order)."""
    root = nn.Module()
    for name, t in weights.items():
        *path, leaf = name.split(".")
        m = root
        for p in path:
            if not hasattr(m, p):
                m.add_module(p, nn.Module())
            m = getattr(m, p)
        m.register_parameter(leaf, nn.Parameter(t.detach().clone()))
    return root


def params_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@torch.no_grad()
def perturb(model: nn.Module, seed: int, scale: float = 0.05) -> None:
    """Stand-in for an optimizer step: change every parameter."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g) * scale)


class Harness:
    def __init__(
        self,
        model_dir: Path,
        *,
        async_mode: bool,
        timeout_s: float = 3.0,
        bucket_size_mb: float = 64.0,
        method: str = "full",
        num_engines: int = 1,
        prompts_per_step: int = 2,
        group_size: int = 4,
        max_new_tokens: int = 8,
    ):
        self.model_dir = str(model_dir)
        weights, self.shape = weight_dict.load_hf_weights_dict(model_dir)
        self.model = module_from_weights(weights)
        self.events: queue.Queue = queue.Queue()
        cfg = WeightSync(
            async_weight_update=async_mode, timeout_seconds=timeout_s, bucket_size_mb=bucket_size_mb, master_port=0,
            method=method,
        )
        job_config = SimpleNamespace(
            # never gives an engine up (the tests count restarts in ``restarts``); one thread per engine
            rollout=Rollout(num_engines=num_engines, engine_threads=1, max_engine_restarts=10**6),
            weight_sync=cfg,
            off_policy=OffPolicy(max_version_gap=1),  # only sizes the engines' weight buffers (2)
            model=SimpleNamespace(hf_assets_path=self.model_dir),
            job=SimpleNamespace(dump_folder=""),  # server logs: no servers here
            training=SimpleNamespace(steps=0),  # final version of vLLM checksums: no vLLM here
        )
        self.fleet = EngineFleet(job_config, self.events, trainer_on_gpu=False)
        self.fleet.start()
        self.engines = self.fleet.engines  # one list, shared with the scheduler and the syncer as in the trainer
        self.restarts: list[tuple[int | None, int | None]] = []  # (old pid, new pid)
        for e in self.engines:  # serves its pipe once up (the first start waits for the fork server's imports)
            e.checksum(timeout=60)
        self.scheduler = RolloutScheduler(
            self.engines, self.events, DigitsTask(), ByteTokenizer(),
            group_size=group_size, prompts_per_step=prompts_per_step, max_new_tokens=max_new_tokens,
            temperature=1.0, top_k=0, seed=0, pad_id=assets.PAD_ID,
            on_weight_event=lambda ev: self.syncer.on_event(ev), on_engine_dead=self._restart_engine,
        )
        self.syncer = WeightSyncer(cfg, self.model, self.engines, device=torch.device("cpu"), is_sender=True,
                                   pump=self.scheduler.pump)
        self.syncer.connect()

    def _restart_engine(self, dead):
        """What ``FluxTrainer._on_engine_dead`` does, and the restart recorded in ``restarts``."""
        old_pid = dead.pid
        new = self.fleet.restart(dead)
        if new is not None:
            self.syncer.replace_engine(dead, new)
        self.restarts.append((old_pid, None if new is None else new.pid))
        return new

    @property
    def link(self):
        return self.syncer.links[0]

    def pump_until(self, cond: Callable[[], bool], timeout: float, what: str = "") -> float:
        """Pump engine events until ``cond()``; returns the seconds it took."""
        t0 = time.monotonic()
        while not cond():
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"timed out after {timeout}s waiting for {what or cond}")
            self.scheduler.pump(0.02)
        return time.monotonic() - t0

    def drain(self, seconds: float) -> None:
        """Pump whatever arrives during ``seconds``."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.scheduler.pump(0.02)

    def engine_checksum(self, i: int = 0) -> tuple[int, str]:
        return self.engines[i].checksum(timeout=30)

    def staging_checksum(self) -> str:
        return self.syncer.staging.checksum()

    def close(self) -> None:
        self.syncer.close()
        self.fleet.close()


def assert_in_sync(h: Harness, version: int, i: int = 0) -> None:
    """Engine ``i`` holds ``version``, bitwise equal to the staging buffer, which equals the model's parameters."""
    FIGURES["checksums_compared"] += 1
    assert h.engine_checksum(i) == (version, h.staging_checksum())
    params = params_snapshot(h.model)
    assert all(h.syncer.staging.views[n].equal(p) for n, p in params.items())
