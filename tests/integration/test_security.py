"""Secure defaults: the rendezvous store listens on its address only; with a shared token, the HTTP auth middleware
refuses requests without it and the rendezvous handshake keeps engines and trainers without it out of weight-sync
groups; the launch scripts refuse to leave loopback without a token.

Elsewhere: config validation of non-loopback addresses (``test_config.py``), the client's header
(``test_http_client.py``), a real vLLM server with a token (``test_vllm.py``), SGLang's ``--api-key``
(``test_sglang_contract.py``).
"""

from __future__ import annotations

import asyncio
import json
import queue
import socket
import subprocess
import threading
from datetime import timedelta

import psutil
import pytest
import torch
from _engine_push import layout_of, trainer_model
from conftest import ROOT

from torchtitan_flux import compat

from torchtitan_flux.wire import transport

from torchtitan_flux.config import WeightSync
from torchtitan_flux import auth
from torchtitan_flux.auth import MIDDLEWARE, BearerAuthMiddleware
from torchtitan_flux.auth import TOKEN_ENV
from torchtitan_flux.engine.base import EngineError
from torchtitan_flux.engine.embedded import EmbeddedEngine
from torchtitan_flux.sync.syncer import WeightSyncer

TOKEN = "s3cret-token"

# ------------------------------------------------------------------------------------------ HTTP middleware


def asgi_call(method: str, path: str, authorization: str | None = None, kind: str = "http",
              token: str | None = TOKEN) -> tuple[list[dict], bool]:
    """One request through the middleware (``token``; None: from the environment) in front of an app that answers
    200. Returns (the messages sent back, whether the app was reached)."""
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    sent: list[dict] = []

    async def send(msg):
        sent.append(msg)

    headers = [(b"host", b"127.0.0.1")] + ([(b"authorization", authorization.encode())] if authorization else [])
    scope = {"type": kind, "path": path, "root_path": "", "headers": headers}
    if kind == "http":
        scope["method"] = method
    asyncio.run(BearerAuthMiddleware(app, token=token)(scope, receive, send))
    return sent, bool(reached)


GUARDED = [("POST", "/update_weights"), ("POST", "/init_weight_transfer_engine"), ("POST", "/pause"),
           ("POST", "/collective_rpc"), ("GET", "/weight_info"), ("POST", "/v1/completions"), ("POST", "/health"),
           ("GET", "/healthz"), ("GET", "/")]


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", "Bearer s3cret-token2", "Bearer s3cret-toke",
                                           "s3cret-token", "Basic s3cret-token", "Bearer "])
def test_middleware_refuses_requests_without_the_token(authorization, monkeypatch):
    compared = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    for method, path in GUARDED:
        sent, reached = asgi_call(method, path, authorization)
        assert sent[0]["status"] == 401 and not reached, (method, path)
        assert (b"www-authenticate", b"Bearer") in sent[0]["headers"]
        assert TOKEN_ENV.encode() in sent[1]["body"] and TOKEN.encode() not in sent[1]["body"]
    assert len(compared) == len(GUARDED)  # every check is a constant-time comparison


@pytest.mark.parametrize("authorization", ["Bearer s3cret-token", "bearer s3cret-token"])
def test_middleware_passes_the_token(authorization):
    for method, path in GUARDED:
        sent, reached = asgi_call(method, path, authorization)
        assert sent[0]["status"] == 200 and reached, (method, path)


def test_middleware_leaves_probes_open_and_closes_websockets():
    for method, path in [("GET", "/health"), ("HEAD", "/health"), ("GET", "/metrics")]:
        sent, reached = asgi_call(method, path)
        assert sent[0]["status"] == 200 and reached, (method, path)
    sent, reached = asgi_call("GET", "/v1/realtime", kind="websocket")
    assert sent == [{"type": "websocket.close", "code": 1008}] and not reached
    sent, reached = asgi_call("GET", "/v1/realtime", "Bearer s3cret-token", kind="websocket")
    assert reached


