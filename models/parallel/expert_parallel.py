"""Expert parallelism (EP), applied from outside the model as torchtitan's ExpertParallel does: each MoE layer's
stacked expert weights (models/routed_experts.py ``Experts``) are split along their first dimension, the experts, over
``expert_parallel_size`` of the data-parallel ranks, and the layer's forward exchanges the routed tokens with the
ranks that hold their experts.

The data-parallel ranks form a row-major (expert_replicate, expert_parallel) grid: rank r of the data-parallel
dimension holds experts [e x E / P, (e + 1) x E / P) with e = r mod P (P = expert_parallel_size, E = n_expert), and
the data_parallel_size / P ranks with the same e hold the same experts (replicas). Each expert weight is a DTensor
on that grid, placed (Replicate(), Shard(0)), so checkpoints, consolidation and the gradient norm see the whole
tensor; FSDP2 shards the rest of the network over the data-parallel ranks (all of them, or under hybrid sharding
each replica's) and leaves the experts alone.

A forward on rank r, which routed its own tokens: the counts per expert go to every rank of its expert-parallel
group (all-to-all), then each rank's tokens go to the ranks of their experts (all-to-all, torch's autograd-aware
one, so backward sends the gradients back the same way); the received rows, which arrive by source rank, are
regrouped by local expert, the local experts run on them, and their outputs return in the order they came (the
reverse all-to-all). Dropped choices (rows past the counts) never leave the rank: their outputs are zero.

Gradients: each rank's loss is the mean over its own samples, and the all-to-all's backward adds every source
rank's contribution to the experts that served it, so an expert's gradient on its rank is the sum, over the ranks
of its expert-parallel group, of their losses' gradients. Summed over the replicas and divided by the
data-parallel size it is the mean over every rank's loss, what FSDP2 makes of every other gradient and what one
process computes over the global batch. That happens once per optimizer step, after its last micro-batch's
backward (``reduce_expert_gradients``, which ``choose_gradient_reduction`` tells which one that is): the
micro-batches before add up locally.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from models.routed_experts import Experts, expert_outputs

EXPERT_PLACEMENTS = (Replicate(), Shard(0))  # over (expert_replicate, expert_parallel)


@dataclass
class ExpertParallel:
    """A network's split experts: how this rank's expert gradients become the global batch's mean and when, and
    the time points around the token exchanges for whoever times them."""

    replicas: dist.ProcessGroup | None  # the ranks holding the same experts; None where there is one
    scale: float  # 1 / data-parallel size
    last_micro_batch: bool = True  # set before each backward by choose_gradient_reduction
    # makes a time point (the monitor's Marker: a CUDA event on GPUs); None: the exchanges are not timed
    mark: Callable[[], object] | None = None
    exchanges: list[tuple[object, object]] = field(default_factory=list)  # (start, end) of each forward exchange


# each expert-parallel network's state, for choose_gradient_reduction and the monitor
EXPERT_PARALLEL: WeakKeyDictionary[nn.Module, ExpertParallel] = WeakKeyDictionary()


def expert_parallel_of(network: nn.Module) -> ExpertParallel | None:
    """The network's expert-parallel state; None where its experts are not split over ranks."""
    return EXPERT_PARALLEL.get(network)


def expert_mesh(device_mesh: DeviceMesh, expert_parallel_size: int) -> DeviceMesh:
    """The (expert_replicate, expert_parallel) grid of the data-parallel ranks: their dimension unflattened
    row-major, so consecutive data-parallel ranks (within a node) exchange tokens. A collective call every rank
    makes here (it creates the two dimensions' process groups)."""
    replicas = device_mesh["data_parallel"].size() // expert_parallel_size
    grid = device_mesh._unflatten("data_parallel", (replicas, expert_parallel_size),
                                  ("expert_replicate", "expert_parallel"))
    return grid["expert_replicate", "expert_parallel"]


