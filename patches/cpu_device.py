"""Make torchtitan pick the CPU, not ``torch.cuda``, when no accelerator is present.

What: replaces ``torchtitan.tools.utils.device_type`` / ``device_module`` /
``get_device_info`` and the copies of ``device_type`` / ``device_module`` that other modules
took at import time (``COPYING_MODULES``), plus the ``"cuda:0"`` default argument of
``torchtitan.components.metrics.DeviceMemoryMonitor.__init__``. ``device_type`` becomes
``"cpu"`` and ``device_module`` becomes :data:`CPU_DEVICE_MODULE`.

Versions: torchtitan 0.3.0; torch versions checked: 2.15.0. (0.2.2's list of copying modules had
``tools.profiling`` and ``distributed.dual_pipe_v``; 0.3.0 has ``tools.profiler`` and
``models.common.token_dispatcher`` instead.)

Why: torchtitan computes ``device_type = _get_available_device_type() or "cuda"``, so on a
machine without an accelerator the Trainer calls ``torch.cuda.set_device``, builds a "cuda"
device mesh (NCCL backend) and asks ``torch.cuda`` for memory stats, all of which fail.
``torch.cpu`` is not a drop-in either: its ``current_device()`` returns ``"cpu"`` where
torchtitan expects an index, and it has no memory-stats API. With ``device_type == "cpu"``,
``init_distributed`` picks gloo and meshes are built on CPU.

When: only if ``torch._utils._get_available_device_type()`` is ``None`` (no CUDA, MPS, XPU,
MTIA or PrivateUse1 device), i.e. exactly when torchtitan would fall back to ``"cuda"``.
Modules imported after the patch copy the patched values themselves.
"""

import importlib
import os
import sys
import types

import torch
from torch._utils import _get_available_device_type

# torchtitan modules that copy ``device_type``/``device_module`` at import time.
COPYING_MODULES = (
    "torchtitan.components.metrics",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.models.common.token_dispatcher",
    "torchtitan.tools.profiler",
)


class _CPUDeviceModule:
    """Stands in for ``torch.cuda`` as torchtitan's ``device_module`` on CPU.

    Defines what torchtitan calls on ``device_module`` and ``torch.cpu`` lacks or answers
    differently; everything else (``set_device``, ``synchronize``, ``device_count``, ...)
    is ``torch.cpu``'s.
    """

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_name(device=None) -> str:
        return "CPU"

    @staticmethod
    def get_device_properties(device=None) -> types.SimpleNamespace:
        total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(name="CPU", total_memory=total_memory)

    @staticmethod
    def memory_stats(device=None) -> dict:
        # No allocator stats on CPU; DeviceMemoryMonitor then reports -1 for every figure.
        return {}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


CPU_DEVICE_MODULE = _CPUDeviceModule()


def _get_device_info() -> tuple[str, _CPUDeviceModule]:
    return "cpu", CPU_DEVICE_MODULE


def apply() -> bool:
    """Point torchtitan at the CPU if no accelerator exists; returns whether it did."""
    if _get_available_device_type() is not None:
        return False

    utils = importlib.import_module("torchtitan.tools.utils")
    utils.get_device_info = _get_device_info
    utils.device_type, utils.device_module = _get_device_info()
    for name in COPYING_MODULES:
        module = sys.modules.get(name)
        if module is None:  # not imported yet: it will copy the patched values
            continue
        for attr in ("device_type", "device_module"):
            if hasattr(module, attr):
                setattr(module, attr, getattr(utils, attr))

    metrics = importlib.import_module("torchtitan.components.metrics")
    metrics.DeviceMemoryMonitor.__init__.__defaults__ = ("cpu:0",)
    return True
