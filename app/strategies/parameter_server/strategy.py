"""Asynchronous training through a parameter server, chosen as ``trainer.strategy`` (configs/trainer/async_ps_cpu.yaml,
async_ps_gpu_bf16.yaml): rank 0 is the server, every other rank a worker, and no rank ever waits for another's step.

    server (rank 0)  holds the weights, the optimizer and its schedule, and the version: the updates applied so far.
                     It applies each worker's gradient as it arrives (one optimizer step, with clipping and the
                     bad-step guard), replies to that worker alone with the new weights, validates and checkpoints.
    worker (1..N)    asks the server which global batch to read, computes that batch's gradient (forward and
                     backward over its micro-batches) on the weights it last pulled, pushes it tagged with their
                     version, and goes on with the weights the reply brings.

Each update is one global batch of ``data.global_batch_size`` samples computed by one worker, so the batch size, the
learning rate and its schedule (counted in updates) mean what they mean in a synchronous run. The server hands out
the global batches of the synchronous stream (datamodules/samplers.py) in order, one to whichever worker asks next:
every sample is read by exactly one worker per pass, whatever the workers' speeds, and a batch whose gradient is
dropped is handed out again.

Staleness. A gradient computed on version v and arriving at version V is V - v updates stale. Up to
``max_staleness`` (S) it is applied as it is; beyond, the ``staleness_policy`` decides: ``drop`` discards it, or
``scale`` applies it with the learning rate divided by its staleness (staleness-aware async SGD, Zhang et al. 2016).
``stale_synchronous`` adds the stale-synchronous-parallel bound (Ho et al. 2013): a worker that has pushed more than
S batches more than the slowest worker still training waits for its reply until that one catches up. With S = 0 and
``drop`` every applied gradient is fresh, so the run is plain serial SGD on global batches (the tests compare it with
a synchronous run). The server logs to TensorBoard, every ``trainer.log_every_n_steps`` updates, the staleness of
the applied gradients (histogram, mean, max), the updates applied and dropped, and each worker's tokens/s; the
end-of-run summary says the same for the whole run.

Messages: app/strategies/parameter_server/protocol.py; the two sides: server.py and worker.py beside it; the settings
the server reads: settings.py.

Checkpoints and resume. Only the server saves: its weights, optimizer, schedule and version (Lightning's
``global_step``), and here the next batch to hand out and the batches handed out but not applied, which a resumed
run hands out first. ``--ckpt_path last`` so resumes every update applied before the checkpoint and reads every
batch not applied; it is not bitwise the run that was not stopped, since which worker's gradient lands when depends
on timing (a synchronous run resumes bitwise). Preemption (SIGUSR1, SIGTERM) is heard by each rank on its own: the
server checkpoints after the update it is applying and stops; a worker stops after its step. A server that stops
answers every worker's next message with "stop".

Failures. A worker that dies or hangs stops the server: the server hears from every worker at least once per step,
so a worker silent for ``timeout`` (or none heard at all for that long) ends the run with one line naming it; the
others then lose the server and stop too. A server that dies ends every worker at its next message.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, Checkpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.constants import default_pg_timeout
from torchmetrics import Metric

from app.observability.monitor import RankMonitor
from app.strategies.gradient_compression import GradientCompression
from app.strategies.local_updates import LocalUpdates
from app.strategies.parameter_server.protocol import SERVER_RANK
from app.strategies.parameter_server.server import ParameterServer, Push, Pushes
from app.strategies.parameter_server.settings import ParameterServerSettings, check_staleness
from app.strategies.parameter_server.worker import Worker
from core.errors import UserError
from datamodules.samplers import GlobalBatchSampler


class ParameterServerStrategy(DDPStrategy):
    """DDPStrategy's processes and placement, without DistributedDataParallel: the ranks meet only at setup and at
    exit, and in between the server and the workers exchange messages."""

    def __init__(self, max_staleness: int = 4, staleness_policy: str = "scale", stale_synchronous: bool = False,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout) -> None:
        """
        Args:
            max_staleness: S, the updates a gradient may lag behind and still be applied as it is (0: only fresh).
            staleness_policy: what happens to a gradient more than S updates stale: "drop" it (its batch is handed
                out again) or "scale" the learning rate of its update by 1 / staleness.
            stale_synchronous: a worker that has pushed more than S batches beyond the slowest one waits.
            process_group_backend: the backend of the process group the ranks start in (messages always go over
                gloo).
            timeout: a worker silent this long (dead or hung) ends the run; also the longest a worker waits for the
                server's reply, which includes the server's validation and checkpoint writes.
        """
        self.settings = ParameterServerSettings(max_staleness, staleness_policy, stale_synchronous,
                                                message_timeout=timeout or default_pg_timeout)
        self._group: dist.ProcessGroup | None = None  # the messages' gloo group, once the ranks have met
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self.server = ParameterServer(self.settings)
        self.worker: Worker | None = None  # on worker ranks, from setup on

    @property
    def world_size(self) -> int:
        """1 once the ranks have met: Lightning's loop then runs each rank on its own. With more, it would broadcast
        rank 0's SIGTERM flag before every batch (lightning/pytorch/loops/training_epoch_loop.py), which would make
        every rank wait for the server's step; ``dist.get_world_size()`` still counts the ranks."""
        return 1 if self._group is not None else super().world_size

    @property
    def is_server(self) -> bool:
        return self.global_rank == SERVER_RANK

    # ----- setup: one process group for the messages, each rank's role -----
    def setup_environment(self) -> None:
        super().setup_environment()  # the process group every rank joins
        self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        trainer = self.lightning_module.trainer
        # the server's bookkeeping is a callback on every rank, so that Lightning restores it on every rank alike
        trainer.callbacks = [callback for callback in trainer.callbacks if not works_in_lockstep(callback)]
        trainer.callbacks.append(self.server)
        if not self.is_server:  # only the server saves and validates: a worker's weights are a stale copy
            trainer.callbacks = [callback for callback in trainer.callbacks if not isinstance(callback, Checkpoint)]

    def setup(self, trainer: L.Trainer) -> None:
        super().setup(trainer)
        for metric in self.lightning_module.modules():  # the server validates alone: no metric gathers over ranks
            if isinstance(metric, Metric):
                metric.sync_on_compute = metric._to_sync = metric.dist_sync_on_step = False
        if self.is_server:  # its batches are pushes, each a whole optimizer step (its run plan says so)
            return
        self.worker = Worker(self.lightning_module, self._group)
        trainer.limit_val_batches = 0
        trainer.num_sanity_val_steps = 0
        trainer.fit_loop.epoch_loop.max_steps = -1  # the server decides when training ends: it counts the updates
        trainer.fit_loop.max_epochs = -1

    def configure_ddp(self) -> None:
        """No DistributedDataParallel: nothing is all-reduced, and the workers pull their weights from the server."""

    def process_dataloader(self, dataloader: object) -> object:
        """The training stream: the server's batches are the workers' pushes; a worker reads the global batches the
        server hands it."""
        sampler = getattr(dataloader, "sampler", None)
        if not isinstance(sampler, GlobalBatchSampler):
            return dataloader  # validation and test: the server reads all of them
        if self.is_server:
            return Pushes(self.server, sampler.steps_per_epoch)
        assert self.worker is not None
        sampler.assigned_steps = self.worker.assigned_steps
        return dataloader

    # ----- the ranks do not meet: Lightning's collectives are this rank's own value -----
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        return tensor

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor.unsqueeze(0)

    # ----- training -----
    def on_train_start(self) -> None:
        if self.is_server:
            self.server.start(self._group, self.lightning_module)
        else:
            assert self.worker is not None
            self.worker.pull()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.is_server:
            assert self.worker is not None
            loss = super().training_step(*args, **kwargs)
            self.worker.add_loss(loss)
            return loss
        push: Push = args[0]
        module = self.lightning_module
        module.log("train/loss", push.loss, prog_bar=True)
        module.log("lr", module.lr_schedulers().get_last_lr()[0])
        return push.loss.clone()  # the worker's loss; backward below installs its gradient

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not self.is_server:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)  # the hooks, as around a backward
        self.server.install_gradient()
        return self.precision_plugin.post_backward(closure_loss, module)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if not self.is_server:
            assert self.worker is not None
            closure()  # the step's last micro-batch (Lightning has run the others)
            self.worker.push_and_pull()
            return None
        with self.server.scaled_learning_rate(optimizer):
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.server.applied()
        return output

    def on_train_end(self) -> None:
        if self.is_server:
            self.server.finish()
        elif self.worker is not None:
            self.worker.goodbye()


