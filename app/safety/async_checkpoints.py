"""Checkpoints written in the background (``checkpoint.async_save``): the training loop stops only to copy the
checkpoint into CPU memory; a thread writes that copy while training goes on.

The copy is the state of the step that was saved: torch's checkpoint stager copies every tensor, on a GPU or
already on the CPU, into CPU buffers before the loop goes on (pinned buffers on a GPU, so the copy runs at the
bus's speed). The buffers are kept for the next save, which stages into them only after this write is over: one
write at a time.

A sharded checkpoint is written by torch.distributed.checkpoint, whose collectives then run in the writing thread of
every rank. They go through a gloo group of their own: on the group the training loop uses, they would interleave
with the loop's all-reduces in a different order on each rank and deadlock. What the ranks agree on (is every rank's
write over, and did every one succeed) is decided on the training thread, through one small all-reduce on a CPU
group, at a point every rank reaches alike.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from app.safety import cpu_group_over_every_rank


@dataclass
class PendingSave:
    """A checkpoint whose write has started and is not in place yet: rank 0 moves ``partial`` to ``target``, then
    runs ``after_write`` (the ``last.ckpt`` link, the removal of the oldest checkpoint), only once every rank's write
    is over and every one succeeded. Until then the previous checkpoint is the newest, which ``kept`` names (and
    ``resume`` says how to resume from) should this one fail."""

    step: int
    partial: Path
    target: Path
    kept: str
    resume: str
    written: Future[int] | None  # this rank's write: 0, or the error number it failed with; None: nothing to write
    started: float  # time.perf_counter() when the save began
    blocking_seconds: float = 0.0  # how long the training loop has waited for this save so far
    after_write: list[Callable[[], None]] = field(default_factory=list)

    def written_here(self) -> bool:
        return self.written is None or self.written.done()

    def error_number(self) -> int:
        """0 once this rank's write succeeded, else its error number (EIO for an error that is not the disk's: the
        rank it happened on raises it as it is after the ranks have agreed); waits for the write."""
        if self.written is None:
            return 0
        return errno.EIO if self.written.exception() is not None else self.written.result()

    def raise_unexpected_error(self) -> None:
        """Raise the write's own error, with its traceback, if it failed with anything but an error number."""
        if self.written is not None and self.written.exception() is not None:
            self.written.result()


class BackgroundWriter:
    """One checkpoint at a time written in a thread of its own; holds the CPU buffers the checkpoint is copied into
    and, in a run of several processes, the two gloo groups: one for the writing threads, one for agreeing."""

    def __init__(self) -> None:
        self._stager: DefaultStager | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._write_group: dist.ProcessGroup | None = None  # the writing threads' collectives (sharded checkpoints)
        self._agreement_group: dist.ProcessGroup | None = None  # the training thread's agreement on the outcome

    def start(self, trainer: L.Trainer, checkpoint: dict[str, Any] | None,
              write: Callable[[dict[str, Any], dist.ProcessGroup | None], int]) -> Future[int] | None:
        """Copy ``checkpoint`` (this rank's part; None where this rank writes nothing) into CPU memory and return at
        once, while ``write(copy, group)`` runs in the background, its collectives on ``group``. Every rank calls
        this at the same save."""
        if self._thread is None:
            self._meet(trainer)
        if checkpoint is None:
            return None
        return self._thread.submit(write, self._stager.stage(checkpoint), self._write_group)

    def _meet(self, trainer: L.Trainer) -> None:
        """The buffers, the thread and the groups, made once, at the first save: every rank gets there alike."""
        on_gpu = trainer.strategy.root_device.type == "cuda"
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=on_gpu, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=on_gpu))
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        if trainer.world_size > 1:  # a parameter server's ranks save alone: its world size is 1 once they have met
            self._write_group = dist.new_group(backend="gloo")
            self._agreement_group = cpu_group_over_every_rank()

    def agree(self, trainer: L.Trainer, written_here: bool, error_number: int) -> tuple[bool, int]:
        """Whether every rank's write is over, and the worst error number of all ranks (0: all succeeded). A CPU
        tensor through gloo: on NCCL a device tensor read back at every step end would stall the device's queue."""
        if self._agreement_group is None:
            return written_here, error_number
        outcome = torch.tensor([0 if written_here else 1, error_number])
        dist.all_reduce(outcome, op=dist.ReduceOp.MAX, group=self._agreement_group)
        return outcome[0].item() == 0, int(outcome[1].item())

    def close(self) -> None:
        """Let the CPU copy's memory and the thread go once training is over; a later save meets again."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._stager.close()
        self._stager = self._thread = self._write_group = self._agreement_group = None
