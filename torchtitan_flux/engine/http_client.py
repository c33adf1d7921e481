"""``HttpClient``: the pooled, retrying JSON client of the HTTP rollout engines (one ``httpx.Client`` per server,
shared by a handler's threads: it is thread-safe). A request that never reached the server is always retried; one
that may have reached it (5xx, dropped or timed-out response) only when marked ``idempotent``, and a read timeout
not at all on a client built with ``retry_timeouts=False`` (start-up checks: a server that took a request and never
answered is wedged, and asking again only multiplies the wait). Weight-update calls are never idempotent: each
consumes a broadcast, and repeating it would desynchronise the weight-sync group.
"""

from __future__ import annotations

import json
import logging
import random
import time
from typing import Any

import httpx

logger = logging.getLogger("torchtitan_flux")

RETRY_STATUS = frozenset({500, 502, 503, 504})
_HTTPX_LOG = logging.getLogger("httpx")


class HttpError(RuntimeError):
    """An HTTP call failed for good (after retries). ``status`` is None when no response came back."""

    def __init__(self, server: str, method: str, path: str, status: int | None, detail: str):
        self.server, self.method, self.path, self.status, self.detail = server, method, path, status, detail
        what = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"{server}: {method} {path} -> {what}: {detail}")


def _detail(resp: httpx.Response, limit: int = 600) -> str:
    """The error text of a response: a JSON ``detail``/``error``/``message`` field if there is one."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:limit].strip() or resp.reason_phrase
    if isinstance(body, dict):
        for key in ("detail", "error", "message"):
            if key in body:
                v = body[key]
                if isinstance(v, dict) and "message" in v:
                    v = v["message"]
                return (v if isinstance(v, str) else json.dumps(v))[:limit]
    return json.dumps(body)[:limit]


class HttpClient:
    """A pooled, retrying JSON client for one server (see the module docstring)."""

    def __init__(self, base_url: str, *, label: str = "server", timeout_s: float = 600.0,
                 connect_timeout_s: float = 5.0, max_connections: int = 16, retries: int = 3, backoff_s: float = 0.25,
                 backoff_max_s: float = 4.0, transport: httpx.BaseTransport | None = None,
                 auth_token: str | None = None, retry_timeouts: bool = True):
        self.base_url = base_url.rstrip("/")
        self.label = label
        if _HTTPX_LOG.level == logging.NOTSET:  # httpx logs every request at INFO; keep trainer logs readable
            _HTTPX_LOG.setLevel(logging.WARNING)
        self.retries, self.backoff_s, self.backoff_max_s = retries, backoff_s, backoff_max_s
        self.retry_timeouts = retry_timeouts
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s, pool=connect_timeout_s)
        self._client = httpx.Client(
            base_url=self.base_url, timeout=self.timeout, transport=transport,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                                keepalive_expiry=30.0),
            trust_env=False,  # never route loopback engine traffic through a proxy from the environment
            headers={"Authorization": f"Bearer {auth_token}"} if auth_token else None,
        )
        self.attempts = 0  # total HTTP attempts made (tests)

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry ``attempt`` (1-based): exponential, capped, with +-10% jitter."""
        base = min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1))
        return base * (0.9 + 0.2 * random.random())

    def request(self, method: str, path: str, *, json_body: Any = None, params: dict | None = None,
                timeout_s: float | None = None, idempotent: bool = False, retries: int | None = None) -> Any:
        """Send one request; return the decoded JSON (or text) body of a 2xx response, else raise ``HttpError``."""
        retries = self.retries if retries is None else retries
        timeout = self.timeout if timeout_s is None else httpx.Timeout(timeout_s, connect=self.timeout.connect,
                                                                      pool=self.timeout.pool)
        attempt = 0
        while True:
            attempt += 1
            self.attempts += 1
            try:
                resp = self._client.request(method, path, json=json_body, params=params, timeout=timeout)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as e:
                err: HttpError = HttpError(self.label, method, path, None, f"{type(e).__name__}: {e}")
                retry = True  # never reached the server
            except httpx.TimeoutException as e:  # read or write timeout: taken by the server, never answered
                err = HttpError(self.label, method, path, None, f"{type(e).__name__}: {e}")
                retry = idempotent and self.retry_timeouts
            except httpx.TransportError as e:  # read/write error or timeout, dropped connection
                err = HttpError(self.label, method, path, None, f"{type(e).__name__}: {e}")
                retry = idempotent
            else:
                if resp.is_success:
                    if not resp.content:
                        return None
                    try:
                        return resp.json()
                    except ValueError:
                        return resp.text
                err = HttpError(self.label, method, path, resp.status_code, _detail(resp))
                retry = idempotent and resp.status_code in RETRY_STATUS
            if not retry or attempt > retries:
                raise err
            delay = self.backoff(attempt)
            logger.debug(f"{err}; retry {attempt}/{retries} in {delay:.2f}s")
            time.sleep(delay)

    def get(self, path: str, **kw) -> Any:
        kw.setdefault("idempotent", True)
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any = None, **kw) -> Any:
        return self.request("POST", path, json_body=body, **kw)

    def close(self) -> None:
        self._client.close()
