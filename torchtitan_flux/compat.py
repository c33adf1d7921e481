"""Version guards: every torch API we use whose location, signature or default changed between torch 2.3 and 2.15
(the trainer's torch; this list was drawn up on 2.13, and its tests and ``check_old_torch.sh`` pass on 2.15).

The engine-side weight receiver (``transport.py``, ``inference.py``, ``engine/embedded.py``) runs in inference
environments that pin their own torch, so it and this module import nothing from torchtitan and work on torch
>= 2.3. Guards pick by feature (is the API there?); only behaviour changes compare version numbers.
``tests/unit/test_compat.py`` simulates the older APIs; ``scripts/check_old_torch.sh`` runs the receiver's tests
under torch 2.3.1. ``F.rms_norm`` (2.4+) is guarded in ``inference._rms_norm`` (``inference.py`` imports nothing).

Checked and identical in 2.3.1 and 2.13, and used unchanged on 2.15 (no guard needed; do not add one):
``ProcessGroupGloo`` / ``ProcessGroupNCCL`` constructors with ``Options._timeout`` (used instead of ``_new_process_group_helper``, whose
options keyword was renamed in 2.6), ``BroadcastOptions``, ``Work.wait(timeout)``, ``PrefixStore``, ``TCPStore``'s
arguments, ``dtype.itemsize``, ``Tensor.view(dtype)``, ``Generator(device=)``, SDPA with a bool ``attn_mask``.
A 2.3.1 ``TCPStore`` client works with a 2.13 or 2.15 server, not the reverse: the trainer hosts the store.
"""

from __future__ import annotations

