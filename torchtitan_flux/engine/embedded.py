"""The embedded rollout engine: a child process holding its own copy of the policy (the default engine).

Process model: rank 0 starts each engine from ``engine.forkserver``. The engine dies with its parent
(``PR_SET_PDEATHSIG``) and exits when its control pipe closes, so no engine outlives its trainer.

Threads inside the engine (both send on the pipe; ``_send`` serialises them with a lock):
  * the main thread serves the control pipe in order: it generates with the live weights, one request at a time,
    or with ``rollout.continuous_batching`` runs ``batcher.ContinuousBatcher``'s loop (several requests decode in
    one batch, the pipe read between decode steps). Requests not ready yet queue in order while the other messages
    are still served, so a (re)join is never stuck behind a request. Which version each request runs on, and when
    ``WeightReceiver.swap()`` changes the live one, is the engine's ``versions.VersionRule`` (``Pinned``, or with
    ``rollout.in_flight_weight_updates`` ``InFlight``: engine/versions.py), read by both loops;
  * the receiver thread (``transport.WeightReceiver``) takes pushes from the weight-sync group and acks them.

Trainer side, ``EmbeddedEngine``'s reader thread turns pipe messages into events. It reports the engine's death at
most once, and not after ``close()``: engines restart by name, so a second report would restart the replacement.
Every message to the engine goes through its ``sender.PipeSender`` thread, so no send blocks its caller (that
module states what may be dropped, and why nothing is lost).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing import connection as mp_connection

import torch

from torchtitan_flux.engine.base import (EngineError, EngineHandler, GenerationRequest, GenerationResult, WeightAck,
                                        WeightGroupInfo)
from torchtitan_flux.engine.forkserver import name_process, die_with_parent, engine_context, release_server_liveness
from torchtitan_flux.engine.sender import PipeSender
from torchtitan_flux.engine.versions import InFlight, Pinned

logger = logging.getLogger("torchtitan_flux")


class _EngineProcess:
    """State of one engine process. Runs in the child."""

    def __init__(self, conn, name: str, model_dir: str, threads: int, device: str, weight_buffers: int,
                 auth_token: str | None, max_batch_sequences: int, kv_slots: int, in_flight_updates: bool,
                 decode_graphs: bool):
        """``max_batch_sequences``: the continuous batch's rows; 0: one request at a time (``serve``). ``kv_slots``:
        the slots of each of those rows; ``decode_graphs``: its decode steps captured (``batcher.EngineIO``).
        ``in_flight_updates``: ``rollout.in_flight_weight_updates`` (continuous batching only)."""
        import json

        from torchtitan_flux.models import hf, inference, weight_dict

        self.conn, self.name, self._token = conn, name, auth_token
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.inference = inference
        torch.set_num_threads(threads)
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        self.shape = weight_dict.ModelShape.from_hf_config(cfg)
        self.eos_id, self.pad_id = hf.eos_token_ids(cfg), int(cfg.get("pad_token_id") or 0)
        self.receiver = None
        self.weight_buffers = weight_buffers
        self.max_batch_sequences, self.kv_slots = max_batch_sequences, kv_slots
        self.decode_graphs = "captured" if decode_graphs else ""
        self.rule = InFlight() if in_flight_updates else Pinned()  # which version each request runs on
        self.stall_s = 0.0  # fault injection: sleep before each generation
        self._send_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()

    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def join(self, info: WeightGroupInfo) -> None:
        from torchtitan_flux import compat
        from torchtitan_flux.wire import cuda_rules, transport

        def make_group():
            store = transport.connect_store(info.host, info.port, info.timeout_s, is_master=False)
            transport.handshake(store, info.prefix, self._token, transport.ENGINE, info.timeout_s)
            if info.backend == "nccl":
                cuda_rules.check_nccl_version(store, info.prefix, "engine", info.timeout_s)
            prefixed = torch.distributed.PrefixStore(info.prefix, store)
            return compat.new_weight_sync_group(
                info.backend, prefixed, 1, 2, timedelta(seconds=info.timeout_s), device=self.device,
                idle_timeout=transport.IDLE_TIMEOUT,  # the receiver's wait for the next push (see compat)
                listen_host=transport.listen_address(info.host),
            )

        def on_received(version: int) -> None:
            self._send(("ack", version, time.time()))
            os.write(self._wake_w, b"w")  # wakes serve(): a waiting request may now be ready

        def on_error(e: BaseException) -> None:
            self._send(("error", f"weight receiver: {type(e).__name__}: {e}", False))

        if self.receiver is None:
            plan = transport.plan_buckets(info.specs, info.bucket_bytes)
            self.receiver = transport.WeightReceiver(plan, self.device, on_received, on_error, self.weight_buffers)
        self.rule.wait_bound_s = info.timeout_s
        # a re-join (resync) keeps serving the live version meanwhile
        if info.backend == transport.COLOCATED:
            staging, seq = info.shared
            self.receiver.start_shared(staging, transport.Seqlock(seq))
        else:
            self.receiver.start(make_group, patches=info.patches)

    def live_model(self):
        """The live buffer's model (``inference.Model.of`` its views: a lookup, no copy), main thread. Not cached: a
        re-join may land the same version number in another buffer."""
        return self.inference.Model.of(self.receiver.live.views, self.shape)

    def generate(self, req: GenerationRequest) -> None:
        if self.stall_s:
            time.sleep(self.stall_s)
        version = self.receiver.swap(self.rule.swap_target(req))
        t0 = time.perf_counter()
        prompts = [p for p in req.prompt_ids for _ in range(req.group_size)]
        gen = torch.Generator(device=self.device).manual_seed(req.seed)
        tokens, logprobs, lengths = self.inference.generate_on(
            self.live_model(), prompts, max_new_tokens=req.max_new_tokens,
            temperature=req.temperature, top_k=req.top_k, eos_id=self.eos_id, pad_id=self.pad_id, generator=gen)
        self.send_result(req.req_id, tokens.cpu(), logprobs.cpu(), lengths.cpu(), version, time.perf_counter() - t0)

    def send_result(self, req_id: int, tokens: torch.Tensor, logprobs: torch.Tensor, lengths: torch.Tensor,
                    version: int, gen_time_s: float, token_versions: torch.Tensor | None = None) -> None:
        """A request's result (CPU tensors) to the trainer, with the newest version received by now.
        ``token_versions``: each token's version (in-flight updates only; None: every token ``version``)."""
        # numpy, not tensors: torch's pickler would pass each tensor as a shared-memory file descriptor (slower)
        arrays = (tokens.numpy(), logprobs.numpy(), lengths.numpy())
        per_token = token_versions.numpy() if token_versions is not None else None
        self._send(("result", req_id, *arrays, version, self.receiver.newest()[0], gen_time_s, per_token))

    def wait(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` for a message or a landed push (which ends a request's wait); whether the control
        pipe has a message."""
        ready = mp_connection.wait([self.conn, self._wake_r], timeout)
        if self._wake_r in ready:
            os.read(self._wake_r, 4096)
        return self.conn in ready

    def serve_messages(self, waiting: collections.deque, timeout: float | None) -> bool:
        """Wait up to ``timeout`` (``wait``), then serve every message already in the pipe; False on shutdown or a
        closed pipe (``batcher.EngineIO``)."""
        if not self.wait(timeout):
            return True
        while self.conn.poll():
            try:
                msg = self.conn.recv()
            except EOFError:
                return False
            if not self.handle(msg, waiting):
                return False
        return True

    def serve(self) -> None:
        """Serve the control pipe: with continuous batching, ``batcher.ContinuousBatcher``'s loop; else in order,
        one request at a time, requests waiting (FIFO) until ready."""
        if self.max_batch_sequences:
            from torchtitan_flux.engine.batcher import ContinuousBatcher

            return ContinuousBatcher(self, self.max_batch_sequences).run()
        waiting: collections.deque = collections.deque()  # (request, arrival time)
        while True:
            if waiting and self.rule.ready(*waiting[0], self.receiver):
                self.generate(waiting.popleft()[0])
                continue
            if not self.wait(self.rule.wait_timeout(waiting)):
                continue
            try:
                msg = self.conn.recv()
            except EOFError:
                return
            if not self.handle(msg, waiting):
                return

    def handle(self, msg: tuple, waiting: collections.deque) -> bool:
        """Serve one control message (a request joins ``waiting`` with its arrival time); False on shutdown."""
        kind = msg[0]
        if kind == "generate":
            waiting.append((msg[1], time.monotonic()))
        elif kind == "join":
            self.join(msg[1])
        elif kind == "checksum":
            with self._reading_newest() as (version, weights):
                digest = weights.checksum() if weights is not None else ""
            self._send(("checksum", version, digest))
        elif kind == "score":
            self._send(("score", *self.score(msg[1])))
        elif kind == "fault":
            self.fault(*msg[1:])
        elif kind == "shutdown":
            return False
        return True

    def score(self, tokens: list[int]) -> tuple[int, list[float]]:
        """(newest received version, logprobs of ``tokens[1:]`` under it); (-1, []) before the first push."""
        with self._reading_newest() as (version, weights):
            if weights is None:
                return -1, []
            seq = torch.tensor([tokens], dtype=torch.long)
            return version, self.inference.score(weights.views, self.shape, seq)[0].cpu().tolist()

    def _reading_newest(self):
        """The newest received version and its buffer, pinned against the receiver while read (``WeightReceiver``)."""
        return self.receiver.reading_newest() if self.receiver else contextlib.nullcontext((-1, None))

    def fault(self, what: str, arg: float) -> None:
        """Fault injection for the fault tests: stall generation or weight receipt, or die."""
        if what == "stall_generate":
            self.stall_s = arg
        elif what == "stall_receive":
            self.receiver.fault_stall_s = arg
        elif what == "crash":
            os._exit(17)


def _engine_main(conn, name: str, model_dir: str, threads: int, device: str, weight_buffers: int,
                 auth_token: str | None, max_batch_sequences: int, kv_slots: int, in_flight_updates: bool,
                 decode_graphs: bool) -> None:
    die_with_parent()
    release_server_liveness()
    name_process(f"flux-{name}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when engines stop
    try:
        proc = _EngineProcess(conn, name, model_dir, threads, device, weight_buffers, auth_token, max_batch_sequences,
                              kv_slots, in_flight_updates, decode_graphs)
        proc.serve()
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc(), True))
        except (OSError, EOFError):
            pass
        raise
    finally:
        if proc := locals().get("proc"):
            if proc.receiver is not None:
                proc.receiver.stop()
        os._exit(0)  # do not wait on the receiver thread's blocking collective


class EmbeddedEngine(EngineHandler):
    """``EngineHandler`` for one embedded engine process (see the module docstring)."""

    def __init__(self, name: str, model_dir: str, threads: int, events: queue.Queue, device: str = "cpu",
                 weight_buffers: int = 2, auth_token: str | None = None, colocated: bool = False,
                 continuous_batching: bool = False, max_batch_sequences: int = 256, kv_slots: int = 0,
                 in_flight_weight_updates: bool = False, decode_graphs: bool = False):
        """``weight_buffers``: weight versions the engine holds (>= 2; ``transport.WeightReceiver.swap``).
        ``auth_token``: what its weight-sync joins prove (None: no handshake), passed through the start pipe.
        ``colocated``: on the trainer's device, copying rank 0's staging by reference (``rollout.colocated``).
        ``continuous_batching``, ``max_batch_sequences``, ``in_flight_weight_updates``: ``rollout``'s fields
        (``engine/batcher.py``); the last needs the first. ``kv_slots``: with continuous batching, the slots of each
        KV row (the longest prompt plus completion: ``training.seq_len``). ``decode_graphs``: ``rollout``'s, the
        batcher's decode steps as CUDA graphs (continuous batching on a GPU)."""
        if continuous_batching and kv_slots < 1:
            raise ValueError(f"continuous batching needs kv_slots >= 1 (training.seq_len), got {kv_slots}")
        if decode_graphs and (not continuous_batching or not device.startswith("cuda")):
            raise ValueError(f"decode_graphs needs continuous_batching on a CUDA device, got {continuous_batching} on "
                             f"{device} (rollout.decode_graphs)")
        if in_flight_weight_updates and not continuous_batching:
            raise ValueError("in_flight_weight_updates = true needs continuous_batching = true on an embedded engine "
                             "(rollout.continuous_batching; the serial engine swaps only between requests)")
        self.name, self.model_dir, self.threads, self.events = name, model_dir, threads, events
        self.device, self.weight_buffers, self._token = device, weight_buffers, auth_token
        self.colocated = colocated
        self.max_batch_sequences = max_batch_sequences if continuous_batching else 0  # 0: serial
        self.kv_slots = kv_slots
        self.in_flight_updates = in_flight_weight_updates
        self.decode_graphs = decode_graphs
        self._acked = -1  # newest version the engine acked (reader thread writes, push thread reads)
        self._proc: mp.Process | None = None
        self._conn = None
        self._reader: threading.Thread | None = None
        self._replies: queue.Queue = queue.Queue()  # synchronous replies (checksum)
        self._closing = False
        self._dead_lock = threading.Lock()
        self._dead_reported = False
        self._sender: PipeSender | None = None  # every message to the engine goes through it
        self._requests_lock = threading.Lock()
        self._requests: set[int] = set()  # submitted, result not yet read (``submit`` adds, reader thread removes)

    def start(self) -> None:
        ctx = engine_context()
        parent, child = ctx.Pipe(duplex=True)
        args = (child, self.name, self.model_dir, self.threads, self.device, self.weight_buffers, self._token,
                self.max_batch_sequences, self.kv_slots, self.in_flight_updates, self.decode_graphs)
        self._proc = ctx.Process(target=_engine_main, args=args, name=self.name, daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        self._reader = threading.Thread(target=self._read, name=f"{self.name}-reader", daemon=True)
        self._reader.start()
        self._sender = PipeSender(parent, self.name, self._report_dead)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def _send(self, msg: tuple) -> None:
        self._sender.send(msg)  # any thread; never blocks

    def _report_dead(self, message: str) -> None:
        """Emit the fatal event once per engine process (see the module docstring); later ones are logged."""
        with self._dead_lock:
            first = not (self._dead_reported or self._closing)
            self._dead_reported = True
        if first:
            self.events.put(EngineError(self.name, message, fatal=True))
        else:
            last = message.strip().splitlines()[-1] if message else ""
            logger.debug(f"engine {self.name}: {last} (already reported)")

    def _read(self) -> None:
        conn = self._conn
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                proc = self._proc
                code = proc.exitcode if proc is not None else None
                self._report_dead("engine process exited" + (f" (exit code {code})" if code is not None else ""))
                return
            kind = msg[0]
            if kind == "result":
                _, req_id, tokens, logprobs, lengths, version, newest, dt, per_token = msg
                with self._requests_lock:
                    self._requests.discard(req_id)
                tokens, logprobs, lengths = (torch.from_numpy(a) for a in (tokens, logprobs, lengths))
                per_token = torch.from_numpy(per_token) if per_token is not None else None
                self.events.put(GenerationResult(req_id, self.name, tokens, logprobs, lengths, version, newest, dt,
                                                 per_token))
            elif kind == "ack":
                self._acked = max(self._acked, msg[1])
                self.events.put(WeightAck(self.name, msg[1], msg[2]))
            elif kind == "error":
                if msg[2]:
                    self._report_dead(msg[1])
                else:
                    self.events.put(EngineError(self.name, msg[1], fatal=False))
            elif kind in ("checksum", "score"):
                self._replies.put((msg[1], msg[2]))

    def submit(self, request: GenerationRequest) -> None:
        """Any thread; never blocks (``sender.PipeSender``)."""
        with self._requests_lock:
            self._requests.add(request.req_id)
        self._send(("generate", request))

    def idle(self) -> bool:
        """Alive and holding no request (every submitted request's result has been read): its cores compute
        nothing until the next ``submit`` (``run.threads.TrainerThreads``)."""
        with self._requests_lock:
            return not self._requests and self.alive()

    def join_weight_group(self, info: WeightGroupInfo) -> None:
        self._send(("join", info))  # HF names already (the syncer's layout)

    def weight_backend(self, trainer_backend: str) -> str:
        from torchtitan_flux.wire.transport import COLOCATED

        if self.colocated:
            return COLOCATED
        return "gloo" if self.device == "cpu" else trainer_backend  # NCCL needs a GPU on both sides

    def self_push(self, version: int, flats: list[torch.Tensor]) -> "_AckWait | None":
        """Colocated: the engine copies staging by itself once the pusher published ``version``; the push is
        complete when it acks (or dies). Else None: the pusher broadcasts."""
        return _AckWait(self, version) if self.colocated else None

    def begin_update(self, version: int) -> None:
        pass  # the receiver thread stages the push; nothing to open

    def finish_update(self, version: int) -> None:
        pass  # the engine acks on its own once the push is complete

    def checksum(self, timeout: float = 30.0) -> tuple[int, str]:
        """(newest received version, sha256 of its weights). Served between generation requests (decode steps, with
        continuous batching)."""
        self._send(("checksum",))
        return self._replies.get(timeout=timeout)

    def score(self, tokens: list[int], timeout: float = 30.0) -> tuple[int, list[float]]:
        """(newest received version, its logprobs of ``tokens[1:]``): the post-sync probe. Callers do not overlap it
        with ``checksum`` (one reply queue)."""
        self._send(("score", list(tokens)))
        return self._replies.get(timeout=timeout)

    def kill(self, why: str) -> None:
        self._report_dead(why)
        proc = self._proc
        if proc is not None and proc.is_alive():
            proc.kill()  # SIGKILL ends a stopped (SIGSTOP) process too, and with it a send blocked on it
        if self._sender is not None:
            self._sender.stop()

    def inject_fault(self, what: str, arg: float = 0.0) -> None:
        self._send(("fault", what, arg))

    def close(self) -> None:
        if self._proc is None:
            return
        self._closing = True
        self._send(("shutdown",))
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)
        self._sender.stop()
        self._conn.close()
        self._proc = None


class _AckWait:
    """A colocated push, polled like a Work (``cuda_rules.wait_works``): complete once the engine acked
    ``version`` or died; ``wait`` raises in the second case. A copy the engine finishes after the push's deadline
    is still a complete version (``transport.Seqlock``), so its late ack is true."""

    def __init__(self, engine: EmbeddedEngine, version: int):
        self.engine, self.version = engine, version

    def is_completed(self) -> bool:
        return self.engine._acked >= self.version or not self.engine.alive()

    def wait(self) -> None:
        if self.engine._acked < self.version:
            raise RuntimeError(f"{self.engine.name} exited before it acked version {self.version}")
