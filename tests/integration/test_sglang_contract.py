"""``SglangEngine`` against a contract server for SGLang 0.5.23's HTTP API (``tests/fakes/sglang_server.py``, what it
implements and how strictly), and (on a GPU) against real SGLang.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import queue
import shutil
import socket
import subprocess
import threading
import time

import pytest
import torch
from _engine_push import push_like_syncer as push
from _engine_push import as_pushed, engine_specs, layout_of, trainer_weights, wait_event
from fakes.sglang_server import ROOT, ContractServer

from torchtitan_flux.models import inference

from torchtitan_flux.wire import transport

from torchtitan_flux.models import weight_dict
from torchtitan_flux.engine.base import (
    EngineError,
    GenerationRequest,
    GenerationResult,
    WeightAck,
    WeightGroupInfo,
)
from torchtitan_flux.errors import EngineStartError
from torchtitan_flux.engine.sglang import SglangEngine
from torchtitan_flux.sync.pusher import trainer_group


def connect(handler, name: str, specs, bucket_bytes: int, epoch: int = 1):
    """The trainer's side of joining (the pusher's ``trainer_group``)."""
    store = transport.connect_store("127.0.0.1", 0, 30, True)
    info = WeightGroupInfo("127.0.0.1", store.port, f"flux_ws/{name}/{epoch}", "gloo", 30.0,
                           engine_specs(handler, specs), bucket_bytes)
    handler.join_weight_group(info)
    pg = trainer_group(handler, store, info)
    return store, pg, transport.plan_buckets(list(specs), bucket_bytes)


def max_logprob_diff(result, prompts, group_size, weights, shape, temperature) -> float:
    """Max |engine logprob - trainer logprob| over every completion token (trainer = inference.score on ``weights``
    as pushed: HF names and layout)."""
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
        if k.endswith(("attention.qkv_linear.wq.weight", "attention.qkv_linear.wk.weight", "feed_forward.w1.weight")):
            new[k] += 0.05 * torch.randn(new[k].shape, generator=g)
    new["lm_head.weight"] *= 1.5
    new["norm.weight"] *= 0.5
    return new


def pushed(handler, weights: dict) -> dict:
    """``weights`` as ``handler``'s engine receives them (HF names and layout)."""
    return as_pushed(layout_of(handler.model_dir), weights)


def hf_sha(handler, weights: dict) -> dict:
    names = list(weights)
    layout = layout_of(handler.model_dir)
    hf = layout.hf_names(names, [tuple(weights[n].shape) for n in names])
    return {h: hashlib.sha256(layout.wire_tensor(n, weights[n]).contiguous().view(torch.uint8).numpy()
                              .tobytes()).hexdigest() for h, n in zip(hf, names)}


PROMPTS = [[1, 75, 108, 108, 111], [1, 52, 53, 43, 55, 61], [1, 35]]
G = 3


def request(req_id: int, temperature: float = 1.0, max_new: int = 12, seed: int = 7) -> GenerationRequest:
    return GenerationRequest(req_id, 1, PROMPTS, G, max_new, temperature, 0, seed, 0)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    weights, shape = trainer_weights(tiny_model_dir), weight_dict.ModelShape.from_hf_dir(tiny_model_dir)
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
    assert max_logprob_diff(r, PROMPTS, G, pushed(h, weights), shape, 1.0) < 1e-5
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
    want = layout_of(h.model_dir).wire_tensor("layers.1.attention.qkv_linear.wq.weight", new["layers.1.attention.qkv_linear.wq.weight"])[:3]
    assert torch.allclose(torch.tensor(q), want)
    assert staging.checksum() != ""  # the trainer-side buffer is what went out

    # generation now uses version 1, and the server's logprobs are the trainer's for the new weights
    h.submit(request(1, temperature=0.7))
    r = wait_event(events, GenerationResult)
    assert r.version == 1 and r.newest_seen == 1
    assert max_logprob_diff(r, PROMPTS, G, pushed(h, new), shape, 0.7) < 1e-5
    assert max_logprob_diff(r, PROMPTS, G, pushed(h, weights), shape, 0.7) > 1e-3

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
    assert max_logprob_diff(r2, PROMPTS, G, pushed(h, new), shape, 1.0) < 1e-5
    assert max_logprob_diff(r3, PROMPTS, G, pushed(h, new2), shape, 1.0) < 1e-5
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

    from model_assets import build_model_dir

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
        assert r.version == 1 and max_logprob_diff(r, PROMPTS, G, pushed(h, new), shape, 1.0) < 1e-5

        server.http.post("/_contract/restart").raise_for_status()
        h.submit(request(11))
        ev = events.get(timeout=60)
        assert isinstance(ev, EngineError) and ev.fatal, ev
        assert "weight version 'default'" in ev.message and "version 1" in ev.message
        assert events.empty() and not h.alive()  # the result was dropped

        h2 = h.reconnect()  # what Rollouts does with a dead server, then WeightSyncer.replace_engine resyncs
        store2, pg2, plan2 = connect(h2, "sgl_r", specs, 64 * 1024, epoch=2)
        push(h2, pg2, plan2, new, 2)
        assert wait_event(events, WeightAck).version == 2
        h2.submit(request(11))
        r = wait_event(events, GenerationResult)
        assert r.version == 2 and max_logprob_diff(r, PROMPTS, G, pushed(h, new), shape, 1.0) < 1e-5
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
                      "--off_policy.async_ratio", "1" if mode == "async" else "0",
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
        # bf16/fp16 kernels on the GPU
        assert max_logprob_diff(r, PROMPTS, G, pushed(h, new), shape, 1.0) < 1e-2
    finally:
        h.close()
        os.killpg(proc.pid, 9)
        proc.wait(timeout=30)
        log.close()