def test_middleware_reads_the_servers_token_and_never_fails_open(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert asgi_call("POST", "/pause", "Bearer from-env", token=None)[1]
    assert not asgi_call("POST", "/pause", f"Bearer {TOKEN}", token=None)[1]
    monkeypatch.setenv(TOKEN_ENV, "")
    with pytest.raises(RuntimeError, match=f"needs the shared token in \\${TOKEN_ENV}"):
        BearerAuthMiddleware(None)
    assert MIDDLEWARE == f"{BearerAuthMiddleware.__module__}.{BearerAuthMiddleware.__name__}"  # what --middleware loads


def test_loopback_detection():
    for host in ("127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost"):
        assert auth.is_loopback(host), host
    for host in ("0.0.0.0", "10.0.0.5", "::", "192.0.2.2", "gen1", "localhost.evil.com", ""):
        assert not auth.is_loopback(host), host


# ---------------------------------------------------------------------------------------- rendezvous store


def _tcp_listeners(pid: int | None = None) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket listening in process ``pid`` (default: this one), IPv4 and IPv6."""
    proc = psutil.Process(pid)
    conns = proc.net_connections(kind="tcp") if hasattr(proc, "net_connections") else proc.connections(kind="tcp")
    return {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}


def test_store_listens_on_master_addr_only():
    """torch's own TCPStore server listens on every interface whatever its host; ours on ``master_addr``."""
    store = transport.connect_store("127.0.0.1", 0, 10.0, is_master=True)
    assert [ip for ip, port in _tcp_listeners() if port == store.port] == ["127.0.0.1"]  # and no [::] wildcard
    client = transport.connect_store("127.0.0.1", store.port, 10.0, is_master=False)
    client.set("k", "v")
    assert store.get("k") == b"v"


def _non_loopback_ipv4() -> str | None:
    """An IPv4 address of this machine outside loopback, or None."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not auth.is_loopback(a.address):
                return a.address
    return None


def test_listen_address_is_the_local_end_of_the_route_to_the_peer():
    assert transport.listen_address("127.0.0.1") == "127.0.0.1"
    assert auth.is_loopback(transport.listen_address("localhost"))
    ip = _non_loopback_ipv4()
    if ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    assert transport.listen_address(ip) == ip


def _gloo_pair_listeners(listen_host: str) -> set[str]:
    """Build both ranks of a 2-rank weight-sync gloo group in this process; the addresses it listens on."""
    before = _tcp_listeners()
    store, groups = torch.distributed.HashStore(), [None, None]

    def rank(r):
        groups[r] = compat.new_weight_sync_group("gloo", store, r, 2, timedelta(seconds=20), listen_host=listen_host)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(g is not None for g in groups)
    return {ip for ip, _ in _tcp_listeners() - before}


@pytest.mark.parametrize("where", ["loopback", "another interface"])
def test_weight_sync_group_listens_on_the_given_address_only(where, monkeypatch):
    """gloo's default device listens on whatever the hostname resolves to (often a public interface, even when
    every peer is on loopback); our groups listen on ``transport.listen_address(rendezvous host)``."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    host = "127.0.0.1" if where == "loopback" else _non_loopback_ipv4()
    if host is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    assert _gloo_pair_listeners(host) == {host}


def test_gloo_socket_ifname_is_the_users_choice_and_wins(monkeypatch):
    ip = _non_loopback_ipv4()
    if ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert _gloo_pair_listeners(ip) == {"127.0.0.1"}


# ------------------------------------------------------------------------------------------ handshake


PREFIX = "flux_ws/engine0/1"


