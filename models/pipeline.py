"""Pipeline parallelism for the GPT with ``torch.distributed.pipelining``: this rank's stages (one, or two under
the interleaved schedule), the schedule that runs every pipeline micro-batch's forward and backward through them,
and the two things a pipeline adds to a training step, both over the pipeline ranks: the tied embedding's gradient
summed between the first and the last stage, and the gradient norm summed over all stages before clipping.

A stage is the GPT with the other stages' parts removed (``models.parallelize.keep_stage``), so parameter names,
checkpoints and optimizer states are the unsplit model's. Nothing here knows about Lightning: the LightningModule
calls ``Pipeline.train_step`` and ``Pipeline.eval_step`` with its micro-batch, which the schedule cuts into
``n_microbatches`` pipeline micro-batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor

from core.tokens import IGNORE_INDEX
from models.gpt import GPT

SCHEDULES: dict[str, type] = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B}


@dataclass(frozen=True)
class StageSpan:
    """One pipeline stage of a GPT: its index among ``num_stages`` and the blocks it runs. The first stage also
    holds the embeddings, the last the final norm and the head."""

    index: int
    num_stages: int
    layers: range

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1


def split_layers(n_layer: int, num_stages: int, layers: tuple[int, ...] | None = None) -> list[StageSpan]:
    """The blocks of each stage: ``layers`` blocks each, in order, if given; else balanced over the stages by count,
    where the embeddings and the head each count as one block (as torchtitan does): the first and last stages get
    one block fewer than the middle ones when that evens out."""
    if not 1 <= num_stages <= n_layer:
        raise ValueError(f"{num_stages} pipeline stages for {n_layer} blocks: every stage needs at least one block")
    if layers is not None:
        if len(layers) != num_stages or sum(layers) != n_layer or min(layers) < 1:
            raise ValueError(f"pipeline layers {list(layers)}: {num_stages} stages of at least one block, adding up "
                             f"to {n_layer}")
        starts = [sum(layers[:stage]) for stage in range(num_stages + 1)]
        return [StageSpan(index, num_stages, range(start, end))
                for index, (start, end) in enumerate(zip(starts, starts[1:]))]
    units = n_layer + 2  # the embeddings, the blocks, the head
    bounds = [round(stage * units / num_stages) for stage in range(num_stages + 1)]
    # unit u is block u - 1; clamp so that the embeddings and the head take no block's place
    layers = [range(max(start - 1, 0), min(end - 1, n_layer)) for start, end in zip(bounds, bounds[1:])]
    if any(len(span) == 0 for span in layers):  # few blocks: the balance would leave a stage without one
        per_stage, extra = divmod(n_layer, num_stages)
        starts = [stage * per_stage + min(stage, extra) for stage in range(num_stages + 1)]
        layers = [range(start, end) for start, end in zip(starts, starts[1:])]
    return [StageSpan(index, num_stages, span) for index, span in enumerate(layers)]


def keep_stage(model: GPT, stage: StageSpan) -> None:
    """Remove what other stages hold. The last stage keeps the token embedding when it is not also the first: it
    holds the head's tied weight, under the same name, so that checkpoints and optimizer states line up with
    the unsplit model's (its gradient is summed with the first stage's, see models/pipeline.py)."""
    for name in list(model.blocks):
        if int(name) not in stage.layers:
            del model.blocks[name]
    if not stage.first:
        model.wpe = None
    if not stage.last:
        model.ln_f = model.lm_head = None
    if not (stage.first or stage.last):
        model.wte = None


def merge_stages(stages: list[GPT]) -> GPT:
    """One GPT holding the parts of this rank's stages (an interleaved schedule runs two), so that parameter
    names, the state dict and the optimizer see the unsplit model's names. Only the stages run forward."""
    with torch.device("meta"):
        merged = GPT(stages[0].config)
    merged.blocks = nn.ModuleDict({name: block for stage in stages for name, block in stage.blocks.items()})
    for part in ("wte", "wpe", "ln_f", "lm_head"):
        held = [getattr(stage, part) for stage in stages if getattr(stage, part) is not None]
        setattr(merged, part, held[0] if held else None)
    return merged



def rank_stages(n_layer: int, mesh: DeviceMesh, stages_per_rank: int,
                layers: tuple[int, ...] | None = None) -> list[StageSpan]:
    """This rank's stages (``layers`` blocks each, if given), in the "loop" order of the interleaved schedules:
    pipeline rank r of p runs stages r, r + p, r + 2p, ... (one stage per rank without interleaving)."""
    pipeline_mesh = mesh["pipeline_parallel"]
    ranks, rank = pipeline_mesh.size(), pipeline_mesh.get_local_rank()
    stages = split_layers(n_layer, ranks * stages_per_rank, layers)
    return [stages[rank + round_ * ranks] for round_ in range(stages_per_rank)]


