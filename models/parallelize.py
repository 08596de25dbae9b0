"""Spreading a GPT over devices, from outside the model, in torchtitan's order.

``build_gpt`` creates the model on the meta device (no memory, whatever its size), applies tensor parallelism,
activation checkpointing, compile and FSDP2 in that order, then materialises this rank's shards and initialises
them. Each parameter's initial value is drawn whole from a generator seeded by (seed, parameter name) and each
rank keeps its own slice, so one seed gives the same model under any strategy and world size.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from core.seeding import derive_seed
from models.gpt import GPT, GPTConfig

CHECKPOINT_WRAPPER_PREFIX = "_checkpoint_wrapped_module."


def build_gpt(
    config: GPTConfig,
    device: torch.device,
    seed: int,
    device_mesh: DeviceMesh | None = None,
    activation_checkpointing: bool = False,
    compile: bool = False,
    param_dtype: torch.dtype | None = None,
) -> GPT:
    """A GPT on ``device``, parallelised over ``device_mesh`` (dims "data_parallel" and "tensor_parallel") if
    given, and initialised from ``seed``. ``param_dtype`` is FSDP2's compute dtype under mixed precision."""
    with torch.device("meta"):
        model = GPT(config)
    if device_mesh is not None and device_mesh["tensor_parallel"].size() > 1:
        apply_tensor_parallel(model, device_mesh["tensor_parallel"])
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile:
        apply_compile(model)
    if device_mesh is not None:
        apply_fsdp(model, device_mesh["data_parallel"], param_dtype)
    materialize(model, device)
    init_weights(model, seed)
    return model


def apply_tensor_parallel(model: GPT, tp_mesh: DeviceMesh) -> None:
    """Megatron-style: the first projection of attention and of the MLP split by output columns (whole heads,
    thanks to the head-interleaved qkv layout), the second by input rows, so each block needs one all-reduce
    forward and one backward per sub-layer. Embeddings, norms and the head stay replicated."""
    check_tensor_parallel_size(model.config.n_head, tp_mesh.size())
    plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)


def check_tensor_parallel_size(n_head: int, tensor_parallel_size: int) -> None:
    """A ValueError unless every tensor-parallel rank gets whole attention heads."""
    if n_head % tensor_parallel_size != 0:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} does not divide the model's {n_head} attention "
                         "heads: choose a size that does")


def apply_activation_checkpointing(model: GPT) -> None:
    """Keep only each block's input; recompute its activations in backward. The wrapper's state-dict hooks drop
    its name from checkpoint keys, so checkpoints load with or without it."""
    for index, block in enumerate(model.blocks):
        model.blocks[index] = checkpoint_wrapper(block)


def apply_compile(model: GPT) -> None:
    """Compile each block's forward (all blocks share one compiled graph). Replacing ``forward`` rather than
    wrapping the module keeps parameter names unchanged and leaves FSDP's hooks outside the graph."""
    for block in model.blocks:
        block.forward = torch.compile(block.forward)  # type: ignore[method-assign]


def apply_fsdp(model: GPT, dp_mesh: DeviceMesh, param_dtype: torch.dtype | None = None) -> None:
    """FSDP2: each block is one unit (gathered just before it runs, freed after); the root holds the embeddings,
    the final norm and the tied head. Gradients are reduced in float32 whatever the compute dtype."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate (uninitialised) storage on ``device`` for a meta-device model. Parameters are swapped in place,
    not replaced, so a parameter shared by two modules (the tied head) stays one parameter."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


@torch.no_grad()
def init_weights(model: GPT, seed: int) -> None:
    """GPT-2 initialisation (``GPT.initial_std``) that depends on the seed and the parameter names only."""
    for raw_name, param in model.named_parameters():
        name = raw_name.replace(CHECKPOINT_WRAPPER_PREFIX, "")
        local = param.to_local() if isinstance(param, DTensor) else param
        std = model.initial_std(name)
        if std is None:
            local.fill_(0.0 if name.endswith("bias") else 1.0)
            continue
        generator = torch.Generator(device=local.device).manual_seed(derive_seed(seed, name))
        full = torch.empty(param.shape, device=local.device).normal_(0.0, std, generator=generator)
        local.copy_(local_slice(full, param))


def local_slice(full: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """This rank's part of ``full``, laid out as ``param`` is (a plain tensor is all of it)."""
    if not isinstance(param, DTensor):
        return full
    # src_data_rank=None: every rank holds the same full tensor, so each just keeps its slice, no communication
    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients of ``parameters`` together so that their global L2 norm is at most ``max_norm``; returns
    the norm before clipping. ``model`` is the module as the strategy wrapped it: under FSDP (1) only the root
    module can add up the norms of its shards; DTensor gradients (FSDP2, tensor parallel) may live on several
    meshes; plain ones (one device, DDP) are torch's case, summed in the order given."""
    if isinstance(model, FullyShardedDataParallel):
        return model.clip_grad_norm_(max_norm)
    parameters = [param for param in parameters if param.grad is not None]
    if any(isinstance(param.grad, DTensor) for param in parameters):
        return clip_grad_norm_across_meshes_(parameters, max_norm)
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm)


@torch.no_grad()
def clip_grad_norm_across_meshes_(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` for DTensor gradients. torch's own version needs every gradient on one device mesh;
    under tensor parallelism some live on the 2-D (data, tensor) mesh and the replicated ones on the data mesh
    only. Norms are taken per mesh, made whole (a sum over the shards), then combined."""
    grads_by_mesh: dict[object, list[torch.Tensor]] = {}
    for param in parameters:
        mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
        grads_by_mesh.setdefault(mesh, []).append(param.grad)
    squares = torch.zeros((), dtype=torch.float32)
    for grads in grads_by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares = squares.to(norm.device) + norm.float() ** 2
    total_norm = squares.sqrt()
    scale = min(1.0, max_norm / (total_norm.item() + 1e-6))  # one host sync per step
    if scale < 1.0:
        for grads in grads_by_mesh.values():
            torch._foreach_mul_(grads, scale)
    return total_norm
