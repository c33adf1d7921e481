"""``run.threads.TrainerThreads``: the trainer's CPU threads, and the engine cores it borrows while they are idle."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

from torchtitan_flux.engine.embedded import EmbeddedEngine
from torchtitan_flux.run import threads
from torchtitan_flux.run.threads import OtherLoad, TrainerThreads, every_block


class FakeEngine(EmbeddedEngine):
    """Never started; idle as scripted (one value per call, the last repeated)."""

    def __init__(self, threads: int, idle: list[bool]):
        super().__init__("engine0", "unused", threads, events=None)
        self.script = list(idle)

    def idle(self) -> bool:
        return self.script.pop(0) if len(self.script) > 1 else self.script[0]


def job(borrow: bool = True, engine: str = "embedded", threads: int = 1, engines: int = 1, compiled: bool = False):
    return SimpleNamespace(
        rollout=SimpleNamespace(engine=engine, launch=False, engine_threads=threads, num_engines=engines,
                                borrow_idle_engine_cores=borrow),
        compile=SimpleNamespace(enable=compiled, components=["model", "loss"]))


@pytest.fixture(autouse=True)
def keep_threads(monkeypatch):
    """Restore torch's thread count; and no machine load unless a test scripts one (this machine's real load,
    other tests beside these, must not decide whether they borrow)."""
    monkeypatch.setattr(threads, "machine_busy_s", lambda: None)
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_own_share_then_idle_engines_lend_theirs():
    t = TrainerThreads(job(threads=1, engines=2))
    own = max(1, (os.cpu_count() or 1) - 2)
    assert t.own == own and torch.get_num_threads() == own
    fleet = SimpleNamespace(engines=[FakeEngine(1, [True]), FakeEngine(1, [False])])
    t.before_compute(fleet)
    assert torch.get_num_threads() == own + 1  # only the idle engine's core
    fleet.engines[1].script = [True]
    t.before_compute(fleet)
    assert torch.get_num_threads() == own + 2
    fleet.engines[0].script = fleet.engines[1].script = [False]  # both got requests: every borrowed core returned
    t.before_compute(fleet)
    assert torch.get_num_threads() == own
    assert t.step_metrics() == {"trainer_threads": pytest.approx((3 * own + 3) / 3), "borrow_contended": 0.0,
                                "other_cores": 0.0}
    assert t.step_metrics() == {}  # reset by reading


@pytest.mark.parametrize("cfg", [job(borrow=False), job(engine="vllm"), job(compiled=True)])
def test_no_borrowing_when_off_not_embedded_or_compiled(cfg):
    """Off; a server's threads are not tracked; a compiled model's kernels keep the thread count they were
    generated with (Inductor), so changing it later would not reach them."""
    t = TrainerThreads(cfg)
    before = torch.get_num_threads()
    t.before_compute(SimpleNamespace(engines=[FakeEngine(1, [True])]))
    assert torch.get_num_threads() == before and t.step_metrics() == {}


class Block(torch.nn.Module):
    def __init__(self, seen: list):
        super().__init__()
        self.lin, self.seen = torch.nn.Linear(4, 4), seen

    def forward(self, x):
        self.seen.append(("fwd", torch.get_num_threads()))
        return torch.tanh(self.lin(x))


class Model(torch.nn.Module):
    def __init__(self, seen: list):
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(i): Block(seen) for i in range(3)})

    def forward(self, x):
        for b in self.layers.values():
            x = b(x)
        return x


def test_every_block_rechecks_before_every_block_forward_and_backward():
    """The engine turns idle during the forward: the later blocks, and the whole backward, get its core; the
    check runs once per block each way (the backward through a gradient hook on the block's output)."""
    seen: list = []
    model = Model(seen)
    t = TrainerThreads(job())
    own = t.own
    engine = FakeEngine(1, [False, False, True])  # busy for the first two checks
    every_block(model, lambda: t.before_compute(SimpleNamespace(engines=[engine])))
    x = torch.randn(2, 4, requires_grad=True)
    out = model(x).sum()
    assert [n for _, n in seen] == [own, own, own + 1]
    out.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert t.step_metrics()["trainer_threads"] == pytest.approx((2 * own + 4 * (own + 1)) / 6)  # 3 fwd + 3 bwd


def test_other_load_is_the_machines_busy_time_less_ours_and_our_engines(monkeypatch):
    """Per window: the machine's busy CPU seconds minus this process's and its engines', over the window's wall time;
    a window with a restarted engine (another pid) is skipped."""
    clock = {"wall": 100.0, "machine": 1000.0, "own": 10.0, 7: 5.0, 8: 5.0}
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(threads.time, "process_time", lambda: clock["own"])
    monkeypatch.setattr(threads, "machine_busy_s", lambda: clock["machine"])
    monkeypatch.setattr(threads, "process_busy_s", lambda pid: clock.get(pid))
    load = OtherLoad()
    assert load.update([7]) == math.inf  # the first reading: no window yet, so nothing is borrowed
    clock.update(wall=100.2, machine=1001.0)
    assert load.update([7]) == math.inf  # within the window: not read again
    clock.update(wall=100.5, machine=1001.0, own=10.3)  # 0.5 s: machine 1.0 busy, trainer 0.3, engine 0.2
    clock[7] = 5.2
    assert load.update([7]) == pytest.approx((1.0 - 0.3 - 0.2) / 0.5)
    clock.update(wall=101.0, machine=1001.5, own=10.8)  # the trainer alone busy: nobody else
    assert load.update([7]) == pytest.approx(0.0)
    clock.update(wall=101.5, machine=1003.0)
    assert load.update([8]) == pytest.approx(0.0)  # engine 7 replaced by 8: that window is not measured


def test_nothing_is_borrowed_while_other_processes_keep_a_core_busy(monkeypatch):
    """The third hostile sweep (2026-11-27): beside another job, borrowing made a step swing from 0.06 s to 2.2 s."""
    t = TrainerThreads(job(threads=1, engines=1))
    own = t.own
    fleet = SimpleNamespace(engines=[FakeEngine(1, [True])])
    busy = {"cores": 1.0}
    monkeypatch.setattr(t.others, "update", lambda pids: busy["cores"])
    t.before_compute(fleet)
    assert torch.get_num_threads() == own  # the idle engine's core is not free
    busy["cores"] = 0.1
    t.before_compute(fleet)
    assert torch.get_num_threads() == own + 1
    assert t.step_metrics()["borrow_contended"] == 0.5


def test_without_proc_nothing_backs_off(monkeypatch):
    monkeypatch.setattr(threads, "machine_busy_s", lambda: None)
    assert OtherLoad().update([1]) == 0.0
