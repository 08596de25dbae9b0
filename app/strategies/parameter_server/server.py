"""A parameter server's server (rank 0): it holds the weights, the optimizer and its schedule, and the version (the
updates applied so far); it applies each worker's gradient as it arrives (one optimizer step, with clipping and the
bad-step guard), replies to that worker alone with the new weights, validates and checkpoints
(app/strategies/parameter_server/ says how the whole works)."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch.nn.utils import parameters_to_vector

from app.observability.tensorboard_layout import log_final_val_loss, tensorboard_loggers
from app.strategies.parameter_server.protocol import SERVER_RANK, Header, Kind, flat_sizes, flat_state, load_buffers
from app.strategies.parameter_server.settings import ParameterServerSettings
from core.run_plan import run_plan_of

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

    def __init__(self, settings: ParameterServerSettings) -> None:
        self.settings = settings
        self.next_step = 0  # the next global batch never handed out
        self.handed_again: deque[int] = deque()  # handed out but never applied: dropped, or lost by a stop
        self.in_flight: dict[int, deque[int]] = {}  # per worker, the batches handed to it and not pushed yet
        self.staleness_counts: Counter[int] = Counter()  # of every gradient applied, the whole run
        self.dropped = 0
        self.scaled = 0  # applied with the learning rate divided by their staleness
        self.window: dict[str, Any] = {}
        self._current: Push | None = None

    # ----- the loop: one message at a time -----
    def start(self, group: dist.ProcessGroup, module: L.LightningModule) -> None:
        """On the server, as training starts: ``group`` carries the messages, ``module`` holds the weights."""
        trainer = module.trainer
        self.group = group
        self.module = module
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
        self._parameters = [param for param in self.module.parameters()]
        self._parameter_count, self._flat_size = flat_sizes(self.module)
        self.tokens: Counter[int] = Counter()  # per worker, this run
        self.started = time.monotonic()
        self._start_window()
        if trainer.is_global_zero:  # the monitor, which writes the layout of synchronous runs, is off here
            for logger in tensorboard_loggers(trainer):
                logger.experiment.add_custom_scalars(ASYNC_LAYOUT)

    def next_push(self) -> Push | None:
        """Answers the workers' other messages until a gradient to apply arrives; None once every worker has left."""
        settings = self.settings
        while self.training:
            worker, header = self._receive()
            if header.kind == Kind.ASK_STEP:
                self._hand_out(worker)
            elif header.kind == Kind.PULL:
                self._send_weights(worker)
            elif header.kind == Kind.GOODBYE:
                self.training.discard(worker)
                self._release_held()
            elif header.kind == Kind.PUSH:
                push = self._receive_push(worker, header)
                if push.staleness > settings.max_staleness and settings.staleness_policy == "drop":
                    self.dropped += 1
                    self.window["dropped"] += 1
                    self.handed_again.append(push.step)
                    self._reply(worker)
                    continue
                self._current = push
                return push
        rank_zero_info(f"parameter server: every worker has left, so training stops at update {self.version}")
        self.module.trainer.should_stop = True
        return None

    def _receive(self) -> tuple[int, Header]:
        timeout = self.settings.message_timeout.total_seconds()
        waiting_since = time.monotonic()
        try:
            worker, header = Header.receive(self.group, source=None)
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

    def _receive_push(self, worker: int, header: Header) -> Push:
        flat = torch.empty(self._flat_size, dtype=torch.float32)
        dist.recv(flat, src=worker, group=self.group)
        if header.step in self.in_flight[worker]:
            self.in_flight[worker].remove(header.step)
        self.pushes[worker] += 1
        tokens = header.samples * run_plan_of(self.module).sequence_length
        self.window["tokens"][worker] += tokens
        self.tokens[worker] += tokens
        return Push(worker, self.version - header.version, header.step, torch.tensor(header.loss), flat)

    def _hand_out(self, worker: int) -> None:
        step = self.handed_again.popleft() if self.handed_again else self.next_step
        self.next_step += step == self.next_step
        self.in_flight[worker].append(step)
        Header(Kind.STEP, self.version, step).send(self.group, worker)

    def _send_weights(self, worker: int) -> None:
        Header(Kind.WEIGHTS, self.version).send(self.group, worker)
        dist.send(flat_state(self.module, parameters_to_vector(self._parameters)), dst=worker, group=self.group)

    # ----- applying a gradient (inside Lightning's optimizer step) -----
    def install_gradient(self) -> None:
        push = self._current
        assert push is not None
        count = self._parameter_count
        gradient = push.gradient[:count].to(self._parameters[0].device)
        for param, flat in zip(self._parameters, gradient.split([param.numel() for param in self._parameters])):
            param.grad = flat.view_as(param).to(param.dtype)
        load_buffers(self.module, push.gradient[count:])

    def scaled_learning_rate(self, optimizer: Any) -> ScaledLearningRate:
        push = self._current
        stale = push is not None and push.staleness > self.settings.max_staleness
        return ScaledLearningRate(optimizer, 1.0 / push.staleness if stale else 1.0)

    def applied(self) -> None:
        push = self._current
        assert push is not None
        self.version += 1
        self.scaled += push.staleness > self.settings.max_staleness
        self.staleness_counts[push.staleness] += 1
        self.window["staleness"].append(push.staleness)
        self._reply(push.worker)
        self._current = None

    def _reply(self, worker: int) -> None:
        """The newest weights, now or, under the stale-synchronous bound, once the slowest worker catches up."""
        if self.settings.stale_synchronous and self._ahead(worker):
            self.held.append(worker)
        else:
            self._send_weights(worker)
        self._release_held()

    def _ahead(self, worker: int) -> bool:
        slowest = min(self.pushes[other] for other in self.training) if self.training else 0
        return self.pushes[worker] - slowest > self.settings.max_staleness

    def _release_held(self) -> None:
        for worker in list(self.held):
            if not self._ahead(worker):
                self.held.remove(worker)
                self._send_weights(worker)

    def finish(self) -> None:
        """After the last update (and its checkpoint): every worker still training is told to stop at its next
        message, and the server waits for each to leave."""
        for worker in self.held:
            Header(Kind.STOP, self.version).send(self.group, worker)
        self.held.clear()
        while self.training:
            worker, header = self._receive()
            if header.kind == Kind.PUSH:
                self._receive_push(worker, header)
                Header(Kind.STOP, self.version).send(self.group, worker)
            elif header.kind in (Kind.ASK_STEP, Kind.PULL):
                Header(Kind.STOP, self.version).send(self.group, worker)
            elif header.kind == Kind.GOODBYE:
                self.training.discard(worker)
        rank_zero_info(self.summary())
        log_final_val_loss(self.module.trainer)

    # ----- what it logs -----
    def _start_window(self) -> None:
        self.window = {"start": time.monotonic(), "staleness": [], "dropped": 0, "tokens": Counter()}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not (trainer.global_rank == SERVER_RANK and trainer.global_step % trainer.log_every_n_steps == 0):
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
        unit = run_plan_of(self.module).unit
        workers = ", ".join(f"rank {worker} {self.pushes[worker]} ({self.tokens[worker] / elapsed:,.0f} {unit}/s)"
                            for worker in self.workers)
        return (f"parameter server: {applied} updates applied, {self.scaled} of them with the learning rate divided "
                f"by their staleness, {self.dropped} dropped (staleness > {self.settings.max_staleness}, policy "
                f"{self.settings.staleness_policy}); staleness of those applied: mean {mean:.2f}, "
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
