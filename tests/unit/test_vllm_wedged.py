"""The fifth GPU review's finding 14: a vLLM server wedged by an abandoned push (``fakes.http_servers.VllmFake``'s
``wedged`` mode: every call that reaches the engine core blocks, ``/health`` still answers) never blocks the trainer's
main thread. ``pump()`` hands the dead handler's replacement to a thread (``rollout/reconnect.py``) and returns; its
start-up checks give up at their read timeout, never retried (the server is given up), and a server we launched is
stopped and launched again, the requests the dead handler held going to the new one."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from fakes.engines import FakeEngine
from fakes.http_servers import VllmFake

from torchtitan_flux.engine import http, vllm_launch
from torchtitan_flux.engine.base import GenerationRequest, GenerationResult, WeightGroupInfo
from torchtitan_flux.rollout.engines import EngineFleet
from torchtitan_flux.rollout.pump import EnginePump
from torchtitan_flux.rollout.reconnect import Reconnecting
from torchtitan_flux.rollout.split import SpeedSplit
from torchtitan_flux.wire import transport


@pytest.fixture
def serve(tiny_model_dir):
    """``serve(wedged)``: a running ``VllmFake``."""
    made = []

    def make(wedged: bool = False) -> VllmFake:
        s = VllmFake(tiny_model_dir)
        s.wedged = wedged
        threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.release()  # what still blocks on a wedged engine core ends
        s.shutdown()
        s.server_close()


@pytest.fixture
def fleet(serve, tiny_model_dir, tmp_path, monkeypatch):
    """A fleet of one vLLM server (``fleet.wedged``, at ``rollout.urls``), with 2 s start-up checks."""
    import queue

    monkeypatch.setattr(http, "STARTUP_TIMEOUT_S", 2.0)
    jc = SimpleNamespace(
        rollout=SimpleNamespace(engine="vllm", in_flight_weight_updates=False, max_engine_restarts=3,
                                launch_python="python", launch_timeout_s=60.0, engine_threads=1),
        weight_sync=SimpleNamespace(auth_token_env="FLUX_TEST_UNSET_TOKEN", verify_every=0),
        training=SimpleNamespace(steps=4), hf_assets_path=tiny_model_dir,
        dump_folder=str(tmp_path))
    f = EngineFleet(jc, queue.Queue(), device=torch.device("cpu"), stops=SimpleNamespace(signal=None))
    f.wedged = serve(wedged=True)
    f._urls, f._devices = [f.wedged.url], ["cpu"]
    yield f
    f.close([])


def pump_of(engines, fleet: EngineFleet, results: list) -> EnginePump:
    holder = []
    pump = EnginePump(engines, fleet.events, split=SpeedSplit([e.name for e in engines], 0.1, 0.75), stall_s=600.0,
                      replace=lambda dead: fleet.replace(dead, holder[0].engines.index(dead)),
                      handlers={GenerationResult: lambda f, r: results.append(r)}, turns=False)
    holder.append(pump)
    return pump


def wedge(handler, fake: VllmFake, request: GenerationRequest | None = None, pump: EnginePump | None = None):
    """A push the server never finishes (``request``, sent then, is held by its engine core); the handler is then
    killed, as the pusher kills a vLLM handler whose push missed its deadline."""
    specs = [transport.TensorSpec("model.norm.weight", (4,), "float32")]
    handler.join_weight_group(WeightGroupInfo("127.0.0.1", 1, "flux_ws/vllm0/1", "gloo", 10.0, specs, 2**20))
    handler.begin_update(1)
    deadline = time.monotonic() + 10
    while not fake.stuck:
        assert time.monotonic() < deadline, fake.calls
        time.sleep(0.02)
    if request is not None:
        pump.send(request, handler)
    handler.kill("weight push 1 missed its deadline (weight_sync.timeout_seconds)")


def pump_returns_at_once(pump: EnginePump) -> None:
    """One ``pump()`` (the handler's death) returns within seconds (on a thread: the old code blocked ~4 minutes)."""
    t = threading.Thread(target=pump.pump, args=(5.0,), daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(30)  # the old code: ~240 s; 30 s leaves room for a loaded machine
    assert not t.is_alive(), "pump() blocked on the reconnect of a wedged server"
    assert time.monotonic() - t0 < 30
    assert isinstance(pump.engines[0], Reconnecting)


def pump_until(pump: EnginePump, done, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline
        t0 = time.monotonic()
        pump.pump(0.1)
        assert time.monotonic() - t0 < 2  # never waits for the reconnect


def test_a_wedged_server_is_given_up_off_the_main_thread_at_its_start_up_timeout(fleet, caplog):
    handler = fleet._new_engine(0)
    other = FakeEngine("other", 1.0, fleet.events)
    pump = pump_of([handler, other], fleet, [])
    wedge(handler, fleet.wedged)
    pump_returns_at_once(pump)
    with caplog.at_level("ERROR", logger="torchtitan_flux"):
        pump_until(pump, lambda: len(pump.engines) == 1)
    assert pump.engines == [other]  # given up
    assert fleet.wedged.blocked.count("/weight_info") == 1  # its read timeout is not retried
    assert "vllm0: server gone" in caplog.text


class Launched:
    """A server ``vllm_launch.launch_servers`` started, as the fleet sees it: its URL; ``stop`` is recorded."""

    def __init__(self, url: str, stopped: list):
        self.url, self.stopped = url, stopped

    def stop(self, grace_s: float = 20.0) -> None:
        self.stopped.append(self.url)


def test_a_wedged_server_we_launched_is_relaunched_and_the_request_it_held_goes_to_the_new_one(
        fleet, serve, monkeypatch):
    fresh = serve()
    stopped, launched = [], []

    def launch_servers(n, model_dir, **kw):
        launched.append(kw["log_names"])
        return [Launched(fresh.url, stopped)]

    monkeypatch.setattr(vllm_launch, "launch_servers", launch_servers)
    fleet.servers = [Launched(fleet.wedged.url, stopped)]
    handler = fleet._new_engine(0)
    results: list = []
    pump = pump_of([handler], fleet, results)
    wedge(handler, fleet.wedged, GenerationRequest(0, 1, [[1, 2, 3]], 2, 4, 1.0, 0, 7, dispatch_version=0), pump)
    pump_returns_at_once(pump)  # with no engine alive, the request waits on the reconnect
    pump_until(pump, lambda: results)
    assert stopped == [fleet.wedged.url] and launched == [["vllm_server0.relaunch1.log"]]
    new = pump.engines[0]
    assert new.alive() and new.url == fresh.url and fleet.servers[0].url == fresh.url
    assert results[0].engine == "vllm0" and results[0].tokens.shape[0] == 2


def test_a_server_relaunched_after_the_run_ended_is_stopped_and_never_reported(fleet, serve, monkeypatch):
    """The run closes its fleet while a wedged server is relaunched (a launch takes minutes): the new server is
    stopped once it is up, and no replacement reaches the events queue."""
    fresh = serve()
    stopped, started = [], threading.Event()

    def launch_servers(n, model_dir, **kw):
        assert started.wait(10)
        return [Launched(fresh.url, stopped)]

    monkeypatch.setattr(vllm_launch, "launch_servers", launch_servers)
    fleet.servers = [Launched(fleet.wedged.url, stopped)]
    handler = fleet._new_engine(0)
    placeholder = fleet.replace(handler, 0)
    assert isinstance(placeholder, Reconnecting)
    fleet.close([placeholder])
    started.set()
    deadline = time.monotonic() + 10
    while fresh.url not in stopped:
        assert time.monotonic() < deadline, stopped
        time.sleep(0.02)
    time.sleep(0.2)
    assert fleet.events.empty()
