"""``Rollouts``: rank 0's rollout side as one object: the engines, their event queue, the scheduler (inherited:
dispatch, collect, ``pump``) and the weight syncer that sends to the engines.

Which engines (``rollout.engine``): embedded engine processes (placed on ``rollout.engine_devices``), vLLM servers
we launch (``rollout.launch``) or servers someone else runs (``rollout.urls``: vLLM or SGLang). A dead engine is
replaced (an embedded one by a fresh process, a server by a reconnect) at most ``rollout.max_engine_restarts``
times per engine within ``RESTART_WINDOW_S``, and not at all while the run stops on a signal.

Direction: ``Rollouts`` builds rank 0's ``WeightSyncer`` with its own ``pump`` (the syncer waits by pumping);
``pump`` delivers acks and engine errors to the syncer (``on_event``) and replacements (``replace_engine``), and
the syncer calls nothing else here. Ranks > 0 have no rollout side. Concurrency: main thread only; engine threads
and processes only put events on the queue.
"""

from __future__ import annotations

import logging
import os
import queue
import time

import torch

from torchtitan_flux.auth import read_token
from torchtitan_flux.engine.kinds import engine_kind
from torchtitan_flux.models import hf
from torchtitan_flux.models.hf_weights import HFLayout
from torchtitan_flux.rollout.multiturn import episode_groups
from torchtitan_flux.rollout.placement import engine_devices, visible_devices_env
from torchtitan_flux.rollout.scheduler import RolloutScheduler
from torchtitan_flux.sync.syncer import WeightSyncer

logger = logging.getLogger("torchtitan_flux")

RESTART_WINDOW_S = 600.0  # rollout.max_engine_restarts counts restarts of one engine within this window


