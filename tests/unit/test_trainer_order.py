"""N13: torchtitan's ``set_pg_timeouts`` (a barrier and a device synchronize) runs before the first weight push,
never while one is in flight (on a GPU its synchronize would wait for the push's broadcasts)."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

from torchtitan_flux.patches import apply_patches

apply_patches()  # before torchtitan is imported (CPU: no triton)

from torchtitan_flux.run import trainer as trainer_module  # noqa: E402
from torchtitan_flux.run.trainer import GRPOTrainer  # noqa: E402


def test_pg_timeouts_are_set_before_the_first_push_and_not_again(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(trainer_module.resume, "load", lambda *a: None)
    monkeypatch.setattr(trainer_module.dist_utils, "set_pg_timeouts", lambda **k: calls.append("set_pg_timeouts"))
    steps = iter([True, True, False])

    def train_step():
        t.step += 1
        t.syncer.after_optimizer_step(t.step)

    syncer = SimpleNamespace(connect=lambda: calls.append("connect"), flush=lambda v: calls.append(f"flush {v}"),
                             after_optimizer_step=lambda v: calls.append(f"push {v}"))
    profiler = SimpleNamespace(build=lambda **k: mock.MagicMock())  # a context manager with .step()
    jc = SimpleNamespace(comm=SimpleNamespace(train_timeout_seconds=100), eval=None, profiler=profiler,
                         dump_folder="/x", checkpoint=None)
    t = mock.MagicMock(step=0, rank=0, config=jc, syncer=syncer, evaluator=None, rollouts=None,
                       should_continue_training=lambda: next(steps), train_step_grpo=train_step,
                       _finish=lambda: calls.append("finish"))
    GRPOTrainer.train(t)
    assert calls == ["connect", "set_pg_timeouts", "flush 0", "push 1", "push 2", "finish"], calls
