"""Preemption that is safe across ranks: checkpoint at one agreed step, requeue, resume without the user.

SLURM warns a job before it ends it (``#SBATCH --signal=USR1@90``, or ``scancel --signal=USR1``). The signal
handler only records the request: a handler that saved there and then would save one rank in the middle of a step
while the others go on. At each optimizer step the ranks combine their requests with one small all-reduce, so all
of them stop after the same step; ``last.ckpt`` is written at that step (by the checkpoint callback when training
ends, sharded or not), then rank 0 asks SLURM to requeue the job. The requeued job runs the same batch script,
whose ``--ckpt_path last`` resumes from that checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
from types import FrameType

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info


class PreemptionCheckpoint(Callback):
    def __init__(self, signal_name: str = "SIGUSR1", requeue: bool = True) -> None:
        """
        Args:
            signal_name: the signal that announces preemption (SLURM's --signal, or scancel --signal).
            requeue: ask SLURM to requeue the job after the checkpoint (only inside a SLURM job).
        """
        self.signum = signal.Signals[signal_name]
        self.requeue = requeue
        self.requested = False
        self.stopped_for_preemption = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        signal.signal(self.signum, self._record_request)
        # the flag travels through a CPU (gloo) group: on NCCL a GPU tensor read back every step would stall the
        # device queue once per step
        self._group = None
        if dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        then = "requeue the job" if self.requeue and "SLURM_JOB_ID" in os.environ else "stop"
        rank_zero_info(f"preemption: {self.signum.name} will checkpoint at the next step and {then}")

    def _record_request(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True  # nothing else is safe inside a signal handler

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: object, batch: object,
                           batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches != 0:
            return  # only optimizer-step boundaries are resumable points
        requested = torch.tensor([float(self.requested)])
        if self._group is not None:
            dist.all_reduce(requested, op=dist.ReduceOp.MAX, group=self._group)  # any rank's signal stops all here
        if requested.item() > 0:
            self.stopped_for_preemption = True
            trainer.should_stop = True  # the checkpoint callback writes last.ckpt for this step as training ends
            rank_zero_info(f"preemption: stopping after step {trainer.global_step} to checkpoint and requeue")

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After training ended and last.ckpt was written: put the job back in the queue."""
        job_id = os.environ.get("SLURM_JOB_ID")
        if not (self.stopped_for_preemption and self.requeue and job_id and trainer.is_global_zero):
            return
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"scontrol requeue {job_id} failed: {result.stderr.strip()}; the checkpoint is saved, "
                               "resubmit the job with --ckpt_path last")
        rank_zero_info(f"preemption: job {job_id} requeued; it resumes from last.ckpt")
