"""A contract server for SGLang 0.5.23's HTTP API, standing in for SGLang in ``tests/integration/test_sglang_contract.py``.

SGLang cannot run on this CPU-only machine (no CPU build on PyPI), so the handler is checked against a contract
server: this module, run as ``python tests/fakes/sglang_server.py serve ...`` (``ContractServer`` starts one),
in a child process on 127.0.0.1.
It implements the endpoints and payloads the handler uses, as documented in SGLang 0.5.23's
``entrypoints/http_server.py`` / ``managers/io_struct.py`` / ``api/v1/api_types.py``:

* it joins the weight-sync group the way SGLang does (``tcp://`` rendezvous on the trainer's store,
  ``PrefixStore(group_name)``, torch's ``_new_process_group_helper``) and really receives each
  ``flattened_bucket`` broadcast (one uint8 tensor per call) into its HF-named weights;
* it generates with those weights (``torchtitan_flux.models.inference`` after an HF -> torchtitan conversion), so a
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
import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import httpx
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

        from torchtitan_flux.models import weight_dict

        self.model_dir = model_dir
        with open(os.path.join(model_dir, "config.json")) as f:
            self.cfg = json.load(f)
        self.shape = weight_dict.ModelShape.from_hf_config(self.cfg)
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
        self._weights = None  # the forward's view of self.hf (``hf_to_weights``), rebuilt after each update

    def weights(self):
        from torchtitan_flux.models import weight_dict

        if self._weights is None:
            self._weights = weight_dict.hf_to_weights(self.hf, self.shape)
        return self._weights


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
            state._weights, state.weight_version, state.groups = None, "default", {}
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
    from torchtitan_flux.models import inference

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
        weights, version = state.weights(), state.weight_version
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
        state._weights = None
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


class ContractServer:
    """This module's server in a child process (``serve`` below), with its log, URL and test controls."""

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
