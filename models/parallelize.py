"""Spreading a GPT or a BERT over devices, from outside the model, in torchtitan's order.

``build_gpt`` and ``build_bert`` create the model on the meta device (no memory, whatever its size); ``build_gpt``
keeps only this rank's pipeline stage; ``parallelize_and_initialize`` then applies tensor parallelism, activation
checkpointing, compile and FSDP2 in that order, materialises this rank's shards and initialises them. Both models
keep their blocks in ``model.blocks`` and name their projections alike, so every step serves both. Each
parameter's initial value is drawn whole from a generator seeded by (seed, parameter name) and each rank keeps its
own slice, so one seed gives the same model under any strategy, world size and pipeline split.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from core.seeding import derive_seed
from models.bert import BERT, BertConfig
from models.gpt import GPT, GPTConfig
from models.resnet import BasicBlock, ResNet, ResNetConfig

CHECKPOINT_WRAPPER_PREFIX = "_checkpoint_wrapped_module."


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


def build_gpt(
    config: GPTConfig,
    device: torch.device,
    seed: int,
    device_mesh: DeviceMesh | None = None,
    activation_checkpointing: bool = False,
    compile: bool = False,
    param_dtype: torch.dtype | None = None,
    stage: StageSpan | None = None,
) -> GPT:
    """A GPT on ``device``, parallelised over ``device_mesh`` (dims "data_parallel" and "tensor_parallel") if
    given, and initialised from ``seed``. ``param_dtype`` is FSDP2's compute dtype under mixed precision. With a
    ``stage``, only that pipeline stage, its weights equal to the same weights of the whole model."""
    with torch.device("meta"):
        model = GPT(config)
    if stage is not None:
        keep_stage(model, stage)
    # a pipeline runs each stage's forward once per pipeline micro-batch: gathering the shards again each time
    # would cost more than keeping them (torchtitan does the same)
    parallelize_and_initialize(model, device, seed, device_mesh, activation_checkpointing, compile, param_dtype,
                               reshard_after_forward=stage is None)
    return model


def build_bert(
    config: BertConfig,
    device: torch.device,
    seed: int,
    device_mesh: DeviceMesh | None = None,
    activation_checkpointing: bool = False,
    compile: bool = False,
    param_dtype: torch.dtype | None = None,
) -> BERT:
    """A BERT on ``device``, parallelised over ``device_mesh`` (dims "data_parallel" and "tensor_parallel") if
    given, and initialised from ``seed``, as ``build_gpt`` does a GPT. No pipeline parallelism."""
    with torch.device("meta"):
        model = BERT(config)
    parallelize_and_initialize(model, device, seed, device_mesh, activation_checkpointing, compile, param_dtype)
    return model


def build_resnet(config: ResNetConfig, device: torch.device, seed: int, device_mesh: DeviceMesh | None = None) -> ResNet:
    """A ResNet on ``device``, initialised from ``seed`` (drawn on the CPU, so every device and world size start
    alike) and, with a ``device_mesh``, FSDP2-sharded one residual block per unit over its data-parallel dimension.
    Tensor parallelism, activation checkpointing and pipeline stages are not for a network of a few million
    parameters: ``ImageClassifier.check_config`` refuses them."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "resnet"))
        model = ResNet(config).to(device)
    if device_mesh is not None:
        for block in [module for module in model.modules() if isinstance(module, BasicBlock)]:
            fully_shard(block, mesh=device_mesh["data_parallel"])
        fully_shard(model, mesh=device_mesh["data_parallel"])
    return model


def parallelize_and_initialize(
    model: GPT | BERT,
    device: torch.device,
    seed: int,
    device_mesh: DeviceMesh | None,
    activation_checkpointing: bool,
    compile: bool,
    param_dtype: torch.dtype | None,
    reshard_after_forward: bool = True,
) -> None:
    """Tensor parallelism, activation checkpointing, compile and FSDP2, in torchtitan's order, on a model built
    on the meta device; then this rank's shards materialised on ``device`` and initialised from ``seed``."""
    if device_mesh is not None and device_mesh["tensor_parallel"].size() > 1:
        apply_tensor_parallel(model, device_mesh["tensor_parallel"])
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile:
        apply_compile(model)
    if device_mesh is not None:
        apply_fsdp(model, device_mesh["data_parallel"], param_dtype, reshard_after_forward)
    materialize(model, device)
    init_weights(model, seed)


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