def theoretical_bubble(ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> float:
    """The idle share of a step: (p - 1) / (m + p - 1) for GPipe and 1F1B over p ranks and m micro-batches; an
    interleaved schedule with v stages per rank fills and drains v times faster, (p - 1) / (v m + p - 1)."""
    return (ranks - 1) / (stages_per_rank * n_microbatches + ranks - 1)


class TimedStage(PipelineStage):
    """A PipelineStage that adds up the time it computes (forward and backward of its chunks), so that the time it
    waits on its neighbours is the rest of the schedule's: the measured pipeline bubble (app/monitoring.py). On
    GPUs the chunks are timed with CUDA events, read when ``busy_seconds`` is, so timing never stalls the stream."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._busy = 0.0
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @property
    def busy_seconds(self) -> float:
        for start, end in self._pending:
            end.synchronize()
            self._busy += start.elapsed_time(end) / 1000
        self._pending.clear()
        return self._busy

    @busy_seconds.setter
    def busy_seconds(self, seconds: float) -> None:
        self._pending.clear()
        self._busy = seconds

    def _timed(self, run: Callable[[], Any]) -> Any:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = run()
            end.record()
            self._pending.append((start, end))
            return result
        start_time = time.perf_counter()
        result = run()
        self._busy += time.perf_counter() - start_time
        return result

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(lambda: super(TimedStage, self).forward_one_chunk(*args, **kwargs))

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(lambda: super(TimedStage, self).backward_one_chunk(*args, **kwargs))


class Pipeline:
    """This rank's stages (GPTs already cut by ``build_gpt``, described by ``spans``) and the schedule over the
    mesh's "pipeline_parallel" dimension."""

    def __init__(self, stages: list[GPT], spans: list[StageSpan], mesh: DeviceMesh, device: torch.device,
                 schedule: str, n_microbatches: int) -> None:
        self.device = device
        self.has_first = any(span.first for span in spans)
        self.has_last = any(span.last for span in spans)
        self.group = mesh["pipeline_parallel"].get_group()
        self.tied_group = tied_embedding_group(mesh)
        self.stages = [TimedStage(stage, span.index, span.num_stages, device, group=self.group)
                       for stage, span in zip(stages, spans)]
        # the last stage's copy of the tied embedding: its gradient is summed into the first stage's
        self.tied_weight = next((stage.wte.weight for stage, span in zip(stages, spans)
                                 if span.last and stage.wte is not None), None)
        # scale_grads=False: torch's scaling divides every gradient, also those accumulated over earlier
        # micro-batches of the optimizer step; the loss below is scaled instead
        local = self.stages[0] if len(self.stages) == 1 else self.stages
        self.schedule = SCHEDULES[schedule](local, n_microbatches, loss_fn=self._loss, scale_grads=False)
        self._loss_denominator: torch.Tensor | float = 1.0
        self.schedule_seconds = 0.0  # inside training schedules since the start; compute_seconds is the busy part

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="sum")
        return loss_sum / self._loss_denominator

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, accumulation: int) -> torch.Tensor:
        """Forward and backward of the micro-batch (inputs, targets) through the whole pipeline; the gradients
        are added to this stage's parameters' as if by ``(loss / accumulation).backward()`` on one process.
        Returns the micro-batch's mean loss on every pipeline rank."""
        tokens = (targets != IGNORE_INDEX).sum().clamp(min=1)
        self._loss_denominator = tokens * accumulation  # each chunk adds its share of the mean (a tensor: no sync)
        losses: list[torch.Tensor] = []
        start = time.perf_counter()
        self.schedule.step(inputs if self.has_first else None, target=targets if self.has_last else None,
                           losses=losses, return_outputs=False)
        self.schedule_seconds += time.perf_counter() - start
        return self._shared_loss(losses, accumulation)

    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss, token count) of the micro-batch, on every pipeline rank."""
        tokens = (targets != IGNORE_INDEX).sum().clamp(min=1)
        self._loss_denominator = tokens
        losses: list[torch.Tensor] = []
        busy = [stage.busy_seconds for stage in self.stages]
        self.schedule.eval(inputs if self.has_first else None, target=targets if self.has_last else None,
                           losses=losses)
        for stage, seconds in zip(self.stages, busy):  # validation is not training time
            stage.busy_seconds = seconds
        return self._shared_loss(losses, 1), tokens

    def _shared_loss(self, losses: list[torch.Tensor], scale: int) -> torch.Tensor:
        """The last stage's loss, summed from its chunks, on every pipeline rank: one all-reduce of one number."""
        # float32 on every rank, whatever the default dtype (bf16-true sets it to bfloat16 around the step)
        loss = (torch.stack(losses).float().sum().detach() * scale if losses
                else torch.zeros((), dtype=torch.float32, device=self.device))
        dist.all_reduce(loss, group=self.group)
        return loss

    def finish_gradients(self) -> None:
        """After the optimizer step's last backward: the first stage's embedding gradient and the last stage's
        head gradient are one parameter's, so each gets their sum."""
        if self.tied_group is None:  # no pipeline, or a middle rank
            return
        # pipeline rank 0's first stage is stage 0, the one with the embedding
        weight = self.tied_weight if self.tied_weight is not None else self.stages[0].submod.wte.weight
        grad = weight.grad
        dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self.tied_group)

    def counted_parameters(self, parameters: list[nn.Parameter]) -> list[nn.Parameter]:
        """``parameters`` without those another stage already counts (the tied embedding on the last stage)."""
        if self.has_first or self.tied_weight is None:
            return parameters
        return [param for param in parameters if param is not self.tied_weight]

    @property
    def compute_seconds(self) -> float:
        """Seconds this rank's stages have computed in training schedules since the start."""
        return sum(stage.busy_seconds for stage in self.stages)


def tied_embedding_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The first and the last pipeline rank at this rank's (data, tensor) coordinates, which both hold the tied
    embedding; None without a pipeline. Every rank creates every pair's group, in the same order, as
    ``new_group`` requires."""
    ranks = mesh.mesh  # (pipeline, data, tensor) -> global rank
    if ranks.size(0) == 1:
        return None
    mine = None
    for pair in torch.stack([ranks[0].flatten(), ranks[-1].flatten()], dim=1).tolist():
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine
