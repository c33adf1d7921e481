"""Every monkey-patch torchtitan_flux applies to torchtitan or torch.

Call :func:`apply_patches` first thing, before anything imports ``torchtitan``: the
``triton_stub`` patch has to run before torchtitan's models can be imported without triton.
Each patch module documents what it replaces, for which versions, why, and when it applies;
each has an ``apply() -> bool`` that is safe to call repeatedly and returns whether the patch
is in effect.
"""

import importlib.metadata
import logging

from . import cpu_device, cpu_quiet, gloo_fsdp_sum, list_str_quotes, triton_stub

logger = logging.getLogger("torchtitan_flux")

# The torchtitan release these patches were written and checked against.
TORCHTITAN_VERSION = "0.3.0"

# In application order: triton_stub must come before anything imports torchtitan.
PATCHES = {
    "triton_stub": triton_stub,
    "cpu_device": cpu_device,
    "cpu_quiet": cpu_quiet,
    "gloo_fsdp_sum": gloo_fsdp_sum,
    "list_str_quotes": list_str_quotes,
}


def apply_patches() -> list[str]:
    """Apply every patch this machine needs; idempotent.

    Returns:
        The names (keys of :data:`PATCHES`) of the patches now in effect.
    """
    installed = importlib.metadata.version("torchtitan")
    if installed != TORCHTITAN_VERSION:
        logger.warning(
            f"torchtitan {installed} is installed but the patches in "
            f"torchtitan_flux.patches were written for torchtitan {TORCHTITAN_VERSION}"
        )
    applied = [name for name, patch in PATCHES.items() if patch.apply()]
    logger.info(f"Applied patches: {', '.join(applied) or 'none'}")
    return applied
