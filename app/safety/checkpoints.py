"""Checkpoints: writing them so that a crash never leaves a half-written one in place, finding the newest, checking
one before a run starts, reading them as data (a sharded folder also as one whole checkpoint), keying optimizer
state by parameter name, and consolidating a sharded one into one file.

A checkpoint is one file (one process, DDP) or a folder of shards (torch.distributed.checkpoint, under fsdp,
model_parallel and the pipeline) whose ``meta.pt`` holds everything but the weights and optimizer states. Either
way the optimizer state is keyed by parameter name, as sharded strategies store it, so a checkpoint moves between
strategies: a plain optimizer's positions depend on the weight-decay groups, names do not. Sharded strategies read
a file or a folder of any sharding themselves; one device and DDP read a folder through ``FolderReadingCheckpointIO``
as if it had been consolidated, without writing the file. Every read goes through
torch's ``weights_only`` unpickler, which builds only tensors, containers and plain values: a file whose pickle
would import or call anything else is refused with the name of what it asked for, and nothing of it runs.
Cohort's own checkpoints need nothing beyond that unpickler's defaults. ``--weights_only false`` on the command
line is the documented escape hatch for a trusted file of another kind; it is off by default.
"""

from __future__ import annotations

import errno
import functools
import os
import pickle
import re
import shutil
import tempfile
import time
import zipfile
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any
from weakref import proxy

import lightning as L
import torch
import torch.distributed.checkpoint
from jsonargparse import Namespace
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.load import _load_distributed_checkpoint
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerStatus
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from app.safety.async_checkpoints import BackgroundWriter, PendingSave
from core.errors import UserError
from core.run_plan import run_plan_of
from models.class_paths import current_class_path
from models.module import SHAPE_HYPERPARAMETERS
from models.parallel.parallelize import CHECKPOINT_WRAPPER_PREFIX

META_FILE = "meta.pt"  # what Lightning writes beside the shards: loop state, hyperparameters, callbacks


class RunCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that never leaves a half-written checkpoint in place and that also saves when training ends
    between two periodic saves, so the final weights are never lost (Lightning's own only does so when nothing was
    saved at all). The CLI configures it to keep the newest ``save_top_k`` step checkpoints (``step=000500.ckpt``,
    the oldest deleted only once the new one is in place) with ``last.ckpt`` a link to the newest.

    Every checkpoint, a single file or a sharded folder, is written next to its target as ``NAME.partial`` by all
    ranks, then moved into place by rank 0: a run killed mid-write keeps the previous checkpoint. Nor is a poisoned
    one ever written: if any rank's weights or optimizer state hold NaN or inf, every rank stops with one line and
    the previous checkpoint stays the newest. A write that fails on any rank (a full disk, no permission) also
    stops every rank with one line; the partial is removed and the previous checkpoint stays the newest.

    With ``async_save`` the loop waits only while the checkpoint is copied into CPU memory, and a thread writes the
    copy (app/safety/async_checkpoints.py). The move into place, the ``last.ckpt`` link and the removal of the
    oldest wait until every rank's write is over and all succeeded: the ranks ask at every optimizer step's end,
    and a new save, a rollback and the end of training (a preemption's included) wait for it. A failed write stops
    every rank there with the same one line, naming its step, and the previous checkpoint stays the newest.

    Each save logs, at its step, ``checkpoint/blocking_seconds`` (how long the training loop waited for it) and
    ``checkpoint/write_seconds`` (from its start until it was in place). Its hooks key a plain optimizer's state by
    parameter name in every checkpoint the trainer writes, and back to positions in every one it loads.
    """

    def __init__(self, *args: Any, async_save: bool = False, **kwargs: Any) -> None:
        """
        Args:
            async_save: write each checkpoint in a background thread while training goes on; a save then holds
                the loop only while it copies the checkpoint (this rank's shards, if sharded) into CPU memory, which
                must have room for that second copy of the weights and optimizer state. The other arguments are
                ModelCheckpoint's.
        """
        super().__init__(*args, **kwargs)
        self.async_save = async_save
        self._writer = BackgroundWriter()
        self._pending: PendingSave | None = None
        self._save_started: float | None = None  # time.perf_counter() when the save being made began

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.async_save:
            check_writes_in_background(trainer.strategy)

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        self.finish_pending_save(trainer)  # one write at a time: the previous one lands first
        started = time.perf_counter()
        poisoned = non_finite_tensors(trainer)
        if trainer.strategy.reduce_boolean_decision(bool(poisoned), all=False):  # one flag, every rank decides alike
            kept, resume = self.kept_and_resume(trainer)
            where = f"rank {trainer.global_rank}: {', '.join(poisoned[:3])}" if poisoned else "on another rank"
            raise UserError(f"step {trainer.global_step}: the weights or optimizer state hold NaN or inf ({where}), so "
                            f"no checkpoint was written and {kept}: lower model.optimizer.learning_rate or set "
                            f"trainer.gradient_clip_val, then resume with {resume}")
        partial = Path(f"{filepath}.partial")
        if trainer.is_global_zero:
            remove_path(partial)  # left by a run killed while writing
        trainer.strategy.barrier("RunCheckpoint.partial")
        kept, resume = self.kept_and_resume(trainer)  # what a failed write leaves: the newest before this save
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(self.save_weights_only)
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        self._save_started = started
        # a save while the run is being interrupted (checkpoint.save_on_exception) is written at once: the ranks
        # may never meet again to finish a background write
        if self.async_save and trainer.state.status == TrainerStatus.RUNNING:
            written = self._write_in_background(trainer, checkpoint, partial)
            self._pending = PendingSave(trainer.global_step, partial, Path(filepath), kept, resume, written, started)
            return
        if failed := self._write(trainer, checkpoint, partial):
            raise UserError(self._discard(trainer, trainer.global_step, partial, failed, kept, resume))
        if trainer.is_global_zero:
            replace_path(partial, Path(filepath))
        trainer.strategy.barrier("RunCheckpoint.replace")

    def _save_last_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict[str, torch.Tensor]) -> None:
        """Lightning's, then the time the loop spent on the save just made, which Lightning follows with this in
        every path: the write (or the copy, for a background write), the removal of the oldest, the link."""
        super()._save_last_checkpoint(trainer, monitor_candidates)
        if self._save_started is None:
            return
        seconds, self._save_started = time.perf_counter() - self._save_started, None
        if self._pending is not None:  # the rest is counted when it is put in place
            self._pending.blocking_seconds = seconds
        else:
            self._saved(trainer, trainer.global_step, blocking_seconds=seconds, write_seconds=seconds)

    def _write(self, trainer: L.Trainer, checkpoint: dict[str, Any], partial: Path) -> int:
        """Write this rank's part of ``checkpoint`` to ``partial``; the worst error number of all ranks' writes, 0
        if all succeeded. This is ``Trainer.save_checkpoint`` without its barrier, which a rank whose write failed
        would never reach while the others waited there forever: all ranks agree on the outcome instead."""
        failed = write_error_number(lambda: trainer.strategy.save_checkpoint(checkpoint, partial), partial.parent)
        worst = trainer.strategy.reduce(torch.tensor(failed, device=trainer.strategy.root_device), reduce_op="max")
        return int(worst.item())

    def _write_in_background(self, trainer: L.Trainer, checkpoint: dict[str, Any], partial: Path) -> Future[int] | None:
        """Start writing this rank's part of ``checkpoint`` to ``partial`` in the background, once it is copied;
        None where this rank writes nothing (DDP: rank 0 writes the one file)."""
        sharded = writes_shards(trainer.strategy)
        mine = checkpoint if sharded or trainer.is_global_zero else None
        return self._writer.start(trainer, mine, functools.partial(write_copy, trainer.strategy, partial, sharded))

    def finish_pending_save(self, trainer: L.Trainer) -> None:
        """Wait for the checkpoint being written in the background, then put it in place, or stop with one line if
        any rank's write failed. Every rank calls this at the same point; nothing happens when none is pending."""
        if self._pending is not None:
            started = time.perf_counter()
            _, failed = self._writer.agree(trainer, True, self._pending.error_number())
            self._put_in_place(trainer, failed, started)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # a write that is over goes into place at once, not at the next save: a crash in between would lose it
        if self._pending is not None and run_plan_of(pl_module).ends_optimizer_step(batch_idx):
            started = time.perf_counter()
            written_here = self._pending.written_here()
            written, failed = self._writer.agree(trainer, written_here,
                                                 self._pending.error_number() if written_here else 0)
            if written:
                self._put_in_place(trainer, failed, started)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def _put_in_place(self, trainer: L.Trainer, failed: int, started: float) -> None:
        """The pending save, whose write every rank has finished (``failed``: the worst error number of all),
        moved into place with its link and removals; or, if any rank failed, removed, with one line."""
        pending, self._pending = self._pending, None
        if failed:
            message = self._discard(trainer, pending.step, pending.partial, failed, pending.kept, pending.resume)
            pending.raise_unexpected_error()
            raise UserError(message)
        if trainer.is_global_zero:
            replace_path(pending.partial, pending.target)
        trainer.strategy.barrier("RunCheckpoint.replace")
        for action in pending.after_write:
            action()
        blocking_seconds = pending.blocking_seconds + time.perf_counter() - started
        self._saved(trainer, pending.step, blocking_seconds, write_seconds=time.perf_counter() - pending.started)

    def _discard(self, trainer: L.Trainer, step: int, partial: Path, failed: int, kept: str, resume: str) -> str:
        """The line for a write of ``step`` that failed on some rank with error number ``failed``, said alike by
        every rank: each measures the free space before rank 0 removes the partial, which every rank has stopped
        writing to."""
        message = write_failed(step, partial.parent, failed, kept, resume)
        trainer.strategy.barrier("RunCheckpoint.failed")
        if trainer.is_global_zero:
            remove_path(partial)
        return message

    def _saved(self, trainer: L.Trainer, step: int, blocking_seconds: float, write_seconds: float) -> None:
        """A checkpoint of ``step`` is in place: log what it cost, and tell the loggers."""
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({"checkpoint/blocking_seconds": blocking_seconds,
                                    "checkpoint/write_seconds": write_seconds}, step=step)
                logger.after_save_checkpoint(proxy(self))

    def kept_and_resume(self, trainer: L.Trainer) -> tuple[str, str]:
        """What a refused or failed save leaves to resume from, and the option that resumes from it: ``--ckpt_path
        last`` looks only in the logger's run folders, and from another checkpoint.dirpath would start a new run
        that overwrites the kept checkpoints."""
        previous = self.last_model_path or self._last_checkpoint_saved
        if not previous:
            return "there is none from before", "--ckpt_path last"
        in_run_folder = trainer.log_dir is not None and (  # log_dir broadcasts: every rank comes here alike
            Path(self.dirpath).resolve() == Path(trainer.log_dir, "checkpoints").resolve())
        path = os.path.normpath(previous)
        return f"{path} is kept", "--ckpt_path last" if in_run_folder else f"--ckpt_path {path}"

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        self.finish_pending_save(trainer)  # training ends with its checkpoints in place, after a preemption too

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """A write still going on in the background is never put in place: the ranks may not meet again to agree
        on it. Its ``.partial`` stays, as a killed run's does, until a save of that step removes it."""
        self._pending = None
        super().on_exception(trainer, pl_module, exception)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._writer.close()  # the CPU copy's memory and the writing thread

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        name_optimizer_states(trainer, checkpoint)  # Lightning calls this after it has put in the optimizer states

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        number_optimizer_states(trainer, checkpoint)  # Lightning calls this before it loads the optimizer states
        recount_micro_batches(trainer, checkpoint)  # and before it loads the loops' progress

    def _link_checkpoint(self, trainer: L.Trainer, filepath: str, linkpath: str) -> None:
        self._after_write(functools.partial(link_atomically, trainer, filepath, linkpath))

    def _remove_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        self._after_write(functools.partial(super()._remove_checkpoint, trainer, filepath))

    def _after_write(self, action: Callable[[], None]) -> None:
        """``action`` now, or once the checkpoint being written in the background is in place: ``last.ckpt`` never
        links to a checkpoint still being written, and the oldest is removed only once the newest is whole."""
        if self._pending is not None:
            self._pending.after_write.append(action)
        else:
            action()


def link_atomically(trainer: L.Trainer, filepath: str, linkpath: str) -> None:
    """``last.ckpt`` as a relative link to the newest step checkpoint, replaced atomically (Lightning's own removes
    the old link first, and a crash just then would leave no ``last.ckpt`` to resume from)."""
    if trainer.is_global_zero:
        partial = Path(f"{linkpath}.partial")
        remove_path(partial)
        partial.symlink_to(os.path.relpath(filepath, os.path.dirname(linkpath)))
        replace_path(partial, Path(linkpath))
    trainer.strategy.barrier("RunCheckpoint.link")


def write_failed(step: int, folder: Path, failed: int, kept: str, resume: str) -> str:
    """The line every rank stops with when writing the checkpoint of ``step`` in ``folder`` failed with error number
    ``failed`` on some rank; ``kept`` and ``resume`` as ``RunCheckpoint.kept_and_resume`` said before that save."""
    folder_name, reason = os.path.normpath(folder), os.strerror(failed)
    if failed in (errno.ENOSPC, errno.EDQUOT):
        staging = tempfile.gettempdir()  # where Lightning writes a one-file checkpoint before copying it over
        free, staging_free = shutil.disk_usage(folder).free, shutil.disk_usage(staging).free
        where = f"{in_units(free)} free in {folder_name}"
        if staging_free < free:
            where += f", {in_units(staging_free)} in the temporary folder {staging}"
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


def writes_shards(strategy: Strategy) -> bool:
    """Whether the strategy writes a sharded folder (torch.distributed.checkpoint) rather than one file."""
    if isinstance(strategy, ModelParallelStrategy):
        return strategy._save_distributed_checkpoint
    return isinstance(strategy, FSDPStrategy) and strategy._state_dict_type == "sharded"


def check_writes_in_background(strategy: Strategy) -> None:
    """A UserError for a strategy whose checkpoints ``write_copy`` cannot write as the strategy itself would."""
    name = type(strategy).__name__
    if isinstance(strategy, FSDPStrategy) and writes_shards(strategy):
        raise UserError(f"checkpoint.async_save cannot copy {name}'s sharded checkpoints (torch's checkpoint stager "
                        "takes DTensors, not FSDP's ShardedTensors): use configs/trainer/model_parallel_gpu_bf16.yaml "
                        "(FSDP2), set trainer.strategy.init_args.state_dict_type full, or checkpoint.async_save false")
    own_writer = type(strategy).save_checkpoint is not Strategy.save_checkpoint
    if own_writer and not isinstance(strategy, (ModelParallelStrategy, FSDPStrategy)):
        raise UserError(f"checkpoint.async_save does not know how {name} writes its checkpoints: use one process, "
                        "DDP, FSDP2 (model_parallel) or the pipeline, or set checkpoint.async_save false")


def write_copy(strategy: Strategy, partial: Path, sharded: bool, checkpoint: dict[str, Any],
               group: torch.distributed.ProcessGroup | None) -> int:
    """In the writing thread: the CPU copy ``checkpoint`` written to ``partial`` as the strategy's own
    ``save_checkpoint`` writes it (one file from rank 0, or this rank's shards and, from rank 0, ``meta.pt`` beside
    them, laid out as ModelParallelStrategy lays them out), with collectives only on ``group``; 0 or the error number
    it failed with. One file goes straight to the local disk (a ``last.ckpt`` link needs one): Lightning's writer
    first serialises it into memory through Python, which took 4x as long on the 2-core VM, all of it beside the
    training loop."""
    def write() -> None:
        if not sharded:
            partial.parent.mkdir(parents=True, exist_ok=True)
            torch.save(checkpoint, partial)
            return
        partial.mkdir(parents=True, exist_ok=True)  # by every rank, whichever comes first
        optimizers = checkpoint.pop("optimizer_states", [])
        shards = {"state_dict": checkpoint.pop("state_dict"), **{f"optimizer_{i}": s for i, s in enumerate(optimizers)}}
        torch.distributed.checkpoint.save(shards, checkpoint_id=partial, process_group=group)
        if strategy.global_rank == 0:
            torch.save(checkpoint, partial / META_FILE)

    return write_error_number(write, partial.parent)


def non_finite_tensors(trainer: L.Trainer) -> list[str]:
    """Names of this rank's parameters and optimizer-state tensors (its shards, if sharded) holding NaN or inf;
    one host sync for all of them."""
    named = [(name, param) for name, param in trainer.lightning_module.named_parameters()]
    for index, optimizer in enumerate(trainer.optimizers):
        names = {id(param): name for name, param in named}
        named += [(f"optimizer {index} {key} of {names.get(id(param), '?')}", value)
                  for param, state in optimizer.state.items() for key, value in state.items()
                  if isinstance(value, torch.Tensor) and value.is_floating_point()]
    local = [tensor.to_local() if isinstance(tensor, DTensor) else tensor for _, tensor in named]
    if not local:
        return []
    # a NaN or inf makes a tensor's sum NaN or inf: one pass over it, where isfinite would also write a boolean copy
    # (4x slower on a CPU; the save waits for it). A finite tensor whose sum overflows is cleared by the exact check.
    sums = torch.stack([tensor.sum().float().to(local[0].device) for tensor in local])
    if torch.isfinite(sums).all():
        return []
    return [name for (name, _), tensor, total in zip(named, local, sums, strict=True)
            if not torch.isfinite(total) and not torch.isfinite(tensor).all()]


def disk_full(folder: Path) -> bool:
    """Whether the folder's disk, or the temporary folder Lightning stages a one-file checkpoint in, has less than
    a MiB left: where a write that failed without an OSError failed."""
    return min(shutil.disk_usage(folder).free, shutil.disk_usage(tempfile.gettempdir()).free) < 2**20


def in_units(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def os_error_in(error: BaseException | None) -> OSError | None:
    """The OSError behind a failed write: the error itself, one that a rank reported inside DCP's
    CheckpointException (``failures`` maps each failed rank to its exception and traceback), or their cause."""
    if error is None or isinstance(error, OSError):
        return error
    reported = [exception for exception, _ in error.failures.values()] if isinstance(error, CheckpointException) else []
    return next(filter(None, map(os_error_in, [*reported, error.__cause__])), None)


def replace_path(source: Path, target: Path) -> None:
    """Move ``source`` to ``target``: atomically unless either is a real folder (files and links rename over each
    other); a folder is renamed aside first, so a crash between the two renames leaves the previous checkpoint as
    ``NAME.old``."""
    nothing_there = not target.exists() and not target.is_symlink()
    if nothing_there or not (is_real_folder(source) or is_real_folder(target)):
        os.replace(source, target)
        return
    previous = target.with_name(f"{target.name}.old")
    remove_path(previous)
    os.replace(target, previous)
    os.replace(source, target)
    remove_path(previous)


def remove_path(path: Path) -> None:
    """Delete a file, a link (not what it points to) or a folder, if there is one."""
    if is_real_folder(path):
        shutil.rmtree(path)
    elif path.is_symlink() or path.exists():
        path.unlink()


def is_real_folder(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def find_last_checkpoint(log_root: Path) -> Path | None:
    """The newest ``version_*/checkpoints/last.ckpt`` under a TensorBoard log root, or a fault-tolerant job's
    ``version_*/replica_group_*/checkpoints/last.ckpt``."""
    candidates = [*log_root.glob("version_*/checkpoints/last.ckpt"),
                  *log_root.glob("version_*/replica_group_*/checkpoints/last.ckpt")]
    return max(candidates, key=lambda path: path.lstat().st_mtime) if candidates else None


def is_sharded_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` is a complete sharded checkpoint: the shards' index and Lightning's ``meta.pt``."""
    return (folder / ".metadata").is_file() and (folder / META_FILE).is_file()


def check_sharded_checkpoint(folder: Path) -> None:
    """A UserError unless ``folder`` is a complete sharded checkpoint."""
    if not is_sharded_checkpoint(folder):
        raise UserError(f"checkpoint {folder} is not a complete sharded checkpoint folder (it needs .metadata and "
                        f"{META_FILE}): pass one the fsdp or model_parallel strategy wrote, e.g. "
                        "lightning_logs/version_0/checkpoints/last.ckpt")


def read_checkpoint(path: Path, weights_only: bool = True) -> dict[str, Any]:
    """A checkpoint file (or a sharded folder's ``meta.pt``) read as data; a UserError for anything else: missing,
    unreadable, not a torch file, a pickle that asks for code, or a torch file that is not a Lightning checkpoint.
    ``weights_only=False`` (the user's ``--weights_only false``) unpickles anything: for trusted files only."""
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist: pass a .ckpt file or folder, or --ckpt_path last")
    if not os.access(path, os.R_OK):
        raise UserError(f"checkpoint {path} is not readable: fix its permissions")
    if not zipfile.is_zipfile(path):
        raise UserError(f"checkpoint {path} is not a torch checkpoint (truncated or another format): use another one")
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except RuntimeError:  # torch's reader on a zip archive it did not write
        raise UserError(f"checkpoint {path} is a zip archive but not a torch checkpoint: pass a checkpoint "
                        "written by cohort fit") from None
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL ([\w.]+)", str(error))  # torch names the global the pickle asked for
        what = f"'{found.group(1)}'" if found else "a type torch's safe loader does not allow"
        raise UserError(f"checkpoint {path} asks to run code ({what}) when loaded, so it was not loaded: Cohort reads "
                        "checkpoints as data only; use one written by cohort (fit, validate and predict "
                        "take --weights_only false for a file you trust completely)") from None
    if not isinstance(checkpoint, dict) or "pytorch-lightning_version" not in checkpoint:
        raise UserError(f"{path} is {describe(checkpoint)}, not a Lightning checkpoint: pass a checkpoint written by "
                        "cohort fit (lightning_logs/version_N/checkpoints/last.ckpt)")
    return checkpoint


def describe(content: object) -> str:
    """A few words on what a torch file that is not a Lightning checkpoint holds."""
    if isinstance(content, dict) and content and all(isinstance(value, torch.Tensor) for value in content.values()):
        return f"a bare state dict of {len(content)} tensors (weights only, no training state)"
    if isinstance(content, dict):
        return f"a dict with keys {sorted(map(str, content))[:5]}"
    return f"a {type(content).__name__}"


def check_checkpoint(path: Path, model_config: Namespace, weights_only: bool = True) -> None:
    """A UserError, before anything starts, for a checkpoint that is missing, broken, unsafe, or of another model
    (another family, or another size of this one). ``model_config`` is the config's model: class_path and init_args."""
    if path.is_dir():
        check_sharded_checkpoint(path)
    checkpoint = read_checkpoint(path / META_FILE if path.is_dir() else path, weights_only)
    family = checkpoint.get("cohort_model_class")
    if family is not None and current_class_path(family) != model_config.class_path:
        raise UserError(f"checkpoint {path} holds a {family.rsplit('.', 1)[-1]} but the config's model.class_path is "
                        f"{model_config.class_path}: use that run's config.yaml, or another checkpoint")
    saved, configured = checkpoint.get("hyper_parameters", {}), model_config.init_args
    for name in SHAPE_HYPERPARAMETERS:  # what decides the shapes of the weights
        if name in saved and name in configured and configured[name] is not None and saved[name] != configured[name]:
            raise UserError(
                f"checkpoint {path} was trained with model.{name}={saved[name]!r} but the config says "
                f"{configured[name]!r}: use that run's config.yaml, or another checkpoint"
            )


def load_training_state(trainer: L.Trainer, path: str) -> None:
    """Weights and optimizer state from one of this run's checkpoints into the running model, on every rank, as
    Lightning loads them on resume; the loops, the LR schedule and the data position stay where they are."""
    checkpoint = trainer.strategy.load_checkpoint(path, weights_only=True)  # sharded: loads in place
    number_optimizer_states(trainer, checkpoint)
    trainer.strategy.load_model_state_dict(checkpoint, strict=True)
    trainer.strategy.load_optimizer_state_dict(checkpoint)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint file or sharded folder read as data, in this one process, with its weights as full tensors
    under ``state_dict`` either way; a UserError for anything that is not a Lightning checkpoint."""
    return load_sharded_checkpoint(path) if path.is_dir() else read_checkpoint(path)


def consolidate(folder: Path, output: Path) -> dict[str, Any]:
    """Write the sharded checkpoint ``folder`` as the single file ``output``, in this one process (the whole
    checkpoint must fit in its CPU memory); returns the checkpoint."""
    check_sharded_checkpoint(folder)
    if output.exists():
        raise UserError(f"{output} already exists: remove it or name another output file")
    checkpoint = load_sharded_checkpoint(folder)
    partial = output.with_name(f"{output.name}.partial")
    torch.save(checkpoint, partial)
    partial.replace(output)
    return checkpoint


class FolderReadingCheckpointIO(TorchCheckpointIO):
    """Lightning's reader and writer of one-file checkpoints that also reads a sharded checkpoint folder, whole, in
    every process, as ``load_sharded_checkpoint`` makes it: what a strategy that loads a checkpoint whole (one
    device, DDP) restores from as if the folder had been consolidated. Each process then holds the whole checkpoint,
    as each DDP rank holds the whole model anyway."""

    def load_checkpoint(self, path: str | Path, **options: Any) -> dict[str, Any]:
        if Path(path).is_dir():  # read as data whatever weights_only says: Cohort's folders need nothing else
            return load_sharded_checkpoint(Path(path))
        return super().load_checkpoint(path, **options)


def read_sharded_folders(trainer: L.Trainer) -> None:
    """Give the trainer's strategy, if it loads a checkpoint whole through Lightning's own CheckpointIO (one device,
    DDP and the strategies built on them), a ``FolderReadingCheckpointIO`` instead, so that it resumes from a sharded
    folder too. Sharded strategies load a file or a folder of any sharding themselves; a CheckpointIO of the user's
    stays."""
    strategy = trainer.strategy
    sharded = isinstance(strategy, (FSDPStrategy, ModelParallelStrategy))
    if not sharded and type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = FolderReadingCheckpointIO()


def load_sharded_checkpoint(folder: Path) -> dict[str, Any]:
    """A sharded checkpoint folder as one single-file checkpoint in memory (weights and optimizer states as full
    tensors, laid out as a one-process run saves them); all of it must fit in this process's CPU memory."""
    check_sharded_checkpoint(folder)
    read_checkpoint(folder / META_FILE)  # refuses a meta.pt whose pickle asks for code, before Lightning reads it
    checkpoint = _load_distributed_checkpoint(folder)  # shards and meta.pt, as full tensors
    # ModelParallelStrategy saves the weights as "state_dict", FSDPStrategy as "model"; the optimizers as
    # optimizer_0, optimizer_1, ... where a single-file checkpoint has the list "optimizer_states"
    if "model" in checkpoint:
        checkpoint["state_dict"] = checkpoint.pop("model")
    optimizer_keys = sorted((key for key in checkpoint if re.fullmatch(r"optimizer_\d+", key)), key=lambda k: int(k[10:]))
    if optimizer_keys:
        checkpoint["optimizer_states"] = [checkpoint.pop(key) for key in optimizer_keys]
    return checkpoint


def name_optimizer_states(trainer: L.Trainer, checkpoint: dict[str, Any]) -> None:
    """Key each plain optimizer's state in ``checkpoint`` by parameter name, in place; sharded strategies'
    states already are."""
    names = parameter_names(trainer.lightning_module)
    states = checkpoint.get("optimizer_states", [])
    for index, optimizer in enumerate(trainer.optimizers[: len(states)]):
        if keyed_by_position(states[index]):
            states[index] = optimizer_state_by_name(states[index], optimizer, names)


def number_optimizer_states(trainer: L.Trainer, checkpoint: dict[str, Any]) -> None:
    """Key each optimizer state in ``checkpoint`` by this run's positions again, in place, for a plain optimizer
    (DDP, one device); sharded strategies load names themselves. Before the optimizers exist (a fresh resume,
    which sets them up only after this) there is nothing to match, and torch's ``load_state_dict`` pairs the
    saved parameters with the optimizer's in order."""
    if isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy)):
        return
    names = parameter_names(trainer.lightning_module)
    states = checkpoint.get("optimizer_states", [])
    for index, optimizer in enumerate(trainer.optimizers[: len(states)]):
        if not keyed_by_position(states[index]):
            states[index] = optimizer_state_by_position(states[index], optimizer, names)


def recount_micro_batches(trainer: L.Trainer, checkpoint: dict[str, Any]) -> None:
    """Lightning's count of the micro-batches in ``checkpoint``'s training epoch made, in place, what this run's
    accumulation would have counted for the same optimizer steps. Lightning ends an optimizer step, validates and
    ends an epoch by that count, and a run of another data-parallel size (the same global batch in other
    micro-batch counts) counted its own: resumed as it is, a step would end after the wrong number of micro-batches.
    Every checkpoint is written at the end of an optimizer step, where the count is steps x accumulation; the counts
    of earlier epochs, which no decision reads, keep their difference to this one's."""
    progress = checkpoint.get("loops", {}).get("fit_loop")
    if progress is None:  # a checkpoint of weights only
        return
    micro_batches = progress["epoch_loop.batch_progress"]
    optimizer_steps = progress["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["current"]
    shift = optimizer_steps["completed"] * trainer.accumulate_grad_batches - micro_batches["current"]["processed"]
    for counts in (micro_batches["current"], micro_batches["total"]):  # ready, started, processed, completed
        for name in counts:
            counts[name] += shift


def parameter_names(module: torch.nn.Module) -> dict[int, str]:
    """Parameter (by id) to its name as checkpoints store it, without wrapper modules' names."""
    return {id(param): name.replace(CHECKPOINT_WRAPPER_PREFIX, "") for name, param in module.named_parameters()}


def keyed_by_position(optimizer_state: dict[str, Any]) -> bool:
    """Whether a torch optimizer state dict numbers its parameters (torch's own) or names them (ours)."""
    return any(isinstance(params, int) for group in optimizer_state["param_groups"] for params in group["params"])


def optimizer_state_by_name(state: dict[str, Any], optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, Any]:
    """A torch optimizer state dict (parameters numbered in param-group order) with parameter names instead."""
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {
        "state": {order[position]: value for position, value in state["state"].items()},
        "param_groups": [{**group, "params": [order[position] for position in group["params"]]}
                         for group in state["param_groups"]],
    }


def optimizer_state_by_position(state: dict[str, Any], optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, Any]:
    """The inverse of ``optimizer_state_by_name`` for this optimizer: positions in its own param-group order."""
    flat = [p for group in optimizer.param_groups for p in group["params"]]
    position = {names[id(p)]: index for index, p in enumerate(flat)}
    unknown = [name for group in state["param_groups"] for name in group["params"] if name not in position]
    if unknown or len(state["param_groups"]) != len(optimizer.param_groups):
        raise UserError(f"the checkpoint's optimizer state does not fit this model (parameters {unknown[:3]}): "
                        "resume with the model config it was trained with")
    groups, start = [], 0
    for saved, current in zip(state["param_groups"], optimizer.param_groups):
        groups.append({**saved, "params": list(range(start, start + len(current["params"])))})
        start += len(current["params"])
    return {"state": {position[name]: value for name, value in state["state"].items()}, "param_groups": groups}
