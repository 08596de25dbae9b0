"""The parameter server's messages: point-to-point sends and receives over a gloo process group. The server receives
from any worker (``dist.recv`` without a source), then answers that worker alone. A GPU run stages the flat vectors
through the CPU for gloo, which keeps NCCL's stream out of it. ``torch.distributed.rpc`` would also do, but it is in
maintenance mode, needs its own agent initialised beside the process group, and its futures add a thread pool where
the server's loop is one thread answering one message at a time.

Each message is a ``Header``, then, for a push or weights, one flat float32 vector: the parameters (or their
gradients) and the floating-point buffers (a BatchNorm's running statistics travel with the push that updated them
and come back with the weights).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields
from enum import IntEnum

import torch
import torch.distributed as dist

SERVER_RANK = 0


class Kind(IntEnum):
    """What a message is."""

    ASK_STEP = 1  # worker to server: which global batch do I read next?
    PULL = 2  # worker to server: the newest weights, please
    PUSH = 3  # worker to server: a gradient (a flat vector follows)
    GOODBYE = 4  # worker to server: I have stopped training
    STEP = 5  # server to worker: read this global batch
    WEIGHTS = 6  # server to worker: the newest weights (a flat vector follows)
    STOP = 7  # server to worker: training is over


@dataclass(frozen=True)
class Header:
    """The numbers every message starts with, sent as one float64 tensor (which holds every integer a run counts
    exactly)."""

    kind: Kind
    version: int = 0  # the sender's weights' version: the updates the server had applied to them
    step: int = -1  # the global batch handed out (STEP) or computed on (PUSH)
    samples: int = 0  # the samples a pushed gradient was computed on
    loss: float = 0.0  # the worker's mean loss over them

    def send(self, group: dist.ProcessGroup, destination: int) -> None:
        dist.send(torch.tensor(astuple(self), dtype=torch.float64), dst=destination, group=group)

    @classmethod
    def receive(cls, group: dist.ProcessGroup, source: int | None) -> tuple[int, Header]:
        """The next header from ``source`` (None: from any rank), and the rank that sent it."""
        values = torch.empty(len(fields(cls)), dtype=torch.float64)
        sender = dist.recv(values, src=source, group=group)
        kind, version, step, samples, loss = values.tolist()
        return sender, cls(Kind(int(kind)), int(version), int(step), int(samples), loss)


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
