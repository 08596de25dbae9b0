"""Hybrid sharded data parallel (HSDP): Lightning's ModelParallelStrategy shards over every data-parallel rank
(Lightning-AI/pytorch-lightning#21059 asks for more), so Cohort adds one mesh dimension. The data-parallel ranks
form a (data_parallel_replicate, data_parallel_shard) grid: FSDP2 shards each parameter over the ranks of one
replica (within a node, where the all-gathers and reduce-scatters of every layer are fast) and all-reduces the
gradient shards across the replicas (over the slower network, once per optimizer step), as torchtitan's
dp_replicate x dp_shard. The two dimensions, flattened, are still the mesh's "data_parallel" dimension, in the same
rank order (data-parallel rank = replica x shard size + shard), so the samplers, the run plan and everything else
that reads the data-parallel ranks see one data-parallel dimension of replicate x shard ranks."""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import init_device_mesh

from core.errors import UserError

MESH_DIMENSIONS = ("data_parallel_replicate", "data_parallel_shard", "tensor_parallel")


class HybridShardedStrategy(ModelParallelStrategy):
    """ModelParallelStrategy over a (data_parallel_replicate, data_parallel_shard, tensor_parallel) device mesh, with
    the first two flattened into "data_parallel": FSDP2 on the 2-D (replicate, shard) mesh where the replicate size
    is over 1 (models/parallel/parallelize.py), else as under ModelParallelStrategy."""

    def __init__(
        self,
        data_parallel_size: int | Literal["auto"] = "auto",
        tensor_parallel_size: int | Literal["auto"] = "auto",
        data_parallel_replicate_size: int = 1,
        reduce_gradients_every_micro_batch: bool = False,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        """
        Args:
            data_parallel_size: ranks that split the batch: data_parallel_replicate_size replicas of
                data_parallel_size / data_parallel_replicate_size ranks, which shard the parameters (FSDP2); "auto":
                the nodes, as ModelParallelStrategy's.
            tensor_parallel_size: ranks that split each layer; "auto": the processes of a node.
            data_parallel_replicate_size: replicas of the sharded model; 1: FSDP2 over all data-parallel ranks.
            reduce_gradients_every_micro_batch: under gradient accumulation, reduce-scatter each micro-batch's
                gradients (each rank holds only its shard of them: less memory, one reduce-scatter per micro-batch);
                false: keep the unsharded gradients until the step's last micro-batch and reduce once. Across replicas
                the gradients are all-reduced once per optimizer step either way. Read through the run plan
                (core/run_plan.py), which the model acts on (models/module.py).
            save_distributed_checkpoint, process_group_backend, timeout: as ModelParallelStrategy's.
        """
        super().__init__(data_parallel_size, tensor_parallel_size, save_distributed_checkpoint,
                         process_group_backend, timeout)
        self.data_parallel_replicate_size = data_parallel_replicate_size
        self.reduce_gradients_every_micro_batch = reduce_gradients_every_micro_batch

    def setup_environment(self) -> None:
        """As ModelParallelStrategy's, with the 3-D mesh in place of its 2-D one (built once: each dimension is a
        process group every rank must create)."""
        ParallelStrategy.setup_environment(self)  # the device; ModelParallelStrategy's own would build its mesh
        self._setup_distributed()
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes
        if self._tensor_parallel_size == "auto":
            self._tensor_parallel_size = self.num_processes
        replicate = self.data_parallel_replicate_size
        sizes = (replicate, self._data_parallel_size // replicate, self._tensor_parallel_size)
        if sizes[0] * sizes[1] * sizes[2] != self.world_size:  # the pre-flight checks say so first, in config terms
            raise UserError(f"data-parallel replicate x shard x tensor-parallel sizes {sizes} do not multiply to the "
                            f"world size {self.world_size}")
        self._device_mesh = init_device_mesh(self.root_device.type, sizes, mesh_dim_names=MESH_DIMENSIONS)
        self._device_mesh[MESH_DIMENSIONS[:2]]._flatten("data_parallel")  # the samplers' and checks' dimension
        self.lightning_module._device_mesh = self._device_mesh  # as ModelParallelStrategy: configure_model reads it
