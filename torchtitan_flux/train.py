"""Entry point: ``torchrun -m torchtitan_flux.train --job.config_file train_configs/<x>.toml [--section.field v]``.

Applies the patches torchtitan needs (refusing another torchtitan version in one line), builds the config from the
TOML and the overrides (``run/config_file.py``), validates it before torchtitan starts, and builds and trains a
``GRPOTrainer`` as torchtitan's own ``train.main`` does. How a run ends (``_report``): bad input is one
line, ``error: <field> = <value> ...; allowed: ...``, exit code 2; an unusable engine server or a failed post-sync
probe one ``error:`` line, exit 1; an expected stop one ``stopped: ...`` line, exit 1. Real bugs keep their
traceback (as does everything under ``TORCHTITAN_FLUX_DEBUG=1``). Processes user code left running are stopped,
with one line naming them (``run/leftovers.py``). Then ``os._exit``: the interpreter's finalisation could abort the
process (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
import traceback


def _starts_embedded_engines(argv: list[str]) -> bool:
    """Best-effort: will this process start embedded engines, processes it forks (then the fork server is
    prestarted)? Imports no torch: the fork server imports it on another core while this process imports the rest."""
    from torchtitan_flux.config import Rollout
    from torchtitan_flux.engine.kinds import ENGINE_KINDS

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
    engine = engine or Rollout.engine
    kind = ENGINE_KINDS.get(engine) if isinstance(engine, str) else None  # else validation refuses it
    return kind is not None and not kind.server


# path fields -> their default (torchtitan's ``job.dump_folder``: tests/unit/test_config.py checks it is the same)
PATH_FIELDS = {"job.dump_folder": "./outputs", "model.hf_assets_path": "", "rollout.dataset_path": "",
               "eval.dataset_path": ""}


def _absolute_paths(config) -> None:
    """Make every path field (``PATH_FIELDS``) given as a relative or ``~`` path absolute: resolved once against
    the directory the run starts in, so user code that calls ``os.chdir`` moves no input or output."""
    for name in PATH_FIELDS:
        section, _, field = name.rpartition(".")
        owner = config if section in ("job", "model") else getattr(config, section)  # 0.3.0: top-level fields
        value = getattr(owner, field)
        if isinstance(value, str) and value:
            setattr(owner, field, os.path.abspath(os.path.expanduser(value)))


_LOCKS: list = []  # the open lock files of the folders this run writes (rank 0), held until the process ends


def _lock_run_folders(config) -> None:
    """Rank 0 locks the dump folder and, with checkpoints on, the checkpoint folder for the life of the process; a
    dump folder inside a running run's (its ``hf_final``, say) is refused, and so is a checkpoint folder that is
    the dump folder itself."""
    from torchtitan_flux.errors import ConfigError

    if os.environ.get("RANK", "0") != "0":
        return
    dump = config.dump_folder
    _refuse_inside_a_running_run(dump)
    _lock_folder("job.dump_folder", dump, dump)
    if config.checkpoint.enable:
        folder = os.path.join(dump, config.checkpoint.folder)  # torchtitan's resolution
        if os.path.realpath(folder) == os.path.realpath(dump):
            raise ConfigError(f"checkpoint.folder = {config.checkpoint.folder!r} is the dump folder itself; "
                              "allowed: a folder of its own, e.g. 'checkpoint' (inside job.dump_folder)")
        _lock_folder("checkpoint.folder", config.checkpoint.folder, folder)


def _refuse_inside_a_running_run(dump: str) -> None:
    """``ConfigError`` when a folder above ``dump`` is the dump folder of a run still running (its lock is held):
    that run would write, set aside or export over this one's outputs."""
    import fcntl

    from torchtitan_flux.errors import ConfigError

    parent = os.path.dirname(os.path.realpath(dump))
    while True:
        lock = os.path.join(parent, ".flux.lock")
        try:
            with open(lock) as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise ConfigError(f"job.dump_folder = {dump!r} is inside {parent!r}, the dump folder of a "
                                      f"running run (pid {f.read().strip() or 'unknown'}); allowed: a folder "
                                      "outside every running run's") from None
        except OSError:  # no lock file there (or one we cannot read): no run of ours
            pass
        if parent == os.path.dirname(parent):
            return
        parent = os.path.dirname(parent)


