"""A checkpoint that cannot be written is one line naming its step, the path and the fix for its cause
(``resume.CheckpointSaver``, ``resume.os_error_fix``), also when torchtitan writes it in the background
(``checkpoint.async_mode``). Through the real command: ``test_stops.py::test_a_failed_checkpoint_write_...``."""

from __future__ import annotations

import errno
import os
from concurrent.futures import Future

import pytest

from torchtitan_flux.run.resume import CheckpointSaver, os_error_fix
from torchtitan_flux.errors import CheckpointWriteError


@pytest.mark.parametrize("code, fix", [
    ("ENOSPC", "free space on its disk"),
    ("EDQUOT", "free space or raise this user's disk quota"),
    ("EACCES", "give this user write permission on {ck}/step-4"),
    ("EPERM", "give this user write permission on {ck}/step-4"),
    ("EROFS", "remount the file system of {ck}/step-4 read-write"),
    ("EIO", "check the disk of {ck}/step-4 (an I/O error: a failing disk or network file system; see dmesg)"),
    ("ENOENT", "restore {ck}/step-4 (it was deleted or unmounted while the run wrote it)"),
    ("ENOTDIR", "remove or rename the file {ck} (a folder must be there)"),
    ("EEXIST", "remove or rename the file {ck} (a folder must be there)"),
    ("EISDIR", "remove or rename the folder {ck}/step-4/__0_0.distcp (a file must be there)"),
    ("EBADF", "fix {ck}/step-4"),
])
def test_the_advice_fits_the_errno(tmp_path, code, fix):
    """Before (issue 27): every OS error was told to free space, as if the disk were full."""
    ck = tmp_path / "checkpoint"
    if code in ("ENOTDIR", "EEXIST"):
        ck.write_text("")  # checkpoint/ is a file
    else:
        (ck / "step-4").mkdir(parents=True)
    if code == "EISDIR":
        (ck / "step-4" / "__0_0.distcp").mkdir()
    n = getattr(errno, code)
    e = OSError(n, os.strerror(n), str(ck / "step-4" / "__0_0.distcp"))
    assert os_error_fix(e, str(ck / "step-4")) == fix.format(ck=ck)


class _Checkpointer:
    """torchtitan's ``CheckpointManager`` as ``CheckpointSaver`` uses it: every 2 steps, async or not; ``fail``:
    the OS error of the write of that step (raised by ``save`` or, async, by its future)."""

    def __init__(self, is_async: bool, fail: dict[int, int]):
        self.is_async, self.fail, self.save_future, self.saved = is_async, fail, None, []

    def _should_save(self, step, last_step):
        return last_step or step % 2 == 0

    def save(self, step, last_step=False):
        if not self._should_save(step, last_step):
            return
        if self.save_future is not None:
            self.save_future.result()  # torchtitan's _async_wait
        error = OSError(self.fail[step], os.strerror(self.fail[step])) if step in self.fail else None
        if self.is_async and not last_step:
            self.save_future = Future()
            self.save_future.set_exception(error) if error else self.save_future.set_result(None)
        elif error:
            raise error
        self.saved.append(step)


def test_a_failed_write_names_its_step_and_the_fix(tmp_path):
    saver = CheckpointSaver(_Checkpointer(False, {4: errno.EROFS}), str(tmp_path), {"a": 1}, True)
    assert saver.save(2, False) and not saver.save(3, False)
    with pytest.raises(CheckpointWriteError) as e:
        saver.save(4, False)
    assert str(e.value) == (f"checkpoint of step 4 could not be written to {tmp_path}/step-4 (OSError: [Errno 30] "
                            f"Read-only file system); a resume loads the previous complete one: remount the file "
                            f"system of {tmp_path}/step-4 read-write, or set checkpoint.folder elsewhere")
    assert (tmp_path / "step-2" / "fingerprint.json").is_file()


def test_a_failed_async_write_is_raised_after_its_step_naming_that_step(tmp_path, caplog):
    """Before (issue 27): the failure of step 4's background write surfaced in the next save, named as step 6's
    (and a failed last periodic write surfaced at the final save, named as the last step's)."""
    ck = _Checkpointer(True, {4: errno.EACCES})
    saver = CheckpointSaver(ck, str(tmp_path), {}, True)
    with caplog.at_level("INFO", logger="torchtitan_flux"):
        saver.save(2, False)
        saver.poll()
    assert "checkpoint of step 2 saved" in caplog.text
    saver.save(4, False)
    with pytest.raises(CheckpointWriteError, match=r"^checkpoint of step 4 could not be written to .*step-4 "
                                                   r"\(PermissionError: \[Errno 13\] Permission denied\); .*give this"):
        saver.poll()
    saver.poll()  # raised once


@pytest.mark.parametrize("last", [False, True])
def test_the_next_save_settles_the_write_in_flight_first(tmp_path, last):
    ck = _Checkpointer(True, {2: errno.EIO})
    saver = CheckpointSaver(ck, str(tmp_path), {}, True)
    saver.save(2, False)
    with pytest.raises(CheckpointWriteError, match="^checkpoint of step 2 could not be written .*check the disk"):
        saver.save(3 if last else 4, last)
    assert ck.saved == [2]