def apply_tensor_parallel(model: GPT | BERT, tp_mesh: DeviceMesh) -> None:
    """Megatron-style: the first projection of attention and of the MLP split by output columns (whole heads,
    thanks to GPT's head-interleaved qkv layout and BERT's separate query, key and value), the second by input
    rows, so each block needs one all-reduce forward and one backward per sub-layer. Embeddings, norms and the
    head stay replicated."""
    check_tensor_parallel_size(model.config.n_head, tp_mesh.size())
    attention_inputs = ("attn.query", "attn.key", "attn.value") if isinstance(model, BERT) else ("attn.qkv",)
    plan = {**{name: ColwiseParallel() for name in attention_inputs}, "attn.proj": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, plan)


def check_tensor_parallel_size(n_head: int, tensor_parallel_size: int) -> None:
    """A ValueError unless every tensor-parallel rank gets whole attention heads."""
    if n_head % tensor_parallel_size != 0:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} does not divide the model's {n_head} attention "
                         "heads: choose a size that does")


def apply_activation_checkpointing(model: GPT | BERT) -> None:
    """Keep only each block's input; recompute its activations in backward. The wrapper's state-dict hooks drop
    its name from checkpoint keys, so checkpoints load with or without it."""
    for name, block in model.blocks.items():
        model.blocks[name] = checkpoint_wrapper(block)


def apply_compile(model: GPT | BERT) -> None:
    """Compile each block's forward (all blocks share one compiled graph). Replacing ``forward`` rather than
    wrapping the module keeps parameter names unchanged and leaves FSDP's hooks outside the graph."""
    for block in model.blocks.values():
        block.forward = torch.compile(block.forward)  # type: ignore[method-assign]


def apply_fsdp(model: GPT | BERT, dp_mesh: DeviceMesh, param_dtype: torch.dtype | None = None,
               reshard_after_forward: bool = True) -> None:
    """FSDP2: each block is one unit (gathered just before it runs, freed after unless ``reshard_after_forward``
    is false); the root holds the embeddings, the final norm and the tied head. Gradients are reduced in float32
    whatever the compute dtype."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for block in model.blocks.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)


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
def init_weights(model: GPT | BERT, seed: int) -> None:
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


def local_slice(full: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """This rank's part of ``full``, laid out as ``param`` is (a plain tensor is all of it)."""
    if not isinstance(param, DTensor):
        return full
    # src_data_rank=None: every rank holds the same full tensor, so each just keeps its slice, no communication
    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, parameters: Iterable[nn.Parameter], max_norm: float,
                    pipeline_group: dist.ProcessGroup | None = None,
                    counted: Iterable[nn.Parameter] | None = None) -> torch.Tensor:
    """Scale the gradients of ``parameters`` together so that their global L2 norm is at most ``max_norm``; returns
    the norm before clipping. ``model`` is the module as the strategy wrapped it: under FSDP (1) only the root
    module can add up the norms of its shards; DTensor gradients (FSDP2, tensor parallel) may live on several
    meshes; plain ones (one device, DDP) are torch's case, summed in the order given. Under a pipeline the norm
    is summed over the stages (``pipeline_group``), each stage counting only its ``counted`` parameters."""
    if isinstance(model, FullyShardedDataParallel):
        return model.clip_grad_norm_(max_norm)
    parameters = [param for param in parameters if param.grad is not None]
    if pipeline_group is not None or any(isinstance(param.grad, DTensor) for param in parameters):
        counted = parameters if counted is None else [param for param in counted if param.grad is not None]
        return clip_grad_norm_across_meshes_(parameters, max_norm, counted, pipeline_group)
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm)


@torch.no_grad()
def clip_grad_norm_across_meshes_(parameters: list[nn.Parameter], max_norm: float, counted: list[nn.Parameter],
                                  pipeline_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``clip_grad_norm_`` for DTensor gradients and pipeline stages. torch's own version needs every gradient on
    one device mesh; under tensor parallelism some live on the 2-D (data, tensor) mesh and the replicated ones on
    the data mesh only. Norms of the ``counted`` gradients are taken per mesh, made whole (a sum over the
    shards), combined, and summed over the pipeline stages; then all ``parameters`` are scaled."""
    grads_by_mesh: dict[object, list[torch.Tensor]] = {}
    for param in counted:
        mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
        grads_by_mesh.setdefault(mesh, []).append(param.grad)
    device = parameters[0].grad.device if parameters else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for grads in grads_by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares = squares + norm.float() ** 2
    if pipeline_group is not None:
        dist.all_reduce(squares, group=pipeline_group)
    total_norm = squares.sqrt()
    scale = min(1.0, max_norm / (total_norm.item() + 1e-6))  # one host sync per step
    if scale < 1.0:
        torch._foreach_mul_([param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                             for param in parameters], scale)
    return total_norm
