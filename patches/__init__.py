"""Every monkey-patch torchtitan_flux applies to torchtitan or torch.

Call :func:`apply_patches` first thing, before anything imports ``torchtitan``: the
``triton_stub`` patch has to run before torchtitan's models can be imported without triton.
Each patch module documents what it replaces, for which versions, why, and when it applies;
each has an ``apply() -> bool`` that is safe to call repeatedly and returns whether the patch
is in effect.
"""

import importlib.metadata
import logging

from torchtitan_flux.errors import TorchtitanVersionError

from . import cpu_device, cpu_quiet, gloo_fsdp_sum, set_timeout, triton_stub

logger = logging.getLogger("torchtitan_flux")

# The torchtitan release torchtitan_flux and these patches are written and checked against (and the only one it runs
# on: "switch, do not support both"); the last torchtitan_flux commit on torchtitan 0.2.2 is named in the refusal.
TORCHTITAN_VERSION = "0.3.0"
LAST_TORCHTITAN_022_COMMIT = "420b2f0"

# In application order: triton_stub must come before anything imports torchtitan.
PATCHES = {
    "triton_stub": triton_stub,
    "cpu_device": cpu_device,
    "cpu_quiet": cpu_quiet,
    "gloo_fsdp_sum": gloo_fsdp_sum,
    "set_timeout": set_timeout,
}


def apply_patches() -> list[str]:
    """Apply every patch this machine needs; idempotent. ``TorchtitanVersionError`` (one line) for any torchtitan
    but ``TORCHTITAN_VERSION``.

    Returns:
        The names (keys of :data:`PATCHES`) of the patches now in effect.
    """
    installed = importlib.metadata.version("torchtitan")
    if installed != TORCHTITAN_VERSION:
        raise TorchtitanVersionError(
            f"torchtitan {installed} is installed; torchtitan_flux runs on torchtitan {TORCHTITAN_VERSION} only: "
            f"pip install torchtitan=={TORCHTITAN_VERSION} (scripts/setup.sh), or torchtitan_flux at commit "
            f"{LAST_TORCHTITAN_022_COMMIT} for torchtitan 0.2.2")
    applied = [name for name, patch in PATCHES.items() if patch.apply()]
    logger.info(f"Applied patches: {', '.join(applied) or 'none'}")
    return applied