def handshake_pair(trainer_token, engine_token, prefix: str = PREFIX, timeout_s: float = 2.0):
    """Both sides of ``transport.handshake`` at once (trainer on the store's host, engine on a client):
    {role: None if it passed, else the exception}."""
    store = transport.connect_store("127.0.0.1", 0, 10.0, is_master=True)
    client = transport.connect_store("127.0.0.1", store.port, 10.0, is_master=False)
    out = {}

    def side(role, st, token):
        try:
            transport.handshake(st, prefix, token, role, timeout_s)
            out[role] = None
        except Exception as e:  # noqa: BLE001
            out[role] = e

    threads = [threading.Thread(target=side, args=a) for a in
               [(transport.TRAINER, store, trainer_token), (transport.ENGINE, client, engine_token)]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out, store


def test_handshake_passes_with_the_same_token_and_is_skipped_without_one():
    out, _ = handshake_pair(TOKEN, TOKEN)
    assert out == {transport.TRAINER: None, transport.ENGINE: None}
    out, store = handshake_pair(None, None)
    assert out == {transport.TRAINER: None, transport.ENGINE: None}
    assert not store.check([f"{PREFIX}/auth/nonce"])  # the loopback default writes nothing


@pytest.mark.parametrize("trainer_token,engine_token", [(TOKEN, "wrong"), ("wrong", TOKEN)])
def test_handshake_refuses_another_token_on_both_sides(trainer_token, engine_token):
    out, store = handshake_pair(trainer_token, engine_token)
    assert isinstance(out[transport.TRAINER], transport.AuthError)
    assert "refused the engine: its proof does not match" in str(out[transport.TRAINER])
    assert isinstance(out[transport.ENGINE], transport.AuthError)
    assert "the trainer refused this engine's proof" in str(out[transport.ENGINE])
    assert store.get(f"{PREFIX}/auth/trainer") == b"refused"


def test_handshake_side_with_a_token_refuses_a_peer_without_one():
    out, _ = handshake_pair(TOKEN, None)
    assert out[transport.ENGINE] is None  # it skips the handshake, and then finds no group: it gets nothing
    trainer = out[transport.TRAINER]
    assert isinstance(trainer, TimeoutError) and "no answer from the engine" in str(trainer)
    out, _ = handshake_pair(None, TOKEN)
    engine = out[transport.ENGINE]
    assert isinstance(engine, TimeoutError) and "no answer from the trainer" in str(engine)


def test_engine_refuses_an_impostor_trainer_and_proofs_do_not_replay():
    """A "trainer" without the token that does not check the engine's proof and answers anything is refused by
    the engine; an "engine" replaying a proof seen on an earlier join is refused by the trainer."""
    store = transport.connect_store("127.0.0.1", 0, 10.0, is_master=True)
    peer = transport.connect_store("127.0.0.1", store.port, 10.0, is_master=False)  # one blocking client a thread
    s = torch.distributed.PrefixStore(f"{PREFIX}/auth", store)
    got = {}
    t = threading.Thread(target=lambda: got.update(e=_raises(transport.handshake, peer, PREFIX, TOKEN,
                                                                   transport.ENGINE, 5.0)))
    t.start()
    s.set("nonce", b"0" * 32)
    s.wait(["engine"])
    s.set("trainer", b"f" * 64)
    t.join(10)
    assert isinstance(got["e"], transport.AuthError) and "refused the trainer" in str(got["e"])
    assert s.get("verdict") == b"refused"

    seen = s.get("engine")  # a valid engine proof, for the nonces of that join
    for key in ("nonce", "engine"):
        s.delete_key(key)
    t = threading.Thread(target=lambda: got.update(t=_raises(transport.handshake, peer, PREFIX, TOKEN,
                                                                   transport.TRAINER, 5.0)))
    t.start()
    s.wait(["nonce"])
    s.set("engine", seen)
    t.join(10)
    assert isinstance(got["t"], transport.AuthError) and "refused the engine" in str(got["t"])


def _raises(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        return e
    return None


# ------------------------------------------------------------------------ weight sync with an embedded engine


@pytest.fixture
def rig(tiny_model_dir, monkeypatch):
    """``engine(token)``: an embedded engine holding ``token``; ``trainer(token, engine, events)``: a
    ``WeightSyncer`` for it whose token variable (``weight_sync.auth_token_env``) holds ``token``."""
    made: list = []

    def engine(token) -> tuple[EmbeddedEngine, queue.Queue]:
        events: queue.Queue = queue.Queue()
        e = EmbeddedEngine("engine0", str(tiny_model_dir), 1, events, auth_token=token)
        e.start()
        made.append(e)
        e.checksum(timeout=60)  # up
        return e, events

    def trainer(token, e: EmbeddedEngine, events: queue.Queue) -> WeightSyncer:
        monkeypatch.setenv("FLUX_TEST_TOKEN", token)
        cfg = WeightSync(timeout_seconds=4.0, auth_token_env="FLUX_TEST_TOKEN")
        syncer = WeightSyncer(cfg, trainer_model(tiny_model_dir), [e], device=torch.device("cpu"), is_sender=True,
                              pump=lambda timeout: _deliver(syncer, events, timeout),
                              layout=layout_of(tiny_model_dir))
        made.append(syncer)
        return syncer

    yield engine, trainer
    for m in made:
        m.close()


def _deliver(syncer: WeightSyncer, events: queue.Queue, timeout: float) -> None:
    """The trainer's ``pump``: hand the next engine event to the syncer."""
    try:
        syncer.on_event(events.get(timeout=timeout))
    except queue.Empty:
        pass


def test_trainer_with_another_token_cannot_join_the_engine(rig):
    engine, trainer = rig
    e, events = engine(TOKEN)
    bad = trainer("another-token", e, events)
    with pytest.raises(RuntimeError, match=r"engines \['engine0'\] did not join .* refused the engine"):
        bad.connect()
    ev = events.get(timeout=30)  # the engine refused it too, and reports it (not fatal: it goes on serving)
    assert isinstance(ev, EngineError) and not ev.fatal and "the trainer refused this engine's proof" in ev.message
    assert e.checksum() == (-1, "")  # no weights
    bad.close()

    good = trainer(TOKEN, e, events)  # the same engine, a trainer holding its token: joins and receives
    good.connect()
    good.after_optimizer_step(1)
    assert e.checksum() == (1, good.staging.checksum())
    # a loopback run listens on loopback only, in the trainer (store, gloo) and in the engine (gloo)
    for pid in (None, e.pid):
        assert all(auth.is_loopback(ip) for ip, _ in _tcp_listeners(pid)), _tcp_listeners(pid)


@pytest.mark.parametrize("engine_token", ["another-token", None], ids=["another-token", "no-token"])
def test_engine_without_the_token_is_refused_and_receives_no_weights(rig, engine_token):
    engine, trainer = rig
    e, events = engine(engine_token)
    syncer = trainer(TOKEN, e, events)
    why = "refused the engine" if engine_token else "no answer from the engine"
    with pytest.raises(RuntimeError, match=rf"engines \['engine0'\] did not join .* {why}"):
        syncer.connect()
    syncer.after_optimizer_step(1)
    syncer.after_optimizer_step(2)
    assert e.checksum() == (-1, "")
    assert any(why in f for f in syncer.stats.failures) and syncer.stats.pushes == 2


def test_an_engine_without_the_token_does_not_hold_up_the_others(tiny_model_dir, monkeypatch):
    """Joins run concurrently: while the trainer waits out the silent engine's handshake, the other engine, which
    holds the token, joins and gets weights (each join talks to the store on a connection of its own)."""
    events: queue.Queue = queue.Queue()
    engines = [EmbeddedEngine(f"engine{i}", str(tiny_model_dir), 1, events, auth_token=t)
               for i, t in enumerate([None, TOKEN])]
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    syncer = None
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.checksum(timeout=60)
        syncer = WeightSyncer(WeightSync(timeout_seconds=4.0), trainer_model(tiny_model_dir), engines,
                              device=torch.device("cpu"), is_sender=True,
                              pump=lambda timeout: _deliver(syncer, events, timeout), layout=layout_of(tiny_model_dir))
        with pytest.raises(RuntimeError, match=r"engines \['engine0'\] did not join .* no answer from the engine"):
            syncer.connect()
        syncer.after_optimizer_step(1)  # blocking: returns once engine1 acked
        assert engines[1].checksum() == (1, syncer.staging.checksum()) and engines[0].checksum() == (-1, "")
    finally:
        if syncer is not None:
            syncer.close()
        for e in engines:
            e.close()


# ------------------------------------------------------------------------------------------ launch scripts


def _script(name: str, tmp_path, **env) -> subprocess.CompletedProcess:
    """Run ``scripts/<name>`` on a stand-in model folder, with stand-ins for python (prints its argv and the token
    variable) and nvidia-smi (succeeds), so the command it would exec is visible."""
    model, bin_dir = tmp_path / "model", tmp_path / "bin"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    bin_dir.mkdir(exist_ok=True)
    fake_py = bin_dir / "fakepy"
    fake_py.write_text('#!/bin/sh\n[ "$1" = -c ] && exit 0\nprintf "%s\\n" "$@"\n'
                       'echo "ENV_TOKEN=${TORCHTITAN_FLUX_TOKEN:-}"\n')
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "VLLM_PYTHON": str(fake_py), "SGLANG_PYTHON": str(fake_py)}
    return subprocess.run(["bash", str(ROOT / "scripts" / name), str(model), "8123"], env={**base, **env},
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", ["launch_vllm.sh", "launch_sglang.sh"])
def test_launch_scripts_stay_on_loopback_without_a_token(name, tmp_path):
    p = _script(name, tmp_path, FLUX_HOST="0.0.0.0")
    assert p.returncode == 2 and "FLUX_HOST=0.0.0.0 is not a loopback address" in p.stderr
    assert "TORCHTITAN_FLUX_TOKEN" in p.stderr and p.stdout == ""
    args = _script(name, tmp_path).stdout.splitlines()
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert "--middleware" not in args and "--api-key" not in args


def test_launch_scripts_bind_elsewhere_with_the_token(tmp_path):
    args = _script("launch_vllm.sh", tmp_path, FLUX_HOST="10.0.0.5", TORCHTITAN_FLUX_TOKEN=TOKEN).stdout.splitlines()
    assert args[args.index("--host") + 1] == "10.0.0.5"
    assert args[args.index("--middleware") + 1] == MIDDLEWARE
    assert f"ENV_TOKEN={TOKEN}" in args and TOKEN not in args  # in the environment, not on the command line
    args = _script("launch_sglang.sh", tmp_path, FLUX_HOST="10.0.0.5", TORCHTITAN_FLUX_TOKEN=TOKEN).stdout.splitlines()
    assert args[args.index("--host") + 1] == "10.0.0.5" and args[args.index("--api-key") + 1] == TOKEN


# ------------------------------------------------------------------------------------------------- a run


def test_a_run_with_the_token_joins_and_writes_it_nowhere(tmp_path, monkeypatch, tiny_model_dir):
    """The trainer hands the token to its embedded engine (the handshake passes: no weight-sync error, the engine
    ends in sync) and the token appears in nothing the run writes or prints."""
    from conftest import run_train

    secret = "e2e-" + TOKEN
    monkeypatch.setenv(TOKEN_ENV, secret)
    proc = run_train(tmp_path, "--training.steps", "2", "--model.hf_assets_path", str(tiny_model_dir))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["checksums_match"] and summary["final_engine_version"] == 2
    assert summary["weight_sync"]["weight_sync_errors"] == 0
    assert secret not in proc.stdout + proc.stderr
    leaks = [p for p in tmp_path.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not leaks, leaks
