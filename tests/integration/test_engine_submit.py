"""``EngineHandler.submit`` is thread-safe and never blocks on the engine (GPU review finding 21): an embedded engine
stopped with SIGSTOP reads no pipe, so once the OS buffer is full a blocking send would hang its caller forever.
Every message now goes through the engine's ``sender.PipeSender`` thread; only that thread blocks, until ``kill``."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time

from torchtitan_flux.engine.base import EngineError, GenerationRequest
from torchtitan_flux.engine.embedded import EmbeddedEngine
from torchtitan_flux.engine.sender import PipeSender

PROMPT = [1] + [5 + i % 200 for i in range(2000)]  # 4 of them per request: ~16 KB pickled


def request(req_id: int) -> GenerationRequest:
    return GenerationRequest(req_id, 1, [PROMPT] * 4, 2, 8, 1.0, 0, seed=req_id, dispatch_version=0)


def test_submit_from_two_threads_to_a_stopped_engine_never_blocks_and_kill_ends_it(tiny_model_dir):
    """300 requests of ~16 KB each (~5 MB, many times a pipe's buffer) from the main thread and a second one, to an
    engine stopped with SIGSTOP: every ``submit`` returns at once. ``kill`` then reports the engine dead once (its
    fatal ``EngineError``), the send blocked on it raises, and ``close`` returns at once with the sender ended."""
    events: queue.Queue = queue.Queue()
    engine = EmbeddedEngine("engine0", str(tiny_model_dir), 1, events)
    engine.start()
    pid = engine.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        def submit_many(first: int) -> None:
            for i in range(150):
                engine.submit(request(first + i))

        t0 = time.monotonic()
        other = threading.Thread(target=submit_many, args=(1000,), name="flux-episodes", daemon=True)
        other.start()
        submit_many(0)
        other.join(30.0)
        took = time.monotonic() - t0
        assert not other.is_alive() and took < 30.0, f"300 submits took {took:.2f} s"  # blocked: forever
        assert not engine.idle() and engine.alive()
        assert any(t.name == "engine0-sender" for t in threading.enumerate())  # blocked in its send

        engine.kill("test: declared stuck")
        ev = events.get(timeout=5.0)
        assert isinstance(ev, EngineError) and ev.fatal and ev.message == "test: declared stuck"
        t0 = time.monotonic()
        engine.close()
        assert time.monotonic() - t0 < 15.0  # close joins a killed process: at once; blocked: forever
        assert not any(t.name == "engine0-sender" for t in threading.enumerate())
        time.sleep(0.2)
        assert events.empty(), "the engine's death was reported twice"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        engine.close()


def test_a_full_sender_queue_drops_messages_logging_once_and_a_closed_pipe_ends_the_sender(caplog):
    """The queue's bound: past it a message is dropped, logged once (the rollouts' stall detection kills such an
    engine). The peer's end closing (the engine process dying) makes the blocked send raise: reported once, and
    later messages are dropped; ``stop`` returns at once."""
    ours, theirs = mp.Pipe(duplex=True)
    failures: list[str] = []
    sender = PipeSender(ours, "engine9", failures.append, maxsize=4)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="torchtitan_flux"):
        for i in range(50):
            sender.send(("pad", i, bytes(1 << 20)))  # 1 MiB each: the first fills the pipe, 4 queue, the rest drop
    assert time.monotonic() - t0 < 30.0  # blocked: forever (far above the ms it takes)
    assert [r.getMessage() for r in caplog.records].count(
        "engine engine9: 4 messages queued that it does not read (stopped or hung): its messages are dropped until it "
        "is declared stuck and killed (rollout.engine_stall_seconds)") == 1
    theirs.close()
    deadline = time.monotonic() + 5.0
    while not failures and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(failures) == 1 and failures[0].startswith("control pipe closed")
    sender.send(("pad", 0, b""))
    t0 = time.monotonic()
    sender.stop()
    assert time.monotonic() - t0 < 1.0 and not any(t.name == "engine9-sender" for t in threading.enumerate())
    ours.close()
