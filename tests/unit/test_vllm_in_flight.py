"""``rollout.in_flight_weight_updates`` on the vLLM handler (``engine/http.py``, ``engine/vllm.py``) against
``fakes.http_servers.VllmFake``, whose scheduler pauses as vLLM 0.32's does and whose tokens name the version of
the weights that generated them. Handlers are built by ``Rollouts._new_engine``, as in a run. The real server:
``tests/integration/test_vllm.py::test_a_push_lands_while_a_generation_runs``."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import pytest
import torch
from _engine_push import wait_event
from fakes.http_servers import VllmFake

from torchtitan_flux.engine.base import EngineError, GenerationRequest, GenerationResult, WeightAck, WeightGroupInfo
from torchtitan_flux.wire import transport


@pytest.fixture
def fake(tiny_model_dir):
    s = VllmFake(tiny_model_dir)
    threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield s
    s.release()  # nothing stays held
    s.shutdown()
    s.server_close()


@pytest.fixture
def handler(fake, tiny_model_dir):
    """``make(in_flight)``: a started, joined handler of ``fake`` built as a run builds it, and its events."""
    from torchtitan_flux.rollout.engines import EngineFleet

    made = []

    def make(in_flight: bool):
        jc = SimpleNamespace(rollout=SimpleNamespace(engine="vllm", in_flight_weight_updates=in_flight),
                             weight_sync=SimpleNamespace(auth_token_env="FLUX_TEST_UNSET_TOKEN", verify_every=0),
                             training=SimpleNamespace(steps=4), hf_assets_path=tiny_model_dir)
        rollouts = SimpleNamespace(job_config=jc, trainer_on_gpu=False, _urls=[fake.url], events=queue.Queue())
        h = EngineFleet._new_engine(rollouts, 0)
        made.append(h)
        specs = [transport.TensorSpec("model.norm.weight", (4,), "float32")]
        h.join_weight_group(WeightGroupInfo("127.0.0.1", 1, "flux_ws/vllm0/1", "gloo", 10.0, specs, 2**20))
        return h, rollouts.events

    yield make
    for h in made:
        h.close()


def push(h, events, version: int) -> None:
    h.begin_update(version)
    assert wait_event(events, WeightAck, timeout=30).version == version


def held_request(h, fake, events) -> None:
    """Push version 1, then start a request (2 prompts x 2 samples, 6 tokens) that the fake holds after 2 tokens."""
    push(h, events, 1)
    fake.hold_after = 2
    h.submit(GenerationRequest(0, 1, [[1, 2, 3], [4, 5]], 2, 6, 1.0, 0, 7, dispatch_version=1))
    assert fake.held.wait(30)


def test_a_push_lands_while_a_generation_runs_and_it_is_stamped_with_its_oldest_version(fake, handler):
    h, events = handler(in_flight=True)
    held_request(h, fake, events)
    h.begin_update(2)
    assert wait_event(events, WeightAck, timeout=30).version == 2  # while the request is still held: not drained
    fake.release()
    res = wait_event(events, GenerationResult, timeout=30)
    assert res.version == 1 and res.newest_seen == 2 and res.token_versions is None
    # it continued on the new weights (not retried, not restarted): 2 tokens of v1, then 4 of v2
    assert torch.equal(res.tokens, torch.tensor([[101] * 2 + [102] * 4] * 4)), res.tokens
    assert ("/pause", {"mode": "keep", "clear_cache": "false"}) in fake.calls
    assert fake.preempted == 0  # its KV was kept (clear_cache would have preempted it)
    assert fake.bodies[-1]["cache_salt"] == "flux-v1"  # it reuses no prefix-cache block older than v1


def test_without_the_flag_a_push_still_drains_the_server(fake, handler):
    h, events = handler(in_flight=False)
    held_request(h, fake, events)
    n_calls = len(fake.calls)
    h.begin_update(2)
    with pytest.raises(queue.Empty):  # the push waits for the request: no pause, no ack while it is held
        events.get(timeout=0.5)
    assert fake.calls[n_calls:] == []
    fake.release()
    res = wait_event(events, GenerationResult, timeout=30)
    assert wait_event(events, WeightAck, timeout=30).version == 2
    assert res.version == 1 and torch.equal(res.tokens, torch.full((4, 6), 101))  # every token of v1
    assert ("/pause", {"mode": "wait"}) in fake.calls


def test_without_the_flag_every_request_still_salts_the_prefix_cache_with_its_version(fake, handler):
    """Fifth review, finding 19: vLLM answers ``/reset_prefix_cache`` with ``{"success": false}`` while any block is
    held, and the handler never read it, so after a failed reset a request stamped with the new version could reuse
    prefix KV computed by the old weights. Every request is salted with its stamp now, in-flight updates or not."""
    h, events = handler(in_flight=False)
    push(h, events, 1)
    h.submit(GenerationRequest(0, 1, [[1, 2, 3]], 1, 2, 1.0, 0, 7, dispatch_version=1))
    assert wait_event(events, GenerationResult, timeout=30).version == 1
    assert fake.bodies[-1]["cache_salt"] == "flux-v1"


@pytest.mark.parametrize("behind_our_back", ["default", "7"])  # restarted; weights replaced by another trainer
def test_a_server_changed_under_a_request_spanning_pushes_is_still_caught(fake, handler, behind_our_back):
    h, events = handler(in_flight=True)
    held_request(h, fake, events)
    fake.version = behind_our_back  # not one of our pushes since the request started (1)
    fake.release()
    err = events.get(timeout=30)
    assert isinstance(err, EngineError) and err.fatal, err
    assert (f"reports weight version {behind_our_back!r} after generation request 0, but it started on version 1 "
            "and our newest push is 1") in err.message
    assert events.empty()  # its result was dropped

