"""Entry point: ``torchrun -m torchtitan_flux.train --job.config_file train_configs/<x>.toml [--section.field v]``.

Applies the patches torchtitan needs on this machine, registers our model spec, makes torchtitan's
``ConfigManager`` merge our config sections (``--job.custom_config_module torchtitan_flux.config`` is added
unless the command line or TOML names another module), and runs ``torchtitan.train.main(FluxTrainer)``.

Once that returns or raises (the trainer is closed either way: engines stopped, metrics, checkpoints and the
export written), the process ends with ``os._exit``: skipping the interpreter's finalisation, where torch's C++
teardown of the weight-sync groups and store, racing daemon threads, aborted about 1 run in 20 on this machine
after everything had been written ("terminate called without an active exception", exit -6).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

from torchtitan_flux.patches import apply_patches


def _bool_kind(path: str) -> str | None:
    """"value" for a boolean of our sections (takes True/False); "flag" for anything else given true/false,
    i.e. torchtitan's booleans, which are tyro flags (--x.y / --x.no_y). Imports no torchtitan: this runs
    before ``ConfigManager`` is imported (see ``main``)."""
    import typing

    from torchtitan_flux import config as flux_config

    section, _, name = path.partition(".")
    cls = flux_config.SECTIONS.get(section)
    if cls is None:
        return "flag"
    for part in name.split("."):
        hints = typing.get_type_hints(cls) if isinstance(cls, type) else {}
        if part not in hints:
            return None
        cls = hints[part]
    return "value" if cls is bool else None


def _normalise_argv(argv: list[str]) -> list[str]:
    """Accept ``--section.field true|false`` for every boolean (torchtitan's are tyro flags, ours take a value),
    and name our config module unless one is given."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else ""
        if a.startswith("--") and "=" not in a and nxt.lower() in ("true", "false"):
            kind = _bool_kind(a[2:].replace("-", "_"))
            if kind == "flag":
                section, _, name = a[2:].rpartition(".")
                out.append(a if nxt.lower() == "true" else f"--{section}.no_{name}")
                i += 2
                continue
            if kind == "value":
                out += [a, nxt.capitalize()]
                i += 2
                continue
        out.append(a)
        i += 1
    if any(a.split("=")[0] in ("--job.custom_config_module", "--job.custom-config-module") for a in out):
        return out
    return out + ["--job.custom_config_module", "torchtitan_flux.config"]


def _starts_embedded_engines(argv: list[str]) -> bool:
    """Whether this process will start embedded engines: global rank 0 with ``rollout.engine = "embedded"`` (the
    default). A best-effort peek at the command line and the TOML before torchtitan parses them: it only decides
    whether to start the engines' fork server early (``engine.forkserver``); a wrong answer costs start-up time,
    never correctness, and the real parse reports bad input."""
    if os.environ.get("RANK", "0") != "0":
        return False
    engine, config_file = None, None
    for i, a in enumerate(argv):
        key, eq, val = a.partition("=")
        val = val if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        if key == "--rollout.engine":
            engine = val
        elif key in ("--job.config_file", "--job.config-file"):
            config_file = val
    if engine is None and config_file:
        try:
            import tomllib

            with open(config_file, "rb") as f:
                engine = tomllib.load(f).get("rollout", {}).get("engine")
        except (OSError, ValueError, AttributeError):
            return False
    return (engine or "embedded") == "embedded"


def main() -> None:
    # before torchtitan is imported: ConfigManager.parse_args binds sys.argv[1:] as a default argument
    debug = "--debug" in sys.argv[1:]  # keep Python tracebacks for input errors too
    files = [a for a in sys.argv[1:] if a.split("=")[0] in ("--job.config_file", "--job.config-file")]
    if len(files) > 1:  # torchtitan would silently use the first one
        print(f"error: --job.config_file is given {len(files)} times; allowed: once", file=sys.stderr)
        sys.exit(2)
    sys.argv = [sys.argv[0]] + _normalise_argv([a for a in sys.argv[1:] if a != "--debug"])
    if _starts_embedded_engines(sys.argv[1:]):
        from torchtitan_flux.engine.forkserver import prestart_engine_server

        try:
            prestart_engine_server()  # its imports overlap ours and torchtitan's (seconds) on another core
        except ValueError as e:  # a bad TORCHTITAN_FLUX_ENGINE_START
            sys.exit(f"torchtitan_flux: {e}")
    apply_patches()
    from torchtitan.train import main as titan_main

    from torchtitan_flux.model import register_flux_model
    from torchtitan_flux.config import ConfigError
    from torchtitan_flux.trainer import FluxTrainer, NonFiniteLoss

    register_flux_model()
    try:
        titan_main(FluxTrainer)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except (ConfigError, NonFiniteLoss) as e:  # bad input / a diverged run: one line, no traceback (--debug: both)
        if debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        code = 2 if isinstance(e, ConfigError) else 1
    except BaseException:  # noqa: BLE001 - reported here, then the same non-zero exit as an uncaught error
        traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