class Rollouts(RolloutScheduler):
    """``stops``: the run's ``StopRequests`` (read: ``signal``)."""

    def __init__(self, job_config, task, tokenizer, model: torch.nn.Module, *, device: torch.device, stops):
        self.job_config, self.stops, self.trainer_on_gpu = job_config, stops, device.type == "cuda"
        self.device = device
        self.servers: list = []  # launched vLLM servers (stopped by ``close``)
        self.restarts = 0
        self._restart_times: dict[int, list[float]] = {}  # engine index -> monotonic times of recent restarts
        self.events: queue.Queue = queue.Queue()
        self.engines: list = []
        self.syncer: WeightSyncer | None = None
        jc, r = job_config, job_config.rollout
        try:
            self._start()
            super().__init__(
                self.engines, self.events, task, tokenizer, group_size=jc.grpo.group_size,
                prompts_per_step=r.prompts_per_step, max_new_tokens=r.max_new_tokens, temperature=jc.grpo.temperature,
                top_k=r.top_k, seed=r.seed, pad_id=_pad_id(tokenizer, jc.model.hf_assets_path),
                dead_zone=r.dispatch_dead_zone, max_share=r.dispatch_max_share,
                reward_workers=r.reward_workers, reward_timeout_s=r.reward_timeout_seconds,
                task_timeout_s=r.task_timeout_seconds, stall_s=r.engine_stall_seconds,
                streaming=r.streaming_admission, carry_over=r.streaming_carry_over,
                episodes=episode_groups(job_config, tokenizer, self.events),
            )
            self.syncer = WeightSyncer(jc.weight_sync, model, self.engines, device=device, is_sender=True,
                                       backend="nccl" if self.trainer_on_gpu else "gloo", pump=self.pump,
                                       layout=HFLayout.from_hf_dir(jc.model.hf_assets_path))
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        """Launch servers (``rollout.launch``), then start or connect every engine (``EngineStartError``)."""
        r = self.job_config.rollout
        kind = engine_kind(r.engine)
        self._urls = list(r.urls)
        # before any engine starts; servers at rollout.urls are placed by their owner
        self._devices = [str(self.device)] * r.num_engines if r.colocated else engine_devices(
            list(r.engine_devices), r.num_engines, trainer_on_gpu=self.trainer_on_gpu,
            visible=torch.cuda.device_count(), local_world=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        ) if kind.local(r.launch) else []
        if r.launch:
            from torchtitan_flux.engine.vllm_launch import resolve_launch_python
            from torchtitan_flux.engine.vllm_launch import launch_servers

            self.servers = launch_servers(
                r.num_engines, self.job_config.model.hf_assets_path, python=resolve_launch_python(r.launch_python),
                log_dir=self.job_config.job.dump_folder, timeout_s=r.launch_timeout_s,
                threads=None if torch.cuda.is_available() else r.engine_threads,
                auth_token=read_token(self.job_config.weight_sync.auth_token_env),
                envs=[visible_devices_env(d, os.environ.get("CUDA_VISIBLE_DEVICES")) for d in self._devices],
            )
            self._urls = [s.url for s in self.servers]
        n = len(self._urls) if kind.server else r.num_engines
        self.engines.extend(self._new_engine(i) for i in range(n))

    def _weight_event(self, ev) -> None:
        self.syncer.on_event(ev)

    def _replace(self, dead):
        """A dead engine's replacement, rejoined by the syncer; None when it is given up: while the run stops on a
        signal, past ``rollout.max_engine_restarts`` deaths within ``RESTART_WINDOW_S`` (restarts of our engines and
        reconnects to servers alike: a server wedged after an aborted push took joins and died again, forever), or
        a server that is not back."""
        dead.close()
        if self.stops.signal is not None:
            logger.warning(f"{dead.name}: not restarted: the run is stopping ({self.stops.signal})")
            return None
        idx = self.engines.index(dead)
        now = time.monotonic()
        recent = [t for t in self._restart_times.get(idx, []) if now - t < RESTART_WINDOW_S]
        cap = self.job_config.rollout.max_engine_restarts
        if len(recent) >= cap:  # reconnects too: a server that takes a join and dies at every push would loop
            again = "reconnected" if dead.reconnects else "restarted"
            logger.error(f"{dead.name}: died {len(recent) + 1} times within {RESTART_WINDOW_S:.0f} s "
                         f"(rollout.max_engine_restarts = {cap}); not {again} again: its error is the 'died' line "
                         "above")
            return None
        self._restart_times[idx] = recent + [now]
        self.restarts += 1
        if dead.reconnects:  # an HTTP server is not ours to restart: reconnect if it is back
            try:
                new = dead.reconnect()
            except Exception as e:  # noqa: BLE001
                logger.error(f"{dead.name}: server gone ({e}); going on without it")
                return None
        else:
            new = self._new_engine(idx)
        self.syncer.replace_engine(dead, new)
        return new

    def close(self) -> None:
        """Stop the syncer's threads, every engine, then the servers we launched."""
        if self.syncer is not None:
            self.syncer.close()
        for e in self.engines:
            e.close()
        for s in self.servers:
            s.stop()

    def _new_engine(self, index: int):
        r, ws = self.job_config.rollout, self.job_config.weight_sync
        kind = engine_kind(r.engine)
        cls = kind.handler_class(self.trainer_on_gpu)
        token = read_token(ws.auth_token_env)  # never stored: not in checkpoints
        if kind.server:  # connect and check it (start() raises)
            kw = {}
            if kind.sampled_checksums:  # of what the server received (weight_sync.verify_every)
                kw = dict(verify_every=ws.verify_every, final_version=self.job_config.training.steps)
            if kind.in_flight_updates:  # pushes land while its generations run (rollout.in_flight_weight_updates)
                kw["in_flight"] = r.in_flight_weight_updates
            e = cls(f"{kind.name}{index}", self._urls[index], self.events,
                    model_dir=self.job_config.model.hf_assets_path, auth_token=token, **kw)
        else:
            e = cls(
                f"engine{index}", self.job_config.model.hf_assets_path, r.engine_threads, self.events,
                self._devices[index], weight_buffers=self.job_config.off_policy.max_version_gap + 1,
                auth_token=token, colocated=r.colocated, continuous_batching=r.continuous_batching,
                max_batch_sequences=r.max_batch_sequences, in_flight_weight_updates=r.in_flight_weight_updates,
            )
        e.start()
        return e


def _pad_id(tokenizer, hf_dir: str) -> int:
    pad = tokenizer.tokenizer.token_to_id("<|pad|>") if hasattr(tokenizer, "tokenizer") else None
    return hf.tokenizer_settings(hf_dir)["pad_token_id"] if pad is None else pad
