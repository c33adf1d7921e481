"""HTTP servers standing in for real ones: a flaky server for ``HttpClient``, a vLLM server without the RL
endpoints for the handler's start-up checks, and a vLLM server whose scheduler pauses as vLLM 0.32's does
(``VllmFake``, for the push gate). In-process (``serve_forever`` on a thread), on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse


class Flaky(ThreadingHTTPServer):
    """Answers by path: ``/flaky?key=K&fail=N`` 503 for the first N hits of K then 200, ``/boom`` 500, ``/bad``
    400, ``/slow?s=S`` 200 after S seconds, ``/drop`` closes the connection without an answer, anything else 200.
    Counts hits per key, connections and concurrent requests; shuts down after 500 requests."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _FlakyHandler)
        self.hits: Counter = Counter()
        self.connections: set = set()
        self.active = 0
        self.max_active = 0
        self.lock = threading.Lock()
        self.requests = 0


class _JsonHandler(BaseHTTPRequestHandler):
    """Keep-alive, silent, JSON replies (``_reply``): what every fake server here shares."""

    protocol_version = "HTTP/1.1"
    timeout = 10

    def log_message(self, *args):
        pass

    def _reply(self, status: int, body: dict | None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _FlakyHandler(_JsonHandler):

    def _do(self) -> None:
        srv: Flaky = self.server
        url = urlparse(self.path)
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        if int(self.headers.get("Content-Length") or 0):
            self.rfile.read(int(self.headers["Content-Length"]))
        with srv.lock:
            srv.requests += 1
            if srv.requests > 500:  # bounded: a runaway client cannot keep it busy
                threading.Thread(target=srv.shutdown, daemon=True).start()
            srv.connections.add(self.client_address)
            srv.hits[url.path + "?" + q.get("key", "")] += 1
            hit = srv.hits[url.path + "?" + q.get("key", "")]
            srv.active += 1
            srv.max_active = max(srv.max_active, srv.active)
        try:
            if url.path == "/flaky":  # 503 for the first `fail` hits of `key`, then 200
                if hit <= int(q["fail"]):
                    self._reply(503, {"detail": f"busy (hit {hit})"})
                else:
                    self._reply(200, {"hit": hit})
            elif url.path == "/boom":
                self._reply(500, {"error": {"message": "kaboom", "type": "InternalServerError"}})
            elif url.path == "/bad":
                self._reply(400, {"detail": "missing field 'names'"})
            elif url.path == "/slow":
                time.sleep(float(q["s"]))
                self._reply(200, {"slept": float(q["s"])})
            elif url.path == "/drop":  # close the connection without an answer
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
            else:
                self._reply(200, {"path": url.path})
        finally:
            with srv.lock:
                srv.active -= 1

    do_GET = do_POST = _do


class VllmStub(ThreadingHTTPServer):
    """Answers like a vLLM server started without the RL endpoints (``dev_mode=False``) or without our worker
    extension (``dev_mode=True``)."""

    daemon_threads = True

    def __init__(self, dev_mode: bool):
        self.dev_mode = dev_mode
        super().__init__(("127.0.0.1", 0), _VllmStubHandler)


class _VllmStubHandler(_JsonHandler):
    def _do(self):
        if int(self.headers.get("Content-Length") or 0):
            self.rfile.read(int(self.headers["Content-Length"]))
        path = self.path.partition("?")[0]
        if path == "/health":
            status, body = 200, None
        elif path == "/v1/models":
            status, body = 200, {"data": [{"id": "stub", "max_model_len": 256}]}
        elif path == "/weight_info" and self.server.dev_mode:
            status, body = 200, {"weight_version": "default"}
        elif path == "/collective_rpc" and self.server.dev_mode:
            status, body = 500, {"error": {"message": "AttributeError: 'CPUWorker' object has no attribute "
                                                      "'flux_model_info'"}}
        else:
            status, body = 404, {"detail": "Not Found"}
        self._reply(status, body)

    do_GET = do_POST = _do


class VllmFake(ThreadingHTTPServer):
    """A vLLM 0.32 server with the RL endpoints and our worker extension (``scripts/launch_vllm.sh``), as far as the
    handler's push gate goes: no weights, no weight-sync group (``/update_weights`` receives nothing).

    Its scheduler pauses as vLLM's does (``v1/engine/core.py`` ``pause_scheduler``): ``/pause?mode=wait`` answers
    once the running requests ended, ``mode=keep`` at once with them frozen, ``clear_cache`` (default true) with
    ``keep`` preempts them, dropping their KV (counted in ``preempted``); requests that arrive while paused queue
    until ``/resume``. ``/v1/completions`` emits one token per ``step_s`` while its request may step, token id
    ``100 + the version of the weights of that step`` ("default": 99), so a completion shows the versions it spans.
    With ``hold_after`` set, a running request stops after that many tokens (``held`` is set) until ``release()``.
    Stricter than vLLM: a weight update outside a pause is answered 400. ``calls``: every other request, (path,
    query); ``bodies``: every completion request; ``version``: what ``/weight_info`` reports (a test may change it
    behind the handler's back).

    ``wedged`` (the fifth GPU review's finding 14): the first ``/update_weights`` never ends, as vLLM's does when the
    trainer abandons its NCCL broadcast (the worker stays in ``synchronize()``, and vLLM runs utility calls in the
    engine core's busy loop); from then on every call that reaches the engine core blocks (counted in ``blocked``)
    while ``/health``, ``/v1/models`` and ``/tokenize`` (the API server's own) still answer. ``release()`` ends it."""

    daemon_threads = True

    def __init__(self, model_dir: Path, step_s: float = 0.01):
        from tokenizers import Tokenizer

        self.model_dir = Path(model_dir)
        self.hf_config = json.loads((self.model_dir / "config.json").read_text())
        self.tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self.step_s = step_s
        self.cv = threading.Condition()
        self.paused: str | None = None  # None | "wait" | "keep"
        self.updating = False
        self.running = 0  # requests admitted and not finished
        self.preempted = 0
        self.version = "default"
        self.hold_after: int | None = None
        self.held = threading.Event()
        self._released = False
        self.calls: list[tuple[str, dict]] = []
        self.bodies: list[dict] = []
        self.wedged = False
        self.stuck = False  # wedged, and an /update_weights was left unfinished
        self.blocked: list[str] = []
        super().__init__(("127.0.0.1", 0), _VllmFakeHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def release(self) -> None:
        with self.cv:
            self._released = True
            self.stuck = False
            self.cv.notify_all()

    def engine_core(self, path: str) -> None:
        """Where a call reaches the engine core: a wedged server's first ``/update_weights`` and every call after it
        block until ``release()``, then answer 500."""
        with self.cv:
            self.stuck = self.stuck or (self.wedged and path == "/update_weights")
            if not self.stuck:
                return
            self.blocked.append(path)
            self.cv.wait_for(lambda: not self.stuck, timeout=60)
        raise RuntimeError(f"fake vLLM: {path} on a wedged engine core")

    def _wait(self, ready, what: str) -> None:
        if not self.cv.wait_for(ready, timeout=30):
            raise TimeoutError(f"fake vLLM: {what} waited 30 s")

    def complete(self, body: dict) -> dict:
        with self.cv:
            self.bodies.append(body)
            self._wait(lambda: self.paused is None, "a request queued while paused")
            self.running += 1
        try:
            n = len(body["prompt"]) * body.get("n", 1)
            ids: list[int] = []
            for i in range(body["max_tokens"]):
                with self.cv:
                    if self.hold_after is not None and i == self.hold_after and not self._released:
                        self.held.set()
                    self._wait(lambda: self.paused != "keep" and not self.updating
                               and (self.hold_after is None or i < self.hold_after or self._released), "a step")
                    ids.append(99 if self.version == "default" else 100 + int(self.version))
                time.sleep(self.step_s)
        finally:
            with self.cv:
                self.running -= 1
                self.cv.notify_all()
        return {"choices": [{"index": j, "token_ids": ids, "logprobs": {"token_logprobs": [-1.0] * len(ids)}}
                            for j in range(n)]}

    def control(self, path: str, q: dict, body) -> tuple[int, object]:
        with self.cv:
            self.calls.append((path, q))
            if path == "/pause":
                self.paused = q.get("mode", "abort")
                if self.paused == "wait":
                    self._wait(lambda: self.running == 0, "/pause?mode=wait")
                elif self.paused == "keep" and q.get("clear_cache", "true") != "false":
                    self.preempted += self.running
                return 200, {"status": "paused"}
            if path == "/resume":
                self.paused = None
                self.cv.notify_all()
                return 200, {"status": "resumed"}
            if path in ("/start_weight_update", "/update_weights", "/finish_weight_update"):
                if self.paused is None:
                    return 400, {"error": f"fake vLLM: {path} while generation runs (not paused)"}
                self.updating = path != "/finish_weight_update"
                if path == "/finish_weight_update":
                    self.version = body["weight_version"]
                self.cv.notify_all()
                return 200, {"message": "ok"}
            if path == "/reset_prefix_cache":
                return 200, {"success": self.running == 0}
            return 200, {"message": "ok"}  # /init_weight_transfer_engine

    def collective_rpc(self, body: dict) -> dict:
        assert body["method"] == "flux_model_info", body
        return {"results": [{"transfer_backend": "gloo", "world_size": 1, "model": str(self.model_dir),
                             "hf_config": self.hf_config}]}


class _VllmFakeHandler(_JsonHandler):
    timeout = 30

    def _do(self):
        srv: VllmFake = self.server
        url = urlparse(self.path)
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        size = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(size)) if size else None
        if url.path not in ("/health", "/v1/models", "/tokenize"):
            try:
                srv.engine_core(url.path)
            except RuntimeError as e:
                self._reply(500, {"error": str(e)})
                return
        if url.path == "/health":
            status, out = 200, None
        elif url.path == "/v1/models":
            status, out = 200, {"data": [{"id": "fake", "max_model_len": 256}]}
        elif url.path == "/weight_info":
            status, out = 200, {"weight_version": srv.version}
        elif url.path == "/collective_rpc":
            status, out = 200, srv.collective_rpc(body)
        elif url.path == "/tokenize":
            status, out = 200, {"tokens": srv.tokenizer.encode(body["prompt"], add_special_tokens=False).ids}
        elif url.path == "/v1/completions":
            status, out = 200, srv.complete(body)
        else:
            status, out = srv.control(url.path, q, body)
        self._reply(status, out)

    do_GET = do_POST = _do
