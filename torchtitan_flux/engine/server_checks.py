"""What an HTTP engine handler checks of its server: once at start (``StartupChecks``) and while it runs
(``HealthMonitor``). Simplifications: the tokenizer is compared on one probe string, not the whole vocabulary;
health is one GET of ``/health`` (vLLM and SGLang both serve it), not a generation.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from torchtitan_flux.engine.http_client import HttpClient, HttpError
from torchtitan_flux.errors import EngineStartError

HEALTH_PATH = "/health"


class StartupChecks:
    """The checks a server's ``_check_server`` composes (``reachable``, ``config``, ``tokenizer``), and ``run``,
    which turns an HTTP failure of any of them into an ``EngineStartError`` naming the server and the fix."""

    def __init__(self, client: HttpClient, name: str, kind: str, model_dir: Path, hf_config: dict,
                 launch_hint: str):
        self.client, self.name, self.kind = client, name, kind
        self.model_dir, self.hf_config, self.launch_hint = model_dir, hf_config, launch_hint

    def run(self, check_server: Callable[[], None]) -> None:
        url = self.client.base_url
        try:
            check_server()
        except HttpError as e:
            if e.status is None:
                raise EngineStartError(f"{self.name}: cannot reach the {self.kind} server at {url} ({e.detail}). "
                                       f"Is it running? {self.launch_hint}") from e
            if e.status == 401:
                raise EngineStartError(f"{self.name}: the {self.kind} server at {url} refused the trainer's token "
                                       "(HTTP 401): set the variable named by weight_sync.auth_token_env to the "
                                       "server's TORCHTITAN_FLUX_TOKEN") from e
            raise EngineStartError(f"{self.name}: the {self.kind} server at {url} is not usable: {e}") from e

    def reachable(self) -> None:
        self.client.get(HEALTH_PATH, timeout_s=10.0)

    def tokenizer(self, server_tokens: Callable[[str], list[int]]) -> None:
        """The server's tokenizer gives the trainer's token ids (prompts and completions travel as ids)."""
        from tokenizers import Tokenizer

        probe = "Hello, world! 0123456789 +-*/= {}[]\n\tçé"
        local = Tokenizer.from_file(str(self.model_dir / "tokenizer.json")).encode(probe, add_special_tokens=False).ids
        remote = server_tokens(probe)
        if list(remote) != list(local):
            raise EngineStartError(f"{self.name}: vocabulary mismatch between the trainer ({self.model_dir}) and "
                                   f"the {self.kind} server at {self.client.base_url}: {probe!r} tokenizes to "
                                   f"{list(remote)[:12]}... on the server but {local[:12]}... for the trainer. "
                                   "Serve the trainer's model folder.")

    def config(self, server_cfg: dict, keys: tuple[str, ...], where: str) -> None:
        """The server's model config agrees with the trainer's ``config.json`` on ``keys`` (those it reports)."""
        bad = [f"{k}: server {server_cfg.get(k)!r} != trainer {self.hf_config.get(k)!r}" for k in keys
               if server_cfg.get(k) is not None and server_cfg.get(k) != self.hf_config.get(k)]
        if bad:
            raise EngineStartError(f"{self.name}: model mismatch between the trainer ({self.model_dir}/config.json) "
                                   f"and the {self.kind} server at {self.client.base_url} ({where}): "
                                   f"{'; '.join(bad)}. Serve the trainer's model folder.")


class HealthMonitor:
    """Polls the server's health endpoint every ``interval_s`` on a daemon thread and calls ``on_dead(why)`` once
    ``failures`` polls in a row failed. While ``busy()`` (a weight update, when servers answer slowly) polls are
    skipped and the count starts over. The thread ends at ``stop()``, once ``done()``, or after ``on_dead``."""

    def __init__(self, client: HttpClient, name: str, interval_s: float, failures: int, *,
                 busy: Callable[[], bool], done: Callable[[], bool], on_dead: Callable[[str], None]):
        self.client, self.interval_s, self.failures = client, interval_s, failures
        self._busy, self._done, self._on_dead = busy, done, on_dead
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"{name}-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        failures = 0
        while not self._stop.wait(self.interval_s):
            if self._done():
                return
            if self._busy():
                failures = 0
                continue
            try:
                self.client.get(HEALTH_PATH, timeout_s=max(2.0, self.interval_s), retries=0)
                failures = 0
            except HttpError as e:
                failures += 1
                if failures >= self.failures:
                    self._on_dead(f"health check failed {failures} times in a row: {e}")
                    return
