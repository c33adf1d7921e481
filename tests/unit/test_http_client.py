"""``HttpClient`` (engine/http_client.py): retries with exponential backoff, timeouts, keep-alive and the bounded pool,
against a local flaky HTTP server on 127.0.0.1 (``fakes.http_servers.Flaky``: in-process, bounded in time and
requests)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from fakes.http_servers import Flaky

from torchtitan_flux.engine import http_client as flux_http
from torchtitan_flux.engine.http_client import HttpClient, HttpError


@pytest.fixture
def server():
    srv = Flaky()
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    deadline = threading.Timer(60, srv.shutdown)  # bounded in time whatever happens
    deadline.daemon = True
    deadline.start()
    yield srv
    deadline.cancel()
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def sleeps(monkeypatch):
    """Record backoff sleeps instead of sleeping (the backoff policy is what is tested)."""
    got: list[float] = []
    monkeypatch.setattr(flux_http.time, "sleep", got.append)
    return got


def url(srv: Flaky) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


def test_idempotent_request_retries_5xx_with_exponential_backoff(server, sleeps):
    c = HttpClient(url(server), retries=4, backoff_s=0.1, backoff_max_s=10)
    assert c.get("/flaky", params={"fail": 3, "key": "a"}) == {"hit": 4}
    assert c.attempts == 4
    assert len(sleeps) == 3
    for i, d in enumerate(sleeps):  # 0.1, 0.2, 0.4 with +-10% jitter
        assert 0.1 * 2**i * 0.9 <= d <= 0.1 * 2**i * 1.1
    c.close()


def test_retries_are_bounded_and_the_error_names_server_and_status(server, sleeps):
    c = HttpClient(url(server), label="vLLM server X", retries=2, backoff_s=0.01)
    with pytest.raises(HttpError) as e:
        c.get("/flaky", params={"fail": 10, "key": "b"})
    assert e.value.status == 503 and c.attempts == 3
    assert "vLLM server X: GET /flaky -> HTTP 503: busy (hit 3)" in str(e.value)
    c.close()


def test_non_idempotent_requests_are_not_repeated(server, sleeps):
    c = HttpClient(url(server), retries=5, backoff_s=0.01)
    with pytest.raises(HttpError, match="HTTP 500: kaboom"):
        c.post("/boom", {"x": 1})  # e.g. /update_weights: repeating it would consume a second broadcast
    assert c.attempts == 1 and sleeps == []
    with pytest.raises(HttpError, match="no response"):
        c.post("/drop", {})
    assert c.attempts == 2
    c.close()


def test_4xx_is_not_retried_and_carries_the_detail(server, sleeps):
    c = HttpClient(url(server), retries=5)
    with pytest.raises(HttpError, match=r"HTTP 400: missing field 'names'") as e:
        c.post("/bad", {}, idempotent=True)
    assert e.value.status == 400 and c.attempts == 1 and sleeps == []
    c.close()


def test_connection_refused_is_retried_then_reported(sleeps):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    c = HttpClient(f"http://127.0.0.1:{port}", retries=3, backoff_s=0.05, backoff_max_s=0.1)
    with pytest.raises(HttpError) as e:
        c.post("/update_weights", {})  # never reached the server: safe to retry even when not idempotent
    assert e.value.status is None and "ConnectError" in e.value.detail
    assert c.attempts == 4
    assert len(sleeps) == 3 and max(sleeps) <= 0.1 * 1.1  # capped
    c.close()


def test_read_timeout_is_enforced(server):
    c = HttpClient(url(server), timeout_s=0.3, retries=3)
    t0 = time.monotonic()
    with pytest.raises(HttpError, match="ReadTimeout"):
        c.post("/slow", params={"s": 4})  # not idempotent: one attempt only
    assert time.monotonic() - t0 < 3.0 and c.attempts == 1  # 0.3 s, not the 4 s answer (bounds hold under load)
    assert c.post("/slow", params={"s": 0.5}, timeout_s=3) == {"slept": 0.5}  # per-request override
    c.close()


def test_keep_alive_reuses_one_connection(server):
    c = HttpClient(url(server))
    for _ in range(20):
        c.get("/ok")
    assert server.requests == 20 and len(server.connections) == 1
    c.close()


def test_pool_is_bounded(server):
    c = HttpClient(url(server), max_connections=2, timeout_s=10)
    threads = [threading.Thread(target=c.post, args=("/slow",), kwargs={"params": {"s": 0.3}}) for _ in range(6)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert server.max_active == 2 and len(server.connections) == 2
    assert time.monotonic() - t0 >= 0.85  # 6 calls of 0.3 s through 2 connections: 3 rounds
    c.close()


def test_backoff_is_capped_and_jittered():
    c = HttpClient("http://127.0.0.1:1", backoff_s=0.5, backoff_max_s=2.0)
    values = [c.backoff(a) for a in range(1, 12)]
    assert all(v <= 2.2 for v in values) and values[0] >= 0.45
    assert len({round(c.backoff(1), 6) for _ in range(20)}) > 1  # jitter spreads simultaneous retries
    c.close()


def test_every_request_carries_the_token_when_one_is_set():
    """The shared token (auth.py) goes in one header on every request, retries included; none without it."""
    import httpx

    seen: list[tuple[str, str | None]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get("Authorization")))
        return httpx.Response(503 if seen == [("/health", "Bearer s3cret")] else 200, json={})

    c = HttpClient("http://gen1:8000", transport=httpx.MockTransport(answer), auth_token="s3cret", backoff_s=0.001)
    c.get("/health")  # 503 then 200: retried
    c.post("/update_weights", {"x": 1})
    c.post("/pause", params={"mode": "wait"})
    assert seen == [("/health", "Bearer s3cret")] * 2 + [("/update_weights", "Bearer s3cret"),
                                                          ("/pause", "Bearer s3cret")]
    c.close()
    seen.clear()
    c = HttpClient("http://gen1:8000", transport=httpx.MockTransport(answer))
    c.post("/pause")
    assert seen == [("/pause", None)]
    c.close()
