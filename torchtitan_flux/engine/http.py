"""``HttpEngine``: the abstract ``EngineHandler`` the HTTP rollout engines (vLLM, SGLang) share, for a server we
did not start; subclasses implement only the per-server hooks (endpoints and payloads).

* Generations run on a pool of worker threads that post a ``GenerationResult`` (or a fatal ``EngineError``) on the
  events queue; the health thread posts one once the server is gone.
* Version tracking: a reader/writer gate. A generation holds it shared and is stamped with the server's version; a
  push holds it alone, so every token of a request comes from one version. After each generation the server's
  reported version is compared with the stamp: a server restarted or updated behind our back is caught there, its
  result dropped and the handler dies (reconnect, resync, re-dispatch): no sample is labelled with a wrong version.
* In-flight updates (``in_flight``: ``rollout.in_flight_weight_updates``, where the server can freeze running
  requests with their KV cache, ``pause`` then does): a generation holds the gate shared only to read its stamp
  (after a push in progress), so a push waits for no generation, and requests in flight continue on the new weights
  once the server resumes. Invariant: the stamp is the version of the request's OLDEST token, never newer (the gate
  publishes a version only once the server holds it, and the server's versions only grow); the server's report
  after the call may then be any version from the stamp to the newest push started (``_newest_push``, set before
  that push could change the server), anything else is a server changed behind our back, as above.
* A push runs on one control thread: gate, ``pause``, ``open``, ONE HTTP request per bucket (concurrent with the
  trainer's broadcast of it), ``close``, ``resume``, then the ``WeightAck``. Names and layout are HF's, as for every
  engine (the syncer's ``HFLayout`` maps the names before the join, and the tensors while snapshotting).

Failure policy: a push that fails after the update session opened leaves the weights partly updated: the handler
dies (``reconnect()`` gives a fresh one once the server is usable). One that fails before (pause/open refused) is
non-fatal: the old weights stay and the syncer resyncs.

Simplifications: one server = one weight-sync rank; full pushes only; without in-flight updates a push waits for
the generations in flight, so ``weight_sync.timeout_seconds`` must exceed one generation request.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from torchtitan_flux.engine.base import (EngineError, EngineHandler, GenerationRequest, GenerationResult, WeightAck,
                                         WeightGroupInfo)
from torchtitan_flux.engine.http_client import HttpClient
from torchtitan_flux.engine.server_checks import HealthMonitor, StartupChecks
from torchtitan_flux.engine.threads import Gate, Workers
from torchtitan_flux.models import hf
from torchtitan_flux.wire import transport

logger = logging.getLogger("torchtitan_flux")

# read timeout of each start-up check, never retried: a vLLM server wedged by an abandoned push answers /health but
# blocks every call that reaches its engine core (a reconnect's /weight_info), so a reconnect gives up this soon
STARTUP_TIMEOUT_S = 30.0


@dataclass
class HttpOptions:
    """An HTTP handler's keyword arguments (``reconnect`` builds the new handler from them)."""

    model_dir: str | Path  # the trainer's HF model folder: config and tokenizer the server must match
    max_inflight: int = 8  # generation calls in flight (worker threads)
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    retries: int = 3
    backoff_s: float = 0.25
    health_interval_s: float = 5.0  # 0: no health thread
    health_failures: int = 3  # failed polls in a row that declare the server gone
    transport: httpx.BaseTransport | None = None  # tests: an in-process server
    auth_token: str | None = None

    def client(self, url: str, label: str, startup: bool = False) -> HttpClient:
        """The pooled client for the server at ``url``: a connection per worker thread and a few to spare;
        ``startup``: the start-up checks' (``STARTUP_TIMEOUT_S``, a read timeout not retried)."""
        return HttpClient(url, label=label, timeout_s=STARTUP_TIMEOUT_S if startup else self.request_timeout_s,
                          connect_timeout_s=self.connect_timeout_s, max_connections=self.max_inflight + 4,
                          retries=self.retries, backoff_s=self.backoff_s, transport=self.transport,
                          auth_token=self.auth_token, retry_timeouts=not startup)


