"""Lightning has no pipeline-parallel strategy (Lightning-AI/pytorch-lightning#17180), so Cohort adds the one
thing ModelParallelStrategy lacks for it: a third mesh dimension, and readers of one-file checkpoints and of
folders into stages of plain tensors (one data-parallel rank) that give each stage its own part. Everything else
(process groups, placement, FSDP2 and tensor parallelism over the inner dimensions, sharded checkpoints) is
ModelParallelStrategy's; the stages and the schedule are built by the model (models/parallel/pipeline.py) from the run
plan."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import init_device_mesh

from app.safety.checkpoint_reading import META_FILE
from core.errors import UserError
from models.parallel.parallelize import shards_data_parallel


class PipelineParallelStrategy(ModelParallelStrategy):
    """ModelParallelStrategy over a (pipeline_parallel, data_parallel, tensor_parallel) device mesh: consecutive
    blocks of ranks run consecutive pipeline stages, and within a stage the ranks shard (FSDP2) and split layers
    (tensor parallel) as under ModelParallelStrategy."""

    def __init__(
        self,
        pipeline_parallel_size: int = 2,
        data_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        pipeline_schedule: str = "1F1B",
        pipeline_microbatches: int | None = None,
        pipeline_layers: list[int] | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        """
        Args:
            pipeline_parallel_size: pipeline stages, each on its own group of ranks.
            data_parallel_size: ranks that shard each stage's parameters (FSDP2) and split the batch.
            tensor_parallel_size: ranks that split each layer of a stage.
            pipeline_schedule: "1F1B" (one forward, one backward: fewer activations held), "GPipe" (all
                forwards, then all backwards), "Interleaved1F1B", or a zero-bubble schedule that splits each
                backward into the inputs' and the weights' gradients: "InterleavedZeroBubble", "ZBVZeroBubble",
                "DualPipeV" (the last two on stages placed as a V); core/pipeline_schedules.py holds each one's record.
            pipeline_microbatches: pipeline micro-batches per micro batch; null means one per pipeline rank.
            pipeline_layers: blocks of each stage, in stage order (e.g. [5, 7]: fewer where the embeddings or a
                large head already weigh); null balances them by count, counting the embeddings and the head
                as one block each.
            save_distributed_checkpoint, process_group_backend, timeout: as ModelParallelStrategy's (the
                pre-flight checks keep save_distributed_checkpoint true: one file would hold rank 0's stage only).
        """
        super().__init__(data_parallel_size, tensor_parallel_size, save_distributed_checkpoint,
                         process_group_backend, timeout)
        # the schedule, its micro-batches and the split are the run plan's (app/cli/run_plan_resolution.py reads
        # them, with the defaults above, from the config): the stages are built from the plan, not from here
        self.pipeline_parallel_size = pipeline_parallel_size

    def setup_environment(self) -> None:
        self._setup_distributed()
        sizes = (self.pipeline_parallel_size, self._data_parallel_size, self._tensor_parallel_size)
        if sizes[0] * sizes[1] * sizes[2] != self.world_size:  # the pre-flight checks say so first, in config terms
            raise UserError(f"pipeline x data x tensor parallel sizes {sizes} do not multiply to the world size "
                            f"{self.world_size}")
        self._device_mesh = init_device_mesh(self.root_device.type, sizes,
                                             mesh_dim_names=("pipeline_parallel", "data_parallel", "tensor_parallel"))
        self.lightning_module._device_mesh = self._device_mesh  # as ModelParallelStrategy: configure_model reads it

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer state keyed by parameter name, as ModelParallelStrategy's, but with each param group listing
        the parameters of every stage. torch.distributed.checkpoint writes one copy of what every rank saves under
        the same key, so a group listing only this stage's parameters would lose the others'; on load each stage
        takes its own names from the union (and so do one process and FSDP2)."""
        state = super().optimizer_state(optimizer)
        stages: list[Any] = [None] * self.pipeline_parallel_size
        dist.all_gather_object(stages, [group["params"] for group in state["param_groups"]],
                               group=self.device_mesh["pipeline_parallel"].get_group())
        for index, group in enumerate(state["param_groups"]):
            group["params"] = list(dict.fromkeys(name for names in stages for name in names[index]))
        return state

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """As ModelParallelStrategy's, but a one-file checkpoint is read whole by every rank, which keeps its own
        stage's weights and optimizer state. (Lightning's reader sends each weight from rank 0 to every rank, in
        the order of rank 0's stage: the ranks of another stage would wait for their own weights and get rank 0's.)
        Returns the rest of the checkpoint, as ModelParallelStrategy's does."""
        path = Path(self.broadcast(checkpoint_path))
        if path.is_dir() and shards_data_parallel(self.device_mesh, pipeline_stage=True):
            return super().load_checkpoint(path, weights_only)
        if path.is_dir():
            return self.load_plain_stage(path, weights_only)
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
        stage, weights = self.lightning_module, checkpoint.pop("state_dict")
        options = StateDictOptions(full_state_dict=True, strict=stage.strict_loading)
        own = {name: weights[name] for name in get_model_state_dict(stage) if name in weights}  # not other stages'
        set_model_state_dict(stage, own, options=options)
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
            set_optimizer_state_dict(stage, optimizer, state, options=options)  # takes this stage's names
        return checkpoint

    def load_plain_stage(self, folder: Path, weights_only: bool | None) -> dict[str, Any]:
        """A sharded checkpoint folder read into a stage of plain tensors (one data- and one tensor-parallel rank:
        models/parallel/parallelize.py shards_data_parallel), which Lightning's reader refuses for holding no DTensor. Each
        rank reads its own stage's weights and optimizer state only; returns the rest of the checkpoint."""
        stage = self.lightning_module
        weights = {"state_dict": get_model_state_dict(stage)}
        dcp.load(weights, checkpoint_id=folder)
        stage.load_state_dict(weights["state_dict"], strict=stage.strict_loading)
        for index, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{index}"  # as ModelParallelStrategy writes them
            state = {key: get_optimizer_state_dict(stage, optimizer)}
            dcp.load(state, checkpoint_id=folder)
            set_optimizer_state_dict(stage, optimizer, state[key])
        return torch.load(folder / META_FILE, weights_only=weights_only)