def _lock_folder(field: str, value: str, folder: str) -> None:
    import fcntl

    from torchtitan_flux.errors import ConfigError

    allowed = "allowed: a folder this user can write (created if missing)"
    if not folder:
        raise ConfigError(f"{field} = {value!r} is empty; {allowed}")
    same = os.path.abspath(value) == os.path.abspath(folder)
    named = f"{field} = {value!r}" + ("" if same else f" (that is {folder!r})")
    try:  # every OS error on the folders a run writes is one line naming the path, before any work
        os.makedirs(folder, exist_ok=True)
        f = open(os.path.join(folder, ".flux.lock"), "a+")
    except OSError as e:
        why = ("it is a file, not a folder" if isinstance(e, FileExistsError) else
               e.strerror if e.filename in (None, folder) else f"{e.filename}: {e.strerror}")  # the lock file
        raise ConfigError(f"{named} cannot be used ({why}); {allowed}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        f.close()
        raise ConfigError(f"{named} is not writable; {allowed}")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        owner = f.read().strip() or "unknown"
        f.close()
        raise ConfigError(f"{named} is in use by another run (pid {owner}); allowed: a folder no running job uses "
                          "(each run needs its own)") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    _LOCKS.append(f)


def _report(e: BaseException) -> int:
    """Print how the run ended; return the exit code (see the module docstring)."""
    from torchtitan_flux.errors import (CheckpointWriteError, ConfigError, EngineStartError, LossNotFinite,
                                        MetricsWriteError, NcclVersionMismatch, NoEngineLeft, ProbeMismatch,
                                        RewardError, TorchtitanVersionError, TrainingInterrupted, UserCodeError)

    if isinstance(e, (ConfigError, RewardError, UserCodeError)):
        code, line = 2, f"error: {e}"
    elif isinstance(e, (EngineStartError, ProbeMismatch, NcclVersionMismatch, TorchtitanVersionError)):
        code, line = 1, f"error: {e}"
    elif isinstance(e, (TrainingInterrupted, NoEngineLeft, LossNotFinite, CheckpointWriteError, MetricsWriteError)):
        code, line = 1, f"stopped: {e}"
    else:
        traceback.print_exc()
        return 1
    if os.environ.get("TORCHTITAN_FLUX_DEBUG") == "1":
        traceback.print_exc()
    print(line, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # torchrun prints this in its failure summary (instead of a pointer to its docs)
        with contextlib.suppress(OSError), open(error_file, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    return code


def _stop_while_starting(signum, frame) -> None:
    """Until the trainer installs its own handler (``run.stops``): a signal ends the start-up (imports, validation,
    the fork server) with one line and exit code 1, at once. Not by raising: an exception landing inside a C
    extension's import (numpy's) is turned into an unrelated ``ImportError`` traceback. Nothing trained yet, so
    nothing is lost; the fork server dies with this process, and the run-folder locks with it."""
    os.write(2, f"stopped: received {signal.Signals(signum).name} while starting (nothing trained yet)\n".encode())
    os._exit(1)


def _train(config) -> None:
    """torchtitan's ``train.main`` from its ``config.build()`` on (torchtitan's parses ``sys.argv`` itself, with
    tyro; ``load_config`` builds ours)."""
    import torch

    trainer = None
    try:
        trainer = config.build()
        trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):  # run.stops.STOP_SIGNALS, not imported
        if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup: the user asked to go on
            signal.signal(sig, _stop_while_starting)
    from torchtitan_flux.run.leftovers import adopt_orphans, stop_leftovers

    adopt_orphans()  # what user code starts and abandons stays findable: stopped below, at exit
    argv = sys.argv[1:]
    if _starts_embedded_engines(argv):
        from torchtitan_flux.engine.forkserver import prestart_engine_server

        try:
            prestart_engine_server()  # its imports overlap ours and torchtitan's (seconds) on another core
        except ValueError as e:  # a bad TORCHTITAN_FLUX_ENGINE_START: bad input, like a bad field
            print(f"error: {e}", file=sys.stderr, flush=True)
            os._exit(2)
    try:
        from torchtitan_flux.patches import apply_patches

        apply_patches()  # another torchtitan version: one line (TorchtitanVersionError)
        from torchtitan.tools.logging import init_logger

        from torchtitan_flux.run.config_file import load_config
        from torchtitan_flux.run.trainer import GRPOTrainer
        from torchtitan_flux.run.validation import validate_config

        init_logger()
        config = load_config(argv, GRPOTrainer.Config())
        _absolute_paths(config)
        validate_config(config)  # bad input: one line, before torchtitan's start-up
        _lock_run_folders(config)
        if os.environ.get("RANK", "0") == "0":
            from torchtitan_flux.run.resume import (check_outputs, check_room_for_a_checkpoint,
                                                    set_aside_previous_outputs)

            check_room_for_a_checkpoint(config)
            set_aside_previous_outputs(config)
            check_outputs(config)
        _train(config)
        code = 0
    except SystemExit as e:
        if isinstance(e.code, str):  # sys.exit("why") during the start-up
            print(e.code, file=sys.stderr, flush=True)
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException as e:  # noqa: BLE001 - reported here, then the same non-zero exit as an uncaught error
        code = _report(e)
    leftovers = stop_leftovers()
    if leftovers:
        more = f", and {len(leftovers) - 8} more" if len(leftovers) > 8 else ""
        print(f"stopped {len(leftovers)} process(es) the run's user code left running: {', '.join(leftovers[:8])}"
              f"{more}", file=sys.stderr, flush=True)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(ValueError, OSError):  # closed by user code: what it held is lost either way
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
