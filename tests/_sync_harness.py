"""Component-level harness for the weight-sync tests: rank 0's real rollout side (``rollout.rollouts.Rollouts``:
the engine fleet, event pump, group table and the weight syncer it builds), without torchrun or the trainer.

* the "policy" is the trainer's model of the tiny llama (``_engine_push.trainer_model``: torchtitan names and
  layout), which the real ``EmbeddedEngine`` child process receives in HF names and layout, as every engine does;
* ``Rollouts`` is built from the real config sections, as the trainer builds it: embedded engines on CPU, the
  digits task with a byte tokenizer (``fakes.stub_tokenizers``), its syncer on gloo, loopback, port 0.
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
from _engine_push import as_pushed, layout_of, trainer_model

from torchtitan_flux.engine.base import GenerationResult
from torchtitan_flux.models import weight_dict
from torchtitan_flux.config import OffPolicy, Rollout, WeightSync
from torchtitan_flux.rollout.rollouts import Rollouts
from torchtitan_flux.data.tasks import DigitsTask


class ResultPump:
    """The rollout side's pump over one bare engine's ``events``, for tests without ``Rollouts``: results kept by
    request id, every other event to the syncer (``attach``, once it is built with this pump)."""

    def __init__(self, events):
        self.events, self.results, self.syncer = events, {}, None

    def attach(self, syncer) -> None:
        self.syncer = syncer

    def __call__(self, timeout: float) -> None:
        try:
            ev = self.events.get(timeout=timeout)
        except queue.Empty:
            return
        if isinstance(ev, GenerationResult):
            self.results[ev.req_id] = ev
        else:
            self.syncer.on_event(ev)


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
        num_engines: int = 1,
        prompts_per_step: int = 2,
        group_size: int = 4,
        max_new_tokens: int = 8,
        colocated: bool = False,
        wire_dtype: str = "auto",
        method: str = "dense",
    ):
        self.model_dir = str(model_dir)
        self.shape = weight_dict.ModelShape.from_hf_dir(model_dir)
        self.model = trainer_model(model_dir)
        cfg = WeightSync(
            async_weight_update=async_mode, timeout_seconds=timeout_s, bucket_size_mb=bucket_size_mb, master_port=0,
            wire_dtype=wire_dtype, method=method,
        )
        job_config = SimpleNamespace(
            # never gives an engine up (the tests count restarts in ``restarts``); one thread per engine
            rollout=Rollout(num_engines=num_engines, engine_threads=1, max_engine_restarts=10**6,
                            prompts_per_step=prompts_per_step, max_new_tokens=max_new_tokens, top_k=0, seed=0,
                            colocated=colocated),
            grpo=SimpleNamespace(group_size=group_size, temperature=1.0),
            weight_sync=cfg,
            off_policy=OffPolicy(max_version_gap=1),  # only sizes the engines' weight buffers (2)
            hf_assets_path=self.model_dir,
            dump_folder="",  # server logs: no servers here
            training=SimpleNamespace(steps=0, seq_len=128),  # steps: final version of vLLM checksums (no vLLM here)
        )
        self.rollouts = Rollouts.start(job_config, DigitsTask(), ByteTokenizer(), self.model, device=torch.device("cpu"),
                                  stops=SimpleNamespace(signal=None))  # no signal handlers in the test process
        self.syncer = self.rollouts.syncer
        for e in self.engines:  # serves its pipe once up (the first start waits for the fork server's imports)
            e.checksum(timeout=60)
        self.syncer.connect()

    @property
    def engines(self) -> list:
        return self.rollouts.engines

    @property
    def restarts(self) -> int:
        return self.rollouts.fleet.restarts

    @property
    def link(self):
        return self.syncer.links[0]

    def miss_a_push(self, version: int) -> None:
        """Engine 0 stalls in the middle of every push (60 s); ``version`` is trained and pushed (async) and the
        push gives up on it at its deadline: its link is BROKEN."""
        from torchtitan_flux.sync.links import LinkState

        eng = self.engines[0]
        eng.inject_fault("stall_receive", 60.0)
        eng.checksum()  # a round trip: the fault is in place
        perturb(self.model, seed=version)
        self.syncer.after_optimizer_step(version)
        self.pump_until(lambda: not self.syncer.busy(), 10.0, f"the push of version {version} to give up")
        assert self.link.state is LinkState.BROKEN and self.link.acked < version

    def pump_until(self, cond: Callable[[], bool], timeout: float, what: str = "") -> float:
        """Pump engine events until ``cond()``; returns the seconds it took."""
        t0 = time.monotonic()
        while not cond():
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"timed out after {timeout}s waiting for {what or cond}")
            self.rollouts.pump.pump(0.02)
        return time.monotonic() - t0

    def drain(self, seconds: float) -> None:
        """Pump whatever arrives during ``seconds``."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.rollouts.pump.pump(0.02)

    def engine_checksum(self, i: int = 0) -> tuple[int, str]:
        return self.engines[i].checksum(timeout=30)

    def staging_checksum(self) -> str:
        return self.syncer.staging.checksum()

    def wire(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's ``params`` (``params_snapshot``) as staging holds them: the trainer's names, HF layout."""
        return {n: layout_of(self.model_dir).wire_tensor(n, p) for n, p in params.items()}

    def engine_weights(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's ``params`` as the engines hold them: HF names and layout."""
        return as_pushed(layout_of(self.model_dir), params)

    def close(self) -> None:
        self.rollouts.close()


def assert_in_sync(h: Harness, version: int, i: int = 0) -> None:
    """Engine ``i`` holds ``version``, bitwise equal to the staging buffer, which holds the model's parameters in the
    engines' (HF) layout."""
    FIGURES["checksums_compared"] += 1
    assert h.engine_checksum(i) == (version, h.staging_checksum())
    assert all(h.syncer.staging.views[n].equal(p) for n, p in h.wire(params_snapshot(h.model)).items())
