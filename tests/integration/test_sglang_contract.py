"""``SglangEngine`` against a contract server for SGLang 0.5.23's HTTP API, and (on a GPU) against real SGLang.

SGLang cannot run on this CPU-only machine (no CPU build on PyPI), so the handler is checked against a contract
server: this file, run as ``python tests/integration/test_sglang_contract.py serve ...``, in a child process on 127.0.0.1.
It implements the endpoints and payloads the handler uses, as documented in SGLang 0.5.23's
``entrypoints/http_server.py`` / ``managers/io_struct.py`` / ``api/v1/api_types.py``:

* it joins the weight-sync group the way SGLang does (``tcp://`` rendezvous on the trainer's store,
  ``PrefixStore(group_name)``, torch's ``_new_process_group_helper``) and really receives each
  ``flattened_bucket`` broadcast (one uint8 tensor per call) into its HF-named weights;
* it generates with those weights (``torchtitan_flux.inference`` after an HF -> torchtitan conversion), so a
  wrong name or a wrong q/k layout on the wire shows up as wrong log-probs;
* it is stricter than SGLang where that catches client bugs: every unknown key, wrong type, update outside a
  ``begin``/``end`` session, ``flush_cache`` or session changes while a generation runs, generation while paused
  or inside a session, ``continue_generation`` with a session still open, are answered with HTTP 400 (SGLang
  itself ignores unknown top-level keys and queues generations while paused).

Every server is bounded: it exits after ``--deadline`` seconds or ``--max-requests`` requests, binds 127.0.0.1
only, and refuses to join a group whose master address is not loopback. With ``--api-key K`` it answers like
SGLang's ``--api-key``: 401 to every request without ``Authorization: Bearer K`` but ``/health*`` and
``/metrics*`` (and this server's own ``/_contract`` test controls).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
GEN_KEYS = {"input_ids", "sampling_params", "return_logprob", "stream", "rid", "logprob_start_len",
            "top_logprobs_num", "return_text_in_logprobs"}
SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "sampling_seed", "n", "ignore_eos",
                 "stop", "stop_token_ids", "skip_special_tokens", "min_new_tokens"}
UPDATE_KEYS = {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests", "weight_version",
               "load_format", "selector", "torch_empty_cache"}
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


# ============================================================================================ contract server


class Reject(Exception):
    pass


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fields(body, required: dict, optional: dict) -> dict:
    """Check a JSON object: no unknown keys, required keys present, every value of the declared kind."""
    if not isinstance(body, dict):
        raise Reject(f"body must be a JSON object, got {type(body).__name__}")
    unknown = set(body) - set(required) - set(optional)
    if unknown:
        raise Reject(f"unknown keys {sorted(unknown)}")
    missing = set(required) - set(body)
    if missing:
        raise Reject(f"missing keys {sorted(missing)}")
    for k, v in body.items():
        ok = (required.get(k) or optional.get(k))(v)
        if not ok:
            raise Reject(f"{k} has a wrong type or value: {v!r}"[:300])
    return body


def _str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _shape_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(s, list) and all(_is_int(d) and d >= 0 for d in s) for s in v)


class ContractState:
    def __init__(self, model_dir: str):
        from safetensors.torch import load_file
        from tokenizers import Tokenizer

        from torchtitan_flux import weight_dict

        self.model_dir = model_dir
        with open(os.path.join(model_dir, "config.json")) as f:
            self.cfg = json.load(f)
        self.shape = weight_dict.LlamaShape.from_hf_config(self.cfg)
        self.hf = load_file(os.path.join(model_dir, "model.safetensors"))
        self.tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        self.lock = threading.Lock()
        self.paused = False
        self.session = False
        self.generating = 0
        self.groups: dict[str, object] = {}
        self.weight_version = "default"
        self.calls: list[str] = []
        self.rejected: list[str] = []
        self.buckets = 0
        self.gen_delay_s = 0.0
        self.weight_api = True
        self._tt = None  # torchtitan-named view of self.hf, rebuilt after each update

    def tt_weights(self):
        from torchtitan_flux import weight_dict

        if self._tt is None:
            self._tt = weight_dict.hf_to_weights(self.hf, self.shape)
        return self._tt


def _init_custom_group(state: ContractState, body: dict) -> None:
    """Join like SGLang's ``init_custom_process_group``: tcp rendezvous, PrefixStore(group_name), then torch's
    ``_new_process_group_helper`` (which adds the "{group_name}/" and "{device}/" prefixes)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=30)
    url = f"tcp://{body['master_address']}:{body['master_port']}"
    rank = body["rank_offset"]  # + tp_rank (0)
    store, rank, world = next(rendezvous(url, rank, body["world_size"], timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(body["group_name"], store)
    pg, _ = _new_process_group_helper(world, rank, [], Backend(body["backend"]), store,
                                      group_name=body["group_name"], timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    state.groups[body["group_name"]] = pg


def handle(state: ContractState, method: str, path: str, body) -> tuple[int, object]:
    """One request -> (status, JSON body). Raises Reject for a malformed request (-> 400)."""
    ok = {"success": True, "message": "ok"}
    weight_paths = ("/init_weights_update_group", "/destroy_weights_update_group", "/begin_weight_update",
                    "/end_weight_update", "/update_weights_from_distributed", "/get_weights_by_name")
    if not state.weight_api and path in weight_paths:
        return 404, {"detail": "Not Found"}
    if path == "/health" and method == "GET":
        return 200, None
    if path == "/model_info" and method == "GET":
        return 200, {
            "model_path": state.model_dir, "tokenizer_path": state.model_dir, "is_generation": True,
            "weight_version": state.weight_version, "model_type": state.cfg.get("model_type"),
            "architectures": state.cfg.get("architectures"),
        }
    if path == "/server_info" and method == "GET":
        return 200, {"tp_size": 1, "dp_size": 1, "pp_size": 1, "version": "0.5.23", "model_path": state.model_dir}
    if method != "POST" and path not in ("/flush_cache", "/get_weights_by_name", "/_contract/state"):
        return 405, {"detail": "Method Not Allowed"}
    if path == "/_contract/state":
        with state.lock:
            sha = {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                   for k, v in state.hf.items()}
            return 200, {"calls": list(state.calls), "rejected": list(state.rejected), "sha256": sha,
                         "weight_version": state.weight_version, "buckets": state.buckets, "paused": state.paused,
                         "session": state.session, "groups": sorted(state.groups)}
    if path == "/_contract/restart":  # what the trainer sees of a restarted server: disk weights, no version
        from safetensors.torch import load_file

        with state.lock:
            state.hf = load_file(os.path.join(state.model_dir, "model.safetensors"))
            state._tt, state.weight_version, state.groups = None, "default", {}
        return 200, ok
    if path == "/_contract/config":
        b = _fields(body, {}, {"gen_delay_s": _is_num, "weight_api": lambda v: isinstance(v, bool)})
        state.gen_delay_s = float(b.get("gen_delay_s", state.gen_delay_s))
        state.weight_api = b.get("weight_api", state.weight_api)
        return 200, ok
    if path == "/tokenize":
        b = _fields(body, {"prompt": lambda v: isinstance(v, str)},
                    {"add_special_tokens": lambda v: isinstance(v, bool), "model": lambda v: isinstance(v, str)})
        ids = state.tokenizer.encode(b["prompt"], add_special_tokens=b.get("add_special_tokens", True)).ids
        return 200, {"tokens": ids, "count": len(ids), "max_model_len": state.shape.max_position_embeddings}
    if path == "/generate":
        return _generate(state, body)
    if path == "/pause_generation":
        b = _fields(body, {}, {"mode": lambda v: v in ("abort", "retract", "in_place")})
        with state.lock:
            if b.get("mode", "abort") == "in_place" and state.generating:
                raise Reject("in_place pause with running requests keeps their KV; use retract before a flush")
            state.paused = True
        return 200, {"message": "Generation paused successfully.", "status": "ok"}
    if path == "/continue_generation":
        _fields(body, {}, {"torch_empty_cache": lambda v: isinstance(v, bool)})
        with state.lock:
            if state.session:
                raise Reject("continue_generation while a weight-update session is open")
            state.paused = False
        return 200, {"message": "Generation continued successfully.", "status": "ok"}
    if path == "/flush_cache":
        with state.lock:
            if state.generating:
                return 400, "Flush cache failed: requests are running.\n"
        return 200, "Cache flushed.\n"
    if path == "/get_weights_by_name":
        b = _fields(body, {"name": lambda v: isinstance(v, str)}, {"truncate_size": lambda v: _is_int(v) and v > 0})
        t = state.hf.get(b["name"])
        if t is None:
            return 400, {"error": {"message": "Get parameter by name failed"}}
        return 200, t.float().tolist()[: b.get("truncate_size", 100)]
    if path == "/init_weights_update_group":
        b = _fields(
            body,
            {"master_address": lambda v: isinstance(v, str), "master_port": lambda v: _is_int(v) and 0 < v < 65536,
             "rank_offset": lambda v: _is_int(v) and v >= 1, "world_size": lambda v: _is_int(v) and v >= 2},
            {"group_name": lambda v: isinstance(v, str) and v != "", "backend": lambda v: v in ("nccl", "gloo")},
        )
        b.setdefault("group_name", "weight_update_group")
        b.setdefault("backend", "nccl")
        if b["master_address"] not in LOOPBACK:
            raise Reject(f"contract server joins loopback masters only, not {b['master_address']!r}")
        if b["world_size"] != b["rank_offset"] + 1:
            raise Reject("world_size must be rank_offset + tp_size (tp_size = 1)")
        if b["backend"] != "gloo":
            return 400, {"success": False, "message": "Failed to initialize custom process group: no CUDA here."}
        if b["group_name"] in state.groups:
            return 400, {"success": False, "message": f"group {b['group_name']} exists"}
        try:
            _init_custom_group(state, b)
        except Exception as e:  # noqa: BLE001
            return 400, {"success": False, "message": f"Failed to initialize custom process group: {e}."}
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}
    if path == "/destroy_weights_update_group":
        b = _fields(body, {}, {"group_name": lambda v: isinstance(v, str)})
        if state.groups.pop(b.get("group_name", "weight_update_group"), None) is None:
            return 400, {"success": False, "message": "The group to be destroyed does not exist."}
        return 200, {"success": True, "message": "Succeeded to destroy custom process group."}
    if path == "/begin_weight_update":
        _fields(body, {}, {"selector": lambda v: v in ("target", "draft", "all")})
        with state.lock:
            if state.session:
                raise Reject("a weight-update session is already open")
            if state.generating:
                raise Reject("begin_weight_update while requests are running")
            state.session = True
        return 200, ok
    if path == "/end_weight_update":
        _fields(body, {}, {})
        with state.lock:
            if not state.session:
                raise Reject("end_weight_update without begin_weight_update")
            state.session = False
        return 200, ok
    if path == "/update_weights_from_distributed":
        return _update(state, body)
    return 404, {"detail": "Not Found"}


def _generate(state: ContractState, body) -> tuple[int, object]:
    from torchtitan_flux import inference

    b = _fields(
        body,
        {"input_ids": lambda v: isinstance(v, list) and v != []},
        {"sampling_params": lambda v: isinstance(v, (dict, list)), "return_logprob": lambda v: isinstance(v, bool),
         "stream": lambda v: v is False, "rid": lambda v: True, "logprob_start_len": _is_int,
         "top_logprobs_num": _is_int, "return_text_in_logprobs": lambda v: isinstance(v, bool)},
    )
    batch = b["input_ids"]
    single = all(_is_int(x) for x in batch)
    if single:
        batch = [batch]
    if not all(isinstance(p, list) and p and all(_is_int(x) and 0 <= x < state.shape.vocab_size for x in p)
               for p in batch):
        raise Reject("input_ids must be a non-empty list of token ids in the vocabulary, or a list of them")
    sps = b.get("sampling_params", {})
    sps = sps if isinstance(sps, list) else [sps] * len(batch)
    if len(sps) != len(batch):
        raise Reject(f"{len(sps)} sampling_params for a batch of {len(batch)}")
    for sp in sps:
        _fields(sp, {}, {
            "max_new_tokens": lambda v: _is_int(v) and v >= 0, "temperature": lambda v: _is_num(v) and v >= 0,
            "top_k": lambda v: _is_int(v) and (v >= 1 or v == -1), "sampling_seed": _is_int,
            "top_p": lambda v: _is_num(v) and 0 < v <= 1, "min_p": _is_num, "n": lambda v: v == 1,
            "ignore_eos": lambda v: isinstance(v, bool), "stop": lambda v: True, "stop_token_ids": lambda v: True,
            "skip_special_tokens": lambda v: isinstance(v, bool), "min_new_tokens": _is_int,
        })
    with state.lock:
        if state.paused or state.session:
            raise Reject("generate while paused or inside a weight-update session (the handler must gate these)")
        state.generating += 1
        weights, version = state.tt_weights(), state.weight_version
    try:
        if state.gen_delay_s:
            time.sleep(state.gen_delay_s)
        outs = []
        eos = int(state.cfg["eos_token_id"])
        for ids, sp in zip(batch, sps):
            n = sp.get("max_new_tokens", 128)
            gen = torch.Generator().manual_seed(sp.get("sampling_seed", 0))
            top_k = sp.get("top_k", -1)
            toks, lps, lens = inference.generate(
                weights, state.shape, [ids], max_new_tokens=n, temperature=float(sp.get("temperature", 1.0)),
                top_k=0 if top_k == -1 else top_k, eos_id=eos, pad_id=int(state.cfg.get("pad_token_id", 0)),
                generator=gen,
            )
            L = int(lens[0])
            out_ids, out_lps = toks[0, :L].tolist(), lps[0, :L].tolist()
            finish = ({"type": "stop", "matched": eos} if out_ids and out_ids[-1] == eos
                      else {"type": "length", "length": n})
            meta = {"id": f"c{time.monotonic_ns()}", "finish_reason": finish, "prompt_tokens": len(ids),
                    "completion_tokens": L, "weight_version": version}
            if b.get("return_logprob"):
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(out_lps, out_ids)]
                start = b.get("logprob_start_len", -1)
                if start >= 0:  # SGLang: logprobs of the input tokens from ``start`` on; the first token has none
                    scored = inference.score(weights, state.shape, torch.tensor([ids]))[0].tolist()
                    meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip([None, *scored], ids)][start:]
            outs.append({"text": state.tokenizer.decode(out_ids), "output_ids": out_ids, "meta_info": meta})
    finally:
        with state.lock:
            state.generating -= 1
    return 200, outs[0] if single else outs


