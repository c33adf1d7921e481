"""Entry point: ``torchrun -m torchtitan_flux.train --job.config_file train_configs/<x>.toml [--section.field v]``.

Applies the patches torchtitan needs on this machine, registers our model spec, makes torchtitan's
``ConfigManager`` merge our config sections (``--job.custom_config_module torchtitan_flux.config`` is added
unless the command line or TOML names another module), and runs ``torchtitan.train.main(FluxTrainer)``.
"""

from __future__ import annotations

import sys

from torchtitan_flux.patches import apply_patches


def _normalise_argv(argv: list[str]) -> list[str]:
    """Name our config module unless one is given, and accept true/false for our boolean fields (tyro wants
    True/False)."""
    argv = [a.capitalize() if a.lower() in ("true", "false") else a for a in argv]
    if any(a.split("=")[0] in ("--job.custom_config_module", "--job.custom-config-module") for a in argv):
        return argv
    return argv + ["--job.custom_config_module", "torchtitan_flux.config"]


def main() -> None:
    # before torchtitan is imported: ConfigManager.parse_args binds sys.argv[1:] as a default argument
    sys.argv = [sys.argv[0]] + _normalise_argv(sys.argv[1:])
    apply_patches()
    from torchtitan.train import main as titan_main

    from torchtitan_flux.model import register_flux_model
    from torchtitan_flux.trainer import FluxTrainer

    register_flux_model()
    titan_main(FluxTrainer)


if __name__ == "__main__":
    main()
