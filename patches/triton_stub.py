"""Let torchtitan's models, trainer and ``train`` import on machines without triton.

What: pre-loads ``torchtitan.distributed.minimal_async_ep.kernels`` (the module itself, registered in
``sys.modules``) with a private stub ``triton`` visible only while that one file executes.

Versions: torchtitan 0.3.0; torch versions checked: 2.15.0. (torchtitan 0.2.2's triton import was
``models.moe.kernels``; torchtitan's main after 0.3.0 deprecates ``minimal_async_ep``, so the target moves again.)

Why: ``import torchtitan`` itself works without triton on 0.3.0, but every model does not:
``models.common.decoder`` imports ``models.common.moe`` -> ``token_dispatcher`` ->
``distributed.minimal_async_ep`` -> ``.api`` -> ``.kernels``, and that file does ``import triton`` at top level, so
``torchtitan.models.llama3``, ``torchtitan.trainer`` and ``torchtitan.train`` fail on CPU-only installs (a CPU
torch has no triton). Installing a fake ``triton`` globally is not an option: ``torch._dynamo`` and
``torch.utils._triton`` probe ``triton.language.dtype`` and friends and break on a fake. The stub only has to
satisfy the module body (``triton.jit`` bare and with keywords, the ``tl.constexpr`` / ``tl.pointer_type(...)``
annotations and three ``tl`` dtypes); launching a kernel raises. The kernels serve MinimalAsyncEP, an expert-parallel
token dispatcher for GPUs: no CPU path needs them.

When: only if ``triton`` cannot be imported and the kernels module is not loaded yet; must run before anything
imports torchtitan's models.
"""

import importlib.util
import os
import sys
import types

import torch  # noqa: F401  (imported before the stub exists, so torch never sees it)

KERNELS_MODULE = "torchtitan.distributed.minimal_async_ep.kernels"


class _TritonKernelUnavailable:
    """What the stub ``triton.jit`` returns: fails with a clear message when launched."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        raise RuntimeError(
            f"{self.fn.__name__} is a triton kernel but triton is not installed; "
            "MinimalAsyncEP (expert parallelism on GPUs) needs it"
        )


def _jit(fn=None, **options):
    """The stub ``triton.jit``: ``@triton.jit`` and ``@triton.jit(do_not_specialize=...)``."""
    if fn is None:
        return _TritonKernelUnavailable
    return _TritonKernelUnavailable(fn)


def _stub_triton() -> dict[str, types.ModuleType]:
    """The fake ``triton`` and ``triton.language`` modules, by name."""
    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    triton.jit = _jit
    triton.language = language
    language.constexpr = type("constexpr", (), {})
    language.pointer_type = lambda dtype: f"pointer_type({dtype})"
    for dtype in ("int64", "float32", "bfloat16"):
        setattr(language, dtype, dtype)
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
        return getattr(kernels.triton, "jit", None) is _jit
    if _triton_importable():
        return False

    # find_spec of a top-level package locates it without importing it.
    package_dir = os.path.dirname(importlib.util.find_spec("torchtitan").origin)
    spec = importlib.util.spec_from_file_location(
        KERNELS_MODULE, os.path.join(package_dir, "distributed", "minimal_async_ep", "kernels.py")
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
    # The import system only binds a submodule on its package when it loads it itself; importing the package here
    # finds the kernels in ``sys.modules`` (its ``api`` imports them).
    import torchtitan.distributed.minimal_async_ep as package

    package.kernels = kernels
    return True
