"""Never silently wrong: ranks that should hold the same weights hold them, bit for bit, under every strategy.

Which ranks should agree is read from each parameter, not from the strategy's name. A plain tensor is whole on
every rank that holds it (DDP's replicas; a parameter outside any sharding). A DTensor is split only along the
mesh dimensions where its placement is ``Shard``, so two ranks with the same coordinates on those dimensions hold
the same slice (FSDP2's shards are unique, its replicated dimensions and tensor parallelism's replicated layers
are not; a pipeline's tied embedding is held by its first and last stage under one name). Every
``every_n_steps`` optimizer steps and at the end of training each rank digests each of its parameters (exact
integer sums of the bits: no copy, no rounding, so equal tensors give equal digests on any device), the digests
are gathered, and every (name, slice) held by several ranks must have one digest; otherwise every rank stops with
the same one line. Under local SGD and DiLoCo the replicas differ between syncs by design: the check waits for
the next sync. The asynchronous parameter server holds the weights on one rank only: nothing to compare.

Before the first step, a sharded strategy's ranks must hold sharded (DTensor) parameters and a pipeline's ranks a
pipeline: a network that something other than Cohort built would otherwise train a replica per rank.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Protocol, runtime_checkable

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.distributed.tensor import DTensor

from core.errors import UserError, check_ranges
from models.parallel.parallelize import shards_data_parallel

# the integer type of each element size: a tensor's bits, summed exactly (integer sums wrap, in any order alike)
BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# (parameter name, the slice's coordinates on the mesh dimensions it is sharded along)
SliceKey = tuple[str, tuple[tuple[str, int], ...]]


class ReplicaDivergenceError(RuntimeError):
    """Ranks that should hold identical weights do not."""


@runtime_checkable
class KeepsReplicasApart(Protocol):
    """A callback under which the replicas differ for a while by design (local SGD and DiLoCo between syncs)."""

    def replicas_differ(self) -> bool: ...


def replicas_differ(trainer: L.Trainer) -> bool:
    """Whether the run's ranks may hold different weights now."""
    return any(isinstance(callback, KeepsReplicasApart) and callback.replicas_differ()
               for callback in trainer.callbacks)


class ReplicaCheck(Callback):
    def __init__(self, every_n_steps: int = 100) -> None:
        """
        Args:
            every_n_steps: compare the ranks' copies of every parameter this often, in optimizer steps, and at the
                end of training (0: never). Costs one pass over the weights and one small all_gather.
        """
        check_ranges("replica_check", {"every_n_steps": (every_n_steps >= 0, ">= 0 (0: never)")}, locals())
        self.every_n_steps = every_n_steps
        self._pending = False
        self._last_step = -1

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        check_network_is_parallelized(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if self.every_n_steps and step != self._last_step and step % self.every_n_steps == 0:
            self._pending = True
        self._last_step = step
        if self._pending and not replicas_differ(trainer):
            self._pending = False
            self.check(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.every_n_steps and not replicas_differ(trainer):
            self.check(trainer, pl_module)

    def check(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Gather every rank's digests; raise ReplicaDivergenceError on every rank if any shared slice differs."""
        if not holds_replicas(trainer):
            return
        mine = parameter_digests(pl_module)
        everyone: list[dict[SliceKey, tuple[int, int]]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, mine)
        differing = differing_slices(everyone)
        if differing:
            (name, _), reference, ranks = differing[0]
            raise ReplicaDivergenceError(
                f"replica check at step {trainer.global_step}: rank(s) {ranks} hold different weights than rank "
                f"{reference} for {len(differing)} parameter slice(s), first {name}; a rank's update went wrong "
                "(hardware, a non-deterministic op, or a network not parallelised as the strategy says): resume from "
                "the last checkpoint"
            )


def holds_replicas(trainer: L.Trainer) -> bool:
    """Whether several ranks may hold copies to compare: a process group of two or more, not FSDP (1), whose flat
    shards are views that cannot be told apart by name, and not the asynchronous parameter server (one copy)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return False
    if isinstance(trainer.strategy, FSDPStrategy):
        return False
    return not type(trainer.strategy).__name__.endswith("ParameterServerStrategy")


@torch.no_grad()
def parameter_digests(module: torch.nn.Module) -> dict[SliceKey, tuple[int, int]]:
    """This rank's parameters as {(name, slice coordinates): (sum of all bits, sum of every other element's)}. The
    second sum tells apart tensors that hold the same values in another order."""
    keys, sums = [], []
    for name, param in module.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        bits = local.detach().contiguous().view(BITS[local.element_size()]).flatten()
        keys.append((name, slice_coordinates(param)))
        sums.append(torch.stack([bits.sum(dtype=torch.int64), bits[::2].sum(dtype=torch.int64)]))
    values = torch.stack(sums).cpu().tolist() if sums else []  # one copy to the host for all parameters
    return {key: (total, alternate) for key, (total, alternate) in zip(keys, values)}


def slice_coordinates(param: torch.Tensor) -> tuple[tuple[str, int], ...]:
    """Which slice of the whole parameter this rank holds: its coordinates on the mesh dimensions the parameter is
    sharded along (none for a plain tensor, or one replicated everywhere)."""
    if not isinstance(param, DTensor):
        return ()
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    names = mesh.mesh_dim_names or tuple(str(dim) for dim in range(mesh.ndim))
    return tuple((names[dim], coordinate[dim]) for dim, placement in enumerate(param.placements) if placement.is_shard())


def differing_slices(everyone: list[dict[SliceKey, tuple[int, int]]]) -> list[tuple[SliceKey, int, list[int]]]:
    """The slices held by several ranks with different digests: each with the lowest rank holding it and the ranks
    whose digest is not that one's."""
    holders: dict[SliceKey, dict[int, tuple[int, int]]] = defaultdict(dict)
    for rank, digests in enumerate(everyone):
        for key, digest in digests.items():
            holders[key][rank] = digest
    differing = []
    for key, by_rank in holders.items():
        reference = min(by_rank)
        ranks = sorted(rank for rank, digest in by_rank.items() if digest != by_rank[reference])
        if ranks:
            differing.append((key, reference, ranks))
    return differing


def check_network_is_parallelized(trainer: L.Trainer, pl_module: L.LightningModule) -> None:
    """Under ModelParallelStrategy (FSDP2, tensor parallel) and the pipeline on several processes, a UserError unless
    the network was built sharded (every parameter a DTensor) or, under the pipeline, split into stages (plain tensors
    where one stage is all a rank holds of the network: models/parallel/parallelize.py shards_data_parallel)."""
    strategy = trainer.strategy
    if not isinstance(strategy, ModelParallelStrategy) or trainer.world_size < 2:
        return
    family = type(pl_module).__name__
    pipelined = getattr(strategy, "pipeline_parallel_size", 1) > 1
    if pipelined and getattr(pl_module, "pipeline", None) is None:
        raise UserError(f"{family} built no pipeline stages, so every rank would run the whole network: give it "
                        "build_pipeline, or train it without pipeline stages")
    if not shards_data_parallel(strategy.device_mesh, pipeline_stage=pipelined):
        return
    plain = [name for name, param in pl_module.named_parameters() if not isinstance(param, DTensor)]
    if plain:
        raise UserError(f"{family}'s network was not sharded over the {trainer.world_size} processes ({plain[0]} and "
                        f"{len(plain) - 1} more are whole on every rank), so each rank would train a replica of its "
                        "own: let Cohort build it (no configure_model of the family's own), or train it with DDP")
