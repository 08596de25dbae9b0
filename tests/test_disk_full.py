"""A checkpoint write that fails, on a real small tmpfs: the run stops with one line on every rank, nothing partial
is left, last.ckpt still links to the previous complete checkpoint, and the run resumes from it once there is room.

The debug model's checkpoint is about 460 KB (one file) or 870 KB (FSDP2 shards): a 1 MiB tmpfs holds two files,
or one sharded folder, and the next write runs out of space. Only the checkpoints are on the tmpfs; TensorBoard
logs stay on the ordinary disk."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from app.safety.checkpoint_reading import META_FILE, is_sharded_checkpoint, read_checkpoint
from app.safety.checkpoint_write_failures import os_error_in
from tests.helpers import DDP_2, MODEL_PARALLEL, QUIET, batch_sizes, run_cohort

CHECKPOINTS = Path("lightning_logs/version_0/checkpoints")  # the default checkpoint.dirpath of a new run
EVERY_2_STEPS = ["--trainer.max_steps", "8", "--checkpoint.every_n_train_steps", "2"]


def mount_tmpfs(folder: Path, options: str) -> None:
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], check=False,
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}): these tests need root and mount")


@pytest.fixture
def small_disk() -> Iterator[Callable[[Path, str], Path]]:
    """mount(folder, options): a tmpfs mounted at ``folder`` (made first) until the test ends."""
    if shutil.which("mount") is None:
        pytest.skip("no mount command here")
    mounted: list[Path] = []

    def mount(folder: Path, options: str = "size=1m") -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        mount_tmpfs(folder, options)
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", str(folder)], check=True)


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return [line for line in result.stderr.splitlines() if line.startswith("cohort: error: ")]


@pytest.mark.parametrize("mode", [[], ["--checkpoint.async_save", "true"]], ids=["sync", "async"])
def test_a_full_disk_stops_the_run_keeps_last_and_resumes(mode: list[str], tmp_path: Path, debug_run_args: list[str],
                                                           small_disk: Callable[[Path, str], Path]) -> None:
    """1 process, checkpoints every 2 steps, keep 2: steps 2 and 4 fit, step 6 does not (written in the background,
    the oldest is still there too: it goes only once the new one is in place)."""
    folder = small_disk(tmp_path / CHECKPOINTS)
    run = ["fit", *debug_run_args, *QUIET, *EVERY_2_STEPS, *batch_sizes(4, 4), *mode]
    result = run_cohort([*run, "--trainer.logger.init_args.version", "0"], cwd=tmp_path)  # version_0 exists: the mount
    assert result.returncode == 1, result.stderr[-3000:]
    [line] = error_lines(result)
    assert line.startswith("cohort: error: step 6: the disk is full (No space left on device, ")
    assert f" MiB free in {CHECKPOINTS}), so no checkpoint was written and {CHECKPOINTS}/last.ckpt is kept: free " \
           "space there or point checkpoint.dirpath at another disk, then resume with --ckpt_path last" in line
    assert sorted(path.name for path in folder.iterdir()) == ["last.ckpt", "step=000002.ckpt", "step=000004.ckpt"]
    assert os.readlink(folder / "last.ckpt") == "step=000004.ckpt"
    assert read_checkpoint(folder / "last.ckpt")["global_step"] == 4

    subprocess.run(["mount", "-o", "remount,size=4m", str(folder)], check=True)  # room again, nothing deleted
    resumed = run_cohort([*run, "--ckpt_path", "last"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {CHECKPOINTS}/last.ckpt" in resumed.stderr
    assert sorted(path.name for path in folder.iterdir()) == ["last.ckpt", "step=000006.ckpt", "step=000008.ckpt"]
    assert read_checkpoint(folder / "last.ckpt")["global_step"] == 8
    assert not (tmp_path / "lightning_logs/version_1").exists()  # the same run went on


def test_a_read_only_checkpoint_folder_stops_the_run_at_the_first_save(tmp_path: Path, debug_run_args: list[str],
                                                                       small_disk: Callable[[Path, str], Path]) -> None:
    """Another OSError than a full disk gets its own words; nothing was saved before it."""
    folder = small_disk(tmp_path / CHECKPOINTS, "ro")
    result = run_cohort(["fit", *debug_run_args, *QUIET, *EVERY_2_STEPS, *batch_sizes(4, 4),
                         "--trainer.logger.init_args.version", "0"], cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    assert error_lines(result) == [(
        f"cohort: error: step 2: writing a checkpoint in {CHECKPOINTS} failed (Read-only file system), so no "
        "checkpoint was written and there is none from before: fix the folder or point checkpoint.dirpath elsewhere, "
        "then resume with --ckpt_path last (COHORT_TRACEBACK=1 shows where)")]
    assert not list(folder.iterdir())


def test_a_full_temporary_folder_is_named(tmp_path: Path, debug_run_args: list[str],
                                          small_disk: Callable[[Path, str], Path],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning writes a one-file checkpoint to the temporary folder first, then copies it over: when that folder
    is the full one, the line says so rather than only naming the checkpoint folder, which has room."""
    staging = small_disk(tmp_path / "tmp", "size=256k")
    monkeypatch.setenv("TMPDIR", str(staging))
    result = run_cohort(["fit", *debug_run_args, *QUIET, *EVERY_2_STEPS, *batch_sizes(4, 4)], cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    [line] = error_lines(result)
    assert line.startswith("cohort: error: step 2: the disk is full (No space left on device, ")
    assert f" GiB free in {CHECKPOINTS}, 0." in line  # room where the checkpoint goes; under 1 MiB where it is staged
    assert f" MiB in the temporary folder {staging}), so no checkpoint was written" in line
    assert not list((tmp_path / CHECKPOINTS).iterdir()) and not list(staging.glob("tmp*"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy, kept_step, mode", [(DDP_2, 4, []), (MODEL_PARALLEL, 2, []),
                                                       (MODEL_PARALLEL, 2, ["--checkpoint.async_save", "true"])],
                         ids=["ddp", "fsdp2-sharded", "fsdp2-sharded-async"])
def test_a_full_disk_stops_every_rank_alike(strategy: list[str], kept_step: int, mode: list[str], tmp_path: Path,
                                            debug_run_args: list[str],
                                            small_disk: Callable[[Path, str], Path]) -> None:
    """2 processes, checkpoint.dirpath on the tmpfs. DDP: rank 0 alone writes, and fails; rank 1 must not wait for
    it at a barrier but stop with the same line. FSDP2: both ranks write shards into one folder, and DCP reports
    the failure inside a CheckpointException; with checkpoint.async_save it does so in each rank's writing thread,
    and the ranks find it at a later step end. Then the run resumes from the checkpoint the line names."""
    folder = small_disk(tmp_path / "small")
    run = ["fit", *debug_run_args, *QUIET, *strategy, *EVERY_2_STEPS, *batch_sizes(4, 2),
           "--checkpoint.dirpath", str(folder), *mode]
    result = run_cohort(run, cwd=tmp_path, timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = error_lines(result)
    # each rank's own line, the same; rank 1's may be missing: Lightning's launcher SIGKILLs the ranks it started
    # once rank 0 has stopped with an error, which can be before rank 1 has printed
    assert len(set(lines)) == 1, lines
    assert lines[0].startswith(f"cohort: error: step {kept_step + 2}: the disk is full (No space left on device, ")
    assert f" MiB free in {folder}), so no checkpoint was written and {folder}/last.ckpt is kept" in lines[0]
    assert lines[0].endswith(f"then resume with --ckpt_path {folder}/last.ckpt (COHORT_TRACEBACK=1 shows where)")
    kept = f"step={kept_step:06d}.ckpt"
    assert os.readlink(folder / "last.ckpt") == kept
    assert not list(folder.glob("*.partial"))
    sharded = strategy == MODEL_PARALLEL
    assert is_sharded_checkpoint(folder / kept) == sharded
    assert read_checkpoint(folder / kept / META_FILE if sharded else folder / kept)["global_step"] == kept_step

    subprocess.run(["mount", "-o", "remount,size=8m", str(folder)], check=True)
    resumed = run_cohort([*run, "--ckpt_path", str(folder / "last.ckpt")], cwd=tmp_path, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert os.readlink(folder / "last.ckpt") == "step=000008.ckpt"


def test_the_os_error_is_found_inside_dcp_checkpoint_exceptions() -> None:
    """How torch 2.13's DCP reports a failed write: every rank raises one CheckpointException whose ``failures``
    maps each failed rank to (its exception, traceback)."""
    full = OSError(errno.ENOSPC, "No space left on device")
    assert os_error_in(CheckpointException("write", {1: _wrap_exception(full)})) is full
    caused = RuntimeError("write failed")
    caused.__cause__ = full
    assert os_error_in(CheckpointException("write", {0: _wrap_exception(ValueError()), 1: _wrap_exception(caused)})) \
        is full
    assert os_error_in(CheckpointException("write", {0: _wrap_exception(ValueError())})) is None
