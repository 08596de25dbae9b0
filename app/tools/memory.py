"""Per-device memory of a training step, estimated before the job starts: does this config fit on that GPU?

    estimate = estimate_memory(lambda: GPT(gpt_config("gpt2")), next_token_loss(1024, 50257), micro_batch_size=8,
                               precision="bf16-mixed", strategy="fsdp", data_parallel_size=8)
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
formula: the forward and backward run on the meta device (shapes and dtypes, no data), and
``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd keeps for backward; they are counted once
per storage (q, k and v are views of one qkv output). A dispatch mode follows every tensor the step creates, so
that the peak of the temporaries (the logits, log-softmax and their gradients around the loss) is measured too.
Attention is counted as the fused kernels (flash, memory-efficient) run it on GPUs and CPUs, not as the math path
the meta device would take (see ``MetaStep``), except where the CPU takes that path too: with attention dropout.

Autocast does nothing on the meta device (it dispatches on the CPU and CUDA keys only), so mixed precision is
emulated above autograd, as autocast itself sits: the ops autocast runs in half precision (matrix products,
convolutions, attention) get their floating inputs cast first, the ops it runs in float32 on that device type
get theirs cast up, and a parameter's cast is made once per step and kept, as autocast's cast cache does.

The total adds every line, so it is the peak of a step whose gradients are alive while activations are: a step
with gradient accumulation (gradients carry over from micro-batch to micro-batch), or any step under DDP. With one
micro-batch per step and gradients set to None in between, the real peak is lower by up to the gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from core.errors import UserError
from core.pipeline_schedules import pipeline_microbatches_or_default
from core.precision import Precision, precision_named
from core.sizes import BYTES_IN, GIB, format_bytes, parse_byte_size, size_unit
from models.parallel.parallelize import repeated_blocks

if TYPE_CHECKING:
    from models.module import CohortModule

STRATEGIES = ("single", "ddp", "fsdp")  # fsdp: FSDP, FSDP2 and ModelParallelStrategy (fully sharded)

# Allowances on a GPU, not measured: the CUDA context with cuBLAS/cuDNN workspaces and NCCL's buffers (0.5-1 GiB
# on recent GPUs and CUDA 12), and memory the caching allocator reserves but cannot hand out (fragmentation).
CUDA_CONTEXT_BYTES = 1 * GIB
FRAGMENTATION_FRACTION = 0.10

# The ops autocast runs in its half-precision dtype, on CPU and CUDA alike (torch's autocast_mode.h), by the
# name of the Python function or Tensor method that reaches them.
AUTOCAST_HALF = frozenset({
    "linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "addbmm", "baddbmm", "einsum", "mv",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu",
    "scaled_dot_product_attention",
})
# The ops autocast runs in float32 (their inputs cast up), per device type. On the CPU norms and softmax stay in
# the input's dtype (checked against torch.autocast("cpu") in tests/test_memory.py).
AUTOCAST_FLOAT32 = {
    "cuda": frozenset({
        "layer_norm", "group_norm", "softmax", "log_softmax", "softmin", "cross_entropy", "nll_loss", "mse_loss",
        "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "binary_cross_entropy_with_logits", "exp", "log",
        "log1p", "expm1", "pow", "__pow__", "rsqrt", "reciprocal", "norm", "normalize", "sum", "prod", "cumsum",
        "cumprod", "softplus", "logsumexp", "cosine_similarity", "cdist",
    }),
    "cpu": frozenset({
        "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
        "binary_cross_entropy", "binary_cross_entropy_with_logits", "cdist", "prod", "group_norm",
    }),
}


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


@dataclass(frozen=True)
class NetworkProfile:
    """What one forward and backward of the whole network at ``micro_batch_size`` holds, measured on the meta
    device; ``estimate_memory`` spreads it over a layout."""

    micro_batch_size: int
    precision: Precision
    block_parameters: tuple[int, ...]  # parameters of each repeated block
    other_parameters: int  # embeddings, heads, final norms: everything outside the blocks
    block_saved_bytes: tuple[int, ...]  # bytes autograd saves inside each block
    other_saved_bytes: int  # bytes it saves outside the blocks (embeddings, head, loss)
    block_input_bytes: tuple[int, ...]  # each block's input: what activation checkpointing keeps
    temporary_bytes: int  # the peak of everything alive in the step above what is saved (around the loss)
    weight_copy_bytes: int  # autocast's compute-dtype copies of the weights that backward reads

    @property
    def parameter_count(self) -> int:
        return sum(self.block_parameters) + self.other_parameters


def storage_key(tensor: torch.Tensor) -> int:
    """One number per storage, shared by all views of it; meta tensors have storages too (with no data)."""
    return StorageWeakRef(tensor.untyped_storage()).cdata


def storage_bytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()


class LiveTensors(TorchDispatchMode):
    """Follows the storage of every tensor an op creates from birth (op index) to death (first op index at which
    it is gone), so that the bytes alive at each op can be added up afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.op_index = 0
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}  # storage key -> (reference, entry index)
        self.entries: list[list[int]] = []  # [key, bytes, born, died]; died = -1 while alive

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        output = func(*args, **(kwargs or {}))
        self.op_index += 1
        for key, (reference, entry) in list(self.live.items()):  # before adding: a freed address may be reused
            if reference.expired():
                self.entries[entry][3] = self.op_index
                del self.live[key]
        for tensor in tree_leaves(output):
            if isinstance(tensor, torch.Tensor) and storage_key(tensor) not in self.live:
                storage = tensor.untyped_storage()
                self.live[storage_key(tensor)] = (StorageWeakRef(storage), len(self.entries))
                self.entries.append([storage_key(tensor), storage.nbytes(), self.op_index, -1])
        return output

    def peak_bytes(self, excluded: set[int]) -> int:
        """The most bytes alive at once, leaving out the storages in ``excluded`` (keys of tensors alive at the end)."""
        change = [0] * (self.op_index + 2)
        for key, size, born, died in self.entries:
            if died == -1 and key in excluded:
                continue
            change[born] += size
            change[died if died != -1 else self.op_index + 1] -= size
        peak = running = 0
        for delta in change:
            running += delta
            peak = max(peak, running)
        return peak


