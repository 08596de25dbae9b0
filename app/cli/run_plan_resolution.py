"""The run plan (core/run_plan.py) that a config resolves to: its strategy's kind, taken from the class it names and
read by every later check, its parallel sizes and its batch arithmetic. A config Cohort cannot run gets a one-line
UserError here, before anything is built."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import fields
from typing import TypeVar

import torch
from jsonargparse import Namespace
from lightning.pytorch.strategies import (
    DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, StrategyRegistry, XLAStrategy,
)

from app.strategies.fault_tolerance import checks as fault_tolerance
from app.strategies.fault_tolerance.settings import FaultToleranceSettings
from app.strategies.fault_tolerance.strategy import FaultTolerantStrategy
from app.strategies.hybrid_sharding import HybridShardedStrategy
from app.strategies.kind import ConfiguredStrategy, StrategyKind
from app.strategies.parameter_server.strategy import ParameterServerStrategy, check_asynchronous
from app.strategies.pipeline import PipelineParallelStrategy
from core.errors import UserError
from core.pipeline_schedules import pipeline_microbatches_or_default
from core.precision import precision_named
from core.run_plan import RunPlan
from datamodules.base import ShardedDataModule
from datamodules.own_datamodule import read_training_loader

# each strategy class Cohort tells apart and its kind, subclasses before their bases: a pipeline is model parallel;
# and fault-tolerant groups (FSDP2 within a group) are model parallel; the parameter server, DeepSpeed and XLA are
# DDPStrategies that reduce gradients their own way
KINDS = ((PipelineParallelStrategy, StrategyKind.PIPELINE), (FaultTolerantStrategy, StrategyKind.FAULT_TOLERANT),
         (ModelParallelStrategy, StrategyKind.MODEL_PARALLEL), (ParameterServerStrategy, StrategyKind.PARAMETER_SERVER),
         (DeepSpeedStrategy, StrategyKind.OTHER), (XLAStrategy, StrategyKind.OTHER),
         (FSDPStrategy, StrategyKind.FSDP), (DDPStrategy, StrategyKind.DDP))
Settings = TypeVar("Settings")  # a feature's frozen settings record
# PipelineParallelStrategy's arguments and their defaults: the one place they are written is its signature
PIPELINE_DEFAULTS = {name: parameter.default for name, parameter
                     in inspect.signature(PipelineParallelStrategy.__init__).parameters.items() if name != "self"}
HYBRID_SHARDING_DEFAULTS = {name: inspect.signature(HybridShardedStrategy.__init__).parameters[name].default
                            for name in ("data_parallel_replicate_size", "reduce_gradients_every_micro_batch",
                                         "expert_parallel_size")}


def resolve_run_plan(config: Namespace) -> tuple[ConfiguredStrategy, RunPlan]:
    """The strategy, the sizes and the batch arithmetic of the config: its strategy and run plan, or a UserError."""
    trainer = config.trainer
    if trainer.use_distributed_sampler:
        raise UserError("trainer.use_distributed_sampler must stay false: Cohort gives each data-parallel rank its own "
                        "training samples, with its own sampler (the same samples per step at any world size) or the "
                        "datamodule's DistributedSampler")
    if trainer.accumulate_grad_batches != 1:
        raise UserError(f"trainer.accumulate_grad_batches={trainer.accumulate_grad_batches} is derived here: set "
                        "data.global_batch_size and data.micro_batch_size instead and leave it at 1")
    every = getattr(config, "val_every_n_steps", None)
    if every is not None and every < 1:
        raise UserError(f"val_every_n_steps={every} must be at least 1 (optimizer steps between validations), or null "
                        "to validate once per epoch")
    if type(trainer.val_check_interval) is int and trainer.val_check_interval < 1:  # Lightning divides by it
        raise UserError(f"trainer.val_check_interval={trainer.val_check_interval} must be at least 1 (micro-batches "
                        "between validations) or a fraction of an epoch: better, set val_every_n_steps")
    strategy = configured_strategy(trainer.strategy, accelerator_name(trainer))
    pipeline, data_parallel, tensor_parallel = parallel_sizes(trainer, strategy.kind)
    world_size = devices_per_node(trainer) * int(trainer.num_nodes)
    precision = precision_named(trainer.precision)
    asynchronous = strategy.kind is StrategyKind.PARAMETER_SERVER
    if asynchronous:
        check_asynchronous(config, world_size, precision.name)
    fault_tolerant = (settings_from(trainer.strategy.init_args, FaultToleranceSettings)
                      if strategy.kind is StrategyKind.FAULT_TOLERANT else None)
    replica_groups = 1 if fault_tolerant is None else fault_tolerant.replica_groups
    data = training_data(config, strategy.kind, data_parallel, world_size, replica_groups)
    if fault_tolerant is not None:
        fault_tolerance.check_config(fault_tolerant, world_size, data.global_batch_size, data.micro_batch_size,
                                     getattr(data, "num_workers", 0), bad_steps_action(config))
    plan = RunPlan(
        devices_per_node=devices_per_node(trainer), num_nodes=int(trainer.num_nodes),
        data_parallel_size=data_parallel, tensor_parallel_size=tensor_parallel,
        global_batch_size=data.global_batch_size, micro_batch_size=data.micro_batch_size,
        sequence_length=getattr(data, "sequence_length", 1),  # tokens per sample; an image counts as one
        precision=precision, seed=config.seed_everything,
        pipeline_parallel_size=pipeline, **pipeline_options(trainer, strategy.kind),
        unit=getattr(data, "unit", getattr(class_of(config.data.class_path), "unit", "tokens")),
        asynchronous_workers=world_size - 1 if asynchronous else 0, replica_groups=replica_groups,
        **hybrid_sharding_options(trainer, strategy.kind),
    )
    check_training_batches_limit(trainer.limit_train_batches, plan.accumulation)
    return strategy, plan


def check_training_batches_limit(limit: int | float | None, accumulation: int) -> None:
    """Lightning counts trainer.limit_train_batches in micro-batches and steps the optimizer at an epoch's end: a limit
    that ends an epoch inside an optimizer step would step on part of the global batch (and under FSDP2 before its
    gradients were reduced), so with accumulation it must be a whole number of steps."""
    if accumulation == 1 or limit is None or limit == 1.0:
        return
    if isinstance(limit, float) and limit.is_integer() and limit > 1:  # the parser's 8.0 is Lightning's count 8
        limit = int(limit)
    if isinstance(limit, float) or limit % accumulation:
        raise UserError(f"trainer.limit_train_batches={limit} would end an epoch inside an optimizer step of "
                        f"{accumulation} micro-batches: give a count of micro-batches that is a multiple of "
                        f"{accumulation}, or limit the run with trainer.max_steps")


def configured_strategy(strategy: str | Namespace | None, accelerator: str) -> ConfiguredStrategy:
    """The strategy the config names and its kind, from its class: Lightning's for a name Lightning knows, or the
    one the parser imported (a class path that imports nothing stays a string). A UserError for a name that is
    neither, and for FSDP (version 1) on CPUs, where the same sharding runs as FSDP2 under ModelParallelStrategy."""
    name = strategy if isinstance(strategy, str) else str(getattr(strategy, "class_path", ""))
    if name in ("", "auto"):
        return ConfiguredStrategy(StrategyKind.DDP, name)  # "auto" is DDP on more than one device
    if isinstance(strategy, str) and strategy not in StrategyRegistry.available_strategies():
        raise UserError(f"trainer.strategy={strategy!r} is neither a strategy Lightning knows by name (ddp, fsdp, ...) "
                        "nor a class that can be imported: use a preset from configs/trainer/ or a class path such as "
                        "lightning.pytorch.strategies.ModelParallelStrategy")
    named = StrategyRegistry[name]["strategy"] if isinstance(strategy, str) else class_of(name)
    kind = next((kind for base, kind in KINDS if issubclass(named, base)), StrategyKind.OTHER)
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if kind is StrategyKind.FSDP and on_cpu:
        raise UserError("trainer.strategy fsdp needs CUDA GPUs: on CPUs use configs/trainer/model_parallel_cpu.yaml "
                        "(FSDP2 through ModelParallelStrategy over gloo)")
    return ConfiguredStrategy(kind, name)


def settings_from(options: Namespace | None, record: type[Settings]) -> Settings:
    """A feature's settings record from its group of the config (the record's defaults where a field is missing, or
    the group is): the record checks itself as it is made."""
    given = options or Namespace()
    return record(**{field.name: given[field.name] for field in fields(record) if field.name in given})


def bad_steps_action(config: Namespace) -> str | None:
    """What the bad-step guard does (app/safety/bad_steps.py): stop, skip or rollback; None without one."""
    bad_steps = getattr(config, "bad_steps", None)
    return None if bad_steps is None else bad_steps.action


def training_data(config: Namespace, kind: StrategyKind, data_parallel_size: int, world_size: int,
                  replica_groups: int) -> Namespace:
    """The data's side of the run plan (batch sizes, tokens per sample, unit, loader workers): a ShardedDataModule's
    arguments as the config gives them; for a datamodule of one's own, what its training loader yields, refused in one
    line where the ranks could not each read their own samples (datamodules/own_datamodule.py)."""
    datamodule = class_of(config.data.class_path)
    if issubclass(datamodule, ShardedDataModule):
        return config.data.init_args
    loader = read_training_loader(datamodule(**vars(config.data.get("init_args") or Namespace())))
    by_number = {StrategyKind.PARAMETER_SERVER: "the parameter server",
                 StrategyKind.FAULT_TOLERANT: "FaultTolerantStrategy"}.get(kind)
    loader.check_strategy(world_size, data_parallel_size, by_number)
    return Namespace(global_batch_size=loader.default_global_batch_size(data_parallel_size, replica_groups),
                     micro_batch_size=loader.micro_batch_size, sequence_length=loader.sequence_length,
                     unit=loader.unit, num_workers=loader.num_workers)


def class_of(class_path: str) -> type:
    """The class a config's class_path names."""
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def accelerator_name(trainer: Namespace) -> str:
    return trainer.accelerator if isinstance(trainer.accelerator, str) else "custom"


