"""Component-level harness for the weight-sync tests: trainer-side pieces wired the way ``FluxTrainer`` wires them,
without torchrun or torchtitan.

* the "policy" is a plain ``nn.Module`` whose parameters are the tiny llama's weights under torchtitan names
  (``tok_embeddings.weight``, ``layers.0.attention.wq.weight``, ...), so the real ``EmbeddedEngine`` child process
  can generate with whatever it receives;
* one ``WeightSyncer(is_sender=True)`` (gloo, loopback, port 0), a ``RolloutScheduler`` on the digits task with a
  byte tokenizer, ``WeightSyncer(pump=scheduler.pump)`` and ``on_engine_dead = restart`` exactly as in
  ``EngineFleet.restart`` (close the dead handler, start a new one, ``WeightSyncer.replace_engine``).
"""

from __future__ import annotations

import queue
import time
from pathlib import Path
from typing import Callable

import torch
from conftest import FIGURES
from torch import nn

from torchtitan_flux import assets

from torchtitan_flux import weight_dict
from torchtitan_flux.config import WeightSync
from torchtitan_flux.engine.embedded import EmbeddedEngine
from torchtitan_flux.rollout import RolloutScheduler
from torchtitan_flux.tasks import DigitsTask
from torchtitan_flux.weight_sync import WeightSyncer


class ByteTokenizer:
    """The byte-level tokenizer of ``assets`` (token = BYTE_OFFSET + byte), enough for the scheduler."""

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        ids = [assets.BYTE_OFFSET + b for b in text.encode()]
        return ([assets.BOS_ID] if add_bos else []) + ids + ([assets.EOS_ID] if add_eos else [])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - assets.BYTE_OFFSET for i in ids if i >= assets.BYTE_OFFSET).decode(errors="replace")


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
        self.engines = [self._new_engine(i) for i in range(num_engines)]
        self.restarts: list[tuple[int | None, int | None]] = []  # (old pid, new pid)
        for e in self.engines:  # serves its pipe once up (the first start waits for the fork server's imports)
            e.checksum(timeout=60)
        cfg = WeightSync(
            async_weight_update=async_mode, timeout_seconds=timeout_s, bucket_size_mb=bucket_size_mb, master_port=0,
            method=method,
        )
        self.scheduler = RolloutScheduler(
            self.engines, self.events, DigitsTask(), ByteTokenizer(),
            group_size=group_size, prompts_per_step=prompts_per_step, max_new_tokens=max_new_tokens,
            temperature=1.0, top_k=0, seed=0, pad_id=assets.PAD_ID, max_version_gap=10**6,  # no admission wait
            on_weight_event=lambda ev: self.syncer.on_event(ev), on_engine_dead=self._restart_engine,
        )
        self.syncer = WeightSyncer(cfg, self.model, self.engines, device=torch.device("cpu"), is_sender=True,
                                   pump=self.scheduler.pump)
        self.syncer.connect()

    def _new_engine(self, index: int) -> EmbeddedEngine:
        e = EmbeddedEngine(f"engine{index}", self.model_dir, 1, self.events)
        e.start()
        return e

    def _restart_engine(self, dead: EmbeddedEngine) -> EmbeddedEngine:
        """What ``EngineFleet.restart`` does."""
        old_pid = dead.pid
        dead.close()
        idx = self.engines.index(dead)
        new = self._new_engine(idx)
        self.engines[idx] = new
        self.syncer.replace_engine(dead, new)
        self.restarts.append((old_pid, new.pid))
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
        for e in self.engines:
            e.close()


def assert_in_sync(h: Harness, version: int, i: int = 0) -> None:
    """Engine ``i`` holds ``version``, bitwise equal to the staging buffer, which equals the model's parameters."""
    FIGURES["checksums_compared"] += 1
    assert h.engine_checksum(i) == (version, h.staging_checksum())
    params = params_snapshot(h.model)
    assert all(h.syncer.staging.views[n].equal(p) for n, p in params.items())
