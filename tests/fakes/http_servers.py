"""HTTP servers standing in for real ones: a flaky server for ``HttpClient``, a vLLM server without the RL
endpoints for the handler's start-up checks. In-process (``serve_forever`` on a thread), on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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


class _FlakyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 10

    def log_message(self, *args):
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

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


class _VllmStubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 10

    def log_message(self, *args):
        pass

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
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _do