def works_in_lockstep(callback: Callback) -> bool:
    """Callbacks that work on DDP's all-reduce or hold the ranks together at every step (the monitor's
    all_gather), which an asynchronous run has neither of."""
    return isinstance(callback, (GradientCompression, LocalUpdates, RankMonitor))


def check_asynchronous(config: Any, world_size: int, precision: str) -> None:
    """What the parameter server cannot run with, refused before anything starts (on the config alone)."""
    options = config.trainer.strategy.init_args
    check_staleness(options.max_staleness, options.staleness_policy)
    if world_size < 2:
        raise UserError(f"trainer.strategy ParameterServerStrategy needs a server and at least one worker: "
                        f"{world_size} process is too few; set trainer.devices (or nodes) to 2 or more")
    if precision == "16-mixed":
        raise UserError("trainer.precision=16-mixed under the parameter server: fp16's loss scale lives on each "
                        "worker and its skipped steps on the server; use bf16-mixed or 32-true")
    bad_steps = getattr(config, "bad_steps", None)
    if bad_steps is not None and bad_steps.action == "rollback":
        raise UserError("bad_steps.action=rollback reloads a checkpoint into every rank together, which "
                        "asynchronous ranks never are: use stop or skip")
    for section, default in (("local_updates", "sync"), ("gradient_compression", "none")):
        options = getattr(config, section, None)
        if options is not None and options.method != default:
            raise UserError(f"{section}.method={options.method} works on DDP's all-reduce, which the parameter "
                            f"server has none of: set {section}.method {default}")