def _update(state: ContractState, body) -> tuple[int, object]:
    b = _fields(
        body,
        {"names": _str_list, "dtypes": _str_list, "shapes": _shape_list},
        {"group_name": lambda v: isinstance(v, str), "flush_cache": lambda v: isinstance(v, bool),
         "abort_all_requests": lambda v: isinstance(v, bool), "weight_version": lambda v: v is None or
         isinstance(v, str), "load_format": lambda v: v in (None, "flattened_bucket"),
         "selector": lambda v: v in ("target", "draft", "all"), "torch_empty_cache": lambda v: isinstance(v, bool)},
    )
    names, dtypes, shapes = b["names"], b["dtypes"], b["shapes"]
    if not names or not len(names) == len(dtypes) == len(shapes):
        raise Reject("names, dtypes and shapes must be non-empty and equally long")
    for n, d, s in zip(names, dtypes, shapes):
        if n not in state.hf:
            raise Reject(f"unknown parameter {n!r}")
        if list(state.hf[n].shape) != s:
            raise Reject(f"{n}: shape {s} != {list(state.hf[n].shape)}")
        if d not in ("float32", "bfloat16", "float16"):
            raise Reject(f"{n}: dtype {d!r}")
    with state.lock:
        if not state.session:
            return 400, {"success": False, "message": "No weight-update session: call /begin_weight_update first."}
        if state.generating:
            raise Reject("update_weights_from_distributed while requests are running")
        if b.get("flush_cache", True) and not state.paused:
            raise Reject("flush_cache=true needs generation paused (it fails while requests run)")
    pg = state.groups.get(b.get("group_name", "weight_update_group"))
    if pg is None:
        return 400, {"success": False, "message": "Group not found: call /init_weights_update_group first."}
    dts = [getattr(torch, d) for d in dtypes]
    if b.get("load_format") == "flattened_bucket":
        sizes = [torch.Size(s).numel() * dt.itemsize for s, dt in zip(shapes, dts)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        torch.distributed.broadcast(flat, src=0, group=pg)
        received, off = [], 0
        for s, dt, size in zip(shapes, dts, sizes):
            received.append(flat[off: off + size].view(dt).reshape(s))
            off += size
    else:
        received = [torch.empty(s, dtype=dt) for s, dt in zip(shapes, dts)]
        for t in received:
            torch.distributed.broadcast(t, src=0, group=pg)
    with state.lock:
        for n, t in zip(names, received):
            state.hf[n] = t.to(state.hf[n].dtype).clone()
        state._tt = None
        state.buckets += 1
        if b.get("weight_version") is not None:
            state.weight_version = b["weight_version"]
    return 200, {"success": True, "message": "Succeeded to update parameter online."}


def serve(model_dir: str, port_file: str, deadline_s: float, max_requests: int, api_key: str | None) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    torch.set_num_threads(1)
    state = ContractState(model_dir)
    count = [0]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the pooled client expects
        timeout = 60

        def log_message(self, *args):
            pass

        def _do(self, method: str) -> None:
            count[0] += 1
            path, _, _ = self.path.partition("?")
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else {}
            except ValueError:
                body = None
            if not path.startswith("/_contract"):
                with state.lock:
                    state.calls.append(path)
            try:
                open_path = path.startswith(("/health", "/metrics", "/_contract"))
                if api_key and not open_path and self.headers.get("Authorization") != f"Bearer {api_key}":
                    status, out = 401, {"error": "Unauthorized"}  # SGLang's add_api_key_middleware
                else:
                    status, out = handle(state, method, path, body)
            except Reject as e:
                with state.lock:
                    state.rejected.append(f"{path}: {e}")
                status, out = 400, {"success": False, "message": f"contract violation: {e}"}
            except Exception as e:  # noqa: BLE001
                status, out = 500, {"error": {"message": f"{type(e).__name__}: {e}"}}
            data = b"" if out is None else (out.encode() if isinstance(out, str) else json.dumps(out).encode())
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if isinstance(out, str) else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            if count[0] >= max_requests:
                threading.Thread(target=server.shutdown, daemon=True).start()

        def do_GET(self):
            self._do("GET")

        def do_POST(self):
            self._do("POST")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Timer(deadline_s, server.shutdown).start()
    tmp = port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(tmp, port_file)
    server.serve_forever(poll_interval=0.2)
    os._exit(0)  # do not wait on a handler thread stuck in a collective


# ================================================================================================== tests

if __name__ != "__main__":
    import httpx
    import pytest

    from torchtitan_flux import inference, transport, weight_dict
    from torchtitan_flux.engine.base import (
        EngineError,
        GenerationRequest,
        GenerationResult,
        WeightAck,
        WeightGroupInfo,
    )
    from torchtitan_flux.engine.base import EngineStartError
    from torchtitan_flux.engine.sglang import SglangEngine

    class ContractServer:
        def __init__(self, model_dir: Path, tmp: Path, deadline_s: float = 300, max_requests: int = 3000,
                     api_key: str | None = None):
            port_file = tmp / f"port-{time.monotonic_ns()}"
            self.log = open(tmp / f"contract-{time.monotonic_ns()}.log", "w")
            self.proc = subprocess.Popen(
                [sys.executable, __file__, "serve", "--model-dir", str(model_dir), "--port-file", str(port_file),
                 "--deadline", str(deadline_s), "--max-requests", str(max_requests),
                 *(["--api-key", api_key] if api_key else [])],
                cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
            )
            end = time.monotonic() + 60
            while not port_file.exists():
                if self.proc.poll() is not None or time.monotonic() > end:
                    self.stop()
                    raise RuntimeError(f"contract server did not start: {(tmp / self.log.name).read_text()[-2000:]}")
                time.sleep(0.05)
            self.url = f"http://127.0.0.1:{port_file.read_text()}"
            self.http = httpx.Client(base_url=self.url, timeout=30, trust_env=False)

        def state(self) -> dict:
            return self.http.get("/_contract/state").json()

        def config(self, **kw) -> None:
            self.http.post("/_contract/config", json=kw).raise_for_status()

        def stop(self) -> None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(timeout=10)
            self.log.close()

    def connect(handler, name: str, specs, bucket_bytes: int, epoch: int = 1):
        """The trainer's side of joining (WeightSyncer._start_join with the ``trainer_group`` hook)."""
        store = transport.connect_store("127.0.0.1", 0, 30, True)
        info = WeightGroupInfo("127.0.0.1", store.port, f"flux_ws/{name}/{epoch}", "gloo", 30.0, list(specs),
                               bucket_bytes)
        handler.join_weight_group(info)
        pg = handler.trainer_group(store, info)
        return store, pg, transport.plan_buckets(list(specs), bucket_bytes)

    from _engine_push import push_like_syncer as push
    from _engine_push import wait_event

    def max_logprob_diff(result, prompts, group_size, weights, shape, temperature) -> float:
        """Max |engine logprob - trainer logprob| over every completion token (trainer = inference.score)."""
        worst = 0.0
        for i in range(result.tokens.shape[0]):
            p, L = prompts[i // group_size], int(result.lengths[i])
            seq = torch.tensor([p + result.tokens[i, :L].tolist()])
            ref = inference.score(weights, shape, seq, temperature=temperature if temperature > 0 else 1.0)
            worst = max(worst, (ref[0, len(p) - 1:] - result.logprobs[i, :L]).abs().max().item())
        return worst

    def modified(weights: dict, seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        new = {k: v.clone() for k, v in weights.items()}
        for k in new:
            if k.endswith(("attention.wq.weight", "attention.wk.weight", "feed_forward.w1.weight")):
                new[k] += 0.05 * torch.randn(new[k].shape, generator=g)
        new["output.weight"] *= 1.5
        new["norm.weight"] *= 0.5
        return new

    def hf_sha(handler, weights: dict) -> dict:
        names = list(weights)
        hf = handler.layout.hf_names(names, [tuple(weights[n].shape) for n in names])
        return {h: hashlib.sha256(handler.wire_tensor(n, weights[n]).contiguous().view(torch.uint8).numpy()
                                  .tobytes()).hexdigest() for h, n in zip(hf, names)}

    PROMPTS = [[1, 75, 108, 108, 111], [1, 52, 53, 43, 55, 61], [1, 35]]
    G = 3

    def request(req_id: int, temperature: float = 1.0, max_new: int = 12, seed: int = 7) -> GenerationRequest:
        return GenerationRequest(req_id, 1, PROMPTS, G, max_new, temperature, 0, seed, 0)

    @pytest.fixture(scope="module")
    def tiny(tiny_model_dir):
        weights, shape = weight_dict.load_hf_weights_dict(tiny_model_dir)
        specs = [transport.TensorSpec(n, tuple(v.shape), "float32") for n, v in weights.items()]
        return tiny_model_dir, weights, shape, specs

    @pytest.fixture(scope="module")
    def server(tiny, tmp_path_factory):
        s = ContractServer(tiny[0], tmp_path_factory.mktemp("sglang_contract"))
        yield s
        s.stop()

    @pytest.fixture(scope="module")
    def engine(server, tiny):
        events: queue.Queue = queue.Queue()
        h = SglangEngine("sgl0", server.url, events, model_dir=tiny[0], health_interval_s=0.5)
        h.start()
        yield h, events
        h.close()

    def test_full_cycle_generate_push_pause_version(server, engine, tiny):
        h, events = engine
        model_dir, weights, shape, specs = tiny
        # generation on the server's own weights: version -1, logprobs = the trainer's
        h.submit(request(0))
        r = wait_event(events, GenerationResult)
        assert r.engine == "sgl0" and r.version == -1 and r.tokens.shape == (len(PROMPTS) * G, 12)
        assert max_logprob_diff(r, PROMPTS, G, weights, shape, 1.0) < 1e-5
        assert not torch.equal(r.tokens[0], r.tokens[1])  # the G samples of a prompt differ (seed + sample)

        # a bucketed push: the server joins as rank 1 and receives the broadcasts
        bucket_bytes = 64 * 1024
        store, pg, plan = connect(h, "sgl0", specs, bucket_bytes)
        assert len(plan.buckets) >= 4
        new = modified(weights, 1)
        t0 = time.perf_counter()
        staging = push(h, pg, plan, new, 1)
        ack = wait_event(events, WeightAck)
        assert ack.version == 1 and ack.engine == "sgl0"
        st = server.state()
        assert st["sha256"] == hf_sha(h, new)  # every tensor arrived, HF-named and in HF layout
        assert st["weight_version"] == "1" and h.weight_version() == "1"
        assert st["buckets"] == len(plan.buckets) and not st["paused"] and not st["session"]
        assert time.perf_counter() - t0 < 30
        # one control request per bucket, inside pause / begin ... end / continue
        calls = st["calls"]
        i = calls.index("/pause_generation")
        n = len(plan.buckets)
        assert calls[i: i + n + 4] == (["/pause_generation", "/begin_weight_update"]
                                       + ["/update_weights_from_distributed"] * n
                                       + ["/end_weight_update", "/continue_generation"])
        assert st["rejected"] == []
        # the real endpoint agrees on a permuted q_proj row
        q = h.client.post("/get_weights_by_name", {"name": "model.layers.1.self_attn.q_proj.weight",
                                                    "truncate_size": 3})
        want = h.wire_tensor("layers.1.attention.wq.weight", new["layers.1.attention.wq.weight"])[:3]
        assert torch.allclose(torch.tensor(q), want)
        assert staging.checksum() != ""  # the trainer-side buffer is what went out

        # generation now uses version 1, and the server's logprobs are the trainer's for the new weights
        h.submit(request(1, temperature=0.7))
        r = wait_event(events, GenerationResult)
        assert r.version == 1 and r.newest_seen == 1
        assert max_logprob_diff(r, PROMPTS, G, new, shape, 0.7) < 1e-5
        assert max_logprob_diff(r, PROMPTS, G, weights, shape, 0.7) > 1e-3

        # generations submitted around a second push carry the version that generated all their tokens
        server.config(gen_delay_s=0.4)
        try:
            h.submit(request(2))  # runs on version 1; the push waits for it
            time.sleep(0.1)
            new2 = modified(weights, 2)
            done = threading.Event()
            threading.Thread(target=lambda: (push(h, pg, plan, new2, 2), done.set()), daemon=True).start()
            time.sleep(0.1)
            h.submit(request(3))  # waits for the push, runs on version 2
            got = {}
            while len(got) < 3:
                ev = events.get(timeout=60)
                assert not isinstance(ev, EngineError), ev
                got[type(ev).__name__ + str(getattr(ev, "req_id", ""))] = ev
            assert done.wait(30)
        finally:
            server.config(gen_delay_s=0.0)
        r2, r3, ack2 = got["GenerationResult2"], got["GenerationResult3"], got["WeightAck"]
        assert (r2.version, r3.version, ack2.version) == (1, 2, 2)
        assert max_logprob_diff(r2, PROMPTS, G, new, shape, 1.0) < 1e-5
        assert max_logprob_diff(r3, PROMPTS, G, new2, shape, 1.0) < 1e-5
        assert server.state()["rejected"] == []

        # a re-join (resync after a failure) makes a fresh group; the old one is destroyed
        store2, pg2, plan2 = connect(h, "sgl0", specs, bucket_bytes, epoch=2)
        push(h, pg2, plan2, weights, 3)
        assert wait_event(events, WeightAck).version == 3
        st = server.state()
        assert [g.split("#")[0] for g in st["groups"]] == ["flux_ws/sgl0/2"] and st["sha256"] == hf_sha(h, weights)
        assert h.alive()

    def test_contract_rejects_malformed_requests(server):
        c = server.http
        gen = {"input_ids": [[1, 2, 3]], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
        assert c.post("/generate", json=gen).status_code == 200
        bad = [
            ("/generate", {**gen, "return_logprobs": True}),  # misspelt key
            ("/generate", {**gen, "sampling_params": {"max_tokens": 2}}),  # vLLM's name, not SGLang's
            ("/generate", {**gen, "input_ids": "1 2 3"}),
            ("/generate", {**gen, "sampling_params": {"temperature": "hot"}}),
            ("/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"],
                                                  "shapes": [[64]], "load_format": "flattened_bucket"}),  # no session
            ("/update_weights_from_distributed", {"names": "model.norm.weight", "dtypes": ["float32"],
                                                  "shapes": [[64]]}),
            ("/end_weight_update", {}),  # no session
            ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "29500",
                                            "rank_offset": 1, "world_size": 2}),
            ("/init_weights_update_group", {"master_address": "10.0.0.1", "master_port": 29500,
                                            "rank_offset": 1, "world_size": 2, "backend": "gloo"}),
            ("/pause_generation", {"mode": "freeze"}),
            ("/begin_weight_update", {"selector": "everything"}),
        ]
        for path, body in bad:
            r = c.post(path, json=body)
            assert r.status_code == 400, (path, body, r.status_code, r.text)
        # session rules: no generation inside a session, no second begin, no continue before end
        assert c.post("/pause_generation", json={"mode": "retract"}).status_code == 200
        assert c.post("/begin_weight_update", json={}).status_code == 200
        assert c.post("/begin_weight_update", json={}).status_code == 400
        assert c.post("/generate", json=gen).status_code == 400
        assert c.post("/continue_generation", json={}).status_code == 400
        assert c.post("/end_weight_update", json={}).status_code == 200
        assert c.post("/continue_generation", json={}).status_code == 200
        # flush_cache while a generation runs is refused
        server.config(gen_delay_s=1.0)
        try:
            t = threading.Thread(target=lambda: c.post("/generate", json=gen), daemon=True)
            t.start()
            time.sleep(0.3)
            assert c.post("/flush_cache").status_code == 400
            t.join(10)
            assert c.post("/flush_cache").status_code == 200
        finally:
            server.config(gen_delay_s=0.0)

    def test_handler_payload_violations_are_reported(server, tiny, monkeypatch):
        """A handler that sends a malformed payload gets a clear, non-retried error (here: a misspelt key)."""
        events: queue.Queue = queue.Queue()
        h = SglangEngine("sgl_bad", server.url, events, model_dir=tiny[0], health_interval_s=0)
        h.start()
        try:
            orig = h.client.post

            def post(path, body=None, **kw):
                if path == "/generate":
                    body = {**body, "return_logprobs": body.pop("return_logprob")}
                return orig(path, body, **kw)

            monkeypatch.setattr(h.client, "post", post)
            attempts = h.client.attempts
            h.submit(request(9))
            ev = events.get(timeout=30)
            assert isinstance(ev, EngineError) and ev.fatal and "HTTP 400" in ev.message
            assert "unknown keys ['return_logprobs']" in ev.message
            assert h.client.attempts == attempts + 1  # a 4xx is not retried
            assert not h.alive()
        finally:
            h.close()

    def test_start_fails_clearly(server, tiny, tmp_path):
        model_dir = tiny[0]
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            dead = s.getsockname()[1]
        h = SglangEngine("sgl_x", f"http://127.0.0.1:{dead}", queue.Queue(), model_dir=model_dir, retries=1,
                         backoff_s=0.01)
        with pytest.raises(EngineStartError, match=rf"cannot reach the SGLang server at http://127.0.0.1:{dead}"):
            h.start()

        server.config(weight_api=False)
        try:
            h = SglangEngine("sgl_x", server.url, queue.Queue(), model_dir=model_dir)
            with pytest.raises(EngineStartError, match="no weight-update endpoints"):
                h.start()
        finally:
            server.config(weight_api=True)

        from torchtitan_flux.assets import build_model_dir

        small = build_model_dir(tmp_path / "small", flavor="small")
        h = SglangEngine("sgl_x", server.url, queue.Queue(), model_dir=small)
        with pytest.raises(EngineStartError, match=r"model mismatch .* hidden_size: server 64 != trainer 128"):
            h.start()

        swapped = tmp_path / "swapped"
        shutil.copytree(model_dir, swapped)
        tok = json.loads((swapped / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        a, b = "l", "o"  # two byte tokens trade ids: same size, different vocabulary
        vocab[a], vocab[b] = vocab[b], vocab[a]
        (swapped / "tokenizer.json").write_text(json.dumps(tok))
        h = SglangEngine("sgl_x", server.url, queue.Queue(), model_dir=swapped)
        with pytest.raises(EngineStartError, match=f"vocabulary mismatch .* {server.url}"):
            h.start()

    def test_server_death_is_reported(tiny, tmp_path):
        s = ContractServer(tiny[0], tmp_path)
        events: queue.Queue = queue.Queue()
        h = SglangEngine("sgl_d", s.url, events, model_dir=tiny[0], health_interval_s=0.2, health_failures=2,
                         retries=1, backoff_s=0.01)
        try:
            h.start()
            s.stop()
            ev = events.get(timeout=20)
            assert isinstance(ev, EngineError) and ev.fatal and "health check failed" in ev.message
            assert s.url in ev.message and not h.alive()
        finally:
            h.close()
            s.stop()

    @pytest.mark.faults
    def test_server_with_other_weights_is_detected_and_resynced(tiny, tmp_path):
        """The server is restarted behind the handler's back after our push of version 1 (disk weights, version
        "default"): the next generation's result is dropped, never labelled version 1, and the handler dies; its
        reconnected replacement takes a fresh push and generates on it."""
        model_dir, weights, shape, specs = tiny
        server = ContractServer(model_dir, tmp_path)
        events: queue.Queue = queue.Queue()
        h = SglangEngine("sgl_r", server.url, events, model_dir=model_dir, health_interval_s=60)  # no health help
        h2 = None
        try:
            h.start()
            store, pg, plan = connect(h, "sgl_r", specs, 64 * 1024)
            new = modified(weights, 1)
            push(h, pg, plan, new, 1)
            assert wait_event(events, WeightAck).version == 1
            h.submit(request(10))
            r = wait_event(events, GenerationResult)
            assert r.version == 1 and max_logprob_diff(r, PROMPTS, G, new, shape, 1.0) < 1e-5

            server.http.post("/_contract/restart").raise_for_status()
            h.submit(request(11))
            ev = events.get(timeout=60)
            assert isinstance(ev, EngineError) and ev.fatal, ev
            assert "weight version 'default'" in ev.message and "version 1" in ev.message
            assert events.empty() and not h.alive()  # the result was dropped

            h2 = h.reconnect()  # what EngineFleet.restart does, then WeightSyncer.replace_engine resyncs
            store2, pg2, plan2 = connect(h2, "sgl_r", specs, 64 * 1024, epoch=2)
            push(h2, pg2, plan2, new, 2)
            assert wait_event(events, WeightAck).version == 2
            h2.submit(request(11))
            r = wait_event(events, GenerationResult)
            assert r.version == 2 and max_logprob_diff(r, PROMPTS, G, new, shape, 1.0) < 1e-5
        finally:
            h.close()
            if h2 is not None:
                h2.close()
            server.stop()

    def test_api_key_refuses_requests_without_it_and_the_handler_sends_it(tiny, tmp_path):
        """``--api-key`` as SGLang has it: a request without the key, or with another one, gets 401 and changes
        nothing (weight-update endpoints included), ``/health`` stays open; a handler without the token is refused
        at start with a clear error, one holding it starts, joins and pushes."""
        model_dir, weights, shape, specs = tiny
        s = ContractServer(model_dir, tmp_path, api_key="s3cret")
        try:
            c = s.http
            assert c.get("/health").status_code == 200
            guarded = [
                ("/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"],
                                                      "shapes": [[64]], "load_format": "flattened_bucket"}),
                ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29500,
                                                "rank_offset": 1, "world_size": 2, "backend": "gloo"}),
                ("/pause_generation", {"mode": "retract"}),
                ("/generate", {"input_ids": [[1, 2, 3]], "sampling_params": {"max_new_tokens": 2}}),
            ]
            for path, body in guarded:
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                    r = c.post(path, json=body, headers=headers)
                    assert r.status_code == 401, (path, headers, r.status_code, r.text)
            st = s.state()
            assert st["rejected"] == [] and st["groups"] == [] and not st["paused"] and st["buckets"] == 0

            with pytest.raises(EngineStartError, match=rf"server at {s.url} refused the trainer's token \(HTTP 401\)"):
                SglangEngine("sgl_k", s.url, queue.Queue(), model_dir=model_dir).start()
            events: queue.Queue = queue.Queue()
            h = SglangEngine("sgl_k", s.url, events, model_dir=model_dir, health_interval_s=0, auth_token="s3cret")
            h.start()
            try:
                store, pg, plan = connect(h, "sgl_k", specs, 64 * 1024)
                new = modified(weights, 1)
                push(h, pg, plan, new, 1)
                assert wait_event(events, WeightAck).version == 1
                st = s.state()
                assert st["weight_version"] == "1" and st["sha256"] == hf_sha(h, new) and st["rejected"] == []
            finally:
                h.close()
        finally:
            s.stop()

    @pytest.mark.slow
    def test_grpo_runs_against_contract_server(tiny, tmp_path):
        """Sync then async GRPO runs with ``--rollout.engine sglang`` against one contract server (a server outlives
        trainer runs)."""
        from conftest import read_metrics, run_train

        s = ContractServer(tiny[0], tmp_path, deadline_s=600, max_requests=20000)
        try:
            for mode in ("sync", "async"):
                dump = tmp_path / mode
                run_train(dump, "--training.steps", "4", "--rollout.engine", "sglang", "--rollout.urls", s.url,
                          "--model.hf_assets_path", str(tiny[0]),
                          "--weight_sync.async_weight_update", "true" if mode == "async" else "false",
                          "--weight_sync.probe_every", "1", timeout=400)
                summary = json.loads((dump / "summary.json").read_text())
                assert summary["final_engine_version"] == 4
                # SGLang keeps no byte checksum: never counted as a checksum match, but verified by the probe
                assert all(v["checksum"] is None and v["check"] == "probe" for v in summary["engines"].values())
                assert not summary["checksums_match"] and summary["all_engines_verified"]
                rows = read_metrics(dump)
                assert all(r["version_gap_max"] <= 1 for r in rows)
                # the post-sync probe (input_token_logprobs) ran after every push and passed
                assert all(r["probe_engines_checked"] == 1 and r["probe_max_abs_diff"] < 1e-4 for r in rows)
            st = s.state()
            assert st["rejected"] == [] and st["weight_version"] == "4"
        finally:
            s.stop()

    def _gpu_sglang() -> bool:
        return torch.cuda.is_available() and importlib.util.find_spec("sglang") is not None

    @pytest.mark.skipif(not _gpu_sglang(), reason="SGLang needs a CUDA GPU; not runnable on this machine")
    def test_real_sglang_server(tiny, tmp_path):  # pragma: no cover - GPU machines only
        """The same cycle against ``scripts/launch_sglang.sh`` (a real SGLang on the GPU)."""
        from conftest import free_port

        model_dir, weights, shape, specs = tiny
        port = free_port()
        log = open(tmp_path / "sglang.log", "w")
        proc = subprocess.Popen(["bash", str(ROOT / "scripts/launch_sglang.sh"), str(model_dir), str(port)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        events: queue.Queue = queue.Queue()
        h = SglangEngine("sgl_real", f"http://127.0.0.1:{port}", events, model_dir=model_dir)
        try:
            end = time.monotonic() + 600
            while True:
                try:
                    h.start()
                    break
                except EngineStartError:
                    if time.monotonic() > end or proc.poll() is not None:
                        raise
                    time.sleep(3)
            store, pg, plan = connect(h, "sgl_real", specs, 64 * 1024)
            new = modified(weights, 1)
            push(h, pg, plan, new, 1)
            assert wait_event(events, WeightAck, timeout=300).version == 1
            h.submit(request(0, temperature=1.0))
            r = wait_event(events, GenerationResult, timeout=300)
            assert r.version == 1
            assert max_logprob_diff(r, PROMPTS, G, new, shape, 1.0) < 1e-2  # bf16/fp16 kernels on the GPU
        finally:
            h.close()
            os.killpg(proc.pid, 9)
            proc.wait(timeout=30)
            log.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="SGLang 0.5.23 contract server (tests only)")
    ap.add_argument("cmd", choices=["serve"])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--deadline", type=float, default=300.0)
    ap.add_argument("--max-requests", type=int, default=3000)
    ap.add_argument("--api-key", default=None)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    serve(a.model_dir, a.port_file, a.deadline, a.max_requests, a.api_key)
