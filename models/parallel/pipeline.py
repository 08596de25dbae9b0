"""Pipeline parallelism for any network whose forward is a sequence of parts (its inputs turned into hidden
states, its repeated blocks, its head), with ``torch.distributed.pipelining``: this rank's stages (one, or two under
the interleaved, zero-bubble and V-shaped schedules), the schedule that runs every pipeline micro-batch's forward and
backward through them, and the things a pipeline adds to a training step over the pipeline ranks: the gradient of a
weight tied between the first and the last stage (GPT's and BERT's embedding and output head) summed, the gradient
norm summed over all stages before clipping, and the auxiliary losses of stages before the last (a mixture of
experts' balance loss), whose gradients each stage adds in its own backward (``AddedLossGradient``).

A stage is the family's network with the other stages' parts removed (``keep_stage``), so parameter names,
checkpoints and optimizer states are the unsplit network's; the family says where the parts are and how its two
ends run (``PipelineSplit``). Nothing here knows about Lightning: the LightningModule calls ``Pipeline.train_step``
and ``Pipeline.eval_step`` with its micro-batch, which the schedule cuts into ``n_microbatches`` pipeline
micro-batches.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from core.errors import UserError
from core.run_plan import RunPlan
from core.tokens import IGNORE_INDEX

# torch's class for each of core/pipeline_schedules.py's schedules (core cannot import torch's pipelining)
TORCH_SCHEDULE_CLASSES: dict[str, type] = {
    "GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble, "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
}


def cross_entropy_sum(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of every target that is not padding (IGNORE_INDEX), over the outputs' last dim."""
    return F.cross_entropy(outputs.reshape(-1, outputs.size(-1)).float(), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


@dataclass(frozen=True)
class PipelineSplit:
    """Where a family's network may be cut into stages, between its repeated blocks (``CohortModule.blocks``):
    ``first`` names the modules that turn the inputs into hidden states (run by the first stage, ``embed``), ``last``
    those that turn the last block's output into the outputs (run by the last stage, ``head``). Every parameter must
    belong to a block or to one of these modules. ``loss_sum`` is the summed loss of a pipeline micro-batch's
    outputs; each is divided by the micro-batch's count of targets that are not padding. ``auxiliary_loss``, if
    given, is a stage's own term of the training loss after it ran a pipeline micro-batch, as a mean over that
    micro-batch's samples (None where the stage has none): the training loss is the last stage's plus every stage's
    auxiliary term, weighted by its samples' share of the micro batch."""

    first: tuple[str, ...]
    last: tuple[str, ...]
    embed: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    head: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = field(default=cross_entropy_sum)
    auxiliary_loss: Callable[[nn.Module], torch.Tensor | None] | None = None


@dataclass(frozen=True)
class StageSpan:
    """One pipeline stage: its index among ``num_stages`` and the blocks it runs. The first stage also runs the
    split's ``first`` modules, the last its ``last`` ones."""

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


def block_paths(network: nn.Module, blocks: list[nn.Module]) -> list[str]:
    """Where each block sits in ``network`` ("blocks.3", "stages.1.0"), in order."""
    names = {id(module): name for name, module in network.named_modules()}
    return [names[id(block)] for block in blocks]


def tied_parts(network: nn.Module, split: PipelineSplit) -> dict[str, str]:
    """{first module: the name of its parameter} for each parameter that a ``first`` module shares with a ``last``
    one (an output head tied to the embedding): the last stage keeps that module too, so that both ends hold the
    weight under its own name, and their gradients are summed (``Pipeline.finish_gradients``)."""
    owners: dict[int, list[str]] = defaultdict(list)
    for name, param in network.named_parameters(remove_duplicate=False):
        owners[id(param)].append(name)
    tied = {}
    for names in owners.values():
        parts = [name.split(".")[0] for name in names]
        first = next((part for part in parts if part in split.first), None)
        if first is not None and any(part in split.last for part in parts):
            tied[first] = names[0]
    return tied


def check_split(network: nn.Module, split: PipelineSplit, paths: list[str]) -> None:
    """A UserError naming a parameter that neither a block nor the split's modules hold: every stage would keep it."""
    held = (*paths, *split.first, *split.last)
    for name, _ in network.named_parameters():
        if not any(name == part or name.startswith(part + ".") for part in held):
            raise UserError(f"the pipeline split of {type(network).__name__} leaves {name} in no stage: add its module "
                            "to PipelineSplit.first or .last, or to the blocks")


def remove_module(network: nn.Module, path: str) -> None:
    """Drop the module at ``path``, keeping every other name: from a container its key goes (no renumbering), an
    attribute becomes None."""
    parent_path, _, name = path.rpartition(".")
    parent = network.get_submodule(parent_path)
    if isinstance(parent, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        parent._modules.pop(name)
    else:
        setattr(parent, name, None)


def keep_stage(network: nn.Module, split: PipelineSplit, paths: list[str], span: StageSpan) -> None:
    """Remove what other stages hold and make ``network`` run as this stage: its blocks of ``span``, after the
    split's ``first`` modules if it is the first stage, then its ``last`` ones if it is the last. The last stage
    keeps a first module whose weight the head shares (``tied_parts``)."""
    tied = tied_parts(network, split)
    for index, path in enumerate(paths):
        if index not in span.layers:
            remove_module(network, path)
    for part in split.first:
        if not span.first and not (span.last and part in tied):
            remove_module(network, part)
    for part in split.last:
        if not span.last:
            remove_module(network, part)
    mine = [paths[index] for index in span.layers]
    network.forward = partial(run_stage, network, split, mine, span)  # type: ignore[method-assign]


def run_stage(network: nn.Module, split: PipelineSplit, paths: list[str], span: StageSpan,
              x: torch.Tensor) -> torch.Tensor:
    """One stage's forward. Blocks are looked up by name on each call: activation checkpointing wraps them in place
    after the stage is cut."""
    if span.first:
        x = split.embed(network, x)
    for path in paths:
        x = network.get_submodule(path)(x)
    if span.last:
        x = split.head(network, x)
    return x


def merge_stages(make_network: Callable[[], nn.Module], split: PipelineSplit, paths: list[str],
                 stages: list[nn.Module], spans: list[StageSpan]) -> nn.Module:
    """One module holding the parts of this rank's stages (an interleaved schedule runs two) under the unsplit
    network's names, so that the state dict and the optimizer see them. Only the stages run forward."""
    with torch.device("meta"):
        merged = make_network()
    for part in (*paths, *split.first, *split.last):
        remove_module(merged, part)
    for stage, span in zip(stages, spans):
        held = [paths[index] for index in span.layers]
        held += [part for part in (*split.first, *split.last) if getattr(stage, part, None) is not None]
        for path in held:
            parent_path, _, name = path.rpartition(".")
            setattr(merged.get_submodule(parent_path), name, stage.get_submodule(path))
    return merged


def check_stages_have_blocks(plan: RunPlan, n_blocks: int, name: str) -> None:
    """UserErrors, before anything is built, for pipeline stages that a network of ``n_blocks`` blocks cannot fill:
    a split that does not add up to them, or more stages than blocks."""
    if plan.pipeline_parallel_size == 1:
        return
    stages = plan.pipeline_parallel_size * plan.stages_per_rank
    if plan.pipeline_layers is not None and sum(plan.pipeline_layers) != n_blocks:
        raise UserError(f"trainer.strategy.init_args.pipeline_layers={list(plan.pipeline_layers)} adds up to "
                        f"{sum(plan.pipeline_layers)} blocks, but {name} has {n_blocks}: give every block to one stage")
    if stages > n_blocks:
        raise UserError(f"pipeline_parallel_size={plan.pipeline_parallel_size} ({plan.pipeline_schedule}) makes "
                        f"{stages} stages, more than {name} has blocks ({n_blocks}): use fewer stages")


def rank_stages(n_blocks: int, mesh: DeviceMesh, stage_ranks: list[int],
                layers: tuple[int, ...] | None = None) -> list[StageSpan]:
    """This rank's stages (``layers`` blocks each, if given), in stage order: those that ``stage_ranks``
    (RunPlan.pipeline_stage_ranks: a loop, or a V) gives this pipeline rank."""
    rank = mesh["pipeline_parallel"].get_local_rank()
    try:
        stages = split_layers(n_blocks, len(stage_ranks), layers)
    except ValueError as error:
        raise UserError(f"{error}: use fewer pipeline stages, or give trainer.strategy.init_args.pipeline_layers "
                        "that add up to the blocks") from None
    return [stage for stage, owner in zip(stages, stage_ranks) if owner == rank]


def share_tied_weights(stages: list[nn.Module], spans: list[StageSpan], tied: list[str]) -> None:
    """Where this rank runs both the first and the last stage (a V's rank 0), each weight tied between them becomes
    one parameter: the last stage's copy is replaced, under every name it has there (the head's too), by the first
    stage's, so that both stages' gradients accumulate into it and the optimizer steps it once. Before the first
    forward: FSDP2 takes each module's parameter as it finds it then (its lazy initialisation), so both stages'
    FSDP2 roots gather the one sharded parameter and add their reduced gradients into its gradient."""
    first = next((stage for stage, span in zip(stages, spans) if span.first), None)
    last = next((stage for stage, span in zip(stages, spans) if span.last), None)
    if first is None or last is None:
        return
    for name in tied:
        shared, copy = first.get_parameter(name), last.get_parameter(name)
        for module in last.modules():
            for key, param in list(module.named_parameters(recurse=False)):
                if param is copy:
                    setattr(module, key, shared)


def theoretical_bubble(plan: RunPlan) -> float:
    """The idle share of a training step on each pipeline rank under the plan's schedule (its ``idle_units``,
    core/pipeline_schedules.py): a rank computes 3 units per pipeline micro-batch for each stage it runs, and idles
    ``idle_units``, so that 1F1B's bubble is (p - 1) / (m + p - 1), Interleaved1F1B's (p - 1) / (v m + p - 1) and
    InterleavedZeroBubble's (p - 1) / (3 v m + p - 1) with v stages per rank."""
    idle = plan.schedule.idle_units(plan.pipeline_parallel_size, plan.pipeline_microbatches)
    return idle / (3 * plan.stages_per_rank * plan.pipeline_microbatches + idle)


class AddedLossGradient(torch.autograd.Function):
    """``x`` unchanged; in backward, ``loss`` also gets the gradient ``weight``, as if ``weight x loss`` had been
    added to the training loss. A stage before the last adds its auxiliary loss this way: the pipeline's backward
    starts from the last stage's loss only (Megatron-LM's MoEAuxLossAutoScaler does the same)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, loss: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return x.clone()  # not a view: the zero-bubble schedules detach a stage's outputs in place

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (weight,) = ctx.saved_tensors
        return grad, weight, None


class TimedStage(PipelineStage):
    """A PipelineStage that adds up the time it computes (forward and backward of its chunks, the zero-bubble
    schedules' weight-gradient half of a backward too), so that the time it waits on its neighbours is the rest of
    the schedule's: the measured pipeline bubble (app/observability/monitor.py). On GPUs the chunks are timed with
    CUDA events, read when ``busy_seconds`` is, so timing never stalls the stream."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._busy = 0.0
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        # whether the stage is running a pipeline micro-batch's forward, rather than torch's metadata inference, which
        # runs the network on uninitialised tensors of the right shapes once before the first step
        self.forwarding_chunk = False

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
        self.forwarding_chunk = True
        try:
            return self._timed(lambda: super(TimedStage, self).forward_one_chunk(*args, **kwargs))
        finally:
            self.forwarding_chunk = False

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(lambda: super(TimedStage, self).backward_one_chunk(*args, **kwargs))

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(lambda: super(TimedStage, self).backward_weight_one_chunk(*args, **kwargs))

    # A V's middle rank runs two adjacent stages (p - 1 and p), and torch's schedule hands the gradient from one to
    # the other in memory, also under eval(), where there is none and the stage would raise: nothing to hand then.
    def get_local_bwd_output(self, mb_index: int) -> Any:
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs: tuple[torch.Tensor | None, ...], mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)


class Pipeline:
    """This rank's stages (networks already cut by ``keep_stage``, described by ``spans``) and the schedule over the
    mesh's "pipeline_parallel" dimension. ``tied`` names the parameters the first and the last stage both hold: on
    two ranks each holds a copy, and their gradients are summed; where ``ends_on_one_rank`` (a V), that rank makes
    them one parameter (``share_tied_weights``)."""

    def __init__(self, stages: list[nn.Module], spans: list[StageSpan], mesh: DeviceMesh, device: torch.device,
                 schedule: str, n_microbatches: int, split: PipelineSplit, tied: list[str],
                 ends_on_one_rank: bool = False) -> None:
        self.device = device
        self.split = split
        self.has_first = any(span.first for span in spans)
        self.has_last = any(span.last for span in spans)
        self.group = mesh["pipeline_parallel"].get_group()
        share_tied_weights(stages, spans, tied)
        self.tied_group = tied_weights_group(mesh) if tied and not ends_on_one_rank else None
        self.stages = [TimedStage(stage, span.index, span.num_stages, device, group=self.group)
                       for stage, span in zip(stages, spans)]
        # this rank's copies of the tied weights: the first stage's, or else the last stage's
        end = next((stage for stage, span in zip(stages, spans) if span.first or span.last), None)
        held = dict(end.named_parameters()) if end is not None else {}
        self.tied_weights = [held[name] for name in tied if name in held]
        # scale_grads=False: torch's scaling divides every gradient, also those accumulated over earlier
        # micro-batches of the optimizer step; the loss below is scaled instead
        local = self.stages[0] if len(self.stages) == 1 else self.stages
        self.schedule = TORCH_SCHEDULE_CLASSES[schedule](local, n_microbatches, loss_fn=self._loss, scale_grads=False)
        self._loss_denominator: torch.Tensor | float = 1.0
        self._auxiliary_weight: float | None = None  # per sample, in a training step: 1 / (samples x accumulation)
        self._auxiliary_sum = torch.zeros((), device=device)  # this rank's auxiliary terms of the step's loss
        if split.auxiliary_loss is not None:
            for timed in self.stages:
                timed.submod.forward = partial(self._add_auxiliary_loss, timed, timed.submod.forward)
        self.schedule_seconds = 0.0  # inside training schedules since the start; compute_seconds is the busy part

    def _loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.split.loss_sum(outputs, targets) / self._loss_denominator

    def _add_auxiliary_loss(self, stage: TimedStage, run: Callable[[torch.Tensor], torch.Tensor],
                            x: torch.Tensor) -> torch.Tensor:
        """The stage's forward of a pipeline micro-batch, whose backward also adds the gradient of the stage's
        auxiliary loss, weighted by the pipeline micro-batch's share of the samples and the accumulation, as one
        process adds it to the micro batch's loss. Only in a training step's forwards (not in evaluation, which runs
        without gradients, nor in torch's metadata inference, whose inputs are uninitialised)."""
        outputs = run(x)
        if self._auxiliary_weight is None or not torch.is_grad_enabled() or not stage.forwarding_chunk:
            return outputs
        loss = self.split.auxiliary_loss(stage.submod)
        if loss is None:
            return outputs
        weight = torch.tensor(x.shape[0] * self._auxiliary_weight, dtype=loss.dtype, device=loss.device)
        self._auxiliary_sum += (loss.detach() * weight).float()
        return AddedLossGradient.apply(outputs, loss, weight)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, accumulation: int) -> torch.Tensor:
        """Forward and backward of the micro-batch (inputs, targets) through the whole pipeline; the gradients
        are added to this stage's parameters' as if by ``(loss / accumulation).backward()`` on one process.
        Returns the micro-batch's mean loss on every pipeline rank."""
        tokens = (targets != IGNORE_INDEX).sum().clamp(min=1)
        self._loss_denominator = tokens * accumulation  # each chunk adds its share of the mean (a tensor: no sync)
        self._auxiliary_weight = 1 / (targets.shape[0] * accumulation)
        self._auxiliary_sum.zero_()
        losses: list[torch.Tensor] = []
        start = time.perf_counter()
        try:
            self.schedule.step(inputs if self.has_first else None, target=targets if self.has_last else None,
                               losses=losses, return_outputs=False)
        finally:
            self._auxiliary_weight = None
        self.schedule_seconds += time.perf_counter() - start
        return self._shared_loss(losses, accumulation, self._auxiliary_sum)

    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss, token count) of the micro-batch, on every pipeline rank. A micro-batch of padding alone (see
        RunPlan.evaluation_samples_per_rank) still runs through the stages, as a loss of 0 that counts 0 tokens."""
        tokens = (targets != IGNORE_INDEX).sum()
        self._loss_denominator = tokens.clamp(min=1)
        losses: list[torch.Tensor] = []
        busy = [stage.busy_seconds for stage in self.stages]
        self.schedule.eval(inputs if self.has_first else None, target=targets if self.has_last else None,
                           losses=losses)
        for stage, seconds in zip(self.stages, busy):  # validation is not training time
            stage.busy_seconds = seconds
        return self._shared_loss(losses, 1), tokens

    def _shared_loss(self, losses: list[torch.Tensor], scale: int, auxiliary: torch.Tensor | None = None
                     ) -> torch.Tensor:
        """The last stage's loss, summed from its chunks, plus each stage's ``auxiliary`` terms, on every pipeline
        rank: one all-reduce of one number."""
        # float32 on every rank, whatever the default dtype (bf16-true sets it to bfloat16 around the step)
        loss = (torch.stack(losses).float().sum().detach() if losses
                else torch.zeros((), dtype=torch.float32, device=self.device))
        if auxiliary is not None:
            loss = loss + auxiliary
        loss = loss * scale
        dist.all_reduce(loss, group=self.group)
        return loss

    def finish_gradients(self) -> None:
        """After the optimizer step's last backward: a weight tied between the first and the last stage (the
        embedding and the output head) is one parameter, so each copy gets the sum of both gradients."""
        if self.tied_group is None:  # nothing tied, or a middle rank
            return
        for weight in self.tied_weights:
            grad = weight.grad
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self.tied_group)

    def counted_parameters(self, parameters: list[nn.Parameter]) -> list[nn.Parameter]:
        """``parameters`` without those another stage already counts (the tied weights on the last stage)."""
        if self.has_first:
            return parameters
        tied = {id(weight) for weight in self.tied_weights}
        return [param for param in parameters if id(param) not in tied]

    @property
    def compute_seconds(self) -> float:
        """Seconds this rank's stages have computed in training schedules since the start."""
        return sum(stage.busy_seconds for stage in self.stages)


def tied_weights_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The first and the last pipeline rank at this rank's (data, tensor) coordinates, which both hold the tied
    weights; None without a pipeline. Every rank creates every pair's group, in the same order, as
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
