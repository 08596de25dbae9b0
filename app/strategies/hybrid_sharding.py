"""Hybrid sharded data parallel (HSDP): Lightning's ModelParallelStrategy shards over every data-parallel rank
(Lightning-AI/pytorch-lightning#21059 asks for more), so Cohort adds a replicate size. The data-parallel ranks
form a (data_parallel_replicate, data_parallel_shard) grid: FSDP2 shards each parameter over the ranks of one
replica (within a node, where the all-gathers and reduce-scatters of every layer are fast) and all-reduces the
gradient shards across the replicas (over the slower network, once per optimizer step), as torchtitan's
dp_replicate x dp_shard. The strategy's mesh stays ModelParallelStrategy's (data_parallel, tensor_parallel), so
the samplers, the run plan and everything that reads the data-parallel ranks see them as before (data-parallel rank
= replica x shard size + shard); models/parallel/parallelize.py unflattens its data_parallel dimension into the
grid for FSDP2, from the run plan, which holds both settings (app/cli/run_plan_resolution.py reads them here)."""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.constants import default_pg_timeout


class HybridShardedStrategy(ModelParallelStrategy):
    """ModelParallelStrategy with FSDP2 over data_parallel_replicate_size replicas of data_parallel_size /
    data_parallel_replicate_size shards each, and the choice of gradient collectives under accumulation."""

    def __init__(
        self,
        data_parallel_size: int | Literal["auto"] = "auto",
        tensor_parallel_size: int | Literal["auto"] = "auto",
        data_parallel_replicate_size: int = 1,
        reduce_gradients_every_micro_batch: bool = False,
        expert_parallel_size: int = 1,
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
                the gradients are all-reduced once per optimizer step either way. Read into the run plan
                (core/run_plan.py), which models/parallel/parallelize.py choose_gradient_reduction acts on.
            expert_parallel_size: data-parallel ranks that split each MoE layer's experts between them and exchange
                the routed tokens (models/parallel/expert_parallel.py); must divide data_parallel_size and the
                model's n_expert; composes with data_parallel_replicate_size (the dense layers hybrid-sharded, the
                experts split as they are). 1: every expert on every rank, sharded by FSDP2 like the rest.
            save_distributed_checkpoint, process_group_backend, timeout: as ModelParallelStrategy's.
        """
        super().__init__(data_parallel_size, tensor_parallel_size, save_distributed_checkpoint,
                         process_group_backend, timeout)
        self.data_parallel_replicate_size = data_parallel_replicate_size
        self.reduce_gradients_every_micro_batch = reduce_gradients_every_micro_batch
        self.expert_parallel_size = expert_parallel_size
