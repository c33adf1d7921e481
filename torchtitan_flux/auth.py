"""The shared token that guards rollout servers and weight-sync rendezvous once they leave loopback. Stdlib only:
vLLM servers import it too. The token is an environment variable's value (the trainer reads the one named by
``weight_sync.auth_token_env``, servers ``TOKEN_ENV``), so it stays out of TOML files, logs and checkpoints.

HTTP: ``HttpClient`` sends ``Authorization: Bearer <token>``; a vLLM server started with ``--middleware
MIDDLEWARE`` refuses every other request but the health and metrics probes (vLLM's own ``--api-key`` does not
guard the RL weight-update endpoints); SGLang's ``--api-key`` guards everything but ``/health*`` and
``/metrics*``. Rendezvous: ``transport.handshake``.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os

TOKEN_ENV = "TORCHTITAN_FLUX_TOKEN"  # the environment variable a server reads the token from
MIDDLEWARE = "torchtitan_flux.auth.BearerAuthMiddleware"


def read_token(env: str = TOKEN_ENV) -> str | None:
    """The shared token from environment variable ``env``; None when it is unset or empty."""
    return os.environ.get(env) or None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address, ``[v6]`` or ``localhost``) is loopback; other names are not resolved."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class BearerAuthMiddleware:
    """Pure ASGI middleware: a request without ``Authorization: Bearer <$TORCHTITAN_FLUX_TOKEN>`` is answered 401
    (a websocket closed with 1008), except ``GET``/``HEAD`` of ``OPEN_PATHS`` (liveness probes). Without a token
    it refuses to be built: it never fails open."""

    OPEN_PATHS = ("/health", "/metrics")

    def __init__(self, app, token: str | None = None):
        token = token or read_token()
        if not token:
            raise RuntimeError(f"{type(self).__name__} needs the shared token in ${TOKEN_ENV}; it is unset or empty")
        self.app = app
        self._token = token.encode()

    def _authorized(self, scope) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if scope["type"] == "http" and scope["method"] in ("GET", "HEAD") and path in self.OPEN_PATHS:
            return True
        value = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, credentials = value.partition(b" ")
        return hmac.compare_digest(credentials, self._token) and scheme.lower() == b"bearer"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or self._authorized(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            body = json.dumps({"error": f"Unauthorized: send 'Authorization: Bearer <${TOKEN_ENV}>'"}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"www-authenticate", b"Bearer")]
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": body})
