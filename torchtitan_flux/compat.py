"""Version guards: every torch API whose location or signature changed between torch 2.3 and today.

The engine-side weight receiver (``transport.py``) runs inside inference-engine environments that pin their own
torch, so it and this module import nothing from torchtitan and work on torch >= 2.3. Each guard names the
versions it distinguishes. Tests simulate the older API by monkeypatching (tests/test_compat.py), and
``scripts/check_old_torch.sh`` runs the receiver tests under an older torch.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def new_weight_sync_group(
    backend: str, store: Any, rank: int, world_size: int, timeout: timedelta, device: torch.device | None = None
) -> Any:
    """A process group on ``store`` that is not registered with ``torch.distributed``'s global state.

    It never clashes with the trainer's default group and needs no ``init_process_group``. gloo: the
    ``ProcessGroupGloo(store, rank, size, timeout)`` constructor, unchanged since torch 1.x. nccl:
    ``ProcessGroupNCCL(store, rank, size, options)``; the ``Options`` object gained ``is_high_priority_stream`` in
    torch 2.0 and is optional everywhere we support.
    """
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout  # the Options field is private in every version we support (2.3 .. 2.13)
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        if device is not None and hasattr(pg, "eager_connect_single_device"):  # torch >= 2.3
            pg.eager_connect_single_device(device)
        return pg
    raise ValueError(f"weight-sync backend {backend!r} is not supported; allowed: 'gloo' | 'nccl'")


def broadcast(pg: Any, tensor: torch.Tensor, root: int = 0) -> Any:
    """Issue ``broadcast`` on a raw process-group object; returns its Work. The ``BroadcastOptions`` API is the
    same from torch 1.8 to 2.13."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    return pg.broadcast([tensor], opts)


def accelerator_available() -> bool:
    """``torch.accelerator`` exists from torch 2.6; before that only CUDA counts."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return torch.cuda.is_available()


class SideStream:
    """A side stream for weight-sync copies, or a no-op on CPU.

    ``torch.Stream``/``torch.Event`` are device-generic from torch 2.5; before that we use ``torch.cuda.Stream`` and
    ``torch.cuda.Event``. On CPU every method is a no-op, because copies are synchronous there.

    Ordering contract: ``record_after_main()`` is called on the main stream right after ``optimizer.step()``;
    the copy then runs inside ``copy_context()`` and waits for that event first; ``record_copy_done()`` marks
    its end, and the next ``optimizer.step()`` calls ``wait_copy_done()`` so it never overwrites a parameter
    that is still being copied. The push thread waits on ``synchronize_copy()`` before sending.
    """

    def __init__(self, device: torch.device):
        self.enabled = device.type == "cuda"
        if not self.enabled:
            return
        self.stream = torch.cuda.Stream(device=device)
        self.ready = torch.cuda.Event()
        self.done = torch.cuda.Event()

    def record_after_main(self) -> None:
        if self.enabled:
            self.ready.record(torch.cuda.current_stream())

    @contextlib.contextmanager
    def copy_context(self):
        if not self.enabled:
            yield
            return
        self.stream.wait_event(self.ready)
        with torch.cuda.stream(self.stream):
            yield
        self.done.record(self.stream)

    def wait_copy_done(self) -> None:
        if self.enabled:
            torch.cuda.current_stream().wait_event(self.done)

    def synchronize_copy(self) -> None:
        if self.enabled:
            self.done.synchronize()


def torch_load(path: str, **kw: Any) -> Any:
    """``torch.load`` with ``weights_only`` explicit: its default flipped to True in torch 2.6."""
    kw.setdefault("weights_only", True)
    return torch.load(path, **kw)