class MetaStep(TorchFunctionMode):
    """What the meta device would otherwise get wrong about a real step, fixed above autograd.

    Autocast does not apply on the meta device: with ``dtype`` set, its casts are made here, where autocast sits
    (above autograd), so autograd records them and saves their outputs as it does autocast's. And attention on
    the meta device takes the math path, which saves the (B, nh, T, T) attention matrix; on GPUs and CPUs
    ``scaled_dot_product_attention`` runs a fused kernel (flash, memory-efficient) that saves only q, k, v, the
    output and a (B, nh, T) log-sum-exp: the CPU flash kernel stands in for them here. The CPU's flash kernel has no
    dropout, though: with ``dropout_p`` > 0 torch takes the math path there, which saves the attention probabilities,
    the dropout mask and the dropped probabilities, each (B, nh, T, T) (BERT's 0.1); so does the meta device."""

    def __init__(self, dtype: torch.dtype | None, device_type: str, parameters: Sequence[nn.Parameter]) -> None:
        super().__init__()
        self.dtype = dtype
        self.float32_ops = AUTOCAST_FLOAT32[device_type]
        self.device_type = device_type
        self.parameter_ids = {id(parameter) for parameter in parameters}
        self.cache: dict[int, torch.Tensor] = {}  # autocast casts each weight once per autocast region

    def cast(self, value: Any, dtype: torch.dtype) -> Any:
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dtype == dtype:
            return value
        if id(value) in self.parameter_ids:
            if id(value) not in self.cache:
                self.cache[id(value)] = value.to(dtype)
            return self.cache[id(value)]
        return value.to(dtype)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        kwargs = kwargs or {}
        if self.dtype is not None and name in AUTOCAST_HALF:
            args, kwargs = tree_map(lambda value: self.cast(value, self.dtype), (args, kwargs))
        elif self.dtype is not None and (name in self.float32_ops or name == "cross_entropy_loss"):
            args, kwargs = tree_map(lambda value: self.cast(value, torch.float32), (args, kwargs))
        if name == "scaled_dot_product_attention" and not kwargs.get("enable_gqa"):
            dropout_p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            if self.device_type == "cuda" or dropout_p == 0.0:  # else the math path, as on the CPU
                return fused_attention(*args, **kwargs)
        return func(*args, **kwargs)


def fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                    scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` through a fused kernel, whatever the device would pick on meta."""
    output, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return output


def profile_network(
    build_network: Callable[[], nn.Module],
    step_loss: Callable[[nn.Module, int], torch.Tensor],
    micro_batch_size: int,
    precision: str,
    device_type: str = "cuda",
    blocks: Callable[[nn.Module], Sequence[nn.Module]] | None = None,
) -> NetworkProfile:
    """Build the network on the meta device and run ``step_loss(network, micro_batch_size)`` (which makes the
    inputs, on the default device, and returns the loss) and its backward there, recording what is saved."""
    resolved = precision_named(precision)
    with torch.device("meta"):
        network = build_network().to(resolved.parameter_dtype).train()
        parameters = list(network.parameters())  # each once: a tied weight is one parameter
        block_list = list(blocks(network) if blocks is not None else repeated_blocks(network))
        block_parameters = tuple(sum(p.numel() for p in block.parameters()) for block in block_list)
        parameter_keys = {storage_key(p) for p in parameters}

        current_block: list[int | None] = [None]
        block_inputs = [0] * len(block_list)
        saved: dict[int, tuple[int, int | None]] = {}  # storage key -> (bytes, block index or None)

        def enter(index: int) -> Callable[..., None]:
            def hook(module: nn.Module, args: tuple) -> None:
                current_block[0] = index
                block_inputs[index] = sum(storage_bytes(a) for a in args if isinstance(a, torch.Tensor))
            return hook

        def leave(module: nn.Module, args: tuple, output: Any) -> None:
            current_block[0] = None

        handles = [block.register_forward_pre_hook(enter(index)) for index, block in enumerate(block_list)]
        handles += [block.register_forward_hook(leave) for block in block_list]

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            key = storage_key(tensor)
            if key not in saved:  # the first holder owns it: a block's output is saved by the next block
                saved[key] = (storage_bytes(tensor), current_block[0])
            return tensor

        tracker = LiveTensors()
        step = MetaStep(resolved.autocast_dtype, device_type, parameters)
        try:
            with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                with step:
                    loss = step_loss(network, micro_batch_size)
                copies = {storage_key(copy): storage_bytes(copy) for copy in step.cache.values()}
                loss.backward()
                del loss
        finally:
            for handle in handles:
                handle.remove()
        gradient_keys = {storage_key(p.grad) for p in parameters if p.grad is not None}
        step.cache.clear()
    # autocast's cached copies count while autograd keeps them (weights); a bias's copy is gone after the forward
    copies = {key: size for key, size in copies.items() if key in saved}
    activations = {key: value for key, value in saved.items() if key not in parameter_keys and key not in copies}
    block_saved = [0] * len(block_list)
    for size, owner in activations.values():
        if owner is not None:
            block_saved[owner] += size
    other_saved = sum(size for size, owner in activations.values() if owner is None)
    peak = tracker.peak_bytes(excluded=gradient_keys | parameter_keys) - sum(copies.values())
    return NetworkProfile(
        micro_batch_size=micro_batch_size,
        precision=resolved,
        block_parameters=block_parameters,
        other_parameters=sum(p.numel() for p in parameters) - sum(block_parameters),
        block_saved_bytes=tuple(block_saved),
        other_saved_bytes=other_saved,
        block_input_bytes=tuple(block_inputs),
        temporary_bytes=max(0, peak - sum(block_saved) - other_saved),
        weight_copy_bytes=sum(copies.values()),
    )


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
) -> MemoryEstimate:
    """Per-device bytes of a training step with AdamW for the network ``build_network()`` (built on the meta
    device) whose loss ``step_loss(network, micro_batch_size)`` computes, under ``strategy`` ("single", "ddp" or
    "fsdp": parameters, gradients and optimizer state sharded over ``data_parallel_size``), tensor parallelism
    (the blocks' parameters and activations divided by its size, an approximation), ``pipeline_stages`` (blocks
    divided over them; 1F1B keeps up to that many pipeline micro-batches in flight on the first stage) and
    activation checkpointing of every block. ``device_type`` "cuda" adds the GPU's fixed allowances and picks
    autocast's CUDA op lists; "cpu" neither. With ``advise``, the estimate carries the totals of the changes that
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
                  activation_checkpointing=activation_checkpointing, device_type=device_type)
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


def next_token_loss(sequence_length: int, vocab_size: int) -> Callable[[nn.Module, int], torch.Tensor]:
    """``step_loss`` for a network mapping token ids (B, T) to logits (B, T, vocab): cross-entropy against
    next tokens, as models/causal_language_model.py's batch_loss computes it."""
    def step_loss(network: nn.Module, micro_batch_size: int) -> torch.Tensor:
        tokens = torch.zeros(micro_batch_size, sequence_length, dtype=torch.long)
        logits = network(tokens)  # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    return step_loss


def module_step_loss(model: CohortModule, sequence_length: int) -> Callable[[nn.Module, int], torch.Tensor]:
    """``step_loss`` for any model family: its example batch of ``micro_batch_size`` samples, made on the meta device,
    through its own ``batch_loss``. What ``cohort doctor`` estimates with (pass ``model.plain_network`` as
    ``build_network``); ``sequence_length`` is the data's, which families without sequences ignore."""
    meta = torch.device("meta")

    def step_loss(network: nn.Module, micro_batch_size: int) -> torch.Tensor:
        return model.batch_loss(network, model.example_batch(micro_batch_size, sequence_length, meta))
    return step_loss


def visible_device_memory() -> int:
    """Total memory of the first visible GPU; a UserError when there is none, since then the size must be given."""
    if not torch.cuda.is_available():
        raise UserError("no GPU is visible here to read its memory size: give the device memory explicitly "
                        "(e.g. 16GiB or 80GB)")
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def parse_memory_size(text: str) -> int:
    """Bytes of device memory in "16GiB", "16 G" (2^30 each), "80GB" (10^9) or a plain number (core/sizes.py)."""
    return parse_byte_size(text, "device memory")