def devices_per_node(trainer: Namespace) -> int:
    """trainer.devices as a count, with Lightning's "auto" / -1 / list forms resolved as Lightning resolves them; a
    UserError for those that pick GPUs where the run is on the CPU (Lightning's would be a TypeError)."""
    devices = trainer.devices
    on_cpu = trainer.accelerator == "cpu" or (trainer.accelerator == "auto" and not torch.cuda.is_available())
    if on_cpu and (devices in (-1, "-1") or isinstance(devices, (list, tuple)) or "," in str(devices)):
        why = "" if trainer.accelerator == "cpu" else " and no CUDA GPU is visible"
        raise UserError(f"trainer.devices={devices} picks GPUs, but this run is on the CPU (trainer.accelerator="
                        f"{trainer.accelerator}{why}): set trainer.devices to a number of CPU processes (2: "
                        "configs/trainer/ddp_cpu.yaml), or run where GPUs are visible")
    if devices in ("auto", -1, "-1"):
        return torch.cuda.device_count() if torch.cuda.is_available() and trainer.accelerator != "cpu" else 1
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and "," in devices:
        return len(devices.strip(",").split(","))
    return int(devices)


def parallel_sizes(trainer: Namespace, kind: StrategyKind) -> tuple[int, int, int]:
    """(pipeline stages, data-parallel size, tensor-parallel size) as the config asks. ModelParallelStrategy's
    "auto" is data parallel over the nodes and tensor parallel within one; PipelineParallelStrategy's sizes are
    numbers; every other strategy is data parallel only."""
    sizes = getattr(trainer.strategy, "init_args", Namespace())
    if kind is StrategyKind.PIPELINE:
        pipeline, data, tensor = (int(getattr(sizes, size, PIPELINE_DEFAULTS[size]))
                                  for size in ("pipeline_parallel_size", "data_parallel_size", "tensor_parallel_size"))
        return pipeline, data, tensor
    if kind is StrategyKind.PARAMETER_SERVER:
        return 1, 1, 1  # each update is one global batch, which one worker reads
    if kind is not StrategyKind.MODEL_PARALLEL:  # a fault-tolerant group's processes are its data-parallel ranks
        return 1, devices_per_node(trainer) * int(trainer.num_nodes), 1
    data_parallel = getattr(sizes, "data_parallel_size", "auto")
    tensor_parallel = getattr(sizes, "tensor_parallel_size", "auto")
    return (1, int(trainer.num_nodes) if data_parallel == "auto" else int(data_parallel),
            devices_per_node(trainer) if tensor_parallel == "auto" else int(tensor_parallel))


