"""Version guards of ``torchtitan_flux.compat``: each guard's fallback is exercised by simulating the older torch API
(monkeypatched attributes, fake modules in ``sys.modules``), and the real API of the running torch is checked too.

Torch-only (no torchtitan): ``scripts/check_old_torch.sh`` also runs this file under torch 2.3.1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchtitan_flux import compat

from torchtitan_flux.wire import transport

# ------------------------------------------------------------------------------------------ version string


@pytest.mark.parametrize(
    "v, expected",
    [("2.3.1+cu121", (2, 3)), ("2.5.0a0+git1234abc", (2, 5)), ("2.13.0+cpu", (2, 13)), ("2.10.0.dev20250101", (2, 10))],
)
def test_parse_version(v, expected):
    assert compat._parse_version(v) == expected


def test_torch_version_is_running_torch():
    assert compat.TORCH_VERSION == compat._parse_version(torch.__version__)
    assert compat.TORCH_VERSION >= (2, 3)


# ------------------------------------------------------------------------------------------------ DTensor


def _fake_module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


def test_dtensor_real():
    cls = compat.DTensor
    assert cls is not None and cls.__name__ == "DTensor" and hasattr(cls, "full_tensor")
    if compat.TORCH_VERSION >= (2, 5):
        from torch.distributed.tensor import DTensor
    else:
        from torch.distributed._tensor import DTensor
    assert cls is DTensor
    assert not compat.is_dtensor(torch.ones(2))
    assert not compat.is_dtensor(torch.nn.Parameter(torch.ones(2)))


def test_dtensor_private_path_before_2_5(monkeypatch):
    """torch 2.3/2.4: ``torch.distributed.tensor`` exists (tensor parallelism) but has no DTensor."""

    class OldDTensor:
        pass

    monkeypatch.setitem(sys.modules, "torch.distributed.tensor", _fake_module("torch.distributed.tensor"))
    monkeypatch.setitem(
        sys.modules, "torch.distributed._tensor", _fake_module("torch.distributed._tensor", DTensor=OldDTensor)
    )
    assert compat.DTensor is OldDTensor
    assert compat.is_dtensor(OldDTensor())
    assert not compat.is_dtensor(torch.ones(2))


def test_dtensor_public_path_wins(monkeypatch):
    class NewDTensor:
        pass

    class OldDTensor:
        pass

    monkeypatch.setitem(
        sys.modules, "torch.distributed.tensor", _fake_module("torch.distributed.tensor", DTensor=NewDTensor)
    )
    monkeypatch.setitem(
        sys.modules, "torch.distributed._tensor", _fake_module("torch.distributed._tensor", DTensor=OldDTensor)
    )
    assert compat.DTensor is NewDTensor
    assert not compat.is_dtensor(OldDTensor())


def test_dtensor_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.distributed.tensor", None)  # None in sys.modules: ImportError
    monkeypatch.setitem(sys.modules, "torch.distributed._tensor", None)
    assert compat.DTensor is None
    assert not compat.is_dtensor(torch.ones(2))


def test_unknown_attribute():
    with pytest.raises(AttributeError, match="no_such_api"):
        compat.no_such_api  # noqa: B018


# -------------------------------------------------------------------------------------------------- FSDP2


def test_fsdp2_real():
    fully_shard, module_cls = compat.fully_shard, compat.FSDPModule
    assert callable(fully_shard) and isinstance(module_cls, type)
    if compat.TORCH_VERSION >= (2, 6):
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp import fully_shard as public

        assert fully_shard is public and module_cls is FSDPModule
    else:
        import torch.distributed._composable.fsdp as private

        assert fully_shard is private.fully_shard
        assert module_cls is getattr(private, "FSDPModule", getattr(private, "FSDP", None))


def _fsdp_modules(monkeypatch, public: dict | None, private: dict | None) -> None:
    for name, attrs in (("torch.distributed.fsdp", public), ("torch.distributed._composable.fsdp", private)):
        monkeypatch.setitem(sys.modules, name, None if attrs is None else _fake_module(name, **attrs))


def test_fsdp2_composable_path_2_4_and_2_5(monkeypatch):
    """torch 2.4/2.5: ``torch.distributed.fsdp`` is FSDP1 only; FSDP2 lives in ``_composable.fsdp``."""

    class FSDPModule:
        pass

    def fully_shard(m):
        return m

    _fsdp_modules(monkeypatch, {}, {"FSDPModule": FSDPModule, "fully_shard": fully_shard})
    assert compat.fully_shard is fully_shard
    assert compat.FSDPModule is FSDPModule


def test_fsdp2_first_release_2_3(monkeypatch):
    """torch 2.3: the FSDP2 class is called ``FSDP``."""

    class FSDP:
        pass

    def fully_shard(m):
        return m

    _fsdp_modules(monkeypatch, {}, {"FSDP": FSDP, "fully_shard": fully_shard})
    assert compat.fully_shard is fully_shard
    assert compat.FSDPModule is FSDP


def test_fsdp2_public_path_wins(monkeypatch):
    class FSDPModule:
        pass

    def fully_shard(m):
        return m

    _fsdp_modules(
        monkeypatch,
        {"FSDPModule": FSDPModule, "fully_shard": fully_shard},
        {"FSDPModule": object, "fully_shard": print},
    )
    assert compat.fully_shard is fully_shard and compat.FSDPModule is FSDPModule


def test_fsdp2_absent(monkeypatch):
    _fsdp_modules(monkeypatch, {}, None)
    assert compat.fully_shard is None and compat.FSDPModule is None


# --------------------------------------------------------------------------------------- device streams


class _FakeDeviceModule:
    """A ``torch.cuda``-shaped device module that logs the stream calls SideStream makes."""

    def __init__(self):
        self.log: list[tuple] = []
        log = self.log

        class Event:
            def __init__(self):
                self.name = f"event{sum(1 for e in log if e[0] == 'Event')}"
                log.append(("Event", self.name))

            def record(self, stream):
                log.append(("record", self.name, stream.name))

            def synchronize(self):
                log.append(("synchronize", self.name))

        class Stream:
            def __init__(self, device=None, name="side"):
                self.name = name
                log.append(("Stream", str(device)))

            def wait_event(self, event):
                log.append(("wait_event", self.name, event.name))

        self.Stream, self.Event = Stream, Event
        self._main = Stream.__new__(Stream)
        self._main.name = "main"

    def current_stream(self, device=None):
        return self._main

    def stream(self, s):
        log = self.log

        class Ctx:
            def __enter__(self):
                log.append(("enter", s.name))

            def __exit__(self, *exc):
                log.append(("exit", s.name))

        return Ctx()


def _run_side_stream(device: torch.device) -> list[tuple]:
    side = compat.SideStream(device)
    assert side.enabled
    side.record_after_main()
    with side.copy_context():
        side.mod.log.append(("copy",))
    side.wait_copy_done()
    side.synchronize_copy()
    return side.mod.log


_EXPECTED_STREAM_LOG = [
    ("Stream", "xpu:0"), ("Event", "event0"), ("Event", "event1"),
    ("record", "event0", "main"),  # ready: recorded on the main stream after optimizer.step()
    ("wait_event", "side", "event0"),  # the copy waits for it
    ("enter", "side"), ("copy",), ("exit", "side"),
    ("record", "event1", "side"),  # done
    ("wait_event", "main", "event1"),  # the next optimizer.step() waits for the copy
    ("synchronize", "event1"),  # the push thread waits for the copy
]


def test_side_stream_device_module_2_4(monkeypatch):
    fake = _FakeDeviceModule()
    seen = []
    monkeypatch.setattr(torch, "get_device_module", lambda d: seen.append(d) or fake, raising=False)
    assert _run_side_stream(torch.device("xpu", 0)) == _EXPECTED_STREAM_LOG
    assert seen == [torch.device("xpu", 0)]


def test_side_stream_device_module_before_2_4(monkeypatch):
    """torch 2.3 has no ``torch.get_device_module``: the module is the attribute named after the device type."""
    fake = _FakeDeviceModule()
    monkeypatch.delattr(torch, "get_device_module", raising=False)
    monkeypatch.setattr(torch, "xpu", fake, raising=False)
    assert compat.device_module(torch.device("xpu", 0)) is fake
    assert _run_side_stream(torch.device("xpu", 0)) == _EXPECTED_STREAM_LOG


def test_side_stream_disabled_without_streams(monkeypatch):
    """A device module without streams (e.g. ``torch.mps``) or the CPU: every method is a no-op."""
    monkeypatch.setattr(torch, "get_device_module", lambda d: types.SimpleNamespace(), raising=False)
    for device in (torch.device("cpu"), torch.device("xpu", 0)):
        side = compat.SideStream(device)
        assert not side.enabled
        side.record_after_main()
        with side.copy_context():
            pass
        side.wait_copy_done()
        side.synchronize_copy()


def test_side_stream_cpu_real():
    side = compat.SideStream(torch.device("cpu"))
    assert not side.enabled
    x = torch.zeros(3)
    side.record_after_main()
    with side.copy_context():
        x.copy_(torch.ones(3))
    side.wait_copy_done()
    side.synchronize_copy()
    assert torch.equal(x, torch.ones(3))


# ---------------------------------------------------------------------------------------------- torch.load


# ------------------------------------------------------------------------------------------------ rms_norm
# ``F.rms_norm`` (2.4+) is guarded in ``inference._rms_norm`` (inference.py imports nothing of the package).


def _rms_ref(x, w, eps):
    xd = x.double()
    return (xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps)) * w.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_fallback_before_2_4(monkeypatch, dtype):
    from torchtitan_flux.models import inference

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, 8, generator=g).to(dtype), torch.randn(8, generator=g).to(dtype)
    monkeypatch.delattr(F, "rms_norm", raising=False)
    monkeypatch.setattr(inference, "_HAS_RMS_NORM", False)
    out = inference._rms_norm(x, w, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), _rms_ref(x, w, 1e-5), atol=tol, rtol=tol)


def test_rms_norm_uses_functional_when_present(monkeypatch):
    from torchtitan_flux.models import inference

    calls = []

    def fake_rms_norm(x, shape, w, eps):
        calls.append((tuple(shape), eps))
        return torch.full_like(x, 42.0)

    monkeypatch.setattr(F, "rms_norm", fake_rms_norm, raising=False)
    monkeypatch.setattr(inference, "_HAS_RMS_NORM", True)
    x = torch.randn(2, 4)
    assert torch.equal(inference._rms_norm(x, torch.ones(4), 1e-6), torch.full_like(x, 42.0))
    assert calls == [((4,), 1e-6)]


def test_rms_norm_real_matches_reference():
    from torchtitan_flux.models import inference

    assert inference._HAS_RMS_NORM is hasattr(F, "rms_norm")  # False on torch 2.3
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 16, generator=g), torch.randn(16, generator=g)
    torch.testing.assert_close(inference._rms_norm(x, w, 1e-5).double(), _rms_ref(x, w, 1e-5), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ process groups


def test_gloo_group_and_broadcast_real():
    """The direct ``ProcessGroupGloo`` constructor and ``BroadcastOptions.timeout`` on the running torch."""
    pg = compat.new_weight_sync_group("gloo", dist.HashStore(), 0, 1, timedelta(seconds=10))
    t = torch.arange(6, dtype=torch.bfloat16)
    compat.broadcast(pg, t).wait()
    compat.broadcast(pg, t, timeout=timedelta(days=7)).wait(timedelta(seconds=10))
    assert torch.equal(t, torch.arange(6, dtype=torch.bfloat16))


def test_broadcast_options():
    class FakePG:
        def broadcast(self, tensors, opts):
            self.tensors, self.opts = tensors, opts
            return "work"

    pg, t = FakePG(), torch.zeros(2)
    assert compat.broadcast(pg, t, root=1) == "work"
    assert pg.tensors == [t] and pg.opts.rootRank == 1
    assert pg.opts.timeout == dist.BroadcastOptions().timeout  # unset: the group's timeout
    compat.broadcast(pg, t, timeout=timedelta(seconds=3))
    assert pg.opts.rootRank == 0 and pg.opts.timeout == timedelta(seconds=3)


def _fake_nccl(with_eager_connect: bool):
    made = []

    class ProcessGroupNCCL:
        class Options:
            _timeout = None

        def __init__(self, store, rank, size, opts):
            self.args, self.connected = (store, rank, size, opts), []
            self.async_error_handling = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
            made.append(self)

    if with_eager_connect:
        ProcessGroupNCCL.eager_connect_single_device = lambda self, d: self.connected.append(d)
    return ProcessGroupNCCL, made


@pytest.mark.parametrize("eager", [True, False])
def test_nccl_group_construction(monkeypatch, eager):
    cls, made = _fake_nccl(eager)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", cls, raising=False)
    store, dev = object(), torch.device("cuda", 1)
    pg = compat.new_weight_sync_group("nccl", store, 1, 2, timedelta(seconds=42), device=dev)
    assert made == [pg] and pg.args[:3] == (store, 1, 2)
    assert pg.args[3]._timeout == timedelta(seconds=42)
    assert pg.connected == ([dev] if eager else [])


@pytest.mark.parametrize("before", ["3", "1", None])
def test_nccl_group_is_built_without_async_error_handling(monkeypatch, before):
    """N3: torchtitan sets TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (torchrun: 1), which the constructor reads; a
    weight-sync group sees 0 (a dead peer must not kill the process) and the variable is restored after."""
    cls, made = _fake_nccl(True)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", cls, raising=False)
    if before is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", before)
    compat.new_weight_sync_group("nccl", object(), 0, 2, timedelta(seconds=1))
    assert made[0].async_error_handling == "0"
    assert os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == before

    def fails(*a):
        raise RuntimeError("no GPU")

    monkeypatch.setattr(cls, "__init__", fails)
    with pytest.raises(RuntimeError, match="no GPU"):
        compat.new_weight_sync_group("nccl", object(), 0, 2, timedelta(seconds=1))
    assert os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == before  # restored on failure too


def test_unknown_backend():
    with pytest.raises(ValueError, match="'mpi'"):
        compat.new_weight_sync_group("mpi", dist.HashStore(), 0, 1, timedelta(seconds=1))


# ------------------------------------------------------------------------------- per-collective timeouts


class _FakeGloo:
    def __init__(self, store, rank, size, timeout):
        self.timeout = timeout


@pytest.mark.parametrize("version, honoured", [((2, 3), False), ((2, 8), False), ((2, 9), True), ((2, 13), True)])
def test_gloo_op_timeout_by_version(monkeypatch, version, honoured):
    monkeypatch.setattr(compat, "TORCH_VERSION", version)
    monkeypatch.setattr(dist, "ProcessGroupGloo", _FakeGloo)
    assert compat.op_timeout_honoured("gloo") is honoured
    short, idle = timedelta(seconds=5), timedelta(days=7)
    pg = compat.new_weight_sync_group("gloo", object(), 1, 2, short, idle_timeout=idle)
    assert pg.timeout == (short if honoured else idle)
    assert compat.new_weight_sync_group("gloo", object(), 1, 2, short).timeout == short  # no idle wait: unchanged
    # never shortens the group's timeout
    assert compat.new_weight_sync_group("gloo", object(), 1, 2, idle, idle_timeout=short).timeout == idle


def test_nccl_op_timeout_not_relied_on(monkeypatch):
    cls, _ = _fake_nccl(False)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", cls, raising=False)
    assert not compat.op_timeout_honoured("nccl")
    pg = compat.new_weight_sync_group("nccl", object(), 1, 2, timedelta(seconds=5), idle_timeout=timedelta(days=7))
    assert pg.args[3]._timeout == timedelta(days=7)


_LATE_ROOT = r"""
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from torchtitan_flux import compat
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), None, is_master=False, timeout=timedelta(seconds=60))
store.set("imported", "1")  # both sides then build the group together (its rendezvous has the short timeout)
pg = compat.new_weight_sync_group("gloo", store, 0, 2, timedelta(seconds=float(sys.argv[2])))
time.sleep(float(sys.argv[3]))
try:
    compat.broadcast(pg, torch.ones(4)).wait()
