"""``VllmNcclEngine``: vLLM on GPU, with weights sent by vLLM's own trainer-side NCCL engine
(``NCCLTrainerWeightTransferEngine``), so vLLM owns both ends of the wire (which engine when: docs/gpu.md).

Fit with our push thread (``sync/pusher.py``): ``own_group`` runs vLLM's ``trainer_init`` in the joiner thread (it
posts ``/init_weight_transfer_engine`` itself, on a TCPStore of its own). A push is ``self_push``: on this
handler's control thread (the one thread that issues this communicator's collectives) pause -> ``send_weights()``
-> reset prefix cache -> resume, polled by the pusher like any Work. The source is our staging buffer, copied to
the GPU on vLLM's producer stream. No byte checksum: ``checksum`` is ``HttpEngine``'s (version, None).
"""

from __future__ import annotations

import concurrent.futures
import socket
from typing import Any, Iterator

import torch

from torchtitan_flux.engine.base import WeightGroupInfo
from torchtitan_flux.engine.http import HttpEngine
from torchtitan_flux.engine.vllm import VllmEngine
from torchtitan_flux.sync import cuda_rules

SERVER_BACKEND = "vllm_nccl"  # what ``flux_model_info`` reports for vLLM's own NCCL engine


class HttpWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol on our ``HttpClient`` (token, retries, timeouts)."""

    def __init__(self, engine: "VllmNcclEngine"):
        self.engine = engine
        self.version: int | None = None  # the push in progress; sent as ``weight_version``

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.engine.client.post("/init_weight_transfer_engine", {"init_info": init_info},
                                timeout_s=self.engine._weight_timeout_s)

    def start_weight_update(self) -> None:
        self.engine.client.post("/start_weight_update")

    def update_weights(self, update_info) -> None:
        self.engine.client.post("/update_weights", {"update_info": dict(update_info)},
                                timeout_s=self.engine._weight_timeout_s)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else str(self.version)
        self.engine.client.post("/finish_weight_update", {"weight_version": version})


def staging_source(engine: "VllmNcclEngine", device: torch.device):
    """A vLLM ``WeightSource`` over ``engine``'s current staging buffer (set by ``self_push``)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class StagingSource(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, getattr(torch, d), tuple(s))
                    for names, dtypes, shapes in engine._bucket_meta for n, d, s in zip(names, dtypes, shapes)]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            plan = engine._plan
            for (names, _, _), b, flat in zip(engine._bucket_meta, plan.buckets, engine._flats):
                off = 0
                for name, spec in zip(names, plan.specs[b.start : b.end]):
                    view = flat[off : off + spec.numel].view(spec.shape)
                    off += spec.numel
                    yield name, view.to(device, non_blocking=True)  # on vLLM's producer stream

    return StagingSource()


class _FutureWork:
    """A ``concurrent.futures.Future`` seen as a Work (``is_completed`` / ``wait``) by ``cuda_rules.wait_works``."""

    def __init__(self, future: concurrent.futures.Future):
        self.future = future

    def is_completed(self) -> bool:
        return self.future.done()

    def wait(self, timeout=None) -> bool:
        self.future.result(timeout=0 if self.future.done() else None)
        return True


class VllmNcclEngine(VllmEngine):
    """``VllmEngine`` whose pushes go through vLLM's own NCCL engines (see the module docstring)."""

    expected_backends = (SERVER_BACKEND,)
    rendezvous_handshake = False  # vLLM's rendezvous is its own (a TCPStore on a port of its own)

    def __init__(self, *args, **kw):
        kw.pop("verify_every", None)  # vLLM's receiver keeps no hash (``reconnect`` passes the kwargs back)
        super().__init__(*args, verify_every=0, **kw)
        self._transfer = None
        self._client = HttpWeightSyncClient(self)
        self._flats: list[torch.Tensor] = []
        self._device: torch.device | None = None

    def _init_group(self, info: WeightGroupInfo) -> None:
        pass  # vLLM's trainer_init posts /init_weight_transfer_engine itself (see own_group)

    def own_group(self, store: Any, info: WeightGroupInfo, device: torch.device | None = None) -> Any:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

        with socket.socket() as s:  # vLLM's TCPStore needs a port of its own
            s.bind((info.host, 0))
            port = s.getsockname()[1]
        init = NCCLTrainerInitInfo(rank=0, master_address=info.host, master_port=port, world_size=2)
        self._device = device or torch.device("cuda", torch.cuda.current_device())
        self._transfer = NCCLTrainerWeightTransferEngine.trainer_init(
            init, client=self._client, source=staging_source(self, self._device))
        return self._transfer

    def begin_update(self, version: int) -> None:
        pass  # the push is ``self_push``

    def self_push(self, version: int, flats: list[torch.Tensor]) -> _FutureWork:
        self._flats, self._client.version = flats, version
        future: concurrent.futures.Future = concurrent.futures.Future()

        def task():
            try:
                cuda_rules.bind_thread(self._device)  # rule 6: this control thread issues the broadcasts
                self._update_task(version)
                future.set_result(None)
            except BaseException as e:  # noqa: BLE001 - surfaced by the pusher through wait()
                future.set_exception(e)

        self._ctl.submit(task)
        return _FutureWork(future)

    # the push steps of ``HttpEngine._update_task``: vLLM's engine does start / update / finish itself
    def _open(self, version: int) -> None:
        pass

    def _send_bucket(self, i, n, names, dtypes, shapes, version) -> None:
        if i == 0:
            self._transfer.send_weights()

    def _close(self, version: int) -> None:
        self.client.post("/reset_prefix_cache")

    checksum = HttpEngine.checksum  # (version, None): not VllmEngine's, which asks our gloo receiver for its hash
