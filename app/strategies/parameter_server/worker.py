"""A parameter server's worker (every rank but 0): it asks the server which global batch to read, computes that batch's
gradient (forward and backward over its micro-batches) on the weights it last pulled, pushes it tagged with their
version, and goes on with the weights the reply brings (app/strategies/parameter_server/ says how the
whole works)."""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.nn.utils import vector_to_parameters

from app.strategies.parameter_server.protocol import SERVER_RANK, Header, Kind, flat_sizes, flat_state, load_buffers
from core.run_plan import run_plan_of


class Worker:
    """A worker's side: asking for batches, pushing each batch's gradient, taking the weights the reply brings."""

    def __init__(self, module: L.LightningModule, group: dist.ProcessGroup) -> None:
        self.module = module
        self.group = group
        self.version = 0
        self.assigned: deque[int] = deque()  # batches handed to this worker, in the order its loader reads them
        self.loss_sum = 0.0
        self.micro_batches = 0
        self._parameters = [param for param in module.parameters()]
        self._parameter_count, self._flat_size = flat_sizes(module)
        # Lightning still steps a worker's copy of the schedule after each push, and torch warns that its optimizer,
        # which the server alone steps, never did; the schedule that counts is the server's
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")

    def assigned_steps(self) -> Iterator[int]:
        """The global batches this worker reads, one per request, until the server says stop."""
        while True:
            Header(Kind.ASK_STEP, self.version).send(self.group, SERVER_RANK)
            _, header = Header.receive(self.group, SERVER_RANK)
            if header.kind == Kind.STOP:
                self._stop()
                return
            self.assigned.append(header.step)
            yield header.step

    def add_loss(self, loss: Any) -> None:
        tensor = loss["loss"] if isinstance(loss, dict) else loss
        self.loss_sum += float(tensor.detach())
        self.micro_batches += 1

    def pull(self) -> None:
        Header(Kind.PULL, self.version).send(self.group, SERVER_RANK)
        self._take_reply()

    def push_and_pull(self) -> None:
        module = self.module
        gradients = [param.grad if param.grad is not None else torch.zeros_like(param) for param in self._parameters]
        flat = flat_state(module, torch.cat([gradient.flatten() for gradient in gradients]))
        plan = run_plan_of(module)
        step = self.assigned.popleft() if self.assigned else -1
        Header(Kind.PUSH, self.version, step, plan.global_batch_size, self.loss_sum / max(self.micro_batches, 1)).send(
            self.group, SERVER_RANK)
        dist.send(flat, dst=SERVER_RANK, group=self.group)
        self.loss_sum, self.micro_batches = 0.0, 0
        self._take_reply()

    def goodbye(self) -> None:
        Header(Kind.GOODBYE, self.version).send(self.group, SERVER_RANK)

    @torch.no_grad()
    def _take_reply(self) -> None:
        _, header = Header.receive(self.group, SERVER_RANK)
        if header.kind == Kind.STOP:
            self._stop()
            return
        flat = torch.empty(self._flat_size, dtype=torch.float32)
        dist.recv(flat, src=SERVER_RANK, group=self.group)
        count = self._parameter_count
        vector_to_parameters(flat[:count].to(self._parameters[0].device), self._parameters)
        load_buffers(self.module, flat[count:])
        self.version = header.version

    def _stop(self) -> None:
        self.module.trainer.should_stop = True