except RuntimeError:
    pass  # the receiver gave up first (torch < 2.9)
"""


def test_gloo_op_timeout_claim_matches_running_torch():
    """Measures what ``op_timeout_honoured("gloo")`` claims for this torch: a broadcast issued with a 60 s timeout on
    a group whose own timeout is 2 s, whose root sends after 3.5 s, succeeds iff per-collective timeouts work."""
    root = Path(__file__).resolve().parents[2]
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    proc = subprocess.Popen(
        [sys.executable, "-c", _LATE_ROOT, str(store.port), "2", "3.5"], cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)}, stderr=subprocess.DEVNULL,
    )
    try:
        store.wait(["imported"])
        pg = compat.new_weight_sync_group("gloo", store, 1, 2, timedelta(seconds=2))
        t = torch.zeros(4)
        try:
            compat.broadcast(pg, t, timeout=timedelta(seconds=60)).wait()
            honoured = True
        except RuntimeError as e:
            assert "imed out" in str(e), e
            honoured = False
        assert honoured is compat.op_timeout_honoured("gloo"), compat.TORCH_VERSION
        if honoured:
            assert torch.equal(t, torch.ones(4))
    finally:
        proc.wait(30)


def test_weight_sync_group_binds_its_listener_where_the_api_allows(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    pg = compat.new_weight_sync_group("gloo", dist.HashStore(), 0, 1, timedelta(seconds=10), listen_host="127.0.0.1")
    assert pg.size() == 1
    calls = []

    class GlooWithoutOptions:  # a torch whose ProcessGroupGloo has no _Options / create_device: gloo's default
        def __init__(self, *args):
            calls.append(args)

    monkeypatch.setattr(compat.dist, "ProcessGroupGloo", GlooWithoutOptions)
    compat.new_weight_sync_group("gloo", "store", 0, 1, timedelta(seconds=3), listen_host="127.0.0.1")
    assert calls == [("store", 0, 1, timedelta(seconds=3))]


def test_store_server_on_a_socket_we_bound_only_where_torch_serves_it(monkeypatch):
    """torch 2.3's TCPStore never answers on a socket handed over with ``master_listen_fd`` (measured: it hangs):
    there the store is left to torch; from 2.4 on (libuv) it is served on the socket bound to the host. A store
    works on the running torch's path, and on the fallback path (simulated 2.3) on any torch."""
    for version in [(2, 3), (2, 4), (2, 13)]:
        monkeypatch.setattr(compat, "TORCH_VERSION", version)
        assert compat.store_listens_on_given_socket() == (version >= (2, 4))
    for version in [compat._parse_version(torch.__version__), (2, 3)]:
        monkeypatch.setattr(compat, "TORCH_VERSION", version)
        store = transport.connect_store("127.0.0.1", 0, 10.0, is_master=True)
        client = transport.connect_store("127.0.0.1", store.port, 10.0, is_master=False)
        client.set("k", "v")
        assert store.get("k") == b"v"
