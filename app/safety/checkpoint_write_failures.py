"""A checkpoint write that failed: the error number each rank reports for it (a full disk also where torch's writers
say something else), and the one line every rank stops with, saying what is kept and how to resume."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from core.sizes import format_bytes


def write_failed(step: int, folder: Path, failed: int, kept: str, resume: str) -> str:
    """The line every rank stops with when writing the checkpoint of ``step`` in ``folder`` failed with error number
    ``failed`` on some rank; ``kept`` and ``resume`` as ``RunCheckpoint.kept_and_resume`` said before that save."""
    folder_name, reason = os.path.normpath(folder), os.strerror(failed)
    if failed in (errno.ENOSPC, errno.EDQUOT):
        staging = tempfile.gettempdir()  # where Lightning writes a one-file checkpoint before copying it over
        free, staging_free = shutil.disk_usage(folder).free, shutil.disk_usage(staging).free
        where = f"{format_bytes(free)} free in {folder_name}"
        if staging_free < free:
            where += f", {format_bytes(staging_free)} in the temporary folder {staging}"
        return (f"step {step}: the disk is full ({reason}, {where}), so no checkpoint was written and {kept}: free "
                f"space there or point checkpoint.dirpath at another disk, then resume with {resume}")
    return (f"step {step}: writing a checkpoint in {folder_name} failed ({reason}), so no checkpoint was written and "
            f"{kept}: fix the folder or point checkpoint.dirpath elsewhere, then resume with {resume}")


def write_error_number(write: Callable[[], None], folder: Path) -> int:
    """Run ``write``, which writes a checkpoint into ``folder``: 0 if it succeeded, else the error number it failed
    with. Errors that are not the disk's propagate."""
    try:
        write()
        return 0
    except (OSError, CheckpointException, RuntimeError) as error:  # DCP raises the same on every rank
        os_error = os_error_in(error)
        if os_error is not None:
            return os_error.errno or errno.EIO
        if disk_full(folder):  # torch's zip writer can report a full disk as "unexpected pos"
            return errno.ENOSPC
        raise


def disk_full(folder: Path) -> bool:
    """Whether the folder's disk, or the temporary folder Lightning stages a one-file checkpoint in, has less than
    a MiB left: where a write that failed without an OSError failed."""
    return min(shutil.disk_usage(folder).free, shutil.disk_usage(tempfile.gettempdir()).free) < 2**20


def os_error_in(error: BaseException | None) -> OSError | None:
    """The OSError behind a failed write: the error itself, one that a rank reported inside DCP's
    CheckpointException (``failures`` maps each failed rank to its exception and traceback), or their cause."""
    if error is None or isinstance(error, OSError):
        return error
    reported = [exception for exception, _ in error.failures.values()] if isinstance(error, CheckpointException) else []
    return next(filter(None, map(os_error_in, [*reported, error.__cause__])), None)
