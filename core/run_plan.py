"""The run plan: the shape of one run, resolved once from the config and the launcher (``app/cli/preflight.py``) and
handed to the data, the model, the callbacks and ``cohort doctor``, so that none of them works it out again.

    world size   = devices per node x nodes = pipeline stages x data-parallel x tensor-parallel
                                            (asynchronous: 1 parameter server + the workers)
    global batch = micro batch x data-parallel size x accumulation (x replica groups, under fault tolerance)
    data-parallel size = replicas x shards (hybrid sharding; 1 replica of every data-parallel rank by default)
    micro batch  = pipeline micro-batch x pipeline_microbatches (with pipeline stages only)

Ranks sit on the strategy's device mesh, row-major over (pipeline_parallel, data_parallel, tensor_parallel), the
order of torchtitan and of ModelParallelStrategy's (data_parallel, tensor_parallel) mesh when there is no
pipeline. Ranks of one tensor-parallel group, and the stages of one pipeline, read the same samples; under DDP
every rank is its own data-parallel rank. Under hybrid sharding the data-parallel dimension is itself row-major over
(replica, shard): data-parallel rank = replica x shards + shard, each reading its own samples. Expert parallelism
splits the experts over consecutive data-parallel ranks the same way: (expert replica, expert-parallel rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from core.errors import UserError, check_ranges
from core.pipeline_schedules import PIPELINE_SCHEDULES, PipelineSchedule
from core.precision import Precision


@dataclass(frozen=True)
class RunPlan:
    devices_per_node: int
    num_nodes: int
    data_parallel_size: int
    tensor_parallel_size: int
    global_batch_size: int
    micro_batch_size: int
    sequence_length: int
    precision: Precision  # resolved for the device: Lightning's name and its dtypes
    seed: int  # seed_everything: data order, initial weights and dropout all follow from it
    pipeline_parallel_size: int = 1  # pipeline stages, one per rank of a pipeline
    pipeline_schedule: str = "1F1B"  # the order of the pipeline micro-batches' forwards and backwards
    pipeline_microbatches: int = 1  # pipeline micro-batches each micro batch is cut into
    pipeline_layers: tuple[int, ...] | None = None  # blocks of each stage, in stage order; None: balanced by count
    unit: str = "tokens"  # what throughput counts: tokens of text, or "images" (sequence_length 1: one per sample)
    # workers of an asynchronous run (app/strategies/parameter_server/), rank 0 being the server; 0: the ranks step
    # together. Each update is one global batch that one worker computes: the data-parallel size is then 1
    asynchronous_workers: int = 0
    # fault-tolerant replica groups (app/strategies/fault_tolerance/), each a job of its own of data_parallel_size
    # processes; a quorum of q of them shares each global batch, each group reading global_batch_size / q split over
    # its processes; 1: one job
    replica_groups: int = 1
    # hybrid sharding (app/strategies/hybrid_sharding.py): the data-parallel ranks are this many replicas of the
    # model, each sharded (FSDP2) over data_parallel_size / data_parallel_replicate_size ranks; 1: over all of them
    data_parallel_replicate_size: int = 1
    # FSDP2 under accumulation: reduce-scatter every micro-batch's gradients (sharded gradients only: less memory)
    # rather than once per optimizer step (unsharded gradients held until the step's last micro-batch)
    reduce_gradients_every_micro_batch: bool = False
    # expert parallelism (models/parallel/expert_parallel.py): each MoE layer's experts split over this many
    # data-parallel ranks, which exchange the routed tokens; data_parallel_size / expert_parallel_size replicas of
    # each expert; 1: every rank holds (its FSDP2 shard of) every expert
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        check_ranges("trainer", {"devices": (self.devices_per_node >= 1, "at least 1 per node"),
                                 "num_nodes": (self.num_nodes >= 1, "at least 1")},
                     {"devices": self.devices_per_node, "num_nodes": self.num_nodes})
        check_ranges("data", {"global_batch_size": (self.global_batch_size >= 1, "a positive integer"),
                              "micro_batch_size": (self.micro_batch_size >= 1, "a positive integer")},
                     {"global_batch_size": self.global_batch_size, "micro_batch_size": self.micro_batch_size})
        sizes = self.data_parallel_size * self.tensor_parallel_size * self.pipeline_parallel_size
        if self.asynchronous_workers:
            sizes = 1 + self.asynchronous_workers  # the server, the workers
        if sizes != self.world_size:
            pipeline = (f"pipeline_parallel_size={self.pipeline_parallel_size} x "
                        if self.pipeline_parallel_size > 1 else "")
            raise UserError(
                f"{pipeline}data_parallel_size={self.data_parallel_size} x tensor_parallel_size="
                f"{self.tensor_parallel_size} must equal the world size {self.world_size} ({self.devices_per_node} "
                f"devices x {self.num_nodes} nodes): change the sizes in trainer.strategy.init_args or the devices"
            )
        per_pass = self.micro_batch_size * self.data_parallel_size * self.replica_groups
        if self.global_batch_size % per_pass != 0:
            ranks = f"{self.world_size} processes ({self.devices_per_node} devices x {self.num_nodes} nodes)"
            if self.replica_groups > 1:
                ranks = f"{self.replica_groups} replica groups of {ranks}"
            if self.data_parallel_size != self.world_size:
                ranks = (f"{self.data_parallel_size} data-parallel ranks ({ranks} / tensor_parallel_size "
                         f"{self.tensor_parallel_size})")
            raise UserError(
                f"data.global_batch_size={self.global_batch_size} is not a multiple of data.micro_batch_size="
                f"{self.micro_batch_size} x {ranks} = {per_pass}: choose a global batch that is a multiple of "
                f"{per_pass}, or another micro batch"
            )
        if self.pipeline_parallel_size > 1:
            self._check_pipeline()
        replicas = self.data_parallel_replicate_size
        if replicas < 1 or self.data_parallel_size % replicas != 0:
            raise UserError(f"trainer.strategy.init_args.data_parallel_replicate_size={replicas} must be at least 1 "
                            f"and divide data_parallel_size={self.data_parallel_size} (replicas x shards): choose a "
                            "divisor, such as the number of nodes")
        if self.expert_parallel_size != 1:
            self._check_expert_parallel()

    def _check_expert_parallel(self) -> None:
        field = "trainer.strategy.init_args.expert_parallel_size"
        size = self.expert_parallel_size
        if size < 1 or self.data_parallel_size % size != 0:
            raise UserError(f"{field}={size} must be at least 1 and divide data_parallel_size="
                            f"{self.data_parallel_size}: the experts are split over that many data-parallel ranks")
        if self.tensor_parallel_size > 1:
            raise UserError(f"{field}={size} with tensor_parallel_size={self.tensor_parallel_size}: experts are split "
                            "over data-parallel ranks only; use tensor_parallel_size 1")

    def _check_pipeline(self) -> None:
        field = "trainer.strategy.init_args"
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise UserError(f"{field}.pipeline_schedule={self.pipeline_schedule!r} is not a schedule: use one of "
                            f"{', '.join(PIPELINE_SCHEDULES)}")
        if self.pipeline_microbatches < self.pipeline_parallel_size:
            raise UserError(f"{field}.pipeline_microbatches={self.pipeline_microbatches} is fewer than the "
                            f"{self.pipeline_parallel_size} pipeline stages, so some stages would always wait: use at "
                            f"least {self.pipeline_parallel_size} (more shrink the bubble)")
        rounds = self.pipeline_microbatches // self.pipeline_parallel_size
        looped = self.stages_per_rank > 1 and not self.v_shaped_stages
        if looped and self.pipeline_microbatches % rounds != 0:
            raise UserError(f"{field}.pipeline_microbatches={self.pipeline_microbatches}: {self.pipeline_schedule} "
                            f"runs them in {rounds} rounds, which must divide them: use a multiple of "
                            f"pipeline_parallel_size={self.pipeline_parallel_size}")
        stages = self.pipeline_parallel_size * self.stages_per_rank
        if self.schedule.needs_microbatch_per_stage and self.pipeline_microbatches < stages:
            raise UserError(f"{field}.pipeline_microbatches={self.pipeline_microbatches}: {self.pipeline_schedule} "
                            f"needs at least one per stage, {stages} ({self.stages_per_rank} x "
                            f"pipeline_parallel_size): use at least {stages}")
        if self.micro_batch_size % self.pipeline_microbatches != 0:
            raise UserError(f"{field}.pipeline_microbatches={self.pipeline_microbatches} does not divide "
                            f"data.micro_batch_size={self.micro_batch_size}: each micro batch is cut into that many "
                            "equal pipeline micro-batches; choose a divisor, or another micro batch")
        if self.pipeline_layers is not None and (len(self.pipeline_layers) != stages or min(self.pipeline_layers) < 1):
            raise UserError(f"{field}.pipeline_layers={list(self.pipeline_layers)} must give each of the {stages} stages "
                            "at least one block, in stage order (or be null to balance them by count)")
        if self.precision.name == "16-mixed":
            raise UserError("trainer.precision=16-mixed: the pipeline runs its own backward, which fp16's loss "
                            "scaler cannot scale; use bf16-mixed or 32-true with pipeline stages")

    @property
    def data_parallel_shard_size(self) -> int:
        """Data-parallel ranks that shard each parameter between them (all of them but under hybrid sharding)."""
        return self.data_parallel_size // self.data_parallel_replicate_size

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.num_nodes

    @property
    def asynchronous(self) -> bool:
        """Whether the ranks train without meeting (so each decides on its own rank's word)."""
        return self.asynchronous_workers > 0

    @property
    def schedule(self) -> PipelineSchedule:
        """The pipeline schedule's record (checked to be one by the pipeline checks)."""
        return PIPELINE_SCHEDULES[self.pipeline_schedule]

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each pipeline rank runs: one under GPipe and 1F1B, else two."""
        return self.schedule.stages_per_rank

    @property
    def v_shaped_stages(self) -> bool:
        """Whether pipeline rank r of p runs stages r and 2p - 1 - r (a V: rank 0 runs the first and the last stage,
        rank p - 1 the middle two), as ZBVZeroBubble and DualPipeV need, rather than r, r + p, ... (a loop)."""
        return self.schedule.v_shaped

    @property
    def pipeline_stage_ranks(self) -> list[int]:
        """The pipeline rank of each stage, in stage order."""
        ranks, stages = self.pipeline_parallel_size, self.pipeline_parallel_size * self.stages_per_rank
        if self.v_shaped_stages:
            return [stage if stage < ranks else stages - 1 - stage for stage in range(stages)]
        return [stage % ranks for stage in range(stages)]

    @property
    def pipeline_ends_on_one_rank(self) -> bool:
        """Whether one pipeline rank runs both the first and the last stage (a V's rank 0): a weight tied between
        them is then one parameter there, not two copies on two ranks whose gradients are summed."""
        stage_ranks = self.pipeline_stage_ranks
        return stage_ranks[0] == stage_ranks[-1]

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step on each rank (of each replica group, whatever their quorum)."""
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size * self.replica_groups)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.sequence_length

    def for_rank(self, global_rank: int) -> RunPlan:
        """The plan ``global_rank`` trains by: an asynchronous run's server (rank 0) takes whole global batches, each
        one worker's push and one update, so its micro batch is the global batch; every other rank this plan."""
        if self.asynchronous and global_rank == 0:
            return replace(self, micro_batch_size=self.global_batch_size)
        return self

    def data_parallel_rank(self, global_rank: int) -> int:
        """Which share of each global batch ``global_rank`` reads."""
        return global_rank // self.tensor_parallel_size % self.data_parallel_size

    def tensor_parallel_rank(self, global_rank: int) -> int:
        return global_rank % self.tensor_parallel_size

    def micro_batch_in_step(self, batch_index: int) -> int:
        """Which micro-batch of its optimizer step micro-batch ``batch_index`` of an epoch is, from 0. Epochs hold
        whole steps, so counting from the epoch's start is enough."""
        return batch_index % self.accumulation

    def micro_batch_group(self, data_parallel_rank: int, micro_batch_in_step: int) -> int:
        """Which group of ``micro_batch_size`` consecutive samples of its step's global batch a micro-batch reads:
        the step's first micro-batches of ranks 0, 1, ... come first, then their second ones, so micro-batch a of
        data-parallel rank r is group a x data-parallel size + r, the samples at places [group x micro,
        (group + 1) x micro) of the global batch (datamodules/samplers.py reads them there)."""
        return micro_batch_in_step * self.data_parallel_size + data_parallel_rank

    def evaluation_samples_per_rank(self, num_chosen: int) -> int:
        """How many samples each data-parallel rank reads when an evaluation reads ``num_chosen``: its share,
        ceil(num_chosen / data-parallel size), the same on every rank so that none waits for another in a collective;
        with pipeline stages rounded up to whole micro-batches, since the stages exchange tensors of the shapes they
        first agreed on. Places from num_chosen on are padding, which counts for nothing."""
        per_rank = math.ceil(num_chosen / self.data_parallel_size)
        if self.pipeline_parallel_size > 1:
            per_rank = math.ceil(per_rank / self.micro_batch_size) * self.micro_batch_size
        return per_rank

    def evaluation_place(self, data_parallel_rank: int, sample_in_rank: int) -> int:
        """Which of an evaluation's chosen samples is the ``sample_in_rank``-th that ``data_parallel_rank`` reads:
        they are dealt out in turn, so rank r reads places r, r + W, r + 2W, ... (W the data-parallel size), and a
        place names the same sample at any W (datamodules/samplers.py reads them there, BERT masks by them)."""
        return sample_in_rank * self.data_parallel_size + data_parallel_rank

    def starts_optimizer_step(self, batch_index: int) -> bool:
        return self.micro_batch_in_step(batch_index) == 0

    def ends_optimizer_step(self, batch_index: int) -> bool:
        return self.micro_batch_in_step(batch_index) == self.accumulation - 1

    def describe(self) -> str:
        pipeline = ""
        if self.pipeline_parallel_size > 1:
            stages = self.pipeline_parallel_size * self.stages_per_rank
            pipeline = (f"; {stages} pipeline stages on {self.pipeline_parallel_size} ranks "
                        f"({self.pipeline_schedule}), each micro batch cut into {self.pipeline_microbatches} "
                        "pipeline micro-batches")
        if self.asynchronous_workers:
            return (f"global batch {self.global_batch_size} = micro batch {self.micro_batch_size} x "
                    f"{self.accumulation} accumulation steps, computed by one of {self.asynchronous_workers} "
                    f"asynchronous workers and applied by the parameter server (rank 0) as it arrives; "
                    f"{self.tokens_per_step:,} {self.unit} per update")
        groups = ""
        if self.replica_groups > 1:
            groups = (f" x {self.replica_groups} fault-tolerant replica groups (of q up, each reads "
                      f"{self.global_batch_size} / q over its {self.data_parallel_size} ranks)")
        hybrid = (f" ({self.data_parallel_replicate_size} replicas x {self.data_parallel_shard_size} shards)"
                  if self.data_parallel_replicate_size > 1 else "")
        expert_replicas = self.data_parallel_size // self.expert_parallel_size
        experts = (f"; experts split over {self.expert_parallel_size} ranks"
                   + (f" x {expert_replicas} replicas" if expert_replicas > 1 else "")
                   if self.expert_parallel_size > 1 else "")
        return (f"global batch {self.global_batch_size} = micro batch {self.micro_batch_size} x "
                f"{self.data_parallel_size} data-parallel ranks{hybrid} x {self.accumulation} accumulation "
                f"steps{groups}; "
                f"{self.tokens_per_step:,} {self.unit} per optimizer step{pipeline}{experts}")


def run_plan_of(holder: object) -> RunPlan:
    """The run plan handed to a model or datamodule (its ``run_plan``); a UserError where none was."""
    plan = getattr(holder, "run_plan", None)
    if plan is None:
        raise UserError(f"{type(holder).__name__} has no run plan: train it through the cohort command, or set its "
                        "run_plan to a core.run_plan.RunPlan first")
    return plan