def expert_weights(network: nn.Module) -> list[nn.Parameter]:
    """The stacked weights of every ``Experts`` module of the network."""
    return [param for module in network.modules() if isinstance(module, Experts)
            for param in module.parameters(recurse=False)]


def apply_expert_parallel(network: nn.Module, mesh: DeviceMesh) -> ExpertParallel:
    """Shard every ``Experts`` module's weights over ``mesh`` (``expert_mesh``) and make its forward exchange the
    tokens; returns the state, whose gradient switch ``choose_gradient_reduction`` sets before each backward and
    which ``reduce_expert_gradients`` acts on."""
    replicas = mesh["expert_replicate"]
    data_parallel_size = replicas.size() * mesh["expert_parallel"].size()
    state = ExpertParallel(replicas.get_group() if replicas.size() > 1 else None, 1.0 / data_parallel_size)
    group = mesh["expert_parallel"].get_group()
    for module in network.modules():
        if not isinstance(module, Experts):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            # src_data_rank=None: the weights are initialised after this (every rank keeps its slice of the whole)
            sharded = nn.Parameter(distribute_tensor(param, mesh, EXPERT_PLACEMENTS, src_data_rank=None))
            module.register_parameter(name, sharded)
        module.forward = partial(expert_parallel_forward, module, group, state)  # type: ignore[method-assign]
    EXPERT_PARALLEL[network] = state
    return state


@torch.no_grad()
def reduce_expert_gradients(network: nn.Module) -> None:
    """After a backward: on its optimizer step's last, this rank's expert gradients summed over the replicas and
    scaled to the mean over the data-parallel ranks; otherwise, and for a network without split experts, nothing.
    (An explicit call after the backward rather than a parameter hook: moving the module, as Lightning does after
    configure_model, drops a parameter's hooks.)"""
    state = expert_parallel_of(network)
    if state is None or not state.last_micro_batch:
        return
    for param in expert_weights(network):
        if param.grad is None:
            continue
        local = param.grad.to_local()
        if state.replicas is not None:
            dist.all_reduce(local, group=state.replicas)
        local.mul_(state.scale)


def expert_parallel_forward(experts: Experts, group: dist.ProcessGroup, state: ExpertParallel, tokens: torch.Tensor,
                            tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``Experts.forward`` with the experts spread over ``group``: the same rows in, the same outputs out."""
    ranks = dist.get_world_size(group)
    weights = [param.to_local() for param in (experts.gate_proj, experts.up_proj, experts.down_proj)]
    local_experts = weights[0].shape[0]
    dispatch_start = state.mark() if state.mark else None
    # source s's counts for each of this rank's experts, row s: (ranks, local experts)
    counts = torch.empty_like(tokens_per_expert)
    dist.all_to_all_single(counts, tokens_per_expert, group=group)
    counts = counts.view(ranks, local_experts)
    sent = tokens_per_expert.view(ranks, local_experts).sum(dim=1).tolist()  # rows for each rank, in rank order
    received = counts.sum(dim=1).tolist()
    kept = sum(sent)
    arrived = all_to_all_single_autograd(tokens[:kept], received, sent, group)
    # rows arrive by source rank, each source's grouped by expert: regroup them by expert (stable: sources in order)
    expert_of_row = torch.arange(local_experts, device=tokens.device).repeat(ranks).repeat_interleave(counts.flatten())
    order = expert_of_row.argsort(stable=True)
    grouped = arrived[order]  # the first use waits for the exchange
    if state.mark:
        state.exchanges.append((dispatch_start, state.mark()))
    outputs = expert_outputs(*weights, grouped, counts.sum(dim=0))
    combine_start = state.mark() if state.mark else None
    returned = all_to_all_single_autograd(outputs[order.argsort()], sent, received, group)
    returned = torch.cat([returned, tokens.new_zeros(tokens.shape[0] - kept, tokens.shape[1])])
    if state.mark:
        state.exchanges.append((combine_start, state.mark()))
    return returned
