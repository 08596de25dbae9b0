"""The step time of a layout, predicted from measured or stated constants: what ``cohort plan`` ranks layouts by.

Per optimizer step on one rank, with a = accumulation micro-batches of b samples, t tensor-parallel, p pipeline and
d data-parallel ranks (r replicas of d / r shards under HSDP), F the model's training FLOPs per sample (counted by
torch, ``CohortModule.flops_per_sample``) and R the device's throughput:

    compute     a x (b x F / (t x p) / R + o x calls) x (1 + 1/3 with activation checkpointing: the blocks'
                forward again)                          o: fixed time of one forward and backward (launches, Python),
                                                        calls: m / p per micro batch under a pipeline of m, else 1
    optimizer   local parameters x s                    s: seconds per parameter of the gradient norm and AdamW
                                                        (measured)
    data par.   DDP: all-reduce of the gradients once per step; FSDP2: per micro batch an all-gather of the
                parameters for forward and another for backward, and once per step a reduce-scatter of the
                gradients (Cohort reduces once per step under accumulation, models/parallel/parallelize.py
                choose_gradient_reduction), one message per block, over the d / r ranks of a replica; HSDP adds an
                all-reduce of the gradient shards across the r replicas once per step; a ring collective of S bytes
                over n ranks takes (n - 1) x (latency + S / (n x bandwidth)), twice that for an all-reduce
                (nccl-tests' bus-bandwidth arithmetic)
    tensor par. per micro batch and block: 2 all-reduces of the block's input in forward, 2 in backward (3 and 3
                with checkpointing), over t ranks
    pipeline    per pipeline micro-batch and stage a rank runs: one send of the activations, one of their gradients
    bubble      compute inside the schedule x idle / (1 - idle), idle = the schedule's theory
                (models/parallel/pipeline.py theoretical_bubble, core/pipeline_schedules.py)

Each collective runs on the link its group spans (``Links``): within a node, or across nodes where the group's
ranks lie on several (the device mesh is row-major over (pipeline, data-parallel, tensor-parallel), so a
tensor-parallel group is neighbouring ranks and a data-parallel one ranks t apart). Communication overlaps compute
only where the device lets it: on a GPU DDP's and FSDP2's collectives run on their
own stream, the step's gradient reduction behind the last micro-batch's backward only (two thirds of its compute:
the earlier micro-batches reduce nothing) and FSDP2's all-gathers behind their own micro-batch's compute (exposed:
what exceeds it); on a CPU gloo's threads compete for the same cores as the compute, so nothing is hidden. Where
each constant came from travels with it (``source``).

What these parts leave out (Lightning's loop, a strategy's hooks and DTensor dispatch, the collectives' software
cost) is most of a small model's step on a CPU and little of a large one's on a GPU. ``Overhead`` adds it as one
more part, ``unmodelled``, fitted per strategy to two short runs (``cohort plan --calibrate``)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb: one all-reduce per bucket
CHECKPOINTING_EXTRA = 1 / 3  # the blocks' forward again, a third of forward + backward (backward is twice forward)
BACKWARD_SHARE = 2 / 3  # of a forward and backward, the backward: what a gradient reduction can hide behind


@dataclass(frozen=True)
class Layout:
    """One way to run the recipe: the sizes, the schedule and the batch split. ``strategy`` is "single", "ddp",
    "fsdp" (FSDP2: ModelParallelStrategy's data_parallel_size), "tp" (ModelParallelStrategy with tensor parallel)
    or "pipeline" (PipelineParallelStrategy, with FSDP2 and tensor parallel inside each stage)."""

    strategy: str
    data_parallel: int
    tensor_parallel: int
    pipeline_parallel: int
    micro_batch_size: int
    accumulation: int
    activation_checkpointing: bool = False
    schedule: str = ""
    pipeline_microbatches: int = 1
    stages_per_rank: int = 1
    replicas: int = 1  # HSDP's replicas of the sharded model ("hsdp"); 1: FSDP2 over every data-parallel rank

    @property
    def sharded(self) -> bool:
        """Whether parameters are sharded over the data-parallel ranks (FSDP2 under ModelParallelStrategy)."""
        return self.strategy in ("fsdp", "hsdp", "tp", "pipeline") and self.data_parallel > 1

    @property
    def shards(self) -> int:
        """Data-parallel ranks each parameter is sharded over: those of one replica; 1 where nothing is sharded."""
        return self.data_parallel // self.replicas if self.sharded else 1

    @property
    def calls(self) -> int:
        """Forward and backward calls a rank makes per optimizer step: one per micro-batch, or under a pipeline one
        per pipeline micro-batch and stage it holds."""
        per_micro_batch = self.pipeline_microbatches * self.stages_per_rank if self.pipeline_parallel > 1 else 1
        return self.accumulation * per_micro_batch

    def describe(self) -> str:
        """A short name for the table: ``FSDP2 dp2, micro 8 x 2, AC`` (micro batch x accumulation, checkpointing)."""
        name = {"single": "one process", "ddp": f"DDP dp{self.data_parallel}",
                "fsdp": f"FSDP2 dp{self.data_parallel}", "hsdp": f"HSDP dp{self.data_parallel} ({self.replicas} x "
                                                                 f"{self.shards})",
                "tp": f"{f'FSDP2 dp{self.data_parallel} ' if self.data_parallel > 1 else ''}TP tp{self.tensor_parallel}"
                }.get(self.strategy)
        if name is None:
            name = (f"PP pp{self.pipeline_parallel} {self.schedule} m{self.pipeline_microbatches} dp{self.data_parallel}"
                    f" tp{self.tensor_parallel}")
        return f"{name}, micro {self.micro_batch_size} x {self.accumulation}{', AC' if self.activation_checkpointing else ''}"


@dataclass(frozen=True)
class DeviceSpeed:
    """How fast one device (one process's share of it) computes: ``flops_per_second`` on the model's own step, the
    fixed ``call_overhead_s`` of one forward and backward beyond it, AdamW's ``optimizer_s_per_parameter``."""

    flops_per_second: float
    call_overhead_s: float
    optimizer_s_per_parameter: float
    overlaps_communication: bool  # a GPU's collectives run beside the compute; a CPU's share its cores
    source: str


@dataclass(frozen=True)
class Link:
    """The interconnect between ranks: per-rank ``bandwidth`` in bytes/s (nccl-tests' bus bandwidth) and the
    ``latency`` of one message in seconds."""

    bandwidth: float
    latency: float
    source: str

    def ring(self, size: int, ranks: int, messages: int = 1) -> float:
        """Seconds of an all-gather or reduce-scatter of ``size`` bytes in all over ``ranks``, sent as ``messages``."""
        if ranks == 1:
            return 0.0
        return (ranks - 1) * (messages * self.latency + size / (ranks * self.bandwidth))

    def all_reduce(self, size: int, ranks: int, messages: int = 1) -> float:
        """A reduce-scatter and an all-gather."""
        return 2 * self.ring(size, ranks, messages)

    def send(self, size: int) -> float:
        return self.latency + size / self.bandwidth


@dataclass(frozen=True)
class Links:
    """The link between the processes of one node and the link between nodes, and the processes a node holds."""

    within_node: Link
    across_nodes: Link
    devices_per_node: int

    def of_group(self, ranks: int, stride: int) -> Link:
        """The link a collective over ``ranks`` ranks ``stride`` apart runs on: within a node when their span fits in
        one, else across nodes (the slowest hop paces a ring)."""
        return self.within_node if ranks * stride <= self.devices_per_node else self.across_nodes


@dataclass(frozen=True)
class ModelFacts:
    """What the cost model needs to know of the network, counted on the meta device."""

    flops_per_sample: float  # training (forward + backward) FLOPs of one sample
    parameters: int
    blocks: int
    parameter_bytes: int  # bytes of one parameter (its dtype) and of one gradient
    compute_bytes: int  # bytes of one activation element in the compute dtype
    block_input_bytes_per_sample: int  # one block's input for one sample, in the compute dtype
    samples_per_step: int  # the global batch
    units_per_sample: int  # tokens (or images) a sample counts for throughput
    unit: str = "tokens"


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    memory_bytes: int
    parts: dict[str, float] = field(default_factory=dict)  # seconds by where they go, per optimizer step

    @property
    def step_seconds(self) -> float:
        return sum(self.parts.values())


def predict(layout: Layout, model: ModelFacts, device: DeviceSpeed, links: Links, bubble_share: float,
            memory_bytes: int) -> Prediction:
    """The step time of ``layout`` by part, per the module docstring; ``bubble_share`` is the schedule's idle share
    (0 without a pipeline)."""
    d, t, p = layout.data_parallel, layout.tensor_parallel, layout.pipeline_parallel
    b, a = layout.micro_batch_size, layout.accumulation
    recompute = CHECKPOINTING_EXTRA if layout.activation_checkpointing else 0.0
    calls = layout.pipeline_microbatches * layout.stages_per_rank / p if p > 1 else 1
    per_micro_batch = (b * model.flops_per_sample * (1 + recompute) / (t * p) / device.flops_per_second
                       + device.call_overhead_s * calls * (1 + recompute))
    compute = a * per_micro_batch
    local_parameters = model.parameters / (t * p) / layout.shards
    parts = {"compute": compute, "optimizer": local_parameters * device.optimizer_s_per_parameter}

    stage_parameter_bytes = model.parameters * model.parameter_bytes // (t * p)
    blocks_here = max(1, model.blocks // p)
    gathers = reduction = 0.0  # per micro batch, per step
    if layout.strategy == "ddp":
        buckets = math.ceil(stage_parameter_bytes / DDP_BUCKET_BYTES)
        reduction = links.of_group(d, t).all_reduce(stage_parameter_bytes, d, buckets)
    elif layout.sharded:
        gathered = model.parameters * model.compute_bytes // (t * p)
        units = blocks_here + 1  # each block, and the root's parameters outside them
        shards, replica = layout.shards, links.of_group(layout.shards, t)
        gathers = 2 * replica.ring(gathered, shards, units)
        reduction = replica.ring(stage_parameter_bytes, shards, units)
        if layout.replicas > 1:  # each rank's gradient shard, across the replicas
            reduction += links.of_group(layout.replicas, shards * t).all_reduce(
                stage_parameter_bytes // shards, layout.replicas, units)
    if device.overlaps_communication:
        gathers = max(0.0, gathers - per_micro_batch)
        reduction = max(0.0, reduction - BACKWARD_SHARE * per_micro_batch)
    parts["data-parallel comm"] = a * gathers + reduction

    activation = b * model.block_input_bytes_per_sample
    if t > 1:
        all_reduces = (4 + 2 * (recompute > 0)) * blocks_here
        parts["tensor-parallel comm"] = a * links.of_group(t, 1).all_reduce(activation, t, all_reduces)
    if p > 1:
        sends = 2 * layout.pipeline_microbatches * layout.stages_per_rank
        parts["pipeline comm"] = a * sends * links.of_group(2, d * t).send(activation // layout.pipeline_microbatches)
        parts["bubble"] = compute * bubble_share / (1 - bubble_share)
    return Prediction(layout, memory_bytes, parts)


@dataclass(frozen=True)
class Overhead:
    """What a step of one strategy costs beyond the parts above, measured (``cohort plan --calibrate``): a fixed time
    per optimizer step (the optimizer's and loop's own work, the logging) and per forward and backward call (the
    loop's per micro-batch, the strategy's hooks, DTensor dispatch), a third more with activation checkpointing (the
    forward again)."""

    per_step: float
    per_call: float

    def of(self, layout: Layout) -> float:
        return self.per_step + self.per_call * self.weighted_calls(layout)

    @staticmethod
    def weighted_calls(layout: Layout) -> float:
        return layout.calls * (1 + (CHECKPOINTING_EXTRA if layout.activation_checkpointing else 0.0))

    @classmethod
    def fitted(cls, runs: Sequence[tuple[Layout, float]]) -> Overhead:
        """From (layout, seconds beyond the model) of one or two runs: the line through two runs of different calls
        per step; one run (or two of the same calls) gives the time per call alone. Where the machine's noise tilts
        the line below zero at either end, that term is 0 and the other fits both runs."""
        points = [(cls.weighted_calls(layout), seconds) for layout, seconds in runs]
        (calls, seconds), *others = points
        if not others or others[0][0] == calls:
            return cls(0.0, sum(seconds for _, seconds in points) / sum(calls for calls, _ in points))
        other_calls, other_seconds = others[0]
        per_call = (other_seconds - seconds) / (other_calls - calls)
        per_step = seconds - per_call * calls
        if per_call < 0:
            return cls((seconds + other_seconds) / 2, 0.0)
        if per_step < 0:
            return cls(0.0, (seconds * calls + other_seconds * other_calls) / (calls**2 + other_calls**2))
        return cls(per_step, per_call)


def calibrated(prediction: Prediction, overhead: Overhead) -> Prediction:
    """``prediction`` with one more part, ``unmodelled``: its strategy's measured ``overhead``, what the model does not
    count."""
    parts = {**prediction.parts, "unmodelled": overhead.of(prediction.layout)}
    return Prediction(prediction.layout, prediction.memory_bytes, parts)


def fastest_first(predictions: Iterable[Prediction]) -> list[Prediction]:
    """By predicted step time; the smaller memory first among equals."""
    return sorted(predictions, key=lambda prediction: (prediction.step_seconds, prediction.memory_bytes))


def tokens_per_second(prediction: Prediction, model: ModelFacts) -> float:
    return model.samples_per_step * model.units_per_sample / prediction.step_seconds
