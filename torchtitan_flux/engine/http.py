"""``HttpEngine``: the base handler the HTTP rollout engines (vLLM, SGLang) share; they talk to their servers
through ``HttpClient`` (``engine/http_client.py``).

``HttpEngine`` implements the ``EngineHandler`` protocol (``engine/base.py``) for a server we did not start:

* ``submit`` hands the request to a bounded pool of daemon worker threads, which make the HTTP call and post a
  ``GenerationResult`` (or, when the server is unusable, a fatal ``EngineError``) on the shared events queue.
* Version tracking: a reader/writer gate. Every generation call holds it shared and is stamped with the version
  the server held when it started; a weight update holds it exclusively (it first waits for in-flight generations
  to finish, and new ones wait for the update), so every token of a request comes from one version, exactly as
  with the embedded engine. After each generation call (still under the gate) the server's reported weight
  version is compared with the stamp (one small GET): a server restarted or updated by someone else between our
  pushes is caught there, its result dropped, and the handler dies, so the trainer reconnects and resyncs it and
  re-dispatches the request: no sample is ever labelled with a version that did not generate it.
* A weight push (``begin_update(v)``) runs on one control thread: wait for the gate, ``pause``, ``open`` the
  server's update session, then ONE HTTP request per bucket of the ``BucketPlan`` (names/dtypes/shapes from the
  plan, HF names), each concurrent with the trainer's broadcast of that bucket, then ``close`` (version, cache
  reset) and ``resume``. The control thread posts the ``WeightAck`` itself when the server confirmed the last
  call, so ``finish_update`` has nothing to do: the server, not the trainer, knows when it holds the weights.
* A health thread polls the server (not during a push) and posts a fatal ``EngineError`` once it is gone.

Where names and layouts are converted (trainer side, once, with the model family's torchtitan state-dict adapter,
``torchtitan_flux.model.HFLayout``): for Llama, torchtitan's wq/wk rows are in the RoPE layout of the original
Llama code and HF's q_proj/k_proj rows are permuted (``to_hf`` applies the permutation); Qwen keeps HF's layout.
A tied model has no ``output.weight`` parameter, so nothing is pushed for ``lm_head``: the engine's embedding is
its output projection. SGLang's ``load_weights`` takes HF tensors as they are, so the bytes on the
wire must already be in HF layout; vLLM takes the same, and doing it once for both keeps one wire format. So:

* names: ``join_weight_group`` maps each ``TensorSpec`` name to its HF name (``to_hf`` on meta tensors) and
  those names travel in the per-bucket HTTP requests; the bucket offsets do not change (1:1, same shapes);
* data: the syncer applies ``wire_tensor(name, tensor)`` while it copies parameters into its staging buffer
  (``_snapshot``), so the staging buffer holds HF layout and nothing extra is allocated per push;
* ``wire_tensors(header, flats)``: what to broadcast per push, in order (vLLM: header + buckets; SGLang: the
  buckets only, as uint8 views, which is how ``flattened_bucket`` receives them);
* ``group_store(store, info)``: where rank 0's side of the weight-sync group meets the server's (SGLang builds
  its side with ``init_custom_process_group``, whose store prefixes differ from ours).
The hooks and their defaults are declared in ``engine/base.py`` (``EngineHandler``, ``EngineBase``).

Failure policy: a push that fails after the server's update session opened leaves the server's weights partly
updated; the handler then declares itself dead (fatal ``EngineError``), since nothing could be trusted from it,
and the scheduler re-dispatches its requests (``reconnect()`` gives the trainer a fresh handler once the server
is usable again). A push that fails before that (pause/open refused) is a non-fatal error: the server keeps its
old, consistent weights and the syncer resyncs it.

Simplifications: one server = one weight-sync rank (tensor/pipeline/data parallel size 1 per server; run more
servers for more throughput); full pushes only (the header's bucket list is checked by the vLLM extension);
the update waits for in-flight generations of this handler to finish, so ``weight_sync.timeout_seconds`` must
exceed one generation request.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Callable

import httpx
import torch

from torchtitan_flux import hf, transport
from torchtitan_flux.engine.base import (
    EngineBase,
    EngineError,
    EngineStartError,
    GenerationRequest,
    GenerationResult,
    WeightAck,
    WeightGroupInfo,
)
from torchtitan_flux.engine.http_client import HttpClient, HttpError

logger = logging.getLogger("torchtitan_flux")

class _Gate:
    """Reader/writer gate: generations share it, a weight update holds it alone. Writers go first (a pending
    update blocks new generations), so updates are not starved. ``fail`` wakes every waiter with an error."""

    def __init__(self):
        self._cv = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        self._failed: str | None = None

    @contextlib.contextmanager
    def shared(self):
        with self._cv:
            while (self._writer or self._writers_waiting) and self._failed is None:
                self._cv.wait()
            if self._failed is not None:
                raise RuntimeError(self._failed)
            self._readers += 1
        try:
            yield
        finally:
            with self._cv:
                self._readers -= 1
                self._cv.notify_all()

    def acquire(self) -> None:
        with self._cv:
            self._writers_waiting += 1
            try:
                while (self._writer or self._readers) and self._failed is None:
                    self._cv.wait()
            finally:
                self._writers_waiting -= 1
            if self._failed is not None:
                raise RuntimeError(self._failed)
            self._writer = True

    def release(self) -> None:
        with self._cv:
            self._writer = False
            self._cv.notify_all()

    @property
    def held(self) -> bool:
        return self._writer

    def fail(self, why: str) -> None:
        with self._cv:
            self._failed = why
            self._cv.notify_all()


class _Workers:
    """A fixed set of daemon threads draining a task queue (daemon: a call stuck on a dead server never keeps the
    trainer from exiting, unlike ``ThreadPoolExecutor``'s joined threads)."""

    def __init__(self, n: int, name: str):
        self._q: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable, *args) -> None:
        self._q.put((fn, args))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - tasks report through events; never lose the thread
                logger.exception("HTTP engine task failed")

    def stop(self) -> None:
        with self._q.mutex:
            self._q.queue.clear()
        for _ in self._threads:
            self._q.put(None)


def _read_json(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


class HttpEngine(EngineBase):
    """``EngineHandler`` for an inference server reached over HTTP. Subclasses hold only what differs per server
    (the endpoints and payloads): ``_check_server``, ``_generate``, ``_init_group`` and the five push steps
    ``_pause``, ``_open``, ``_send_bucket``, ``_close``, ``_resume``."""

    kind = "HTTP"  # server kind, for messages ("vLLM", "SGLang")
    supports_delta = False  # servers load whole buckets through their own loaders
    reconnects = True  # a server is not ours to restart
    launch_hint = ""  # how to start a correctly configured server, appended to start-up errors

    def __init__(
        self,
        name: str,
        url: str,
        events: queue.Queue,
        *,
        model_dir: str | Path,
        max_inflight: int = 8,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        retries: int = 3,
        backoff_s: float = 0.25,
        health_interval_s: float = 5.0,
        health_failures: int = 3,
        transport: httpx.BaseTransport | None = None,
        auth_token: str | None = None,
    ):
        self._init_args = (name, url, events)
        self._init_kw = dict(
            model_dir=model_dir, max_inflight=max_inflight, request_timeout_s=request_timeout_s,
            connect_timeout_s=connect_timeout_s, retries=retries, backoff_s=backoff_s,
            health_interval_s=health_interval_s, health_failures=health_failures, transport=transport,
            auth_token=auth_token,
        )
        self.name, self.url, self.events = name, url.rstrip("/"), events
        self.model_dir = Path(model_dir)
        self.max_inflight = max_inflight
        self.request_timeout_s = request_timeout_s
        self.health_interval_s, self.health_failures = health_interval_s, health_failures
        self._client_kw = dict(
            label=f"{self.kind} server {self.url}", timeout_s=request_timeout_s, connect_timeout_s=connect_timeout_s,
            max_connections=max_inflight + 4, retries=retries, backoff_s=backoff_s, transport=transport,
            auth_token=auth_token,
        )
        self.client: HttpClient | None = None
        self.hf_config = _read_json(self.model_dir / "config.json")
        self.eos_id = hf.eos_token_ids(self.hf_config)
        self.pad_id = int(self.hf_config.get("pad_token_id") or 0)
        self._adapter = None  # the family's HFLayout, built on first use
        self._lock = threading.Lock()
        self._gate = _Gate()
        self._version = -1  # version the server holds; -1 = the weights it loaded from disk
        self._version_cv = threading.Condition()  # notified when _version changes (requests wait on min_version)
        self._plan: transport.BucketPlan | None = None
        self._bucket_meta: list[tuple[list[str], list[str], list[list[int]]]] = []
        self._info: WeightGroupInfo | None = None
        self._dead = False
        self._closing = False
        self._gen: _Workers | None = None
        self._ctl: _Workers | None = None
        self._health_stop = threading.Event()
        self.last_push_s = 0.0  # wall time of the last push, gate wait excluded (metrics, tests)

    # --------------------------------------------------------------------------- EngineHandler protocol

    def start(self) -> None:
        self.client = HttpClient(self.url, **self._client_kw)
        try:
            self._check_server()
        except EngineStartError:
            self.client.close()
            raise
        except HttpError as e:
            self.client.close()
            if e.status is None:
                raise EngineStartError(
                    f"{self.name}: cannot reach the {self.kind} server at {self.url} ({e.detail}). Is it running? "
                    f"{self.launch_hint}"
                ) from e
            if e.status == 401:
                raise EngineStartError(
                    f"{self.name}: the {self.kind} server at {self.url} refused the trainer's token (HTTP 401): set "
                    "the variable named by weight_sync.auth_token_env to the server's TORCHTITAN_FLUX_TOKEN"
                ) from e
            raise EngineStartError(f"{self.name}: the {self.kind} server at {self.url} is not usable: {e}") from e
        self._gen = _Workers(self.max_inflight, f"{self.name}-gen")
        self._ctl = _Workers(1, f"{self.name}-ctl")
        if self.health_interval_s > 0:
            threading.Thread(target=self._health_loop, name=f"{self.name}-health", daemon=True).start()

    def alive(self) -> bool:
        return self.client is not None and not self._dead and not self._closing

    def submit(self, request: GenerationRequest) -> None:
        if not self.alive():
            self._die("submit on a dead or closed engine")
            return
        self._gen.submit(self._generate_task, request)

    def join_weight_group(self, info: WeightGroupInfo) -> None:
        plan = transport.plan_buckets(info.specs, info.bucket_bytes)
        names = self.hf_names([s.name for s in plan.specs], [s.shape for s in plan.specs])
        meta = []
        for b in plan.buckets:
            specs = plan.specs[b.start : b.end]
            meta.append((names[b.start : b.end], [s.dtype for s in specs], [list(s.shape) for s in specs]))
        with self._lock:
            self._plan, self._bucket_meta, self._info = plan, meta, info
        self._ctl.submit(self._join_task, info)

    def begin_update(self, version: int) -> None:
        self._ctl.submit(self._update_task, version)

    def finish_update(self, version: int) -> None:
        pass  # the control thread acks when the server confirmed the last bucket (see the module docstring)

    def reconnect(self) -> "HttpEngine":
        """A new, started handler for the same server (what the trainer uses to "restart" a dead HTTP engine: the
        server itself is not ours to restart). Raises ``EngineStartError`` if the server is still unusable. The
        syncer must then rejoin it (``WeightSyncer.replace_engine``): its weights are whatever it holds."""
        new = type(self)(*self._init_args, **self._init_kw)
        new.start()
        return new

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._health_stop.set()
        self._gate.fail(f"{self.name} is closed")
        for w in (self._gen, self._ctl):
            if w is not None:
                w.stop()
        if self.client is not None:
            self.client.close()

    # ------------------------------------------------------------------------------- syncer hooks

    def wire_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A torchtitan parameter in the layout the server loads (HF; see ``HFLayout.wire_tensor``)."""
        return self.layout().wire_tensor(name, tensor)

    # ----------------------------------------------------------------------------------- names

    def layout(self):
        """The model family's HF layout (``torchtitan_flux.model.HFLayout``), built on first use."""
        if self._adapter is None:
            from torchtitan_flux.model import HFLayout  # imports torchtitan (trainer side only)

            self._adapter = HFLayout.from_hf_dir(self.model_dir)
        return self._adapter

    def hf_names(self, names: list[str], shapes: list[tuple[int, ...]]) -> list[str]:
        """HF names of torchtitan parameter names, in order (see ``HFLayout.hf_names``)."""
        try:
            return self.layout().hf_names(names, shapes)
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None

    # ------------------------------------------------------------------------------------ tasks

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
        with self._version_cv:  # born fresh enough; after the wait bound it runs on what the server holds
            bound = self._info.timeout_s if self._info is not None else 60.0
            self._version_cv.wait_for(lambda: self._version >= req.min_version or self._dead, timeout=bound)
        try:
            with self._gate.shared():
                version = self._version
                t0 = time.perf_counter()
                completions = self._generate(req)
                dt = time.perf_counter() - t0
                # no push of ours can run while the gate is held shared: any other version means the server
                # was restarted (or its weights replaced) behind our back, and the tokens are not ``version``'s
                reported = self.weight_version() if version >= 0 else None
            tokens, logprobs, lengths = self._pack(completions, req)
        except Exception as e:  # noqa: BLE001 - the client already retried: the server cannot serve
            self._die(f"generation request {req.req_id} failed: {e}")
            return
        if reported is not None and str(reported) != str(version):
            self._die(f"reports weight version {reported!r} after generation request {req.req_id}, but our last push "
                      f"to it was version {version}: it was restarted or its weights were replaced; the result is "
                      "dropped and the engine is reconnected and resynced")
            return
        self.events.put(GenerationResult(req.req_id, self.name, tokens, logprobs, lengths, version, self._version, dt))

    def _pack(self, completions: list[tuple[list[int], list[float]]], req: GenerationRequest):
        """Per-completion (token ids, logprobs) -> the padded tensors of a ``GenerationResult``."""
        n = len(req.prompt_ids) * req.group_size
        if len(completions) != n:
            raise RuntimeError(f"expected {n} completions, the server returned {len(completions)}")
        T = req.max_new_tokens
        tokens = torch.full((n, T), self.pad_id, dtype=torch.int64)
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
        try:
            if not self._bucket_meta:
                raise RuntimeError("begin_update before join_weight_group")
            self._pause()
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
            try:
                self._resume()
            except Exception:  # noqa: BLE001
                pass
            self._gate.release()
            self.events.put(EngineError(self.name, f"weight push {version} not started: {e}", fatal=False))
            return
        self.last_push_s = time.perf_counter() - t0
        with self._version_cv:
            self._version = version
            self._version_cv.notify_all()
        self._gate.release()
        self.events.put(WeightAck(self.name, version, time.time()))

    def _health_loop(self) -> None:
        failures = 0
        while not self._health_stop.wait(self.health_interval_s):
            if self._dead or self._closing:
                return
            if self._gate.held:  # a push is running; some servers answer health checks slowly then
                failures = 0
                continue
            try:
                self.client.get(self._health_path, timeout_s=max(2.0, self.health_interval_s), retries=0)
                failures = 0
            except HttpError as e:
                failures += 1
                if failures >= self.health_failures:
                    self._die(f"health check failed {failures} times in a row: {e}")
                    return

    # ---------------------------------------------------------------------------- common checks

    _health_path = "/health"

    def _check_reachable(self) -> None:
        self.client.get(self._health_path, timeout_s=10.0)

    def _check_tokenizer(self, server_tokens: Callable[[str], list[int]]) -> None:
        """The server's tokenizer must give the trainer's token ids (prompts travel as ids, completions come back
        as ids): compare them on a probe string."""
        from tokenizers import Tokenizer

        probe = "Hello, world! 0123456789 +-*/= {}[]\n\tçé"
        local = Tokenizer.from_file(str(self.model_dir / "tokenizer.json")).encode(probe, add_special_tokens=False).ids
        remote = server_tokens(probe)
        if list(remote) != list(local):
            raise EngineStartError(
                f"{self.name}: vocabulary mismatch between the trainer ({self.model_dir}) and the {self.kind} server "
                f"at {self.url}: {probe!r} tokenizes to {list(remote)[:12]}... on the server but {local[:12]}... "
                "for the trainer. Serve the trainer's model folder."
            )

    def _check_config(self, server_cfg: dict, keys: tuple[str, ...], where: str) -> None:
        bad = [
            f"{k}: server {server_cfg.get(k)!r} != trainer {self.hf_config.get(k)!r}"
            for k in keys
            if server_cfg.get(k) is not None and server_cfg.get(k) != self.hf_config.get(k)
        ]
        if bad:
            raise EngineStartError(
                f"{self.name}: model mismatch between the trainer ({self.model_dir}/config.json) and the {self.kind} "
                f"server at {self.url} ({where}): {'; '.join(bad)}. Serve the trainer's model folder."
            )

    # ---------------------------------------------------------------------------- per server

    def _check_server(self) -> None:
        raise NotImplementedError

    def weight_version(self) -> str | None:
        """The weight version the server reports (``str(v)`` after our push of ``v``)."""
        raise NotImplementedError

    def _generate(self, req: GenerationRequest) -> list[tuple[list[int], list[float]]]:
        """One HTTP generation call: (token ids, behaviour logprobs) per completion, prompt-major."""
        raise NotImplementedError

    def score(self, tokens: list[int], timeout: float = 30.0) -> tuple[int, list[float]]:
        """(the server's weight version, its logprobs of ``tokens[1:]``): the post-sync probe. The version is read
        before scoring; the caller makes sure no push runs meanwhile."""
        reported = self.weight_version()
        version = int(reported) if reported not in (None, "") and str(reported).lstrip("-").isdigit() else -1
        return version, self._score(list(tokens))

    def _score(self, tokens: list[int]) -> list[float]:
        """Teacher-forced logprobs of ``tokens[1:]`` (prompt logprobs of ``tokens``) from the server."""
        raise NotImplementedError

    def _init_group(self, info: WeightGroupInfo) -> None:
        raise NotImplementedError

    def _pause(self) -> None:
        raise NotImplementedError

    def _open(self, version: int) -> None:
        raise NotImplementedError

    def _send_bucket(self, i: int, n: int, names: list[str], dtypes: list[str], shapes: list[list[int]],
                     version: int) -> None:
        raise NotImplementedError

    def _close(self, version: int) -> None:
        raise NotImplementedError

    def _resume(self) -> None:
        raise NotImplementedError

    @property
    def _weight_timeout_s(self) -> float:
        """Read timeout of a call that blocks while the trainer broadcasts (group init, one bucket)."""
        return (self._info.timeout_s if self._info is not None else 60.0) + 30.0