def pack_completions(completions: list[tuple[list[int], list[float]]], req: GenerationRequest, pad_id: int):
    """Per-completion (token ids, logprobs) -> the padded tensors of a ``GenerationResult``."""
    n = len(req.prompt_ids) * req.group_size
    if len(completions) != n:
        raise RuntimeError(f"expected {n} completions, the server returned {len(completions)}")
    T = req.max_new_tokens
    tokens = torch.full((n, T), pad_id, dtype=torch.int64)
    logprobs = torch.zeros((n, T), dtype=torch.float32)
    lengths = torch.zeros(n, dtype=torch.int64)
    for i, (ids, lps) in enumerate(completions):
        if len(ids) != len(lps):
            raise RuntimeError(f"completion {i}: {len(ids)} tokens but {len(lps)} logprobs")
        if len(ids) > T:
            raise RuntimeError(f"completion {i} has {len(ids)} tokens > max_new_tokens {T}")
        if ids:
            tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
            logprobs[i, : len(ids)] = torch.tensor(lps, dtype=torch.float32)
        lengths[i] = len(ids)
    return tokens, logprobs, lengths


class HttpEngine(EngineHandler, abc.ABC):
    """Concurrency: generations run on the ``_gen`` workers, joins and pushes on the one ``_ctl`` thread, the health
    poll on its own; ``_gate`` orders generations against pushes and holds the server's version, ``_lock`` guards
    the push plan and the dead flag; ``_newest_push`` is written by the ``_ctl`` thread only."""

    kind = "HTTP"  # server kind, for messages ("vLLM", "SGLang")
    in_flight = False  # pushes land while generations run (see the module docstring); set by handlers that can
    reconnects = True  # a server is not ours to restart
    launch_hint = ""  # how to start a correctly configured server, appended to start-up errors
    Options: type[HttpOptions] = HttpOptions  # the constructor's keyword arguments

    def __init__(self, name: str, url: str, events: queue.Queue, **options):
        self.name, self.url, self.events = name, url.rstrip("/"), events
        self.options = self.Options(**options)
        self.model_dir = Path(self.options.model_dir)
        self.hf_config = hf.read_config(self.model_dir)
        self.pad_id = int(self.hf_config.get("pad_token_id") or 0)
        self.client: HttpClient | None = None
        self.checks: StartupChecks | None = None  # what ``_check_server`` composes (set by ``start``)
        self._health: HealthMonitor | None = None
        self._lock = threading.Lock()
        self._gate = Gate()  # generations vs pushes, and the version the server holds
        self._plan: transport.BucketPlan | None = None
        self._bucket_meta: list[tuple[list[str], list[str], list[list[int]]]] = []
        self._info: WeightGroupInfo | None = None
        self._newest_push = -1  # the newest version a push started (control thread; see the module docstring)
        self._dead = False
        self._closing = False
        self._gen: Workers | None = None
        self._ctl: Workers | None = None
        self.last_push_s = 0.0  # wall time of the last push, gate wait excluded (metrics, tests)

    def start(self) -> None:
        o = self.options
        label = f"{self.kind} server {self.url}"
        self.client = o.client(self.url, label, startup=True)
        self.checks = StartupChecks(self.client, self.name, self.kind, self.model_dir, self.hf_config,
                                    self.launch_hint)
        try:
            self.checks.run(self._check_server)
        finally:
            self.client.close()
        self.client = o.client(self.url, label)
        self._gen = Workers(o.max_inflight, f"{self.name}-gen")
        self._ctl = Workers(1, f"{self.name}-ctl")
        if o.health_interval_s > 0:
            self._health = HealthMonitor(self.client, self.name, o.health_interval_s, o.health_failures,
                                         busy=lambda: self._gate.held, done=lambda: self._dead or self._closing,
                                         on_dead=self._die)
            self._health.start()

    def alive(self) -> bool:
        return self.client is not None and not self._dead and not self._closing

    def submit(self, request: GenerationRequest) -> None:
        """Any thread; never blocks: the call runs on a ``_gen`` worker (an unbounded queue's ``put``)."""
        if not self.alive():
            self._die("submit on a dead or closed engine")
            return
        self._gen.submit(self._generate_task, request)

    def join_weight_group(self, info: WeightGroupInfo) -> None:
        plan = transport.plan_buckets(info.specs, info.bucket_bytes)  # HF names already (the syncer's layout)
        meta = [([s.name for s in specs], [s.dtype for s in specs], [list(s.shape) for s in specs])
                for specs in (plan.specs[b.start : b.end] for b in plan.buckets)]
        with self._lock:
            self._plan, self._bucket_meta, self._info = plan, meta, info
        self._ctl.submit(self._join_task, info)

    def begin_update(self, version: int) -> None:
        self._ctl.submit(self._update_task, version)

    def finish_update(self, version: int) -> None:
        pass  # the control thread acks when the server confirmed the last bucket

    def reconnect(self) -> "HttpEngine":
        """A new, started handler for the same server (raises ``EngineStartError`` while it is unusable); the
        syncer must then rejoin it (``WeightSyncer.replace_engine``)."""
        new = type(self)(self.name, self.url, self.events, **vars(self.options))
        new.start()
        return new

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self._health is not None:
            self._health.stop()
        self._gate.fail(f"{self.name} is closed")
        for w in (self._gen, self._ctl):
            if w is not None:
                w.stop()
        if self.client is not None:
            self.client.close()

    def kill(self, why: str) -> None:
        """The server is not ours to stop: the handler gives it up (``_die``) and ``Rollouts`` reconnects if it can."""
        self._die(why)

    def _die(self, why: str) -> None:
        with self._lock:
            if self._dead or self._closing:
                return
            self._dead = True
        msg = f"{self.kind} server {self.url}: {why}"
        logger.error(f"{self.name}: {msg}")
        self._gate.fail(msg)
        self.events.put(EngineError(self.name, msg, fatal=True))

    def _generate_task(self, req: GenerationRequest) -> None:
        if self._dead or self._closing:
            return
        # born fresh enough; after the wait bound it runs on what the server holds
        self._gate.wait_version(req.min_version, self._info.timeout_s if self._info is not None else 60.0)
        try:
            with self._stamped() as version:
                t0 = time.perf_counter()
                completions = self._generate(req, version)
                dt = time.perf_counter() - t0
                # without in-flight updates no push of ours can run while the gate is held shared: any other
                # version means the server was restarted (or its weights replaced) behind our back, and the tokens
                # are not ``version``'s; with them, see ``_ours_since``. Unchecked before our first push.
                pushed = self._newest_push if self.in_flight else version
                reported = self.weight_version() if pushed >= 0 else None
            tokens, logprobs, lengths = pack_completions(completions, req, self.pad_id)
        except Exception as e:  # noqa: BLE001 - the client already retried: the server cannot serve
            self._die(f"generation request {req.req_id} failed: {e}")
            return
        if reported is not None and not self._ours_since(version, reported):
            ours = (f"it started on version {version} and our newest push is {self._newest_push}" if self.in_flight
                    else f"our last push to it was version {version}")
            self._die(f"reports weight version {reported!r} after generation request {req.req_id}, but {ours}: it "
                      "was restarted or its weights were replaced; the result is dropped and the engine is "
                      "reconnected and resynced")
            return
        newest = self._gate.version
        self.events.put(GenerationResult(req.req_id, self.name, tokens, logprobs, lengths, version, newest, dt))

    @contextlib.contextmanager
    def _stamped(self):
        """Around one generation call; yields its stamp, the version it starts on. Without in-flight updates the
        gate is held shared throughout (a push waits for the call: every token is the stamp's); with them only
        while reading the stamp, after a push in progress (the stamp is then the oldest token's)."""
        with self._gate.shared() as version:
            if not self.in_flight:
                yield version
                return
        yield version

    def _ours_since(self, version: int, reported: str | None) -> bool:
        """Whether ``reported``, the server's version after a request stamped ``version``, is one of ours it may
        hold: ``version``; with in-flight updates any from ``version`` to the newest push started (read after the
        report), or the server's own from disk ("default") on a request started before our first push."""
        if not self.in_flight:
            return str(reported) == str(version)
        try:
            held = int(str(reported))
        except ValueError:
            return version < 0
        return max(version, 0) <= held <= self._newest_push

    def _join_task(self, info: WeightGroupInfo) -> None:
        if self._dead or self._closing:
            return
        try:
            self._init_group(info)
        except Exception as e:  # noqa: BLE001 - the syncer's own join times out and retries at the next push
            self.events.put(EngineError(self.name, f"joining the weight-sync group failed: {e}", fatal=False))

    def _update_task(self, version: int) -> None:
        if self._dead or self._closing:
            return
        try:
            self._gate.acquire()
        except RuntimeError:
            return
        opened = False
        t0 = time.perf_counter()
        self._newest_push = max(self._newest_push, version)  # before the server can report it (``_ours_since``)
        try:
            if not self._bucket_meta:
                raise RuntimeError("begin_update before join_weight_group")
            with self._sending(version):  # pauses the server
                self._open(version)
                opened = True
                n = len(self._bucket_meta)
                for i, (names, dtypes, shapes) in enumerate(self._bucket_meta):
                    self._send_bucket(i, n, names, dtypes, shapes, version)
                self._close(version)
            self._resume()
        except Exception as e:  # noqa: BLE001
            if opened:
                self._die(f"weight push {version} failed after the update session opened; the server's weights "
                          f"are partly updated and cannot be used: {e}")
                return  # the gate stays closed: nothing may generate on mixed weights
            with contextlib.suppress(Exception):
                self._resume()
            self._gate.release()
            self.events.put(EngineError(self.name, f"weight push {version} not started: {e}", fatal=False))
            return
        self.last_push_s = time.perf_counter() - t0
        self._gate.release(version)
        self.events.put(WeightAck(self.name, version, time.time()))

    @property
    def _weight_timeout_s(self) -> float:
        """Read timeout of a call that blocks while the trainer broadcasts (group init, one bucket)."""
        return (self._info.timeout_s if self._info is not None else 60.0) + 30.0

    def checksum(self, timeout: float = 30.0) -> tuple[int, str | None]:
        """(version of the last complete push, None): servers keep no hash of what they received unless they say."""
        return self._gate.version, None

    def score(self, tokens: list[int], timeout: float = 30.0) -> tuple[int, list[float]]:
        """(the server's weight version, its logprobs of ``tokens[1:]``): the post-sync probe (no push meanwhile)."""
        reported = self.weight_version()
        version = int(reported) if reported not in (None, "") and str(reported).lstrip("-").isdigit() else -1
        return version, self._score(list(tokens))

    # ---------------------------------------------------------------- per server: the subclasses' hooks

    @abc.abstractmethod
    def _check_server(self) -> None:
        """Start-up checks (of ``self.checks``): raise ``EngineStartError`` saying why the server cannot serve."""

    @abc.abstractmethod
    def weight_version(self) -> str | None:
        """The weight version the server reports (``str(v)`` after our push of ``v``)."""

    @abc.abstractmethod
    def _generate(self, req: GenerationRequest, version: int) -> list[tuple[list[int], list[float]]]:
        """One HTTP generation call: (token ids, behaviour logprobs) per completion, prompt-major. ``version``: its
        stamp (``_stamped``)."""

    @abc.abstractmethod
    def _score(self, tokens: list[int]) -> list[float]:
        """Teacher-forced logprobs of ``tokens[1:]`` (prompt logprobs of ``tokens``) from the server."""

    @abc.abstractmethod
    def _init_group(self, info: WeightGroupInfo) -> None:
        """Have the server join the weight-sync group ``info`` (blocks while rank 0 is created)."""

    @abc.abstractmethod
    def _pause(self) -> None:
        """Stop the server's generation before a push: once the requests in flight ended, or, with ``in_flight``,
        at once, freezing them with their KV cache until ``_resume``."""

    @contextlib.contextmanager
    def _sending(self, version: int):
        """Entered after the gate wait, around open .. close: pauses the server (``_pause``) and is where a push
        starts sending. One that raises on entry (e.g. cancelled meanwhile) leaves the weights untouched: a
        non-fatal failure."""
        self._pause()
        yield

    @abc.abstractmethod
    def _open(self, version: int) -> None:
        """Open the server's update session for ``version``."""

    @abc.abstractmethod
    def _send_bucket(self, i: int, n: int, names: list[str], dtypes: list[str], shapes: list[list[int]],
                     version: int) -> None:
        """The request that receives bucket ``i`` of ``n`` (blocks while the trainer broadcasts it)."""

    @abc.abstractmethod
    def _close(self, version: int) -> None:
        """Close the update session: the server holds ``version`` (and has reset its caches)."""

    @abc.abstractmethod
    def _resume(self) -> None:
        """Let the server generate again."""
