"""What a rank of a replica group sends across the groups, and takes from them: its own shards. Rank r of every group
holds the same slice of every parameter (FSDP2 over the group's n ranks, models/parallel/parallelize.py), so the
gradient is averaged rank by rank (rank r's shards with rank r's of the other groups) and a restarted group's rank r
recovers from a live group's rank r: plain local tensors over torchft's transport, never a DTensor (whose device
mesh is no data for the weights-only reader), made DTensors again on this rank's mesh. With one process per group
the shards are the whole tensors."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``tensor`` (itself where not sharded), sharing its storage."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_shards(tree: Any) -> Any:
    """``tree`` (dicts, lists of tensors and values) with every DTensor replaced by this rank's shard."""
    if isinstance(tree, dict):
        return {key: local_shards(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(local_shards(value) for value in tree)
    return local(tree) if isinstance(tree, torch.Tensor) else tree


def average_local_gradients(params: list[nn.Parameter], allreduce: Any) -> None:
    """Every gradient's local shard, flattened into one tensor, averaged by ``allreduce`` (torchft's, with this
    rank's peers of the other groups) and written back in place."""
    grads = [local(param.grad) if param.grad is not None else torch.zeros_like(local(param)) for param in params]
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    allreduce(flat).wait()
    for param, grad, part in zip(params, grads, flat.split([grad.numel() for grad in grads])):
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        local(param.grad).copy_(part.view_as(grad))


def load_local_shards(module: nn.Module, shards: dict[str, torch.Tensor]) -> None:
    """A peer rank's shards of ``module``'s state copied into this rank's (the same slices, the same names)."""
    with torch.no_grad():
        for name, value in module.state_dict().items():
            local(value).copy_(shards[name])


def optimizer_state_on_mesh(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """A peer rank's optimizer state (local shards) with each per-parameter tensor made a DTensor again, laid out as
    this rank's parameter, so that ``optimizer.load_state_dict`` takes it."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    placed = {}
    for index, entries in state["state"].items():
        param = params[index]
        if isinstance(param, DTensor):
            entries = {key: DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                               shape=param.shape, stride=param.stride())
                       if isinstance(value, torch.Tensor) and value.shape == param.to_local().shape and value.dim()
                       else value for key, value in entries.items()}
        placed[index] = entries
    return {**state, "state": placed}
