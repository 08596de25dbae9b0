"""Preemption that is safe across ranks: checkpoint at one agreed step, then requeue or stop, never lose the steps.

SLURM warns a job before it ends it (``#SBATCH --signal=USR1@90``, or ``scancel --signal=USR1``); Kubernetes,
torchrun's agent when it shuts down, and SLURM without ``--signal`` send SIGTERM. The signal handler only records
the request: a handler that saved there and then would save one rank in the middle of a step while the others go
on. At each optimizer step the ranks combine their requests with one small all-reduce, so all of them stop after
the same step; ``last.ckpt`` is written at that step (by the checkpoint callback when training ends, sharded or
not). After SIGUSR1 inside a SLURM job rank 0 then asks SLURM to requeue the job, whose batch script resumes with
``--ckpt_path last``. Otherwise the run stops: ``cohort`` exits with 128 + the signal's number (143 for SIGTERM)
and one line saying how to resume, so a scheduler never takes the stop for success.

Ctrl-C (SIGINT) stops the same way (exit 130): Lightning's own handling of it (the KeyboardInterrupt in its
``_call_and_handle_interrupt``) tears the run down at once, without a checkpoint of the step reached. A terminal sends
it to every process in its foreground group, so to every rank that Lightning's launcher started; torchrun's agent,
whose workers have sessions of their own, hears it and passes it on to each. A second Ctrl-C ends every process at
once, without the checkpoint: the terminal's second SIGINT, or the SIGTERM that torchrun's agent sends its workers
when its own shutdown is interrupted.

A rank can also fail to reach that step: blocked in a collective with a peer that hangs. Python runs the handler
only between bytecodes, never while a collective waits, so a thread hears each signal through the wakeup fd the
moment it arrives; if the process is still alive ``grace_seconds`` later, it ends it with the same exit code and one
line, before the scheduler's SIGKILL. Checkpoint writes go to ``.partial`` files first, so an exit mid-write loses
nothing but that write. Under ``checkpoint.async_save`` the stop first waits for a checkpoint still being written in
the background and puts it in place, then writes the stop's step: the grace time covers both.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import FrameType
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from app.safety import cpu_group_over_every_rank
from core.errors import check_ranges
from core.run_plan import run_plan_of


class PreemptionCheckpoint(Callback):
    def __init__(self, requeue_signal: str = "SIGUSR1", stop_signal: str = "SIGTERM", requeue: bool = True,
                 grace_seconds: float = 25.0) -> None:
        """
        Args:
            requeue_signal: checkpoint, then requeue inside a SLURM job (SLURM's --signal, or scancel --signal).
            stop_signal: checkpoint, then stop with a non-zero exit (what Kubernetes and torchrun's agent send).
            requeue: ask SLURM to requeue the job after a requeue_signal (only inside a SLURM job).
            grace_seconds: after either signal, the time the ranks get to reach the agreed step and save it before
                the process ends without that checkpoint. Kubernetes and torchrun's agent send SIGKILL 30 s after
                SIGTERM, so the default leaves 5 s to say so; SLURM's --signal=USR1@90 allows up to about 85.
        """
        check_ranges("preemption", {"grace_seconds": (grace_seconds > 0, "> 0")}, locals())
        self.requeue_signal = signal.Signals[requeue_signal]
        self.stop_signal = signal.Signals[stop_signal]
        self.requeue = requeue
        self.grace_seconds = grace_seconds
        self.stop_requested = 0  # the number of the stop signal (stop_signal or SIGINT) received, 0 for none
        self.requeue_requested = 0  # the requeue signal's number once received
        self.stopped_by: signal.Signals | None = None  # set once all ranks stopped for a signal
        self.requeued = False
        self._interrupt_handler: Any = None  # SIGINT's handler before training, put back after it

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # replaces Lightning's own SIGTERM handler, which stops the run without a checkpoint and exits 0, and the
        # interpreter's SIGINT one, whose KeyboardInterrupt Lightning answers by ending the run without one
        self._interrupt_handler = signal.getsignal(signal.SIGINT)
        for signum in (self.requeue_signal, self.stop_signal, signal.SIGINT):
            signal.signal(signum, self._record_request)
        heard, self._wakeup = socket.socketpair()  # kept: the socket closes when collected
        self._wakeup.setblocking(False)  # the interpreter's C-level handler writes each signal's number here at once
        signal.set_wakeup_fd(self._wakeup.fileno())
        threading.Thread(target=self._end_after_grace, args=(heard, trainer.is_global_zero), daemon=True,
                         name="preemption-grace").start()
        self._group = None  # an asynchronous run's ranks stop on their own word (app/strategies/parameter_server/)
        if dist.is_available() and dist.is_initialized() and not run_plan_of(trainer.lightning_module).asynchronous:
            self._group = cpu_group_over_every_rank()
        then = "requeue the job" if self.requeue and "SLURM_JOB_ID" in os.environ else "stop"
        rank_zero_info(f"preemption: {self.requeue_signal.name} will checkpoint at the next step and {then}; "
                       f"{self.stop_signal.name} and Ctrl-C (SIGINT) will checkpoint and stop")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and self._interrupt_handler is not None:  # training is over: Ctrl-C interrupts again
            signal.signal(signal.SIGINT, self._interrupt_handler)

    def _record_request(self, signum: int, frame: FrameType | None) -> None:
        # only recorded: the ranks act on it together at the next step end
        if signum == self.requeue_signal:
            self.requeue_requested = signum
        else:
            self.stop_requested = max(self.stop_requested, signum)

    def _end_after_grace(self, heard: socket.socket, is_global_zero: bool) -> None:
        """Waits for a stop or requeue signal, then ``grace_seconds``; a process still alive then is stuck. A second
        stop after a Ctrl-C ends the process at once."""
        stops = (self.stop_signal, signal.SIGINT)
        signum = 0
        while signum not in (self.requeue_signal, *stops):
            signum = heard.recv(1)[0]
        interrupted = signum == signal.SIGINT
        deadline = time.monotonic() + self.grace_seconds
        while (left := deadline - time.monotonic()) > 0:
            heard.settimeout(left)
            try:
                later = heard.recv(1)[0]
            except TimeoutError:
                break
            if interrupted and later in stops:
                by = ("a second Ctrl-C (SIGINT)" if later == signal.SIGINT
                      else f"{signal.Signals(later).name} after Ctrl-C")  # torchrun's agent, interrupted again
                if is_global_zero:
                    print(f"cohort: stopped at once by {by}, without the checkpoint of the step reached; resume from "
                          "the newest checkpoint with the same command and --ckpt_path last", file=sys.stderr,
                          flush=True)
                os._exit(128 + signal.SIGINT)
            interrupted = interrupted or later == signal.SIGINT
        if is_global_zero:
            print(f"cohort: stopped by {signal.Signals(signum).name} without a checkpoint: the ranks did not reach a "
                  f"step and save it within preemption.grace_seconds={self.grace_seconds:g} (a rank blocked in a "
                  "collective, or a step and save longer than that); resume from the newest checkpoint with the same "
                  "command and --ckpt_path last", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: object, batch: object,
                           batch_idx: int) -> None:
        if not run_plan_of(pl_module).ends_optimizer_step(batch_idx):
            return  # only optimizer-step boundaries are resumable points
        requested = torch.tensor([float(self.stop_requested), float(self.requeue_requested)])
        if self._group is not None:  # any rank's signal stops all here
            dist.all_reduce(requested, op=dist.ReduceOp.MAX, group=self._group)
        stop, requeue = (int(value) for value in requested.tolist())
        if stop or requeue:
            self.stopped_by = signal.Signals(stop or requeue)  # a stop outranks a requeue
            trainer.should_stop = True  # the checkpoint callback writes last.ckpt for this step as training ends
            rank_zero_info(f"preemption: {self.stopped_by.name} received, stopping after step {trainer.global_step} "
                           "to checkpoint")

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After training ended and last.ckpt was written: put the job back in the queue."""
        job_id = os.environ.get("SLURM_JOB_ID")
        if not (self.stopped_by == self.requeue_signal and self.requeue and job_id):
            return
        self.requeued = True
        if not trainer.is_global_zero:
            return
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"scontrol requeue {job_id} failed: {result.stderr.strip()}; the checkpoint is saved, "
                               "resubmit the job with --ckpt_path last")
        rank_zero_info(f"preemption: job {job_id} requeued; it resumes from last.ckpt")

    def stop_message(self, trainer: L.Trainer) -> str | None:
        """After fit: the line to exit with when a signal stopped the run and nothing will resume it by itself."""
        if self.stopped_by is None or self.requeued:
            return None
        checkpoint = trainer.checkpoint_callback.last_model_path if trainer.checkpoint_callback else ""
        saved = f"{os.path.normpath(checkpoint)} holds that step" if checkpoint else "no checkpoint callback saved it"
        return (f"stopped by {self.stopped_by.name} after step {trainer.global_step}; {saved}: resume with the same "
                "command and --ckpt_path last")


def preemption_callback(trainer: L.Trainer) -> PreemptionCheckpoint | None:
    """The run's PreemptionCheckpoint (every cohort run has one)."""
    return next((callback for callback in trainer.callbacks if isinstance(callback, PreemptionCheckpoint)), None)


def stopped_by_signal(trainer: L.Trainer) -> bool:
    """Whether the ranks stopped this run for a preemption signal."""
    callback = preemption_callback(trainer)
    return callback is not None and callback.stopped_by is not None
