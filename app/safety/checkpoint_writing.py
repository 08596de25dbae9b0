"""Writing checkpoints: ``RunCheckpoint``, which never leaves a half-written or a poisoned checkpoint in place, the
``last.ckpt`` link replaced atomically, and the copy that a background write (``checkpoint.async_save``) writes as
the strategy itself would. Reading checkpoints is checkpoint_reading.py's; the line a failed write stops with,
checkpoint_write_failures.py's."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any
from weakref import proxy

import lightning as L
import torch
import torch.distributed.checkpoint
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerStatus
from torch.distributed.tensor import DTensor

from app.safety.async_checkpoints import BackgroundWriter, PendingSave
from app.safety.atomic_paths import remove_path, replace_path
from app.safety.checkpoint_reading import META_FILE, recount_micro_batches
from app.safety.checkpoint_write_failures import write_error_number, write_failed
from app.safety.optimizer_state_keys import name_optimizer_states, number_optimizer_states
from core.errors import UserError
from core.run_plan import run_plan_of


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
