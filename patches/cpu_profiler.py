"""Let torchtitan's ``[profiling]`` torch-profiler traces run on a machine without an accelerator.

What: replaces the ``torch`` name inside ``torchtitan.tools.profiling`` by a view of ``torch`` whose
``profiler.profile`` drops ``None`` from ``activities``; everything else is ``torch``'s. No other module sees it.

Versions: torchtitan 0.2.2; torch versions checked: 2.13.0.

Why: ``maybe_enable_profiling`` builds ``activities=[ProfilerActivity.CPU, gpu_device_profiled]`` with
``gpu_device_profiled = None`` when neither CUDA nor XPU is available, and torch 2.13's profiler rejects it
(``TypeError: Expected ProfilerActivity or dict, got NoneType``), so ``--profiling.enable_profiling true`` fails
at step 0 on CPU. (The memory snapshot records the CUDA caching allocator's history and has no CPU
equivalent: ``validation`` refuses ``profiling.enable_memory_snapshot`` without CUDA instead.)

When: only if ``torch._utils._get_available_device_type()`` is ``None`` (as ``cpu_device``).
"""

import importlib

import torch
from torch._utils import _get_available_device_type


class _Profiler:
    """``torch.profiler`` with ``profile(activities=...)`` ignoring ``None`` entries."""

    def __getattr__(self, name: str):
        return getattr(torch.profiler, name)

    @staticmethod
    def profile(*args, activities=None, **kwargs):
        if activities is not None:
            activities = [a for a in activities if a is not None]
        return torch.profiler.profile(*args, activities=activities, **kwargs)


class _Torch:
    """``torch`` as ``torchtitan.tools.profiling`` sees it: ``profiler`` is :class:`_Profiler`."""

    profiler = _Profiler()

    def __getattr__(self, name: str):
        return getattr(torch, name)


def apply() -> bool:
    """Patch ``torchtitan.tools.profiling`` when there is no accelerator; returns whether it did."""
    if _get_available_device_type() is not None:
        return False
    importlib.import_module("torchtitan.tools.profiling").torch = _Torch()
    return True