import contextlib
import os
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def _parse_version(v: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: ``"2.3.1+cu121"``, ``"2.5.0a0+git1234"``, ``"2.10.0.dev2025"``."""
    major, minor = v.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


TORCH_VERSION = _parse_version(torch.__version__)  # only behaviour guards use it; API guards test for the API


def _load_dtensor() -> type | None:
    try:  # torch >= 2.5 (in 2.3/2.4 the package exists, for tensor parallelism, but has no DTensor)
        from torch.distributed.tensor import DTensor
    except ImportError:
        try:  # torch <= 2.4
            from torch.distributed._tensor import DTensor
        except ImportError:  # torch built without distributed support
            return None
    return DTensor


def _load_fsdp2() -> tuple[Any, type | None]:
    try:  # torch >= 2.6
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError:
        try:  # torch 2.4, 2.5
            from torch.distributed._composable.fsdp import FSDPModule, fully_shard
        except ImportError:
            try:  # torch 2.3: FSDP2's first release calls the class FSDP
                from torch.distributed._composable.fsdp import FSDP as FSDPModule
                from torch.distributed._composable.fsdp import fully_shard
            except ImportError:  # no FSDP2
                return None, None
    return fully_shard, FSDPModule


def __getattr__(name: str) -> Any:
    """``compat.DTensor``, ``compat.fully_shard``, ``compat.FSDPModule`` (None where absent), imported on first use."""
    if name == "DTensor":
        return _load_dtensor()
    if name == "fully_shard":
        return _load_fsdp2()[0]
    if name == "FSDPModule":
        return _load_fsdp2()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (e.g. an FSDP2-sharded parameter), on either import path."""
    cls = _load_dtensor()
    return cls is not None and isinstance(t, cls)


def op_timeout_honoured(backend: str) -> bool:
    """Whether a per-collective timeout (``BroadcastOptions.timeout``) overrides the group's: gloo from torch 2.9
    (pytorch#158128; silently ignored before); nccl treated as ignored on every version (the group's applies)."""
    return backend == "gloo" and TORCH_VERSION >= (2, 9)


def store_listens_on_given_socket() -> bool:
    """Whether a ``TCPStore`` server can be handed a socket we bound (``master_listen_fd``, libuv): on 2.3.1 it
    never answers, so ``transport.connect_store`` leaves the server to torch there (every interface)."""
    return TORCH_VERSION >= (2, 4)


def new_weight_sync_group(backend: str, store: Any, rank: int, world_size: int, timeout: timedelta,
                          device: torch.device | None = None, idle_timeout: timedelta | None = None,
                          listen_host: str | None = None) -> Any:
    """A process group on ``store`` that is not registered with ``torch.distributed``'s global state (no clash
    with the trainer's default group, no ``init_process_group``).

    ``idle_timeout``: the longest per-collective timeout the owner passes to ``broadcast(timeout=)``; where that is
    not honoured (``op_timeout_honoured``) the group itself gets it. ``listen_host`` (gloo): the local address the
    group listens on instead of whatever the hostname resolves to (a set ``GLOO_SOCKET_IFNAME`` wins).
    """
    if idle_timeout is not None and not op_timeout_honoured(backend):
        timeout = max(timeout, idle_timeout)
    if backend == "gloo":
        gloo = dist.ProcessGroupGloo
        bindable = hasattr(gloo, "_Options") and hasattr(gloo, "create_device")
        if listen_host and bindable and not os.environ.get("GLOO_SOCKET_IFNAME"):
            opts = gloo._Options()
            opts._timeout = timeout
            opts._devices = [gloo.create_device(hostname=listen_host)]
            return gloo(store, rank, world_size, opts)
        return gloo(store, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout  # private in every version we support
        with _no_async_error_handling():
            pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        if device is not None and hasattr(pg, "eager_connect_single_device"):
            pg.eager_connect_single_device(device)
        return pg
    raise ValueError(f"weight-sync backend {backend!r} is not supported; allowed: 'gloo' | 'nccl'")


ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _no_async_error_handling():
    """``ProcessGroupNCCL``'s constructor reads ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (no ``Options`` field, 2.3 to
    2.15): 3 on the trainer (torchtitan sets it), 1 under torchrun. Either makes the watchdog tear the process
    down when a weight-sync peer dies mid-push; our polling decides instead (``cuda_rules`` rules 3, 4), so a
    weight-sync group is built with it at 0, then the variable is restored. The lock serializes our own group
    constructions (joiner threads); torch's other groups are built before any joiner starts."""
    with _ENV_LOCK:
        old = os.environ.get(ASYNC_ERROR_HANDLING)
        os.environ[ASYNC_ERROR_HANDLING] = "0"
        try:
            yield
        finally:
            if old is None:
                del os.environ[ASYNC_ERROR_HANDLING]
            else:
                os.environ[ASYNC_ERROR_HANDLING] = old


def broadcast(pg: Any, tensor: torch.Tensor, root: int = 0, timeout: timedelta | None = None) -> Any:
    """``broadcast`` on a raw process group; returns its Work. ``timeout``: this collective's, else the group's."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    if timeout is not None:
        opts.timeout = timeout
    return pg.broadcast([tensor], opts)


def device_module(device: torch.device) -> Any:
    """The runtime module of ``device``'s type (``torch.cuda``, ...): ``torch.get_device_module`` from 2.4."""
    get = getattr(torch, "get_device_module", None)
    return get(device) if get is not None else getattr(torch, device.type, None)


class SideStream:
    """A side stream for weight-sync copies (the device module's ``Stream``/``Event``, the same from 2.3 to 2.15;
    ``torch.accelerator``'s stream API only exists from 2.6), or a no-op on CPU, where copies are synchronous.

    Ordering contract: ``record_after_main()`` right after ``optimizer.step()``; the snapshot runs inside
    ``copy_context()`` (which waits for that event; tensors it allocates there belong to the side stream, so no
    ``record_stream`` is needed); the next ``optimizer.step()`` calls ``wait_copy_done()`` first, so it never
    overwrites a parameter still being read; the push thread ``synchronize_copy()`` before sending.
    """

    def __init__(self, device: torch.device):
        device = torch.device(device)
        mod = device_module(device) if device.type not in ("cpu", "meta") else None
        self.enabled = mod is not None and all(hasattr(mod, a) for a in ("Stream", "Event", "current_stream", "stream"))
        if not self.enabled:
            return
        self.mod, self.device = mod, device
        self.stream = mod.Stream(device=device)
        self.ready = mod.Event()
        self.done = mod.Event()

    def record_after_main(self) -> None:
        if self.enabled:
            self.ready.record(self.mod.current_stream(self.device))

    @contextlib.contextmanager
    def copy_context(self):
        if not self.enabled:
            yield
            return
        self.stream.wait_event(self.ready)
        try:
            with self.mod.stream(self.stream):
                yield
        finally:  # also after a failure: the next optimizer step must wait for whatever was queued
            self.done.record(self.stream)

    def wait_copy_done(self) -> None:
        if self.enabled:
            self.mod.current_stream(self.device).wait_event(self.done)

    def synchronize_copy(self) -> None:
        if self.enabled:
            self.done.synchronize()
