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

Messages. Point-to-point sends and receives over a gloo process group: the server receives from any worker
(``dist.recv`` without a source), then answers that worker alone. A GPU run stages the flat vectors through the CPU
for gloo, which keeps NCCL's stream out of it. ``torch.distributed.rpc`` would also do, but it is in maintenance
mode, needs its own agent initialised beside the process group, and its futures add a thread pool where the
server's loop is one thread answering one message at a time. Each message is a header of HEADER_FIELDS numbers,
then, for a push or weights, one flat float32 vector: the parameters (or their gradients) and the floating-point
buffers (a BatchNorm's running statistics travel with the push that updated them and come back with the weights).

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

import time
import warnings
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, Checkpoint
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed.constants import default_pg_timeout
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torchmetrics import Metric

from app.tensorboard_layout import log_final_val_loss, tensorboard_loggers
from core.errors import UserError, check_ranges
from core.run_plan import run_plan_of
from datamodules.samplers import GlobalBatchSampler

STALENESS_POLICIES = ("drop", "scale")
SERVER_RANK = 0
# a header: what the message is, the weights' version, a global batch's index, samples, the worker's mean loss;
# float64 holds every integer the run counts exactly
HEADER_FIELDS = 5
ASK_STEP, PULL, PUSH, GOODBYE = 1, 2, 3, 4  # worker to server
STEP, WEIGHTS, STOP = 5, 6, 7  # server to worker


# TensorBoard's CUSTOM SCALARS tab for an asynchronous run: tags are regular expressions, matched from the start
ASYNC_LAYOUT = {"asynchronous": {
    "throughput — every worker": ["Multiline", [r"async/\w+_per_second/rank\d+$"]],
    "staleness of the applied gradients — mean, max": ["Multiline", [r"async/staleness_(mean|max)$"]],
    "updates — applied, dropped": ["Multiline", [r"async/updates_(applied|dropped)$"]],
}}


class WorkerLost(RuntimeError):
    """A worker stopped answering: dead or hung. The message names it and says how to go on."""


@dataclass
class Push:
    """A worker's gradient for one global batch, as the server's training loop receives it (its "batch")."""

    worker: int
    staleness: int  # updates applied since the version of the weights it was computed on
    step: int  # the global batch it was computed on
    loss: torch.Tensor
    gradient: torch.Tensor  # the flat gradients, then the floating-point buffers after the worker's forward


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
        check_staleness(max_staleness, staleness_policy)
        self._group: dist.ProcessGroup | None = None  # the messages' gloo group, once the ranks have met
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self.max_staleness = max_staleness
        self.staleness_policy = staleness_policy
        self.stale_synchronous = stale_synchronous
        self.server = ParameterServer(self)
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

    @property
    def message_timeout(self) -> float:
        return (self._timeout or default_pg_timeout).total_seconds()

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
        plan = run_plan_of(self.lightning_module)
        if self.is_server:  # its batches are pushes, each a whole optimizer step
            server_plan = replace(plan, micro_batch_size=plan.global_batch_size)
            self.lightning_module.run_plan = trainer.datamodule.run_plan = server_plan
            trainer.accumulate_grad_batches = 1
            if isinstance(trainer.val_check_interval, int):
                trainer.val_check_interval //= plan.accumulation  # the CLI counted the workers' micro-batches
            return
        self.worker = Worker(self, self._group)
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
            self.server.start(self._group)
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
    # imported here: these modules import what they time or hook into, this one among them
    from app.gradient_compression import GradientCompression
    from app.local_updates import LocalUpdates
    from app.monitoring import RankMonitor

    return isinstance(callback, (GradientCompression, LocalUpdates, RankMonitor))


def is_asynchronous(trainer: L.Trainer) -> bool:
    """Whether the ranks of this run train without meeting (so a callback decides on its own rank's word)."""
    return isinstance(trainer.strategy, ParameterServerStrategy)


def flat_state(module: torch.nn.Module, parameters_or_gradients: torch.Tensor) -> torch.Tensor:
    """One float32 CPU vector: the given flat parameters or gradients, then the floating-point buffers."""
    buffers = [buffer.detach().flatten().float() for buffer in floating_buffers(module)]
    return torch.cat([parameters_or_gradients.detach().float(), *buffers]).cpu()


def floating_buffers(module: torch.nn.Module) -> list[torch.Tensor]:
    return [buffer for buffer in module.buffers() if buffer.is_floating_point()]


def flat_sizes(module: torch.nn.Module) -> tuple[int, int]:
    """The numbers in a flat vector that ``flat_state`` makes: the parameters', and all of it with the buffers."""
    parameters = sum(param.numel() for param in module.parameters())
    return parameters, parameters + sum(buffer.numel() for buffer in floating_buffers(module))


@torch.no_grad()
def load_buffers(module: torch.nn.Module, flat: torch.Tensor) -> None:
    """The floating-point buffers from the tail of a flat vector that ``flat_state`` made."""
    buffers = floating_buffers(module)
    for buffer, values in zip(buffers, flat.split([buffer.numel() for buffer in buffers])):
        buffer.copy_(values.view_as(buffer))


def send_header(kind: int, group: dist.ProcessGroup, destination: int, version: int = 0, step: int = -1,
                samples: int = 0, loss: float = 0.0) -> None:
    header = torch.tensor([kind, version, step, samples, loss], dtype=torch.float64)
    dist.send(header, dst=destination, group=group)


class Pushes:
    """The server's training "dataloader": each item is the next gradient to apply. Its length is one pass over
    the data in updates, so that Lightning's epochs and ``check_val_every_n_epoch`` keep their meaning."""

    def __init__(self, server: ParameterServer, updates_per_pass: int) -> None:
        self.server = server
        self.updates_per_pass = updates_per_pass

    def __len__(self) -> int:
        return self.updates_per_pass

    def __iter__(self) -> Iterator[Push]:
        for _ in range(self.updates_per_pass):
            push = self.server.next_push()
            if push is None:
                return
            yield push

    def state_dict(self) -> dict[str, Any]:
        """The data position: the next batch never handed out, and those handed out but not applied (dropped, or
        in flight when the checkpoint was taken), which a resumed run hands out first."""
        server = self.server
        unapplied = sorted([*server.handed_again, *(step for steps in server.in_flight.values() for step in steps)])
        return {"next_step": server.next_step, "unapplied_steps": unapplied}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.server.next_step = state["next_step"]
        self.server.handed_again = deque(state["unapplied_steps"])


class ParameterServer(Callback):
    """The server's side: answering the workers, the staleness policy, what it logs and what it checkpoints. A
    callback on every rank (Lightning saves and restores callbacks alike everywhere); it acts on the server only."""

    def __init__(self, strategy: ParameterServerStrategy) -> None:
        self.strategy = strategy
        self.next_step = 0  # the next global batch never handed out
        self.handed_again: deque[int] = deque()  # handed out but never applied: dropped, or lost by a stop
        self.in_flight: dict[int, deque[int]] = {}  # per worker, the batches handed to it and not pushed yet
        self.staleness_counts: Counter[int] = Counter()  # of every gradient applied, the whole run
        self.dropped = 0
        self.scaled = 0  # applied with the learning rate divided by their staleness
        self.window: dict[str, Any] = {}
        self._current: Push | None = None

    # ----- the loop: one message at a time -----
    def start(self, group: dist.ProcessGroup) -> None:
        trainer = self.strategy.lightning_module.trainer
        self.group = group
        self.version = trainer.global_step
        self.workers = list(range(1, dist.get_world_size()))
        self.training = set(self.workers)  # those that have not said goodbye
        self.pushes: Counter[int] = Counter()  # per worker, this run: its clock under the stale-synchronous bound
        self.held: list[int] = []  # workers whose reply waits for the slowest (stale_synchronous)
        # per worker, the seconds the server has waited for messages since that worker's last one: a worker waits
        # for the server while it validates or checkpoints, or holds its reply, and is silent then for good reason
        self.silent = {worker: 0.0 for worker in self.workers}
        for worker in self.workers:
            self.in_flight.setdefault(worker, deque())
        self.stopping = False
        self._parameters = [param for param in self.strategy.lightning_module.parameters()]
        self._parameter_count, self._flat_size = flat_sizes(self.strategy.lightning_module)
        self.tokens: Counter[int] = Counter()  # per worker, this run
        self.started = time.monotonic()
        self._start_window()
        if trainer.is_global_zero:  # the monitor, which writes the layout of synchronous runs, is off here
            for logger in tensorboard_loggers(trainer):
                logger.experiment.add_custom_scalars(ASYNC_LAYOUT)

    def next_push(self) -> Push | None:
        """Answers the workers' other messages until a gradient to apply arrives; None once every worker has left."""
        strategy = self.strategy
        while self.training:
            worker, header = self._receive()
            kind = int(header[0])
            if kind == ASK_STEP:
                self._hand_out(worker)
            elif kind == PULL:
                self._send_weights(worker)
            elif kind == GOODBYE:
                self.training.discard(worker)
                self._release_held()
            elif kind == PUSH:
                push = self._receive_push(worker, header)
                if push.staleness > strategy.max_staleness and strategy.staleness_policy == "drop":
                    self.dropped += 1
                    self.window["dropped"] += 1
                    self.handed_again.append(push.step)
                    self._reply(worker)
                    continue
                self._current = push
                return push
        rank_zero_info(f"parameter server: every worker has left, so training stops at update {self.version}")
        strategy.lightning_module.trainer.should_stop = True
        return None

    def _receive(self) -> tuple[int, torch.Tensor]:
        header = torch.empty(HEADER_FIELDS, dtype=torch.float64)
        timeout = self.strategy.message_timeout
        waiting_since = time.monotonic()
        try:
            worker = dist.recv(header, src=None, group=self.group)
        except RuntimeError as error:
            if "Timed out" not in str(error):
                raise
            silent = ", ".join(f"rank {worker}" for worker in sorted(self.training))
            raise WorkerLost(f"parameter server: no worker has sent anything for trainer.strategy.init_args.timeout="
                             f"{timeout:g} s (silent: {silent}): they died or hang; their own output or the "
                             "scheduler's log says why; resume with the same command and --ckpt_path last") from error
        waited = time.monotonic() - waiting_since
        for other in self.training:
            self.silent[other] = 0.0 if other == worker or other in self.held else self.silent[other] + waited
            if self.silent[other] > timeout:
                raise WorkerLost(f"parameter server: worker rank {other} has sent nothing for {self.silent[other]:.0f} "
                                 f"s of the server's waiting, more than trainer.strategy.init_args.timeout={timeout:g} "
                                 "s: it died or hangs (its own output or the scheduler's log says why); resume with "
                                 "the same command and --ckpt_path last")
        return worker, header

    def _receive_push(self, worker: int, header: torch.Tensor) -> Push:
        flat = torch.empty(self._flat_size, dtype=torch.float32)
        dist.recv(flat, src=worker, group=self.group)
        version, step, samples, loss = int(header[1]), int(header[2]), int(header[3]), float(header[4])
        if step in self.in_flight[worker]:
            self.in_flight[worker].remove(step)
        self.pushes[worker] += 1
        tokens = samples * run_plan_of(self.strategy.lightning_module).sequence_length
        self.window["tokens"][worker] += tokens
        self.tokens[worker] += tokens
        return Push(worker, self.version - version, step, torch.tensor(loss), flat)

    def _hand_out(self, worker: int) -> None:
        if self.stopping:
            send_header(STOP, self.group, worker, self.version)
            return
        step = self.handed_again.popleft() if self.handed_again else self.next_step
        self.next_step += step == self.next_step
        self.in_flight[worker].append(step)
        send_header(STEP, self.group, worker, self.version, step=step)

    def _send_weights(self, worker: int) -> None:
        if self.stopping:
            send_header(STOP, self.group, worker, self.version)
            return
        send_header(WEIGHTS, self.group, worker, self.version)
        module = self.strategy.lightning_module
        dist.send(flat_state(module, parameters_to_vector(self._parameters)), dst=worker, group=self.group)

    # ----- applying a gradient (inside Lightning's optimizer step) -----
    def install_gradient(self) -> None:
        push = self._current
        assert push is not None
        count = self._parameter_count
        gradient = push.gradient[:count].to(self._parameters[0].device)
        for param, flat in zip(self._parameters, gradient.split([param.numel() for param in self._parameters])):
            param.grad = flat.view_as(param).to(param.dtype)
        load_buffers(self.strategy.lightning_module, push.gradient[count:])

    def scaled_learning_rate(self, optimizer: Any) -> ScaledLearningRate:
        push = self._current
        stale = push is not None and push.staleness > self.strategy.max_staleness
        return ScaledLearningRate(optimizer, 1.0 / push.staleness if stale else 1.0)

    def applied(self) -> None:
        push = self._current
        assert push is not None
        self.version += 1
        self.scaled += push.staleness > self.strategy.max_staleness
        self.staleness_counts[push.staleness] += 1
        self.window["staleness"].append(push.staleness)
        self._reply(push.worker)
        self._current = None

    def _reply(self, worker: int) -> None:
        """The newest weights, now or, under the stale-synchronous bound, once the slowest worker catches up."""
        if self.strategy.stale_synchronous and self._ahead(worker):
            self.held.append(worker)
        else:
            self._send_weights(worker)
        self._release_held()

    def _ahead(self, worker: int) -> bool:
        slowest = min(self.pushes[other] for other in self.training) if self.training else 0
        return self.pushes[worker] - slowest > self.strategy.max_staleness

    def _release_held(self) -> None:
        for worker in list(self.held):
            if not self._ahead(worker):
                self.held.remove(worker)
                self._send_weights(worker)

    def finish(self) -> None:
        """After the last update (and its checkpoint): every worker still training is told to stop at its next
        message, and the server waits for each to leave."""
        self.stopping = True
        for worker in self.held:
            send_header(STOP, self.group, worker, self.version)
        self.held.clear()
        while self.training:
            worker, header = self._receive()
            kind = int(header[0])
            if kind == PUSH:
                self._receive_push(worker, header)
                send_header(STOP, self.group, worker, self.version)
            elif kind in (ASK_STEP, PULL):
                send_header(STOP, self.group, worker, self.version)
            elif kind == GOODBYE:
                self.training.discard(worker)
        rank_zero_info(self.summary())
        log_final_val_loss(self.strategy.lightning_module.trainer)

    # ----- what it logs -----
    def _start_window(self) -> None:
        self.window = {"start": time.monotonic(), "staleness": [], "dropped": 0, "tokens": Counter()}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not (self.strategy.is_server and trainer.global_step % trainer.log_every_n_steps == 0):
            return
        window, elapsed = self.window, time.monotonic() - self.window["start"]
        staleness = torch.tensor(window["staleness"] or [0], dtype=torch.float32)
        metrics = {"async/staleness_mean": staleness.mean().item(), "async/staleness_max": staleness.max().item(),
                   "async/updates_applied": float(self.version), "async/updates_dropped": float(self.dropped)}
        for worker in self.workers:  # what each worker pushed (applied or dropped) per second of this window
            metrics[f"async/{run_plan_of(pl_module).unit}_per_second/rank{worker}"] = window["tokens"][worker] / elapsed
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_histogram") and window["staleness"]:
                experiment.add_histogram("async/staleness", staleness, trainer.global_step)
        self._start_window()

    def summary(self) -> str:
        applied = sum(self.staleness_counts.values())
        mean = sum(stale * count for stale, count in self.staleness_counts.items()) / max(applied, 1)
        histogram = ", ".join(f"{stale}: {count}" for stale, count in sorted(self.staleness_counts.items()))
        elapsed = time.monotonic() - self.started
        unit = run_plan_of(self.strategy.lightning_module).unit
        workers = ", ".join(f"rank {worker} {self.pushes[worker]} ({self.tokens[worker] / elapsed:,.0f} {unit}/s)"
                            for worker in self.workers)
        return (f"parameter server: {applied} updates applied, {self.scaled} of them with the learning rate divided "
                f"by their staleness, {self.dropped} dropped (staleness > {self.strategy.max_staleness}, policy "
                f"{self.strategy.staleness_policy}); staleness of those applied: mean {mean:.2f}, "
                f"max {max(self.staleness_counts, default=0)}, counts {{{histogram}}}; pushes per worker since this "
                f"process started, and what they carried: {workers}")

    # ----- checkpoint: numbers only (the data position is the server's loader's, Pushes) -----
    def state_dict(self) -> dict[str, Any]:
        return {"staleness_counts": dict(self.staleness_counts), "dropped": self.dropped, "scaled": self.scaled}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.staleness_counts = Counter(state_dict["staleness_counts"])
        self.dropped, self.scaled = state_dict["dropped"], state_dict["scaled"]


class ScaledLearningRate:
    """Every param group's learning rate times ``factor`` for one update; the schedule's values come back after."""

    def __init__(self, optimizer: Any, factor: float) -> None:
        self.groups = optimizer.param_groups
        self.factor = factor

    def __enter__(self) -> None:
        self.saved = [group["lr"] for group in self.groups]
        for group in self.groups:
            group["lr"] = group["lr"] * self.factor

    def __exit__(self, *exc: object) -> None:
        for group, lr in zip(self.groups, self.saved):
            group["lr"] = lr


class Worker:
    """A worker's side: asking for batches, pushing each batch's gradient, taking the weights the reply brings."""

    def __init__(self, strategy: ParameterServerStrategy, group: dist.ProcessGroup) -> None:
        self.strategy = strategy
        self.group = group
        self.version = 0
        self.assigned: deque[int] = deque()  # batches handed to this worker, in the order its loader reads them
        self.loss_sum = 0.0
        self.micro_batches = 0
        module = strategy.lightning_module
        self._parameters = [param for param in module.parameters()]
        self._parameter_count, self._flat_size = flat_sizes(module)
        # Lightning still steps a worker's copy of the schedule after each push, and torch warns that its optimizer,
        # which the server alone steps, never did; the schedule that counts is the server's
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")

    def assigned_steps(self) -> Iterator[int]:
        """The global batches this worker reads, one per request, until the server says stop."""
        while True:
            send_header(ASK_STEP, self.group, SERVER_RANK, self.version)
            header = self._receive_header()
            if int(header[0]) == STOP:
                self._stop()
                return
            self.assigned.append(int(header[2]))
            yield int(header[2])

    def add_loss(self, loss: Any) -> None:
        tensor = loss["loss"] if isinstance(loss, dict) else loss
        self.loss_sum += float(tensor.detach())
        self.micro_batches += 1

    def pull(self) -> None:
        send_header(PULL, self.group, SERVER_RANK, self.version)
        self._take_reply()

    def push_and_pull(self) -> None:
        module = self.strategy.lightning_module
        gradients = [param.grad if param.grad is not None else torch.zeros_like(param) for param in self._parameters]
        flat = flat_state(module, torch.cat([gradient.flatten() for gradient in gradients]))
        plan = run_plan_of(module)
        step = self.assigned.popleft() if self.assigned else -1
        send_header(PUSH, self.group, SERVER_RANK, self.version, step=step, samples=plan.global_batch_size,
                    loss=self.loss_sum / max(self.micro_batches, 1))
        dist.send(flat, dst=SERVER_RANK, group=self.group)
        self.loss_sum, self.micro_batches = 0.0, 0
        self._take_reply()

    def goodbye(self) -> None:
        send_header(GOODBYE, self.group, SERVER_RANK, self.version)

    def _receive_header(self) -> torch.Tensor:
        header = torch.empty(HEADER_FIELDS, dtype=torch.float64)
        dist.recv(header, src=SERVER_RANK, group=self.group)
        return header

    @torch.no_grad()
    def _take_reply(self) -> None:
        header = self._receive_header()
        if int(header[0]) == STOP:
            self._stop()
            return
        flat = torch.empty(self._flat_size, dtype=torch.float32)
        dist.recv(flat, src=SERVER_RANK, group=self.group)
        count = self._parameter_count
        vector_to_parameters(flat[:count].to(self._parameters[0].device), self._parameters)
        load_buffers(self.strategy.lightning_module, flat[count:])
        self.version = int(header[1])

    def _stop(self) -> None:
        self.strategy.lightning_module.trainer.should_stop = True


def check_staleness(max_staleness: int, staleness_policy: str) -> None:
    check_ranges("trainer.strategy.init_args", {
        "max_staleness": (max_staleness >= 0, "at least 0"),
        "staleness_policy": (staleness_policy in STALENESS_POLICIES, f"one of {', '.join(STALENESS_POLICIES)}"),
    }, {"max_staleness": max_staleness, "staleness_policy": staleness_policy})


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
