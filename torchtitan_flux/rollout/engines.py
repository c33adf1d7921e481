"""``EngineFleet``: starting rank 0's rollout engines, replacing a dead one, stopping them all.

Which engines (``rollout.engine``): embedded engine processes (placed on ``rollout.engine_devices``), vLLM servers
we launch (``rollout.launch``) or servers someone else runs (``rollout.urls``: vLLM or SGLang). A dead engine is
replaced (an embedded one by a fresh process; a server off the main thread, ``rollout/reconnect.py``: one we
launched is stopped and launched again, since it may be wedged; another is reconnected if it is back) at most
``rollout.max_engine_restarts`` times per engine within ``RESTART_WINDOW_S``, and not at all while the run stops on
a signal. Every handler reports to the one ``events`` queue given here. Concurrency: the main thread; a server's
relaunch on its reconnect thread (``_reconnect``).
"""

from __future__ import annotations

import logging
import os
import queue
import time

import torch

from torchtitan_flux.auth import read_token
from torchtitan_flux.engine.base import EngineHandler
from torchtitan_flux.engine.kinds import engine_kind
from torchtitan_flux.errors import EngineStartError
from torchtitan_flux.rollout.placement import engine_devices, visible_devices_env
from torchtitan_flux.rollout.reconnect import Reconnecting

logger = logging.getLogger("torchtitan_flux")

RESTART_WINDOW_S = 600.0  # rollout.max_engine_restarts counts restarts of one engine within this window


class EngineFleet:
    """``stops``: the run's ``StopRequests`` (read: ``signal``)."""

    def __init__(self, job_config, events: queue.Queue, *, device: torch.device, stops):
        self.job_config, self.events, self.stops = job_config, events, stops
        self.trainer_on_gpu = device.type == "cuda"
        self.device = device
        self.servers: list = []  # launched vLLM servers (stopped by ``close``)
        self.restarts = 0
        self._restart_times: dict[int, list[float]] = {}  # engine index -> monotonic times of recent restarts
        self._urls: list[str] = []
        self._devices: list[str] = []
        self._closed = False  # ``close`` ran: a relaunch that ends later stops its server (``_reconnect``)

    def start(self) -> list[EngineHandler]:
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
            self.servers = self._launch(self._devices, [f"vllm_server{i}.log" for i in range(r.num_engines)])
            self._urls = [s.url for s in self.servers]
        n = len(self._urls) if kind.server else r.num_engines
        engines: list[EngineHandler] = []
        try:
            for i in range(n):
                engines.append(self._new_engine(i))
        except BaseException:
            for e in engines:
                e.close()
            raise
        return engines

    def _launch(self, devices: list[str], log_names: list[str]) -> list:
        """vLLM servers, one per device in ``devices`` (``launch_servers``), healthy."""
        from torchtitan_flux.engine.vllm_launch import launch_servers, resolve_launch_python

        r = self.job_config.rollout
        return launch_servers(
            len(devices), self.job_config.hf_assets_path, python=resolve_launch_python(r.launch_python),
            log_dir=self.job_config.dump_folder, timeout_s=r.launch_timeout_s,
            threads=None if torch.cuda.is_available() else r.engine_threads,
            auth_token=read_token(self.job_config.weight_sync.auth_token_env), log_names=log_names,
            envs=[visible_devices_env(d, os.environ.get("CUDA_VISIBLE_DEVICES")) for d in devices],
        )

    def replace(self, dead: EngineHandler, index: int) -> EngineHandler | Reconnecting | None:
        """Engine ``index``'s replacement, started, or for a server a ``Reconnecting`` placeholder (its thread
        reconnects); None when it is given up: while the run stops on a signal, or past
        ``rollout.max_engine_restarts`` deaths within ``RESTART_WINDOW_S`` (restarts of our engines and reconnects
        to servers alike: a server wedged after an aborted push took joins and died again, forever)."""
        dead.close()
        if self.stops.signal is not None:
            logger.warning(f"{dead.name}: not restarted: the run is stopping ({self.stops.signal})")
            return None
        now = time.monotonic()
        recent = [t for t in self._restart_times.get(index, []) if now - t < RESTART_WINDOW_S]
        cap = self.job_config.rollout.max_engine_restarts
        if len(recent) >= cap:  # reconnects too: a server that takes a join and dies at every push would loop
            again = "reconnected" if dead.reconnects else "restarted"
            logger.error(f"{dead.name}: died {len(recent) + 1} times within {RESTART_WINDOW_S:.0f} s "
                         f"(rollout.max_engine_restarts = {cap}); not {again} again: its error is the 'died' line "
                         "above")
            return None
        self._restart_times[index] = recent + [now]
        self.restarts += 1
        if dead.reconnects:  # off the main thread: a wedged server blocks its start-up checks
            nth = self.restarts
            return Reconnecting(dead, lambda: self._reconnect(dead, index, nth), self.events)
        return self._new_engine(index)

    def _reconnect(self, dead: EngineHandler, index: int, nth: int) -> EngineHandler:
        """Reconnect thread: a server we launched is stopped and launched again (a dead handler's server may be
        wedged by an abandoned push: only a new process is sure to serve), then connected; another server is
        reconnected if it is back. Raises when it cannot be."""
        if not self.servers:
            return dead.reconnect()
        self.servers[index].stop(grace_s=5.0)
        logger.warning(f"{dead.name}: relaunching the vLLM server we launched at {self._urls[index]}")
        [server] = self._launch([self._devices[index]], [f"vllm_server{index}.relaunch{nth}.log"])
        self.servers[index], self._urls[index] = server, server.url
        if self._closed:  # the run ended while it started
            server.stop(grace_s=5.0)
            raise EngineStartError(f"{dead.name}: the run ended while its server was relaunched")
        return self._new_engine(index)

    def close(self, engines: list[EngineHandler]) -> None:
        """Stop ``engines``, then the servers we launched."""
        self._closed = True
        for e in engines:
            e.close()
        for s in self.servers:
            s.stop()

    def _new_engine(self, index: int) -> EngineHandler:
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
                    model_dir=self.job_config.hf_assets_path, auth_token=token, **kw)
        else:
            e = cls(
                f"engine{index}", self.job_config.hf_assets_path, r.engine_threads, self.events,
                self._devices[index], weight_buffers=self.job_config.off_policy.max_version_gap + 1,
                auth_token=token, colocated=r.colocated, continuous_batching=r.continuous_batching,
                max_batch_sequences=r.max_batch_sequences, kv_slots=self.job_config.training.seq_len,
                in_flight_weight_updates=r.in_flight_weight_updates, decode_graphs=r.decode_graphs,
            )
        e.start()
        return e
