"""``VllmNcclEngine``: vLLM on GPU, with weights sent by vLLM's own trainer-side NCCL engine
(``NCCLTrainerWeightTransferEngine``), so vLLM owns both ends of the wire (which engine when: docs/gpu.md).

Fit with our push thread (``sync/pusher.py``): ``own_group`` runs vLLM's ``trainer_init`` in the joiner thread (it
posts ``/init_weight_transfer_engine`` itself, on a TCPStore of its own). A push is ``self_push``: on this
handler's control thread (the one thread that issues this communicator's collectives) pause -> ``send_weights()``
-> reset prefix cache -> resume, polled by the pusher like any Work. The source is our staging buffer, copied to
the GPU on vLLM's producer stream. No byte checksum: ``checksum`` is ``HttpEngine``'s (version, None).

Pushes and deadlines (the pusher polls every push against one deadline and calls ``abort`` on the group of an
engine that missed it, ``cuda_rules`` rule 3):
* one push SENDS at a time in this process (``_SENDING``): each allocates vLLM's packed buffers (2 x
  ``weight_sync.bucket_size_mb``, passed to vLLM at ``trainer_init``) and per-tensor copies on the trainer GPU;
* rule (review 4, finding 3): a push is queued until it sends. It takes ``_SENDING`` and becomes running only
  after its gate wait (generations in flight, unless in-flight updates: ``engine/http.py``) and ``/pause``
  (``_sending``; with in-flight updates the pause comes after ``_SENDING``), right before ``send_weights()``, so
  a long generation on one server never makes a push "running" that sent nothing, nor holds up another server's
  push;
* a push still queued at its deadline is cancelled (it read and sent nothing): the engine is not killed, it
  rejoins as usual (once its generation ends it resumes with its old weights);
* a push already sending cannot be cancelled on the server (only its communicator can be aborted): the engine is
  declared dead (``kill``: reconnected, resynced in full) and its completion is never acked (``_Push.finish``).
  Rule: no uncancellable push is ever acked. Our producer stops at once: the push is marked abandoned before the
  abort's ``shutdown()``, and the staging iterator raises at its next tensor, so vLLM's ``send_weights`` never
  broadcasts on the communicator being torn down, reads no more staging, does not wait for ``/update_weights``,
  and releases ``_SENDING`` (fifth review, finding 17).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import threading
from typing import Any, Callable, Iterator

import torch

from torchtitan_flux.engine.base import WeightGroupInfo
from torchtitan_flux.engine.http import HttpEngine
from torchtitan_flux.engine.http_client import HttpError
from torchtitan_flux.engine.vllm import VllmEngine
from torchtitan_flux.wire import cuda_rules

SERVER_BACKEND = "vllm_nccl"  # what ``flux_model_info`` reports for vLLM's own NCCL engine
_SENDING = threading.Lock()  # one vLLM NCCL push at a time in this process (see the module docstring)


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

    def shutdown_weight_transfer_engine(self) -> None:
        """The server releases its communicator (vLLM 0.32: ``PyNcclCommunicator.destroy``, an ``ncclCommAbort``)."""
        self.engine.client.post("/shutdown_weight_transfer_engine")


def staging_source(engine: "VllmNcclEngine", device: torch.device):
    """A vLLM ``WeightSource`` over ``engine``'s current staging buffer (set by ``self_push``)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class StagingSource(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, getattr(torch, d), tuple(s))
                    for names, dtypes, shapes in engine._bucket_meta for n, d, s in zip(names, dtypes, shapes)]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            plan, push = engine._plan, engine._push
            for (names, _, _), b, flat in zip(engine._bucket_meta, plan.buckets, engine._flats):
                off = 0
                for name, spec in zip(names, plan.specs[b.start : b.end]):
                    if push.state != "running":  # abandoned (before the abort's shutdown): the producer stops here
                        raise RuntimeError(f"weight push {push.version} was abandoned at its deadline; vLLM's "
                                           "producer stops before its next broadcast")
                    view = flat[off : off + spec.numel].view(spec.shape)
                    off += spec.numel
                    yield name, view.to(device, non_blocking=True)  # on vLLM's producer stream

    return StagingSource()


