"""Spreading any network over devices, from outside the model, in torchtitan's order.

``build_network`` creates a family's network on the meta device (no memory, whatever its size), optionally keeps
only one pipeline stage of it, then applies tensor parallelism (from the family's plan), activation checkpointing
and compile (per repeated block), expert parallelism (a mixture of experts' experts split by expert:
models/parallel/expert_parallel.py) and FSDP2 (each repeated block one unit, the root the rest), materialises this
rank's shards on its device and initialises them. The repeated blocks are found by ``repeated_blocks`` unless
the family names them. Initial weights depend on the seed only, never on the layout: a network with
``initial_std(name)`` (GPT, BERT) draws each parameter whole from a generator seeded by (seed, parameter name),
any other network is built once on the CPU under the seed and each rank copies its slice, so one seed gives the
same model under any strategy, world size and pipeline split.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from fnmatch import fnmatch
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from core.errors import UserError
from core.run_plan import RunPlan
from core.seeding import derive_seed
from models.parallel.expert_parallel import (
    apply_expert_parallel, expert_mesh, expert_parallel_of, expert_weights,
)

# a family's tensor-parallel plan: module-name patterns ("blocks.*.attn.qkv") -> how that Linear is split.
# "colwise": by output features (each rank a slice of the outputs), "rowwise": by input features (each rank a
# partial sum, all-reduced); a colwise layer followed by a rowwise one needs one all-reduce forward and backward
TensorParallelPlan = dict[str, Literal["colwise", "rowwise"]]
TENSOR_PARALLEL_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
CHECKPOINT_WRAPPER_PREFIX = "_checkpoint_wrapped_module."


def build_network(
    make_network: Callable[[], nn.Module],
    device: torch.device,
    seed: int,
    device_mesh: DeviceMesh | None = None,
    tensor_parallel_plan: TensorParallelPlan | None = None,
    blocks: Callable[[nn.Module], list[nn.Module]] | None = None,
    activation_checkpointing: bool = False,
    compile: bool = False,
    autocast_dtype: torch.dtype | None = None,
    keep_stage: Callable[[nn.Module], None] | None = None,
    pretrained: Callable[[str], torch.Tensor] | None = None,
    data_parallel_replicas: int = 1,
    expert_parallel_size: int = 1,
) -> nn.Module:
    """``make_network()`` on ``device``, parallelised over ``device_mesh`` (dims "data_parallel" and
    "tensor_parallel") if given, with FSDP2 over ``data_parallel_replicas`` replicas of the data-parallel ranks
    (``fsdp_mesh``), and initialised from ``seed``. ``autocast_dtype`` (mixed precision's) is the dtype FSDP2 gathers
    the weights in, except in a network with batch norms, whose float32 running statistics cannot meet
    half-precision weights (autocast then runs its convolutions in half precision, as under DDP). ``keep_stage``
    removes what other pipeline stages hold, so that only this rank's stage is built. ``expert_parallel_size`` > 1
    splits the MoE layers' experts over that many data-parallel ranks (models/parallel/expert_parallel.py), which
    FSDP2 then leaves out. ``pretrained`` reads each parameter's full tensor by name (the family's Hugging Face
    adapter, models/interchange.py) instead of initialising it from ``seed``."""
    with torch.device("meta"):
        network = make_network()
    if keep_stage is not None:
        keep_stage(network)
    if device_mesh is not None and device_mesh["tensor_parallel"].size() > 1:
        apply_tensor_parallel(network, device_mesh["tensor_parallel"], tensor_parallel_plan)
    block_list = (blocks or repeated_blocks)(network)
    if activation_checkpointing:
        block_list = apply_activation_checkpointing(network, block_list)
    if compile:
        apply_compile(block_list)
    experts_apart: set[nn.Parameter] = set()
    if expert_parallel_size > 1:
        apply_expert_parallel(network, expert_mesh(device_mesh, expert_parallel_size))
        experts_apart = set(expert_weights(network))
    if shards_data_parallel(device_mesh, pipeline_stage=keep_stage is not None):
        # a pipeline runs each stage's forward once per pipeline micro-batch: gathering the shards again each time
        # would cost more than keeping them (torchtitan does the same)
        batch_norms = any(isinstance(module, nn.modules.batchnorm._BatchNorm) for module in network.modules())
        apply_fsdp(network, block_list, fsdp_mesh(device_mesh, data_parallel_replicas),
                   None if batch_norms else autocast_dtype,
                   reshard_after_forward=keep_stage is None, ignored_params=experts_apart)
    materialize(network, device)
    if pretrained is not None:
        load_weights(network, pretrained)
    else:
        initialize(network, seed, make_network)
    return network


def shards_data_parallel(device_mesh: DeviceMesh | None, pipeline_stage: bool) -> bool:
    """Whether FSDP2 wraps the network on ``device_mesh``: always over several data-parallel ranks, and over one too
    (making every parameter a DTensor), except for a pipeline stage on a mesh of one data- and one tensor-parallel
    rank. There it would shard over one rank, and its hooks and gradient copies around every pipeline micro-batch
    cost about 3 % of the stage's compute on CPU (benchmarks/RESULTS.md, pipeline speed). Under tensor
    parallelism the stage keeps it, so that the optimizer's fused step never meets DTensors and plain tensors
    together."""
    if device_mesh is None:
        return False
    alone = device_mesh["data_parallel"].size() == 1 and device_mesh["tensor_parallel"].size() == 1
    return not (pipeline_stage and alone)


def fsdp_mesh(device_mesh: DeviceMesh, replicas: int = 1) -> DeviceMesh:
    """The mesh FSDP2 shards over: the data-parallel dimension of ``device_mesh``, or with ``replicas`` over 1 (hybrid
    sharding, app/strategies/hybrid_sharding.py) that dimension unflattened row-major into a 2-D
    (data_parallel_replicate, data_parallel_shard) mesh, on which fully_shard shards along the second dimension and
    all-reduces the gradient shards along the first (HSDP). Unflattening keeps the root mesh that tensor
    parallelism's dimension slices, so the two compose; it makes the two dimensions' process groups, a collective
    call every rank makes here."""
    if replicas == 1:
        return device_mesh["data_parallel"]
    shards = device_mesh["data_parallel"].size() // replicas
    grid = device_mesh._unflatten("data_parallel", (replicas, shards),
                                  ("data_parallel_replicate", "data_parallel_shard"))
    return grid["data_parallel_replicate", "data_parallel_shard"]


def repeated_blocks(network: nn.Module) -> list[nn.Module]:
    """The network's repeated layers: the children of its ModuleLists, ModuleDicts and Sequentials that hold one
    class only (GPT's blocks, a BERT encoder's layers, a ResNet's residual blocks over its stages), of the class that
    holds the most parameters. A family whose network is laid out otherwise names its blocks itself."""
    by_class: dict[type, list[nn.Module]] = {}
    for module in network.modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) and len(module) > 0:
            children = list(module.children())
            if len({type(child) for child in children}) == 1 and not isinstance(children[0], nn.Sequential):
                by_class.setdefault(type(children[0]), []).extend(children)
    if not by_class:
        return []
    return max(by_class.values(), key=lambda blocks: sum(p.numel() for block in blocks for p in block.parameters()))


def apply_tensor_parallel(network: nn.Module, tp_mesh: DeviceMesh, plan: TensorParallelPlan | None) -> None:
    """Split the Linear layers the plan names over the tensor-parallel ranks. Each must split evenly: a UserError
    names the first that does not (its outputs for colwise, inputs for rowwise)."""
    if not plan:
        raise UserError(f"{type(network).__name__} has no tensor-parallel plan: use tensor_parallel_size 1")
    size = tp_mesh.size()
    matched = False
    for name, module in network.named_modules():
        style = next((style for pattern, style in plan.items() if fnmatch(name, pattern)), None)
        if style is None:
            continue
        matched = True
        features = module.out_features if style == "colwise" else module.in_features
        if not isinstance(module, nn.Linear) or features % size != 0:
            raise UserError(f"tensor_parallel_size={size} cannot split {name} ({style}, {features} features): choose "
                            "a size that divides it")
    if not matched:
        raise UserError(f"the tensor-parallel plan {list(plan)} names no module of {type(network).__name__}")
    parallelize_module(network, tp_mesh, {pattern: TENSOR_PARALLEL_STYLES[style]() for pattern, style in plan.items()})


def check_tensor_parallel_size(n_head: int, tensor_parallel_size: int) -> None:
    """A ValueError unless every tensor-parallel rank gets whole attention heads."""
    if n_head % tensor_parallel_size != 0:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} does not divide the model's {n_head} attention "
                         "heads: choose a size that does")


def apply_activation_checkpointing(network: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """Keep only each block's input; recompute its activations in backward. Returns the wrapped blocks, which
    replace the blocks in their parents. The wrapper's state-dict hooks drop its name from checkpoint keys, so
    checkpoints load with or without it."""
    parents = {id(child): (parent, name) for parent in network.modules() for name, child in parent.named_children()}
    wrapped = []
    for block in blocks:
        parent, name = parents[id(block)]
        wrapper = checkpoint_wrapper(block)
        setattr(parent, name, wrapper)
        wrapped.append(wrapper)
    return wrapped


def apply_compile(blocks: list[nn.Module]) -> None:
    """Compile each block's forward (blocks of one class share one compiled graph). Replacing ``forward`` rather
    than wrapping the module keeps parameter names unchanged and leaves FSDP's hooks outside the graph."""
    for block in blocks:
        block.forward = torch.compile(block.forward)  # type: ignore[method-assign]


def apply_fsdp(network: nn.Module, blocks: list[nn.Module], dp_mesh: DeviceMesh,
               param_dtype: torch.dtype | None = None, reshard_after_forward: bool = True,
               ignored_params: set[nn.Parameter] | None = None) -> None:
    """FSDP2: each block is one unit (gathered just before it runs, freed after unless ``reshard_after_forward``
    is false); the root holds the rest (embeddings, norms, a tied head), except ``ignored_params`` (experts spread
    over ranks their own way). Gradients are reduced in float32 whatever the compute dtype."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for module in [*blocks, network]:
        fully_shard(module, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward,
                    ignored_params=ignored_params)


def choose_gradient_reduction(network: nn.Module, plan: RunPlan, batch_index: int) -> None:
    """Before a micro-batch's backward under FSDP2, which of its gradient collectives run: all of them on the
    optimizer step's last micro-batch; on the others none (each rank adds up the unsharded gradients: one reduction
    per step, as DDP's no_sync, which Lightning does not do for FSDP2), or with
    ``plan.reduce_gradients_every_micro_batch`` the reduce-scatter only (each rank adds up its shard: less memory).
    Under hybrid sharding the shards are all-reduced across the replicas on the last micro-batch only, either way;
    experts spread over ranks (models/parallel/expert_parallel.py) are reduced on the last micro-batch only."""
    expert_parallel = expert_parallel_of(network)
    if expert_parallel is not None:
        expert_parallel.last_micro_batch = plan.ends_optimizer_step(batch_index)
    if not isinstance(network, FSDPModule):
        return
    last = plan.ends_optimizer_step(batch_index)
    network.set_requires_gradient_sync(last or plan.reduce_gradients_every_micro_batch)
    network.set_requires_all_reduce(last)


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate (uninitialised) storage on ``device`` for a meta-device model. Parameters are swapped in place,
    not replaced, so a parameter shared by two modules (the tied head) stays one parameter."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def initialize(network: nn.Module, seed: int, make_network: Callable[[], nn.Module]) -> None:
    """Initial weights that depend on the seed only: the network's ``initial_std`` where it has one (drawn
    parameter by parameter, so a model of any size costs one parameter's memory), else ``make_network()`` built
    on the CPU under the seed, its parameters and buffers copied (each rank its slice)."""
    if hasattr(network, "initial_std"):
        init_weights(network, seed)
    else:
        copy_reference_weights(network, seed, make_network)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """The model's own initialisation (``GPT.initial_std``, ``BERT.initial_std``), depending on the seed and the
    parameter names only."""
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


@torch.no_grad()
def copy_reference_weights(network: nn.Module, seed: int, make_network: Callable[[], nn.Module]) -> None:
    """Build the whole network on the CPU under ``seed`` (its modules' own initialisation) and copy every parameter
    and buffer into ``network``, each rank its own slice."""
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(derive_seed(seed, "initial weights"))
        built = make_network()
    # buffers a state dict leaves out (non-persistent: rotary frequencies) are uninitialised after to_empty too
    reference = {**dict(built.named_parameters()), **dict(built.named_buffers())}
    for raw_name, tensor in [*network.named_parameters(), *network.named_buffers()]:
        name = raw_name.replace(CHECKPOINT_WRAPPER_PREFIX, "")
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        local.copy_(local_slice(reference[name].detach().to(local.device), tensor))


@torch.no_grad()
def load_weights(network: nn.Module, read: Callable[[str], torch.Tensor]) -> None:
    """Every parameter from ``read(name)``, its full tensor in the network's layout (a pretrained model's), each
    rank keeping its own slice: one tensor at a time, so no rank holds the whole model."""
    for raw_name, param in network.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        local.copy_(local_slice(read(raw_name.replace(CHECKPOINT_WRAPPER_PREFIX, "")).to(local.device), param))


def local_slice(full: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """This rank's part of ``full``, laid out as ``param`` is (a plain tensor is all of it)."""
    if not isinstance(param, DTensor):
        return full
    # src_data_rank=None: every rank holds the same full tensor, so each just keeps its slice, no communication
    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()


class GradientNorms:
    """The L2 norms of a set of gradients from one pass over them, one per device mesh they live on (a DTensor
    gradient's norm is this rank's part of it): the bad-step guard checks this rank's part for NaN and inf without
    communicating, and clipping makes them whole, over the meshes and the pipeline stages, into the global norm.
    (torch's clip_grad_norm_ needs every gradient on one mesh: under tensor parallelism some live on the 2-D (data,
    tensor) mesh and the replicated ones on the data mesh only.)"""

    def __init__(self, grads: Iterable[torch.Tensor]) -> None:
        by_mesh: dict[object, list[torch.Tensor]] = {}
        for grad in grads:
            by_mesh.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
        with torch.no_grad():
            self.parts = [torch.nn.utils.get_total_norm(grads, norm_type=2.0) for grads in by_mesh.values()]

    def finite_here(self) -> torch.Tensor:
        """Whether this rank's gradients are all finite, as one tensor on their device (no host sync)."""
        if not self.parts:
            return torch.ones((), dtype=torch.bool)
        local = [part.to_local() if isinstance(part, DTensor) else part for part in self.parts]
        return torch.isfinite(torch.stack(local).float().sum())

    def total(self, pipeline_group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """The global norm, float32: the sum of squares over every mesh's shards and, under a pipeline, the stages
        (each stage having counted only its own gradients)."""
        wholes = [(part.full_tensor() if isinstance(part, DTensor) else part).float() for part in self.parts]
        if len(wholes) == 1 and pipeline_group is None:
            return wholes[0]  # the norm itself, bit for bit torch's clip_grad_norm_'s
        squares = torch.zeros((), dtype=torch.float32, device=wholes[0].device if wholes else None)
        for whole in wholes:
            squares = squares + whole ** 2
        if pipeline_group is not None:
            dist.all_reduce(squares, group=pipeline_group)
        return squares.sqrt()


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, parameters: Iterable[nn.Parameter], max_norm: float,
                    norms: GradientNorms | None = None,
                    pipeline_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Scale the gradients of ``parameters`` together so that their global L2 norm is at most ``max_norm``; returns
    the norm before clipping. ``norms`` are those of the gradients that count towards it, if already taken (under a
    pipeline, this stage's own, summed over the stages in ``pipeline_group``), else all of ``parameters``'.
    ``model`` is the module as the strategy wrapped it: under FSDP (1) only the root module can add up the norms of
    its shards, so it takes its own. The scale stays on the device, as in torch's clip_grad_norm_: the host never
    waits for the gradients."""
    if isinstance(model, FullyShardedDataParallel):
        return model.clip_grad_norm_(max_norm)
    grads = [param.grad for param in parameters if param.grad is not None]
    total_norm = (norms or GradientNorms(grads)).total(pipeline_group)
    grads = [grad.to_local() if isinstance(grad, DTensor) else grad for grad in grads]
    if grads:
        scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, scale.to(grads[0].device))
    return total_norm
