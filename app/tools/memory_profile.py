"""What one training step of a network holds, measured on the meta device: the profile that app/tools/memory.py
spreads over a layout, and the step losses it is measured with.

Activations are measured, not derived from a per-family formula: the forward and backward run on the meta device
(shapes and dtypes, no data), and ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd keeps for
backward; they are counted once per storage (q, k and v are views of one qkv output). A dispatch mode follows every tensor the step creates, so
that the peak of the temporaries (the logits, log-softmax and their gradients around the loss) is measured too.
Attention is counted as the fused kernels (flash, memory-efficient) run it on GPUs and CPUs, not as the math path
the meta device would take (see ``MetaStep``), except where the CPU takes that path too: with attention dropout.

Autocast does nothing on the meta device (it dispatches on the CPU and CUDA keys only), so mixed precision is
emulated above autograd, as autocast itself sits: the ops autocast runs in half precision (matrix products,
convolutions, attention) get their floating inputs cast first, the ops it runs in float32 on that device type
get theirs cast up, and a parameter's cast is made once per step and kept, as autocast's cast cache does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from core.precision import Precision, precision_named
from models.parallel.parallelize import repeated_blocks

if TYPE_CHECKING:
    from models.module import CohortModule

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
    it is gone), so that the bytes alive at each op can be added up afterwards. A finalizer on each storage notes
    its death as it happens (torch keeps a storage's Python object as long as the storage lives), where polling
    every live storage at every op took minutes for a network of tens of thousands of ops (Mixtral's)."""

    def __init__(self) -> None:
        super().__init__()
        self.op_index = 0
        self.live: dict[int, tuple[weakref.finalize, int]] = {}  # storage key -> (its finalizer, entry index)
        self.entries: list[list[int]] = []  # [key, bytes, born, died]; died = -1 while alive

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        output = func(*args, **(kwargs or {}))
        self.op_index += 1
        for tensor in tree_leaves(output):
            if isinstance(tensor, torch.Tensor) and storage_key(tensor) not in self.live:
                storage = tensor.untyped_storage()
                key = storage_key(tensor)
                self.live[key] = (weakref.finalize(storage, self.died, key), len(self.entries))
                self.entries.append([key, storage.nbytes(), self.op_index, -1])
        return output

    def died(self, key: int) -> None:
        """A storage freed since the last op: gone from the next op on (a freed address may be reused by it)."""
        _, entry = self.live.pop(key)
        self.entries[entry][3] = self.op_index + 1

    def __exit__(self, *exc_info: Any) -> None:
        for finalizer, _ in self.live.values():  # what is freed after the step was alive until its end
            finalizer.detach()
        super().__exit__(*exc_info)

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