def hybrid_sharding_options(trainer: Namespace, kind: StrategyKind) -> dict[str, int | bool]:
    """HybridShardedStrategy's replicate size, gradient reduction under accumulation and expert-parallel size, as
    given (the run plan refuses sizes that do not divide the data-parallel size), else its defaults: Lightning's
    ModelParallelStrategy, which has none of these arguments, shards over all data-parallel ranks, every expert
    included, and, like every FSDP2 run, reduces the gradients once per optimizer step."""
    if kind is not StrategyKind.MODEL_PARALLEL:
        return {}
    given = getattr(trainer.strategy, "init_args", None) or Namespace()
    return {name: getattr(given, name, default) for name, default in HYBRID_SHARDING_DEFAULTS.items()}


def pipeline_options(trainer: Namespace, kind: StrategyKind) -> dict[str, str | int | tuple[int, ...] | None]:
    """The schedule, the pipeline micro-batches and the split PipelineParallelStrategy is given, as given (the
    run plan refuses what cannot work); where a field is missing, the strategy's own default."""
    if kind is not StrategyKind.PIPELINE:
        return {}
    given = {name: getattr(trainer.strategy.init_args, name, default) for name, default in PIPELINE_DEFAULTS.items()}
    if given["save_distributed_checkpoint"] is False:
        raise UserError("trainer.strategy.init_args.save_distributed_checkpoint=false would gather one stage's weights "
                        "only: pipelined runs save sharded checkpoints (cohort consolidate makes one file)")
    microbatches, layers = given["pipeline_microbatches"], given["pipeline_layers"]
    ranks = int(given["pipeline_parallel_size"])
    return {"pipeline_schedule": str(given["pipeline_schedule"]),
            "pipeline_microbatches": pipeline_microbatches_or_default(microbatches, ranks),
            "pipeline_layers": None if layers is None else tuple(int(count) for count in layers)}
