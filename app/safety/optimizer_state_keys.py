"""Optimizer state keyed by parameter name in every checkpoint, as sharded strategies store it, so that a checkpoint
moves between strategies: a plain optimizer's positions depend on the weight-decay groups, names do not.
``RunCheckpoint`` names a plain optimizer's state as it saves and numbers it again, in this run's order, as it
loads."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from core.errors import UserError
from models.parallel.parallelize import CHECKPOINT_WRAPPER_PREFIX


def name_optimizer_states(trainer: L.Trainer, checkpoint: dict[str, Any]) -> None:
    """Key each plain optimizer's state in ``checkpoint`` by parameter name, in place; sharded strategies'
    states already are."""
    names = parameter_names(trainer.lightning_module)
    states = checkpoint.get("optimizer_states", [])
    for index, optimizer in enumerate(trainer.optimizers[: len(states)]):
        if keyed_by_position(states[index]):
            numbered = [names[id(p)] for p in numbered_parameters(trainer, optimizer)]
            states[index] = optimizer_state_by_name(states[index], numbered)


def numbered_parameters(trainer: L.Trainer, optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """The parameters in the order a saved optimizer state numbers them: torch's optimizer numbers them in its
    param groups' order (the weight-decay groups), ModelParallelStrategy's one file (save_distributed_checkpoint
    false) in the network's (FSDP.rekey_optim_state_dict)."""
    if isinstance(trainer.strategy, ModelParallelStrategy):
        return list(trainer.lightning_module.parameters())
    return [p for group in optimizer.param_groups for p in group["params"]]


def number_optimizer_states(trainer: L.Trainer, checkpoint: dict[str, Any]) -> None:
    """Key each optimizer state in ``checkpoint`` by this run's positions again, in place, for a plain optimizer
    (DDP, one device); sharded strategies load names themselves. Before the optimizers exist (a fresh resume,
    which sets them up only after this) there is nothing to match, and torch's ``load_state_dict`` pairs the
    saved parameters with the optimizer's in order."""
    if isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy)):
        return
    names = parameter_names(trainer.lightning_module)
    states = checkpoint.get("optimizer_states", [])
    for index, optimizer in enumerate(trainer.optimizers[: len(states)]):
        if not keyed_by_position(states[index]):
            states[index] = optimizer_state_by_position(states[index], optimizer, names)


def parameter_names(module: torch.nn.Module) -> dict[int, str]:
    """Parameter (by id) to its name as checkpoints store it, without wrapper modules' names."""
    return {id(param): name.replace(CHECKPOINT_WRAPPER_PREFIX, "") for name, param in module.named_parameters()}


def keyed_by_position(optimizer_state: dict[str, Any]) -> bool:
    """Whether a torch optimizer state dict numbers its parameters (torch's own) or names them (ours); neither when it
    is empty, as on the ranks but 0 of a sharded strategy that gathers one file on rank 0."""
    groups = optimizer_state.get("param_groups", [])
    return any(isinstance(params, int) for group in groups for params in group["params"])


def optimizer_state_by_name(state: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """A torch optimizer state dict (parameters numbered in ``order``) with parameter names instead."""
    return {
        "state": {order[position]: value for position, value in state["state"].items()},
        "param_groups": [{**group, "params": [order[position] for position in group["params"]]}
                         for group in state["param_groups"]],
    }


def optimizer_state_by_position(state: dict[str, Any], optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, Any]:
    """The inverse of ``optimizer_state_by_name`` for this optimizer: positions in its own param-group order."""
    flat = [p for group in optimizer.param_groups for p in group["params"]]
    position = {names[id(p)]: index for index, p in enumerate(flat)}
    unknown = [name for group in state["param_groups"] for name in group["params"] if name not in position]
    if unknown or len(state["param_groups"]) != len(optimizer.param_groups):
        raise UserError(f"the checkpoint's optimizer state does not fit this model (parameters {unknown[:3]}): "
                        "resume with the model config it was trained with")
    groups, start = [], 0
    for saved, current in zip(state["param_groups"], optimizer.param_groups):
        groups.append({**saved, "params": list(range(start, start + len(current["params"])))})
        start += len(current["params"])
    return {"state": {position[name]: value for name, value in state["state"].items()}, "param_groups": groups}
