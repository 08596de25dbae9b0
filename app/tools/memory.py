"""Per-device memory of a training step, estimated before the job starts: does this config fit on that GPU?

    estimate = estimate_memory(lambda: GPT(gpt_config("gpt2")), next_token_loss(1024, 50257), micro_batch_size=8,
                               precision="bf16-mixed", strategy="fsdp", data_parallel_size=8)  # memory_profile's loss
    print(estimate.describe(visible_device_memory()))

What is counted, per device, in bytes (each line of ``MemoryEstimate``):

    parameters       local parameters x bytes of the parameters' dtype (float32 unless "*-true" half precision)
    gradients        the same again: a gradient per parameter, in the parameters' dtype
    optimizer state  AdamW's two moments per parameter, allocated like the parameters (zeros_like)
    activations      what autograd saves for backward, plus the temporaries above that around the loss
    other            what the strategy and precision hold besides: compute-dtype copies of the weights under
                     autocast, DDP's gradient buckets, FSDP's gathered units
    overhead         on a GPU only: the CUDA context and allocator fragmentation, stated constants below

``parameters``, ``gradients`` and ``optimizer state`` are exact counts: the network is built on the meta device,
so a model of billions of parameters costs nothing. Activations are measured, not derived from a per-family
formula, by running the step on the meta device (app/tools/memory_profile.py says how).

The total adds every line, so it is the peak of a step whose gradients are alive while activations are: a step
with gradient accumulation (gradients carry over from micro-batch to micro-batch), or any step under DDP. With one
micro-batch per step and gradients set to None in between, the real peak is lower by up to the gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

from app.tools.memory_profile import NetworkProfile, profile_network
from core.errors import UserError
from core.pipeline_schedules import pipeline_microbatches_or_default
from core.precision import precision_named
from core.sizes import BYTES_IN, GIB, format_bytes, parse_byte_size, size_unit

STRATEGIES = ("single", "ddp", "fsdp")  # fsdp: FSDP, FSDP2 and ModelParallelStrategy (fully sharded)

# Allowances on a GPU, not measured: the CUDA context with cuBLAS/cuDNN workspaces and NCCL's buffers (0.5-1 GiB
# on recent GPUs and CUDA 12), and memory the caching allocator reserves but cannot hand out (fragmentation).
CUDA_CONTEXT_BYTES = 1 * GIB
FRAGMENTATION_FRACTION = 0.10


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device needs for a training step, by what holds them; ``other_parts`` and ``overhead_parts``
    name the pieces of ``other`` and ``overhead``; ``advice`` lists changes that would shrink it, with their total."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    other: int
    overhead: int
    other_parts: tuple[tuple[str, int], ...] = ()
    overhead_parts: tuple[tuple[str, int], ...] = ()
    advice: tuple[tuple[str, int], ...] = field(default=(), compare=False)

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.activations + self.other + self.overhead

    def fits(self, device_memory_bytes: int) -> bool:
        return self.total <= device_memory_bytes

    def describe(self, device_memory_bytes: int | None = None) -> str:
        """A few lines: the total and its parts in GiB, against ``device_memory_bytes`` if given, and when it does
        not fit, what would help."""
        unit = size_unit(self.total)  # the parts in the total's unit

        def size_in(size: int) -> str:
            return f"{size / BYTES_IN[unit]:.1f}"

        parts = [("parameters", self.parameters), ("gradients", self.gradients),
                 ("optimizer", self.optimizer_state), ("activations", self.activations),
                 *self.other_parts, *self.overhead_parts]
        line = (f"needs {size_in(self.total)} {unit} per device ("
                + ", ".join(f"{name} {size_in(size)}" for name, size in parts if size) + ")")
        if device_memory_bytes is None:
            return line
        line += f" of {format_bytes(device_memory_bytes, 'GiB')}"
        if self.fits(device_memory_bytes):
            return f"{line}: fits ({format_bytes(device_memory_bytes - self.total, 'GiB')} to spare)"
        helps = [f"{change} ({size_in(total)} {unit}{'' if total > device_memory_bytes else ', fits'})"
                 for change, total in self.advice]
        return f"{line}: does not fit" + (": would help: " + "; ".join(helps) if helps else "")


def estimate_memory(
    build_network: Callable[[], nn.Module],
    step_loss: Callable[[nn.Module, int], torch.Tensor],
    micro_batch_size: int,
    precision: str = "32-true",
    strategy: str = "single",
    data_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    pipeline_stages: int = 1,
    pipeline_microbatches: int | None = None,
    activation_checkpointing: bool = False,
    device_type: str = "cuda",
    blocks: Callable[[nn.Module], Sequence[nn.Module]] | None = None,
    advise: bool = True,
    unsharded_gradients: bool = False,
) -> MemoryEstimate:
    """Per-device bytes of a training step with AdamW for the network ``build_network()`` (built on the meta
    device) whose loss ``step_loss(network, micro_batch_size)`` computes, under ``strategy`` ("single", "ddp" or
    "fsdp": parameters, gradients and optimizer state sharded over ``data_parallel_size``), tensor parallelism
    (the blocks' parameters and activations divided by its size, an approximation), ``pipeline_stages`` (blocks
    divided over them; 1F1B keeps up to that many pipeline micro-batches in flight on the first stage) and
    activation checkpointing of every block. ``unsharded_gradients``: under "fsdp" with gradient accumulation
    reduced once per optimizer step, each rank holds every gradient whole (float32 under mixed precision: FSDP2
    accumulates in its reduce dtype) until the step's last micro-batch. ``device_type`` "cuda" adds the GPU's
    fixed allowances and picks autocast's CUDA op lists; "cpu" neither. With ``advise``, the estimate carries the totals of the changes that
    would shrink it most (see ``MemoryEstimate.describe``)."""
    if strategy not in STRATEGIES:
        raise UserError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    if micro_batch_size < 1 or data_parallel_size < 1 or tensor_parallel_size < 1 or pipeline_stages < 1:
        raise UserError(f"micro batch {micro_batch_size}, data-parallel {data_parallel_size}, tensor-parallel "
                        f"{tensor_parallel_size} and pipeline stages {pipeline_stages} must all be at least 1")
    if strategy == "single" and data_parallel_size > 1:
        raise UserError(f"strategy 'single' with data_parallel_size={data_parallel_size}: use 'ddp' or 'fsdp'")
    profile = profile_network(build_network, step_loss, micro_batch_size, precision, device_type, blocks)
    layout = dict(strategy=strategy, data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
                  pipeline_stages=pipeline_stages, pipeline_microbatches=pipeline_microbatches,
                  activation_checkpointing=activation_checkpointing, device_type=device_type,
                  unsharded_gradients=unsharded_gradients and strategy == "fsdp")
    estimate = spread(profile, micro_batch_size, **layout)
    if not advise:
        return estimate
    advice = []
    if not activation_checkpointing and profile.block_parameters:
        advice.append(("activation checkpointing", spread(profile, micro_batch_size, **{
            **layout, "activation_checkpointing": True}).total))
    if micro_batch_size > 1:
        smaller = micro_batch_size // 2
        advice.append((f"micro batch {smaller}", spread(profile, smaller, **layout).total))
    if strategy != "fsdp" or data_parallel_size == 1:
        ranks = max(2, data_parallel_size)
        advice.append((f"FSDP over {ranks} data-parallel ranks", spread(profile, micro_batch_size, **{
            **layout, "strategy": "fsdp", "data_parallel_size": ranks}).total))
    else:
        advice.append((f"FSDP over {2 * data_parallel_size} data-parallel ranks", spread(profile, micro_batch_size, **{
            **layout, "data_parallel_size": 2 * data_parallel_size}).total))
    if layout["unsharded_gradients"]:
        # the option is HybridShardedStrategy's (with data_parallel_replicate_size 1 it is FSDP2 over every rank)
        advice.append(("HybridShardedStrategy's reduce_gradients_every_micro_batch", spread(profile, micro_batch_size, **{
            **layout, "unsharded_gradients": False}).total))
    if precision_named(precision).name == "32-true":
        mixed = profile_network(build_network, step_loss, micro_batch_size, "bf16-mixed", device_type, blocks)
        advice.append(("bf16-mixed precision", spread(mixed, micro_batch_size, **layout).total))
    advice.sort(key=lambda change: change[1])
    return replace(estimate, advice=tuple(advice))


def spread(
    profile: NetworkProfile,
    micro_batch_size: int,
    strategy: str,
    data_parallel_size: int,
    tensor_parallel_size: int,
    pipeline_stages: int,
    pipeline_microbatches: int | None,
    activation_checkpointing: bool,
    device_type: str,
    unsharded_gradients: bool = False,
) -> MemoryEstimate:
    """The arithmetic of a layout over a measured profile; activations scale linearly with the micro batch."""
    tp, stages = tensor_parallel_size, pipeline_stages
    shards = data_parallel_size if strategy == "fsdp" else 1
    # a stage holds its share of the blocks and, conservatively, everything outside them (with a tied embedding
    # the first and the last stage both hold it); tensor parallelism splits the blocks' matrices
    local_parameters = (profile.other_parameters + sum(profile.block_parameters) / (tp * stages)) / shards
    parameter_bytes = int(local_parameters * profile.precision.parameter_dtype.itemsize)

    scale = micro_batch_size / profile.micro_batch_size
    temporaries = profile.temporary_bytes
    if activation_checkpointing and profile.block_saved_bytes:
        # each block keeps only its input (replicated over tensor-parallel ranks, no sequence parallelism); in
        # backward one block's activations are rebuilt at a time, after the loss's temporaries are gone
        block_part = sum(profile.block_input_bytes) / stages
        temporaries = max(temporaries, max(profile.block_saved_bytes) / tp)
    else:
        block_part = sum(profile.block_saved_bytes) / (tp * stages)
    kept = block_part + profile.other_saved_bytes
    microbatches = 1
    if stages > 1:
        microbatches = pipeline_microbatches_or_default(pipeline_microbatches, stages)
        # 1F1B's first stage holds `stages` pipeline micro-batches (of micro batch / microbatches samples) in flight
        kept *= min(stages, microbatches)
    activations = int(scale * (kept + temporaries) / microbatches)

    other_parts = []
    compute_itemsize = profile.precision.compute_dtype.itemsize
    if strategy == "fsdp":
        # gathered units: the root's parameters, the running block and the one prefetched, in the compute dtype;
        # and one block's unsharded gradients before they are reduce-scattered (float32)
        largest_block = max(profile.block_parameters, default=0) / tp
        gathered = profile.other_parameters * compute_itemsize + 2 * largest_block * compute_itemsize
        parameter_bytes_each = profile.precision.parameter_dtype.itemsize
        other_parts.append(("FSDP gathered", int(gathered + largest_block * parameter_bytes_each)))
        if unsharded_gradients:
            local_whole = profile.other_parameters + sum(profile.block_parameters) / (tp * stages)
            reduce_itemsize = 4 if profile.precision.autocast_dtype else profile.precision.parameter_dtype.itemsize
            other_parts.append(("unsharded gradients under accumulation", int(local_whole * reduce_itemsize)))
    elif profile.weight_copy_bytes:
        share = (profile.other_parameters + sum(profile.block_parameters) / (tp * stages)) / profile.parameter_count
        other_parts.append(("weight copies", int(profile.weight_copy_bytes * share)))
    if strategy == "ddp":
        # torch DDP's reducer allocates flat buckets for all gradients up front, a second copy (Lightning leaves
        # gradient_as_bucket_view off)
        other_parts.append(("DDP buckets", parameter_bytes))

    subtotal = 4 * parameter_bytes + activations + sum(size for _, size in other_parts)
    overhead_parts = []
    if device_type == "cuda":
        overhead_parts = [("CUDA context", CUDA_CONTEXT_BYTES),
                          ("fragmentation", int(FRAGMENTATION_FRACTION * subtotal))]
    return MemoryEstimate(
        parameters=parameter_bytes,
        gradients=parameter_bytes,
        optimizer_state=2 * parameter_bytes,
        activations=activations,
        other=sum(size for _, size in other_parts),
        overhead=sum(size for _, size in overhead_parts),
        other_parts=tuple(other_parts),
        overhead_parts=tuple(overhead_parts),
    )


def visible_device_memory() -> int:
    """Total memory of the first visible GPU; a UserError when there is none, since then the size must be given."""
    if not torch.cuda.is_available():
        raise UserError("no GPU is visible here to read its memory size: give the device memory explicitly "
                        "(e.g. 16GiB or 80GB)")
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def parse_memory_size(text: str) -> int:
    """Bytes of device memory in "16GiB", "16 G" (2^30 each), "80GB" (10^9) or a plain number (core/sizes.py)."""
    return parse_byte_size(text, "device memory")
