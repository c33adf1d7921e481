"""Resume checks around torchtitan's ``CheckpointManager``: a config fingerprint stored with every checkpoint,
refusals of a resume that cannot continue the run (a changed fingerprint field, ``training.steps`` below the
checkpoint's step, a model-only checkpoint), falling back past an unreadable newest checkpoint, and setting a
previous run's outputs aside when a run starts afresh in its dump folder.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
from typing import Any, Callable

from torch.distributed.checkpoint.api import CheckpointException

from torchtitan_flux.errors import CheckpointWriteError, ConfigError

logger = logging.getLogger("torchtitan_flux")

FINGERPRINT = "fingerprint.json"
SET_ASIDE = ".metadata.unreadable"  # what an unreadable checkpoint's .metadata is renamed to


def fingerprint(job_config: Any, task: Any) -> dict[str, Any]:
    """The settings a checkpoint cannot be resumed without, as ``{field: value}``; changing one breaks the resume
    or silently makes it another run: the model folder's ``config.json`` (the weights would not load, or mean
    something else) and ``tokenizer.json`` (the token ids of the checkpointed rollouts and prompt stream), by
    content hash so that a moved folder still matches; ``optimizer.name`` (the optimizer state);
    ``rollout.prompts_per_step`` and ``grpo.group_size`` (the shape of an async checkpoint's rollouts, the prompt
    stream position); ``rollout.task``, ``rollout.task_args``, the dataset's records (content hash, after length
    filtering) and ``rollout.seed`` (which prompts come next); ``rollout.environment`` (an async checkpoint's rollouts are its
    episodes; a checkpoint from before the field has no such key, and is not compared on it).

    Left out on purpose, since a resume may change them: learning rate and schedule, ``training.steps``, the
    checkpoint and sync cadences, async settings, ``max_new_tokens`` (rollouts are padded per batch; the prompt
    limit acts through the filtered records) and ``debug.seed`` (the RNG state is in the checkpoint)."""
    r, hf = job_config.rollout, job_config.hf_assets_path
    fp: dict[str, Any] = {
        "model.hf_assets_path config.json": _json_sha(os.path.join(hf, "config.json")),
        "model.hf_assets_path tokenizer.json": _file_sha(os.path.join(hf, "tokenizer.json")),
        "optimizer.name": job_config.optimizer.name,
        "rollout.prompts_per_step": r.prompts_per_step,
        "grpo.group_size": job_config.grpo.group_size,
        "rollout.task": r.task,
        "rollout.task_args": list(r.task_args),
        "rollout.seed": r.seed,
        "rollout.environment": r.environment,
    }
    data = task.data_state(0, r.prompts_per_step) if hasattr(task, "data_state") else {}
    if "records" in data:  # dataset tasks; generated ones are a function of (task, task_args, seed, step)
        fp["rollout.dataset_path"] = f"{data['records']} records, sha1 {data['sha1'][:12]}"
    return fp


def _file_sha(path: str) -> str:
    with open(path, "rb") as f:
        return "sha256 " + hashlib.sha256(f.read()).hexdigest()[:12]


def _json_sha(path: str) -> str:
    with open(path) as f:  # key order and whitespace do not count
        return "sha256 " + hashlib.sha256(json.dumps(json.load(f), sort_keys=True).encode()).hexdigest()[:12]


def write_fingerprint(step_dir: str, fp: dict[str, Any]) -> None:
    os.makedirs(step_dir, exist_ok=True)
    tmp = os.path.join(step_dir, FINGERPRINT + ".tmp")
    with open(tmp, "w") as f:
        json.dump(fp, f, indent=1)
    os.replace(tmp, os.path.join(step_dir, FINGERPRINT))


CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights and AdamW's two moments (torchtitan's optimizers are Adam / AdamW)


def check_room_for_a_checkpoint(job_config: Any) -> None:
    """Rank 0, at start, with checkpoints on: ``ConfigError`` unless the checkpoint folder's disk has room for one
    checkpoint of this model (a full disk found at the first save would stop the run after its work was done)."""
    from safetensors import safe_open

    from torchtitan_flux.models import hf

    ck, dump = job_config.checkpoint, job_config.dump_folder
    if not ck.enable:
        return
    params = 0
    try:
        for path in hf.weight_files(job_config.hf_assets_path):
            with safe_open(str(path), "pt") as f:
                params += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    except Exception:  # noqa: BLE001 - missing or damaged weights: the trainer's load names them in one line
        return
    need, folder = CHECKPOINT_BYTES_PER_PARAM * params, os.path.join(dump, ck.folder)
    free = shutil.disk_usage(folder).free
    if free < need:
        raise ConfigError(f"checkpoint.folder = {ck.folder!r} (that is {folder!r}) has {free / 2**20:.1f} MiB free; a "
                          f"checkpoint of this model takes about {need / 2**20:.1f} MiB ({params:,} parameters x "
                          f"{CHECKPOINT_BYTES_PER_PARAM} bytes: fp32 weights and the optimizer's two moments); "
                          "allowed: a folder on a disk with room, or checkpoint.enable = false")


RUN_OUTPUTS = {"metrics.jsonl": "file", "summary.json": "file", "completions.jsonl": "file", "eval.jsonl": "file",
               "hf_final": "folder"}  # a run's own outputs in job.dump_folder, and what each is


def set_aside_previous_outputs(job_config: Any) -> str | None:
    """Rank 0, before the trainer is built: if this run starts afresh (nothing to resume) and ``job.dump_folder``
    holds a previous run's outputs, move them into ``previous_runs/<UTC time>/`` and say so. Returns the folder
    they went to, or None."""
    dump, ck = job_config.dump_folder, job_config.checkpoint
    if ck.enable and any(s > 0 for s in complete_steps(os.path.join(dump, ck.folder))):
        return None  # a resume: its rows continue the same metrics.jsonl (a seed checkpoint, step 0, is no progress)
    found = [n for n in RUN_OUTPUTS if os.path.exists(p := os.path.join(dump, n))
             and not (os.path.isfile(p) and os.path.getsize(p) == 0)]  # an empty file holds no run's output
    if not found:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest = os.path.join(dump, "previous_runs", stamp)
    n = 1
    while os.path.exists(dest):
        n += 1
        dest = os.path.join(dump, "previous_runs", f"{stamp}-{n}")
    os.makedirs(dest)
    for name in found:
        os.replace(os.path.join(dump, name), os.path.join(dest, name))
    logger.warning(f"job.dump_folder = {dump!r} held a previous run's outputs ({', '.join(found)}): moved to {dest} "
                   "(a new run never appends to or overwrites them)")
    return dest


def check_outputs(job_config: Any) -> None:
    """Rank 0, after ``set_aside_previous_outputs``: ``ConfigError`` naming the path unless every output the run
    writes in ``job.dump_folder`` is absent or of its kind (a folder named ``metrics.jsonl`` or a file named
    ``hf_final`` failed only when first written, the export after the whole training)."""
    dump, m = job_config.dump_folder, job_config.metrics
    for name, kind in {**RUN_OUTPUTS, **({m.save_tb_folder: "folder"} if m.enable_tensorboard else {})}.items():
        path = os.path.join(dump, name)
        if os.path.exists(path) and os.path.isdir(path) != (kind == "folder"):
            raise ConfigError(f"job.dump_folder = {dump!r} holds {path}, a {'folder' if kind == 'file' else 'file'} "
                              f"where the run writes its {name} {kind}; allowed: remove or rename it, or another "
                              "--job.dump_folder")


def complete_steps(folder: str) -> list[int]:
    """Steps of ``folder``'s complete checkpoints (a ``step-N`` folder with ``.metadata``, torchtitan's rule),
    newest first."""
    if not os.path.isdir(folder):
        return []
    steps = [int(m.group(1)) for name in os.listdir(folder) if (m := re.fullmatch(r"step-(\d+)", name))
             and os.path.isfile(os.path.join(folder, name, ".metadata"))]
    return sorted(steps, reverse=True)


def model_only(step_dir: str) -> bool:
    """Whether a complete checkpoint holds the model's weights only (torchtitan's ``last_save_model_only``: no
    optimizer state in its DCP metadata). False when the metadata cannot be read (the load's fallback handles it)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        keys = FileSystemReader(step_dir).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - unreadable: not this check's business
        return False
    return not any(k.startswith("optimizer.") for k in keys)


# model keys only torchtitan 0.2.2 writes: 0.3.0 names them ``lm_head.weight`` and ``...attention.qkv_linear.wq.weight``
TORCHTITAN_022_KEY = re.compile(r"output\.weight|layers\.\d+\.attention\.w[qkv]\.weight")


def written_by_torchtitan_022(step_dir: str) -> bool:
    """Whether a complete checkpoint was written by torchtitan 0.2.2 (its parameter names). False when the metadata
    cannot be read (the load's fallback handles it)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        keys = FileSystemReader(step_dir).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - unreadable: not this check's business
        return False
    return any(TORCHTITAN_022_KEY.fullmatch(k) for k in keys)


def check_resume(job_config: Any, fp: dict[str, Any], folder: str) -> list[str]:
    """Before anything starts: refuse (``ConfigError``, one line) a resume from ``folder`` that cannot continue
    the run. A fingerprint field that differs is a warning instead with ``checkpoint.on_config_mismatch = "warn"``;
    returns the fields warned about, else []."""
    ck = job_config.checkpoint
    steps = complete_steps(folder)
    if ck.enable and ck.load_step != -1 and ck.load_step not in steps:  # torchtitan: a FileNotFoundError traceback
        raise ConfigError(f"checkpoint.load_step = {ck.load_step} has no complete checkpoint in {folder}; allowed: "
                          f"{', '.join(map(str, sorted(steps))) or 'none there'}, or -1 for the newest")
    step = ck.load_step if ck.load_step != -1 else (steps[0] if steps else -1)
    step_dir = os.path.join(folder, f"step-{step}")
    if not ck.enable or step <= 0 or not os.path.isdir(step_dir):  # step 0 is a seed checkpoint (weights only)
        return []
    if written_by_torchtitan_022(step_dir):  # its parameters have other names: nothing of it would load
        from torchtitan_flux.patches import LAST_TORCHTITAN_022_COMMIT

        raise ConfigError(
            f"checkpoint {step_dir} was written by torchtitan 0.2.2, whose parameter names torchtitan 0.3.0 does not "
            "load; allowed: another --job.dump_folder to start a new run (with model.hf_assets_path = the old run's "
            f"hf_final folder to keep its weights), or torchtitan_flux at commit {LAST_TORCHTITAN_022_COMMIT} "
            "(torchtitan 0.2.2) to resume it")
    if model_only(step_dir):  # else reported unreadable and set aside, and the run fell back to an older one
        full = [s for s in steps if s < step and not model_only(os.path.join(folder, f"step-{s}"))]
        raise ConfigError(
            f"checkpoint {step_dir} holds the model only (written with checkpoint.last_save_model_only = true): it "
            "cannot resume training (no optimizer, scheduler or run state); allowed: "
            + (f"--checkpoint.load_step {full[0]} (the newest full checkpoint) to resume from there, " if full else "")
            + "another --job.dump_folder to start a new run, and checkpoint.last_save_model_only = false in runs you "
            "mean to extend")
    n = job_config.training.steps
    if n < step:
        raise ConfigError(
            f"training.steps = {n} is below the step of the checkpoint to resume ({step_dir}): nothing to do; "
            f"allowed: training.steps > {step} to train on, or another --job.dump_folder to start over"
        )
    path = os.path.join(step_dir, FINGERPRINT)
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:  # absent: written before fingerprints existed
        logger.warning(f"{step_dir} has no readable {FINGERPRINT} ({_one_line(e)}): its config is not compared")
        return []
    diff = [(k, saved[k], fp[k]) for k in fp if k in saved and saved[k] != fp[k]]  # (field, saved, now)
    if not diff:
        return []
    name, old, new = diff[0]
    more = f" (and {', '.join(d[0] for d in diff[1:])})" if len(diff) > 1 else ""
    line = (f"{name} = {new!r} differs from the checkpoint's {old!r}{more} ({path}); resume with the checkpoint's "
            "value, use another --job.dump_folder to start a new run, or set checkpoint.on_config_mismatch = "
            '"warn" to resume anyway')
    if ck.on_config_mismatch == "error":
        raise ConfigError(line)
    logger.warning(line)
    return [d[0] for d in diff]


def load_newest_readable(folder: str, load: Callable[[int], Any], is_writer: bool) -> int:
    """Load the newest complete checkpoint of ``folder`` that loads (``load(step)``, every rank); returns its
    step. The writer rank sets newer unreadable ones aside (``.metadata`` renamed to ``SET_ASIDE``: torchtitan
    then ignores them, and a save of that step rewrites the folder), and one warning names them. When none loads,
    nothing is renamed and a ``ConfigError`` names the newest."""
    steps = complete_steps(folder)
    failed: list[tuple[str, str]] = []  # (step folder, its error), newest first
    for step in steps:
        step_dir = os.path.join(folder, f"step-{step}")
        try:
            load(step)
        # a damaged file raises whatever its reader raises (EOFError, ...), wrapped by DCP in a BaseException
        except (Exception, CheckpointException) as e:  # noqa: BLE001
            failed.append((step_dir, _one_line(e)))
            continue
        if failed:
            if is_writer:
                for bad, _ in failed:
                    os.replace(os.path.join(bad, ".metadata"), os.path.join(bad, SET_ASIDE))
            logger.warning(f"checkpoint {failed[0][0]} cannot be loaded ({failed[0][1]}); resumed from {step_dir} "
                           f"instead, and set {', '.join(b for b, _ in failed)} aside (.metadata renamed to "
                           f"{SET_ASIDE})")
        return step
    raise ConfigError(
        f"checkpoint {failed[0][0]} cannot be loaded ({failed[0][1]}), nor can any earlier one in {folder}; delete "
        f"{folder} to start from scratch, or use another --job.dump_folder"
    )


def load(checkpointer, ck_cfg, folder: str, is_writer: bool) -> None:
    """torchtitan's load of ``checkpoint.load_step``, or of the newest complete checkpoint that loads
    (``load_newest_readable``)."""
    if not ck_cfg.enable or ck_cfg.load_step != -1 or not complete_steps(folder):
        checkpointer.load(step=ck_cfg.load_step)
        return
    load_newest_readable(folder, lambda s: checkpointer.load(step=s), is_writer)


class CheckpointSaver:
    """torchtitan's saves, with the config fingerprint written into the step folder first (writer rank), so every
    complete checkpoint has one; every failure, also of a write in the background (``checkpoint.async_mode``), is
    one ``CheckpointWriteError`` naming the step it was for."""

    def __init__(self, checkpointer, folder: str, fp: dict[str, Any], is_writer: bool):
        self.checkpointer, self.folder, self.fp, self.is_writer = checkpointer, folder, fp, is_writer
        self.pending: int | None = None  # the step whose async write is in flight

    def save(self, step: int, last_step: bool) -> bool:
        """Save ``step`` if due; returns whether it was (written, or staged by an async ``checkpoint.async_mode``:
        torchtitan writes the last step synchronously)."""
        due = self.checkpointer._should_save(step, last_step)
        if due:
            self.settle()  # torchtitan waits for it inside save(), where its failure would name this step
        try:
            if due and self.is_writer:
                write_fingerprint(os.path.join(self.folder, f"step-{step}"), self.fp)
            self.checkpointer.save(step, last_step=last_step)
        except (OSError, CheckpointException) as e:
            raise self._error(step, e) from None
        if due and not last_step and self.checkpointer.save_future is not None:
            self.pending = step
        return due

    def save_on_stop(self, step: int) -> bool:
        """A stop's checkpoint of ``step`` (a signal, no engine left): always a full one, which a resume continues
        from (torchtitan's ``last_save_model_only`` is for the end of training: ``save(step, last_step=True)``
        would write the model alone over the step's full checkpoint and the resume would be refused), written
        synchronously, and not at all when the step already has a complete full checkpoint (it would only repeat
        it, and a write cut short by a second signal must not tear it). Returns whether it wrote one.

        Uses two of torchtitan's ``CheckpointManager`` internals (0.2.2's, unchanged in 0.3.0's
        ``components.checkpointer.dcp``), the same calls its own ``save`` makes for a periodic checkpoint
        (``_flattened_model_states_sd``, ``_create_checkpoint_id``)."""
        from torchtitan.components.checkpoint import AsyncMode

        self.settle()
        step_dir = os.path.join(self.folder, f"step-{step}")
        if step in complete_steps(self.folder) and not model_only(step_dir):
            return False
        ck = self.checkpointer
        try:
            if self.is_writer:
                write_fingerprint(step_dir, self.fp)
            ck.dcp_save(ck._flattened_model_states_sd(), checkpoint_id=ck._create_checkpoint_id(step),
                        async_mode=AsyncMode.DISABLED, enable_garbage_collection=True)
        except (OSError, CheckpointException) as e:
            raise self._error(step, e) from None
        return True

    def poll(self) -> None:
        """After a step: ``settle`` the async write in flight if it has ended."""
        if self.pending is not None and self.checkpointer.save_future.done():
            self.settle()

    def settle(self) -> None:
        """Wait for the async write in flight, if any: log its step once complete, or raise its failure."""
        if self.pending is None:
            return
        step, self.pending = self.pending, None
        try:
            self.checkpointer.save_future.result()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - whatever the write raised: it failed
            raise self._error(step, e) from None
        logger.info(f"checkpoint of step {step} saved")

    def _error(self, step: int, e: BaseException) -> CheckpointWriteError:
        step_dir, cause = os.path.join(self.folder, f"step-{step}"), _cause(e)
        fix = os_error_fix(cause, step_dir) if isinstance(cause, OSError) else f"fix {self.folder}"
        return CheckpointWriteError(f"checkpoint of step {step} could not be written to {step_dir} ({_one_line(e)}); "
                                    f"a resume loads the previous complete one: {fix}, or set checkpoint.folder "
                                    "elsewhere")


def os_error_fix(e: OSError, path: str) -> str:
    """What to do about ``e``, raised writing ``path`` (or a file in it), by its errno: a full disk wants space, a
    read-only folder a permission, a file where a folder should be its removal."""
    path = e.filename or path
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    if e.errno == errno.ENOSPC:
        return "free space on its disk"
    if e.errno == errno.EDQUOT:
        return "free space or raise this user's disk quota"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"give this user write permission on {folder}"
    if e.errno == errno.EROFS:
        return f"remount the file system of {folder} read-write"
    if e.errno in (errno.ENOTDIR, errno.EEXIST):
        blocker = path  # the nearest part of path that exists: a file where a folder must be
        while not os.path.lexists(blocker) and blocker != os.path.dirname(blocker):
            blocker = os.path.dirname(blocker)
        return f"remove or rename the file {blocker} (a folder must be there)"
    if e.errno == errno.EISDIR:
        return f"remove or rename the folder {path} (a file must be there)"
    if e.errno == errno.ENOENT:
        return f"restore {folder} (it was deleted or unmounted while the run wrote it)"
    if e.errno == errno.EIO:
        return f"check the disk of {folder} (an I/O error: a failing disk or network file system; see dmesg)"
    return f"fix {folder}"


def _cause(e: BaseException) -> BaseException:
    """A DCP ``CheckpointException``'s first failing rank's own exception, else ``e``."""
    if isinstance(e, CheckpointException) and e.failures:
        return min(e.failures.items())[1][0]
    return e


def _one_line(e: BaseException) -> str:
    e = _cause(e)
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}".rstrip(": ")