def bounded_rendezvous(trainer_init: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """vLLM's ``trainer_init`` on a helper thread, waited for ``timeout_s`` (``weight_sync.timeout_seconds``): its
    TCPStore waits up to 300 s for a server that never connects (a wedged one), and the joiner thread would wait
    with it. Past the bound the join fails like any other (counted, backed off, the engine killed after
    ``links.JOIN_ATTEMPTS``); a rendezvous that completes later is shut down at once (nobody will use it)."""
    outcome: dict[str, Any] = {}
    lock = threading.Lock()

    def run() -> None:
        try:
            transfer = trainer_init()
        except BaseException as e:  # noqa: BLE001 - raised by the joiner, or dropped once abandoned
            with lock:
                outcome["error"] = e
            return
        with lock:
            if "abandoned" not in outcome:
                outcome["transfer"] = transfer
                return
        transfer.shutdown()

    helper = threading.Thread(target=run, name="flux-vllm-rendezvous", daemon=True)
    helper.start()
    helper.join(timeout_s)
    with lock:
        if "transfer" in outcome:
            return outcome["transfer"]
        if "error" in outcome:
            raise outcome["error"]
        outcome["abandoned"] = True
    raise TimeoutError(f"vLLM's weight-transfer rendezvous with {what} did not complete within {timeout_s:g} s "
                       "(weight_sync.timeout_seconds); the server never connected")


class _Push:
    """The handle of one ``self_push``, polled like a Work (``is_completed`` / ``wait``). Its state, under its lock:
    queued -> running -> done, queued -> cancelled, or running -> abandoned (``abandon``, at a missed deadline)."""

    def __init__(self, version: int):
        self.version = version
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.state = "queued"
        self._lock = threading.Lock()

    def _move(self, frm: str, to: str) -> bool:
        with self._lock:
            if self.state != frm:
                return False
            self.state = to
            return True

    def start(self) -> bool:
        """Control thread, holding ``_SENDING`` after the gate wait and pause: whether to send (False: cancelled)."""
        return self._move("queued", "running")

    def finish(self) -> bool:
        """Control thread, after the server confirmed the push: whether it may be acked (False: abandoned)."""
        return self._move("running", "done")

    def abandon(self) -> str:
        """Push thread, at a missed deadline: cancel a queued push, abandon a running one; returns the old state."""
        with self._lock:
            old = self.state
            self.state = {"queued": "cancelled", "running": "abandoned"}.get(old, old)
            return old

    def is_completed(self) -> bool:
        return self.future.done()

    def wait(self, timeout=None) -> bool:
        self.future.result(timeout=0 if self.future.done() else None)
        return True


class _TransferGroup:
    """What ``own_group`` gives the pusher: vLLM's trainer engine, and the ``abort`` of a missed deadline."""

    def __init__(self, engine: "VllmNcclEngine", transfer: Any):
        self.engine, self.transfer = engine, transfer

    def abort(self) -> None:
        """Push thread: give up the push in flight (see the module docstring), then destroy the communicator
        (vLLM 0.32: ``ncclCommAbort``, so the producer's kernels end and its later broadcasts are no-ops)."""
        self.engine._abandon()
        self.transfer.shutdown()


class VllmNcclEngine(VllmEngine):
    """``VllmEngine`` whose pushes go through vLLM's own NCCL engines (see the module docstring)."""

    expected_backends = (SERVER_BACKEND,)
    rendezvous_handshake = False  # vLLM's rendezvous is its own (a TCPStore on a port of its own)
    accepts_patches = False  # vLLM's dense NCCL engine; its sparse one (sparse_nccl_engine.py) is not wired yet

    def __init__(self, *args, **kw):
        kw.pop("verify_every", None)  # vLLM's receiver keeps no hash (``reconnect`` passes the kwargs back)
        super().__init__(*args, verify_every=0, **kw)
        self._transfer = None
        self._client = HttpWeightSyncClient(self)
        self._flats: list[torch.Tensor] = []
        self._device: torch.device | None = None
        self._push: _Push | None = None  # the newest push (set by the push thread, finished by the control thread)
        self._stream = None  # rule 1: current while vLLM's trainer engine runs (``own_group``, ``self_push``)

    def _check_transfer(self, info: dict) -> None:
        """vLLM's NCCL engine on the server, and the same NCCL as ours (rule 7: a mismatch is one error at start,
        never a rejoin loop; a reconnect that meets it gives the server up)."""
        super()._check_transfer(info)
        cuda_rules.require_same_nccl(f"to {self.name} ({self.url})", "trainer", cuda_rules.nccl_version() or "none",
                                     "vLLM server", str(info.get("nccl_version")))

    def _init_group(self, info: WeightGroupInfo) -> None:
        pass  # vLLM's trainer_init posts /init_weight_transfer_engine itself (see own_group)

    def own_group(self, store: Any, info: WeightGroupInfo, device: torch.device | None = None) -> Any:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

        self._release_communicators()
        with socket.socket() as s:  # vLLM's TCPStore needs a port of its own
            s.bind((info.host, 0))
            port = s.getsockname()[1]
        # packed buffers of our bucket size (vLLM's default: 2 x 1 GiB); the worker gets them from trainer_init
        init = NCCLTrainerInitInfo(rank=0, master_address=info.host, master_port=port, world_size=2,
                                   packed_buffer_size_bytes=info.bucket_bytes)
        self._device = device or torch.device("cuda", torch.cuda.current_device())
        self._stream = self._stream or cuda_rules.group_stream(self._device)

        def trainer_init():
            cuda_rules.bind_thread(self._device)  # rule 6, on the rendezvous thread
            with cuda_rules.on_stream(self._stream):  # rule 1: its warm-up all_reduce runs on the current stream
                return NCCLTrainerWeightTransferEngine.trainer_init(
                    init, client=self._client, source=staging_source(self, self._device))

        self._transfer = bounded_rendezvous(trainer_init, info.timeout_s, f"{self.name} ({self.url})")
        return _TransferGroup(self, self._transfer)

    def _release_communicators(self) -> None:
        """Joiner thread, before a rejoin: destroy the previous communicator on both sides (``trainer_init`` makes a
        new one each time; the server's ``init_transfer_engine`` overwrites its own without destroying it)."""
        if self._transfer is None:
            return
        self._transfer.shutdown()
        with contextlib.suppress(HttpError):  # refused during a weight update, or nothing to release
            self._client.shutdown_weight_transfer_engine()

    def begin_update(self, version: int) -> None:
        pass  # the push is ``self_push``

    def self_push(self, version: int, flats: list[torch.Tensor]) -> _Push:
        self._flats, self._client.version = flats, version
        push = self._push = _Push(version)

        def task():
            try:
                cuda_rules.bind_thread(self._device)  # rule 6: this control thread issues the broadcasts
                with cuda_rules.on_stream(self._stream):  # rule 1: send_weights ends synchronizing the current stream
                    self._update_task(version)  # the gate wait and pause, then ``_sending``
                if push.state != "done":  # not sent, or not confirmed: never completed (the pusher rejoins it)
                    raise RuntimeError(f"weight push {version} to {self.name} was not applied ({push.state})")
                push.future.set_result(None)
            except BaseException as e:  # noqa: BLE001 - surfaced by the pusher through wait()
                push.future.set_exception(e)

        self._ctl.submit(task)
        return push

    def _abandon(self) -> None:
        """Push thread, at a missed deadline (``_TransferGroup.abort``): a running push makes the engine dead."""
        push = self._push
        if push is not None and push.abandon() == "running":
            self.kill(f"weight push {push.version} missed its deadline (weight_sync.timeout_seconds) while vLLM's NCCL "
                      "engine was sending; such a push cannot be cancelled, so the server is reconnected and resynced "
                      "in full and this push is never acknowledged")

    @contextlib.contextmanager
    def _sending(self, version: int):
        """Control thread, after the gate wait: pause, take ``_SENDING``, then start the push (queued -> running)
        unless its deadline cancelled it meanwhile (then nothing was sent: a non-fatal failure, the engine rejoins).
        ``/pause?mode=wait`` waits for the generations in flight, so it comes before ``_SENDING`` (review 4,
        finding 3); ``mode=keep`` (in-flight updates) freezes the running requests at once, so it comes after: a
        server's requests are frozen only once its push can send, not through the pushes ahead of it (fifth
        review, finding 18)."""
        if not self.in_flight:
            self._pause()
        with _SENDING:
            if self.in_flight:
                self._pause()
            push = self._push  # the newest push: a task of an older, cancelled one must not start it
            if push is None or push.version != version or not push.start():
                raise RuntimeError(f"weight push {version} was cancelled at its deadline before it sent anything")
            yield

    # the push steps of ``HttpEngine._update_task``: vLLM's engine does start / update / finish itself
    def _open(self, version: int) -> None:
        pass

    def _send_bucket(self, i, n, names, dtypes, shapes, version) -> None:
        if i == 0:
            self._transfer.send_weights()

    def _close(self, version: int) -> None:
        push = self._push
        if push is None or push.version != version or not push.finish():  # abandoned at its deadline: not acked
            raise RuntimeError(f"weight push {version} completed after its deadline; it was abandoned")
        self.client.post("/reset_prefix_cache")

    checksum = HttpEngine.checksum  # (version, None): not VllmEngine's, which asks our gloo receiver for its hash
