"""Let ``import torchtitan`` succeed on machines without triton.

What: pre-loads ``torchtitan.models.moe.kernels`` (the module itself, registered in
``sys.modules``) with a private stub ``triton`` visible only while that one file executes.

Versions: torchtitan 0.2.2; torch versions checked: 2.13.0.

Why: ``torchtitan/__init__.py`` imports ``components.quantization.float8``, which imports
``models.moe.utils`` -> ``models.moe.kernels``, and that file does ``import triton`` at top
level, so ``import torchtitan`` fails on CPU-only installs. Installing a fake ``triton``
globally is not an option: ``torch._dynamo`` and ``torch.utils._triton`` probe
``triton.language.dtype`` and friends and break on a fake. The stub only has to satisfy the
module body (``triton.jit`` and the ``tl.constexpr`` annotations); launching the kernel raises.
The MoE path keeps working through ``generate_permute_indices(..., use_cpu=True)``.

When: only if ``triton`` cannot be imported and the kernels module is not loaded yet; must run
before anything imports ``torchtitan``.
"""

import importlib.util
import os
import sys
import types

import torch  # noqa: F401  (imported before the stub exists, so torch never sees it)

KERNELS_MODULE = "torchtitan.models.moe.kernels"


class _TritonKernelUnavailable:
    """What the stub ``triton.jit`` returns: fails with a clear message when launched."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        raise RuntimeError(
            f"{self.fn.__name__} is a triton kernel but triton is not installed; "
            "use the CPU implementation (use_cpu=True) instead"
        )


def _stub_triton() -> dict[str, types.ModuleType]:
    """The fake ``triton`` and ``triton.language`` modules, by name."""
    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    triton.jit = _TritonKernelUnavailable
    triton.language = language
    language.constexpr = type("constexpr", (), {})
    return {"triton": triton, "triton.language": language}


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def apply() -> bool:
    """Pre-load the kernels module if triton is missing; returns whether the stub is in use."""
    kernels = sys.modules.get(KERNELS_MODULE)
    if kernels is not None:  # loaded already: by an earlier call, or with the real triton
        return getattr(kernels.triton, "jit", None) is _TritonKernelUnavailable
    if _triton_importable():
        return False

    # find_spec of a top-level package locates it without importing it.
    package_dir = os.path.dirname(importlib.util.find_spec("torchtitan").origin)
    spec = importlib.util.spec_from_file_location(
        KERNELS_MODULE, os.path.join(package_dir, "models", "moe", "kernels.py")
    )
    kernels = importlib.util.module_from_spec(spec)
    stub = _stub_triton()
    # e.g. ``sys.modules["triton"] = None``, which blocks the import; restored afterwards.
    hidden = {name: sys.modules[name] for name in stub if name in sys.modules}
    sys.modules.update(stub)
    try:
        spec.loader.exec_module(kernels)
    finally:
        for name in stub:
            del sys.modules[name]
        sys.modules.update(hidden)
    sys.modules[KERNELS_MODULE] = kernels
    # The import system only binds a submodule on its package when it loads it itself.
    import torchtitan.models.moe

    torchtitan.models.moe.kernels = kernels
    return True
