"""Pre-flight: every check that can stop a run before anything is built, run alike by fit, validate, test and
predict (app/cli/lightning_cli.py), by ``cohort doctor`` (which adds only its probes) and, for what the config alone
decides, by ``--print_config``; and the run plan they resolve (core/run_plan.py), from the config and the launcher.

A failing check raises a UserError whose one line says what was wrong and what to do, before any process group,
model or file exists.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from collections.abc import Callable
from pathlib import Path

import torch
from jsonargparse import Namespace
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities import rank_zero_info

from app.cli.launch import parent_start_time
from app.safety.checkpoint_reading import check_checkpoint, find_last_checkpoint
from app.safety.launch_environment import RUN_VERSION_ENV, replica_group, torchrun_restart
from app.strategies.fault_tolerance.strategy import FaultTolerantStrategy
from app.strategies.gradient_compression import COMPRESSIONS
from app.strategies.local_updates import UPDATE_METHODS
from app.strategies.parameter_server.strategy import check_asynchronous
from app.strategies.pipeline import PipelineParallelStrategy
from core.errors import UserError, check_ranges, check_writable_folder
from core.precision import precision_named
from core.run_plan import ZERO_BUBBLE_SCHEDULES, RunPlan
from datamodules.base import ShardedDataModule
from datamodules.language_modeling import LanguageModelingDataModule, check_byte_level_prompts
from datamodules.own_datamodule import read_training_loader
from datamodules.prepare import DEFAULT_CORPUS_DIR
from models.module import CohortModule


def signature_defaults(cls: type) -> dict[str, object]:
    """A class's arguments and their defaults: the one place a strategy's defaults are written is its signature."""
    return {name: parameter.default for name, parameter in inspect.signature(cls.__init__).parameters.items()
            if name != "self"}


PIPELINE_DEFAULTS = signature_defaults(PipelineParallelStrategy)
FAULT_TOLERANT_DEFAULTS = signature_defaults(FaultTolerantStrategy)


class Preflight:
    """The checks of one command's config, in order. ``run`` raises at the first failure; ``cohort doctor`` runs
    ``checks`` one by one and reports each. The run plan is set once its sizes are resolved (before the family's
    checks against them)."""

    def __init__(self, config: Namespace, subcommand: str | None) -> None:
        self.config = config
        self.subcommand = subcommand
        self.plan: RunPlan | None = None

    def checks(self) -> list[tuple[str, Callable[[], str]]]:
        """(name, step) pairs; each returns one line on what it found. The resolve_* steps also write what they
        resolved into the config: the precision this device runs, the checkpoint ``--ckpt_path last`` names."""
        return [("world size", self.check_world_size), ("precision", self.resolve_trainer_precision),
                ("run plan", self.check_run_plan), ("checkpoint", self.resolve_checkpoint),
                ("replica group", self.resolve_replica_group_folders), ("folders", self.check_folders)]

    def run(self) -> RunPlan:
        for _, check in self.checks():
            check()
        assert self.plan is not None
        return self.plan

    def check_world_size(self) -> str:
        trainer = self.config.trainer
        check_launch(trainer)
        return f"{devices_per_node(trainer)} devices x {trainer.num_nodes} nodes"

    def resolve_trainer_precision(self) -> str:
        trainer = self.config.trainer
        trainer.precision = resolve_precision(trainer.precision, accelerator_name(trainer))
        return trainer.precision

    def check_run_plan(self) -> str:
        # kept even when the checks against it fail: cohort doctor still estimates the memory of its sizes
        self.plan = resolve_run_plan(self.config)
        check_config_against_plan(self.config, self.plan)
        family = model_class(self.config)
        if self.subcommand is not None and self.subcommand not in family.commands:
            raise UserError(f"{family.__name__} has no {self.subcommand} (it has {', '.join(family.commands)}): "
                            "cohort validate reports its validation metrics")
        data = self.config.data
        if self.subcommand == "predict" and issubclass(class_of(data.class_path), LanguageModelingDataModule):
            check_byte_level_prompts(data.init_args.vocab_size)  # before the checkpoint is read
        if self.subcommand == "predict" and self.plan.pipeline_parallel_size > 1:
            raise UserError("predict samples token by token through the whole model, which a pipeline splits: predict "
                            "on one process (configs/trainer/cpu.yaml) with the same --ckpt_path, which reads it whole")
        return self.plan.describe()

    def resolve_checkpoint(self) -> str:
        """Resolve ``--ckpt_path last`` (and a torchrun restart's own run) and read the checkpoint's header."""
        config = self.config
        if "ckpt_path" not in config:  # cohort doctor: no subcommand, nothing to resume
            return "nothing to resume"
        if config.weights_only is None:  # checkpoints are data: refuse a pickle that asks for code, whatever torch's default
            config.weights_only = True
        if replica_group() is not None and torchrun_restart() > 0:
            config.ckpt_path = None  # a restarted replica group takes a live group's state, not the job's checkpoint
        if config.ckpt_path == "last":
            config.ckpt_path = continue_last_run(config.trainer)
        elif config.ckpt_path is None and self.subcommand == "fit" and torchrun_restart() > 0 and replica_group() is None:
            # torchrun restarted the ranks after one failed: continue this job's run, not an older one in the folder
            config.ckpt_path = continue_last_run(config.trainer, written_since=parent_start_time())
        if config.ckpt_path is None and self.subcommand == "predict":
            raise UserError("predict continues prompts with trained weights: pass --ckpt_path with a checkpoint of "
                            "this model (a run's lightning_logs/version_N/checkpoints/last.ckpt, or last)")
        if config.ckpt_path is None and self.subcommand in ("validate", "test"):  # not the untrained weights unasked
            raise UserError(f"{self.subcommand} scores a checkpoint, and none was named (or last found none): pass "
                            "--ckpt_path with a checkpoint of this model (a run's lightning_logs/version_N/checkpoints/"
                            f"last.ckpt, or last), or --ckpt_path {INITIAL_WEIGHTS} to score the weights the seed "
                            "initialises")
        if config.ckpt_path == INITIAL_WEIGHTS and self.subcommand in ("validate", "test"):
            config.ckpt_path = None
            return f"the initial weights of seed {config.seed_everything}"
        if config.ckpt_path in (None, "last"):
            return "a new run" if config.ckpt_path is None else "Lightning's own lookup of the last checkpoint"
        check_checkpoint(Path(config.ckpt_path), config.model, config.weights_only)
        return f"resumes from {config.ckpt_path}"

    def resolve_replica_group_folders(self) -> str:
        """A fault-tolerant replica group logs and checkpoints into replica_group_G of its job's run folder, which
        the job names (COHORT_RUN_VERSION: cohort fit's launcher, or scripts/torchrun.sh), so that the groups of one
        job write side by side and never over each other."""
        group = replica_group()
        if group is None:
            return "not a replica group"
        version = os.environ.get(RUN_VERSION_ENV)
        if version is None:
            raise UserError(f"replica group {group} has no run folder: {RUN_VERSION_ENV} names the job's "
                            "lightning_logs/VERSION; start the job with cohort fit or scripts/torchrun.sh")
        root, folder = log_root(self.config.trainer), f"replica_group_{group}"
        if root is not None:
            self.config.trainer.logger.init_args.version = version
            self.config.trainer.logger.init_args.sub_dir = folder
        checkpoint = self.config.checkpoint
        if checkpoint.dirpath is not None:
            checkpoint.dirpath = str(Path(checkpoint.dirpath) / folder)
        elif root is not None:
            checkpoint.dirpath = str(root / version / folder / "checkpoints")
        return f"replica group {group}: {checkpoint.dirpath}"

    def check_folders(self) -> str:
        folders = {"log folder": log_root(self.config.trainer), "checkpoint folder": self.config.checkpoint.dirpath}
        data = self.config.data
        if data.class_path.endswith("LanguageModelingDataModule") and data.init_args.data_dir is None:
            folders["embedded corpus folder"] = DEFAULT_CORPUS_DIR  # built there on first use
        for what, folder in folders.items():
            if folder is not None:
                check_writable_folder(Path(folder), what)
        return ", ".join(str(folder) for folder in folders.values() if folder is not None) + " writable"


INITIAL_WEIGHTS = "initial"  # --ckpt_path for validate and test to score the untrained weights on purpose


def check_config(config: Namespace) -> RunPlan:
    """What the config alone decides, on any machine (``--print_config`` checks this much): the strategy, the sizes
    and the batch arithmetic, and whether the model fits them. Returns the run plan."""
    plan = resolve_run_plan(config)
    check_config_against_plan(config, plan)
    return plan


def resolve_run_plan(config: Namespace) -> RunPlan:
    """The strategy, the sizes and the batch arithmetic of the config: its run plan, or a UserError."""
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
    check_strategy(trainer.strategy, accelerator_name(trainer))
    pipeline, data_parallel, tensor_parallel = parallel_sizes(trainer)
    world_size = devices_per_node(trainer) * int(trainer.num_nodes)
    precision = precision_named(trainer.precision)
    asynchronous = is_parameter_server(trainer.strategy)
    if asynchronous:
        check_asynchronous(config, world_size, precision.name)
    data = training_data(config, data_parallel, world_size)
    replica_groups = check_fault_tolerance(config, data, world_size) if is_fault_tolerant(trainer.strategy) else 1
    return RunPlan(
        devices_per_node=devices_per_node(trainer), num_nodes=int(trainer.num_nodes),
        data_parallel_size=data_parallel, tensor_parallel_size=tensor_parallel,
        global_batch_size=data.global_batch_size, micro_batch_size=data.micro_batch_size,
        sequence_length=getattr(data, "sequence_length", 1),  # tokens per sample; an image counts as one
        precision=precision, seed=config.seed_everything,
        pipeline_parallel_size=pipeline, **pipeline_options(trainer),
        unit=getattr(data, "unit", getattr(class_of(config.data.class_path), "unit", "tokens")),
        asynchronous_workers=world_size - 1 if asynchronous else 0, replica_groups=replica_groups,
    )


def check_config_against_plan(config: Namespace, plan: RunPlan) -> None:
    """The options and the model family against the run plan: a UserError for what they cannot do with it."""
    trainer, data = config.trainer, config.data.get("init_args") or Namespace()
    check_compression(getattr(config, "gradient_compression", None), trainer.strategy, plan.world_size)
    check_local_updates(config, plan.world_size)
    family = model_class(config)
    check_family_honours_strategy(family, plan, trainer.strategy)
    family.check_config(config.model.init_args, data, plan)
    if (plan.pipeline_parallel_size > 1 and plan.pipeline_schedule in ZERO_BUBBLE_SCHEDULES
            and getattr(config.model.init_args, "compile", False)):
        raise UserError(f"model.compile=true with pipeline_schedule={plan.pipeline_schedule}: a zero-bubble "
                        "schedule runs each backward in two halves (the inputs' gradients, later the weights'), which "
                        "a compiled block cannot; set model.compile false, or use 1F1B or Interleaved1F1B")
    if is_fsdp(trainer.strategy) and getattr(config.model.init_args, "activation_checkpointing", False):
        raise UserError("model.activation_checkpointing is for DDP and model_parallel; under fsdp set "
                        "trainer.strategy.init_args.activation_checkpointing_policy (see configs/trainer/fsdp_gpu_bf16.yaml)")


def training_data(config: Namespace, data_parallel_size: int, world_size: int) -> Namespace:
    """The data's side of the run plan (batch sizes, tokens per sample, unit, loader workers): a ShardedDataModule's
    arguments as the config gives them; for a datamodule of one's own, what its training loader yields, refused in one
    line where the ranks could not each read their own samples (datamodules/own_datamodule.py)."""
    datamodule = class_of(config.data.class_path)
    if issubclass(datamodule, ShardedDataModule):
        return config.data.init_args
    loader = read_training_loader(datamodule(**vars(config.data.get("init_args") or Namespace())))
    strategy = config.trainer.strategy
    by_number = ("the parameter server" if is_parameter_server(strategy) else
                 "FaultTolerantStrategy" if is_fault_tolerant(strategy) else None)
    loader.check_strategy(world_size, data_parallel_size, by_number)
    groups = int(getattr(strategy.init_args, "replica_groups", FAULT_TOLERANT_DEFAULTS["replica_groups"])
                 if is_fault_tolerant(strategy) else 1)
    return Namespace(global_batch_size=loader.default_global_batch_size(data_parallel_size, groups),
                     micro_batch_size=loader.micro_batch_size, sequence_length=loader.sequence_length,
                     unit=loader.unit, num_workers=loader.num_workers)


def check_family_honours_strategy(family: type[CohortModule], plan: RunPlan, strategy: str | Namespace | None) -> None:
    """A UserError, naming what the family lacks, for a layout its network cannot be given: pipeline stages without
    ``pipeline_split``, tensor parallelism without ``tensor_parallel_plan``, and any sharded strategy for a family
    that builds its network in its own ``configure_model`` (where Cohort cannot shard it, each rank would train a
    replica of its own)."""
    name = family.__name__
    if plan.pipeline_parallel_size > 1 and not overrides(family, "pipeline_split"):
        raise UserError(f"{name} has no pipeline split (CohortModule.pipeline_split): train it without pipeline "
                        "stages (configs/trainer/ddp_cpu.yaml, model_parallel_cpu.yaml or their GPU versions)")
    if plan.tensor_parallel_size > 1 and not overrides(family, "tensor_parallel_plan"):
        raise UserError(f"{name} has no tensor-parallel plan (CohortModule.tensor_parallel_plan): set "
                        "trainer.strategy.init_args.tensor_parallel_size 1, or give the family a plan")
    sharded = strategy_name(strategy).endswith(("ModelParallelStrategy", "PipelineParallelStrategy"))
    if sharded and plan.world_size > 1 and overrides(family, "configure_model"):
        raise UserError(f"{name} builds its network in its own configure_model, which Cohort cannot shard over "
                        f"{plan.world_size} processes: remove configure_model and let Cohort build plain_network() "
                        "(README: 'A family of your own'), or train it with DDP (configs/trainer/ddp_cpu.yaml)")


def overrides(family: type[CohortModule], method: str) -> bool:
    """Whether the family gives its own ``method`` rather than CohortModule's."""
    return getattr(family, method) is not getattr(CohortModule, method)


def model_class(config: Namespace) -> type[CohortModule]:
    """The model family the config names (the parser has already checked that the class exists and is one)."""
    return class_of(config.model.class_path)


def class_of(class_path: str) -> type:
    """The class a config's class_path names."""
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def strategy_name(strategy: str | Namespace | None) -> str:
    """A strategy's registry name ("ddp") or class path, as the config gives it."""
    return strategy if isinstance(strategy, str) else str(getattr(strategy, "class_path", ""))


def is_fsdp(strategy: str | Namespace | None) -> bool:
    """FSDP version 1: Lightning's "fsdp" strategies (FSDP2 runs under ModelParallelStrategy)."""
    name = strategy_name(strategy)
    return name.startswith("fsdp") or name.endswith("FSDPStrategy")


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


def parallel_sizes(trainer: Namespace) -> tuple[int, int, int]:
    """(pipeline stages, data-parallel size, tensor-parallel size) as the config asks. ModelParallelStrategy's
    "auto" is data parallel over the nodes and tensor parallel within one; PipelineParallelStrategy's sizes are
    numbers; every other strategy is data parallel only."""
    name = strategy_name(trainer.strategy)
    sizes = getattr(trainer.strategy, "init_args", Namespace())
    if name.endswith("PipelineParallelStrategy"):
        pipeline, data, tensor = (int(getattr(sizes, size, PIPELINE_DEFAULTS[size]))
                                  for size in ("pipeline_parallel_size", "data_parallel_size", "tensor_parallel_size"))
        return pipeline, data, tensor
    if is_parameter_server(trainer.strategy) or is_fault_tolerant(trainer.strategy):
        return 1, 1, 1  # each update is one global batch, which one worker reads; a replica group is one process
    if not name.endswith("ModelParallelStrategy"):
        return 1, devices_per_node(trainer) * int(trainer.num_nodes), 1
    data_parallel = getattr(sizes, "data_parallel_size", "auto")
    tensor_parallel = getattr(sizes, "tensor_parallel_size", "auto")
    return (1, int(trainer.num_nodes) if data_parallel == "auto" else int(data_parallel),
            devices_per_node(trainer) if tensor_parallel == "auto" else int(tensor_parallel))


def pipeline_options(trainer: Namespace) -> dict[str, str | int | tuple[int, ...] | None]:
    """The schedule, the pipeline micro-batches and the split PipelineParallelStrategy is given, as given (the
    run plan refuses what cannot work); where a field is missing, the strategy's own default."""
    if not strategy_name(trainer.strategy).endswith("PipelineParallelStrategy"):
        return {}
    given = {name: getattr(trainer.strategy.init_args, name, default) for name, default in PIPELINE_DEFAULTS.items()}
    if given["save_distributed_checkpoint"] is False:
        raise UserError("trainer.strategy.init_args.save_distributed_checkpoint=false would gather one stage's weights "
                        "only: pipelined runs save sharded checkpoints (cohort consolidate makes one file)")
    microbatches, layers = given["pipeline_microbatches"], given["pipeline_layers"]
    return {"pipeline_schedule": str(given["pipeline_schedule"]),
            # null means one per stage, as the strategy's docstring says; a number is taken as it is
            "pipeline_microbatches": int(given["pipeline_parallel_size"]) if microbatches is None else int(microbatches),
            "pipeline_layers": None if layers is None else tuple(int(count) for count in layers)}


def check_strategy(strategy: str | Namespace | None, accelerator: str) -> None:
    """A strategy named by a word Lightning knows or by a class the parser imported (a class path that imports
    nothing stays a string); FSDP (version 1) needs GPUs: on CPUs the same sharding runs as FSDP2 under
    ModelParallelStrategy."""
    if isinstance(strategy, str) and strategy not in ("auto", *StrategyRegistry.available_strategies()):
        raise UserError(f"trainer.strategy={strategy!r} is neither a strategy Lightning knows by name (ddp, fsdp, ...) "
                        "nor a class that can be imported: use a preset from configs/trainer/ or a class path such as "
                        "lightning.pytorch.strategies.ModelParallelStrategy")
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if is_fsdp(strategy) and on_cpu:
        raise UserError("trainer.strategy fsdp needs CUDA GPUs: on CPUs use configs/trainer/model_parallel_cpu.yaml "
                        "(FSDP2 through ModelParallelStrategy over gloo)")


def is_parameter_server(strategy: str | Namespace | None) -> bool:
    return strategy_name(strategy).endswith("ParameterServerStrategy")


def is_fault_tolerant(strategy: str | Namespace | None) -> bool:
    return strategy_name(strategy).endswith("FaultTolerantStrategy")


def check_fault_tolerance(config: Namespace, data: Namespace, world_size: int) -> int:
    """A UserError for what fault-tolerant replica groups cannot run with; returns the number of groups."""
    field = "trainer.strategy.init_args"
    if importlib.util.find_spec("torchft") is None:
        raise UserError("FaultTolerantStrategy needs torchft, which is not installed: pip install -e '.[ft]'")
    if world_size != 1:
        raise UserError(f"trainer.devices x trainer.num_nodes = {world_size} under FaultTolerantStrategy, whose replica "
                        f"groups are one process each: set trainer.devices 1 and num_nodes 1, and raise "
                        f"{field}.replica_groups instead")
    workers = getattr(data, "num_workers", 0)
    if workers:
        raise UserError(f"data.num_workers={workers}: a fault-tolerant group reads each step's samples once the step's "
                        "quorum has said which, so its loader must not read ahead: set data.num_workers 0")
    bad_steps = getattr(config, "bad_steps", None)
    if bad_steps is not None and bad_steps.action == "rollback":
        raise UserError("bad_steps.action=rollback would reload one replica group's weights from its own checkpoint "
                        "while the others go on: use stop or skip with FaultTolerantStrategy")
    given = {name: getattr(config.trainer.strategy.init_args, name, default)
             for name, default in FAULT_TOLERANT_DEFAULTS.items()}
    groups, fewest = int(given["replica_groups"]), int(given["min_replicas"])
    check_ranges(field, {"replica_groups": (groups >= 1, "at least 1"),
                         "min_replicas": (1 <= fewest <= groups, f"between 1 and replica_groups={groups}"),
                         "max_restarts": (given["max_restarts"] >= 0, ">= 0")}, given)
    accumulation = data.global_batch_size // (data.micro_batch_size * groups)
    for quorum in range(fewest, groups):  # the full quorum's arithmetic is the run plan's check
        if accumulation and data.global_batch_size % (quorum * accumulation):
            raise UserError(f"data.global_batch_size={data.global_batch_size} cannot be shared by a quorum of {quorum} "
                            f"replica groups in {accumulation} equal micro-batches each: choose a global batch that "
                            f"divides by {accumulation} x every quorum size from min_replicas={fewest} to "
                            f"{groups}, or raise {field}.min_replicas")
    return groups


def is_ddp(strategy: str | Namespace | None) -> bool:
    """DDPStrategy, by name or class path; "auto" is DDP too on more than one device."""
    name = strategy_name(strategy)
    return name in ("", "auto") or name.startswith("ddp") or name.endswith("DDPStrategy")


def check_compression(options: Namespace | None, strategy: str | Namespace | None, world_size: int) -> None:
    """A UserError for a gradient compression that is unknown, not DDP's, or out of range; a note (not an error:
    the same config runs on one process to debug, and trains there exactly) where there is nothing to compress."""
    if options is None or options.method == "none":
        return
    method, field = options.method, "gradient_compression"
    if method not in COMPRESSIONS:
        raise UserError(f"{field}.method={method!r} is not a compression: use one of {', '.join(COMPRESSIONS)}")
    if not is_ddp(strategy):
        raise UserError(f"{field}.method={method} compresses DDP's gradient all-reduce, but trainer.strategy is "
                        f"{strategy_name(strategy)}, which reduces gradients its own way: use a DDP preset "
                        f"(configs/trainer/ddp_cpu.yaml, ddp_gpu_bf16.yaml) or set {field}.method none")
    if method == "powersgd":
        check_ranges(field, {"powersgd_rank": (options.powersgd_rank >= 1, "at least 1"),
                             "powersgd_start_step": (options.powersgd_start_step >= 2,
                                                     "at least 2 (DDP regroups its gradient buckets after step 1)")},
                     {"powersgd_rank": options.powersgd_rank, "powersgd_start_step": options.powersgd_start_step})
    if world_size == 1:
        rank_zero_info(f"{field}: method {method} does nothing on one process (there is no all-reduce); the run "
                       "trains with exact gradients")


def check_local_updates(config: Namespace, world_size: int) -> None:
    """A UserError for local updates (local SGD, DiLoCo) that are unknown, out of range, outside DDP, or combined with
    what they cannot work with; notes where they do nothing or where a run ends or validates between two syncs."""
    options = getattr(config, "local_updates", None)
    if options is None or options.method == "sync":
        return
    method, field, strategy = options.method, "local_updates", config.trainer.strategy
    if method not in UPDATE_METHODS:
        raise UserError(f"{field}.method={method!r} is not an update method: use one of {', '.join(UPDATE_METHODS)}")
    check_ranges(field, {"sync_every": (options.sync_every >= 1, "at least 1"),
                         "outer_learning_rate": (options.outer_learning_rate > 0, "> 0"),
                         "outer_momentum": (0 <= options.outer_momentum < 1, "in [0, 1)")},
                 {"sync_every": options.sync_every, "outer_learning_rate": options.outer_learning_rate,
                  "outer_momentum": options.outer_momentum})
    if not is_ddp(strategy):
        raise UserError(f"{field}.method={method} lets each DDP replica step on its own, but trainer.strategy is "
                        f"{strategy_name(strategy)}, whose ranks hold shards, not replicas: use a DDP preset "
                        f"(configs/trainer/diloco_cpu.yaml, ddp_cpu.yaml, ddp_gpu_bf16.yaml) or set {field}.method sync")
    if method == "local_sgd" and options.sync_every == 1:
        rank_zero_info(f"{field}: local_sgd with sync_every 1 is DDP (gradients all-reduced at every step): "
                       "averaging parameters after each rank's own AdamW step would send as much and train worse")
        return
    compression = getattr(config, "gradient_compression", None)
    if compression is not None and compression.method != "none":
        raise UserError(f"{field}.method={method} all-reduces no gradients, so gradient_compression.method="
                        f"{compression.method} would have nothing to compress: set gradient_compression.method none, "
                        f"or {field}.method sync")
    bad_steps = getattr(config, "bad_steps", None)
    if bad_steps is not None and bad_steps.action == "rollback":
        raise UserError(f"bad_steps.action=rollback reloads rank 0's weights and optimizer state into every rank, "
                        f"which under {field}.method={method} would drop each rank's own: use stop or skip")
    if world_size == 1:
        rank_zero_info(f"{field}: method {method} does nothing on one process (there is nothing to sync); the run "
                       "trains as plain AdamW")
        return
    between = [f"{name}={value}" for name, value in (("trainer.max_steps", config.trainer.max_steps),
                                                     ("val_every_n_steps", getattr(config, "val_every_n_steps", None)))
               if value is not None and value > 0 and value % options.sync_every]
    if between:
        rank_zero_info(f"{field}: {' and '.join(between)} not a multiple of sync_every={options.sync_every}: the "
                       "run ends or validates between two syncs, on each rank's own weights (the last checkpoint's "
                       "weights are then rank 0's)")


def resolve_precision(precision: str | int | None, accelerator: str) -> str:
    """The precision Lightning should get; a UserError where the device cannot run the one asked for."""
    requested = precision_named(precision).name
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise UserError(
            f"trainer.accelerator={accelerator} but no CUDA GPU is visible: use configs/trainer/cpu.yaml, "
            "or check the driver and CUDA_VISIBLE_DEVICES"
        )
    if on_gpu and requested.startswith("bf16") and not torch.cuda.is_bf16_supported():
        raise UserError(f"trainer.precision={requested}: this GPU has no bfloat16 support; use 16-mixed or 32-true")
    if not on_gpu and requested == "16-true":
        raise UserError("trainer.precision=16-true: CPUs have no float16 kernels worth training with; "
                        "use bf16-true, bf16-mixed or 32-true")
    if not on_gpu and requested == "16-mixed":
        rank_zero_info("precision: 16-mixed asked for, but CPU autocast has no float16, so this runs as bf16-mixed "
                       "(bfloat16 autocast, no grad scaler)")
        return "bf16-mixed"
    return requested


def check_launch(trainer: Namespace) -> None:
    """A UserError, in seconds, when the processes that exist cannot form the job the config describes; otherwise
    the ranks would wait for each other until a timeout. Lightning alone starts processes on this machine only."""
    expected = devices_per_node(trainer) * int(trainer.num_nodes)
    if TorchElasticEnvironment.detect():
        launcher, started = "torchrun", int(os.environ["WORLD_SIZE"])
        restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))
        if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            raise UserError("torchrun --max-restarts here lends its rendezvous store to every attempt, so a restarted "
                            "rank would read the dead ranks' addresses and fail or hang (pytorch/pytorch#135712): "
                            "launch with scripts/torchrun.sh, or set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and give "
                            "torchrun --standalone (one node) or --rdzv-backend c10d (several)")
    elif SLURMEnvironment.detect():
        launcher, started = "srun", int(os.environ["SLURM_NTASKS"])
    elif int(trainer.num_nodes) > 1:
        raise UserError(f"trainer.num_nodes={trainer.num_nodes} but no launcher started this process, so the other "
                        "nodes' processes would be waited for forever: on every node run scripts/torchrun.sh (torchrun), "
                        "or submit scripts/slurm/train.sbatch (srun)")
    else:
        return
    if started != expected:
        raise UserError(f"{launcher} started {started} processes but trainer.devices={trainer.devices} x "
                        f"trainer.num_nodes={trainer.num_nodes} = {expected}: make the two agree (for srun: "
                        "--ntasks-per-node = devices, --nodes = num_nodes)")


def continue_last_run(trainer_config: Namespace, written_since: float = 0.0) -> str | None:
    """Resolve ``--ckpt_path last`` to the newest run's last.ckpt, if written after ``written_since`` (seconds since
    the epoch), and log into that run's folder again."""
    root = log_root(trainer_config)
    if root is None:
        return "last"  # another logger: Lightning's own lookup
    checkpoint = find_last_checkpoint(root)
    if checkpoint is None or checkpoint.lstat().st_mtime < written_since:
        rank_zero_info(f"--ckpt_path last: no checkpoint under {root}/version_*/checkpoints"
                       f"{' from this job' if written_since else ''}, starting a new run")
        return None
    trainer_config.logger.init_args.version = checkpoint.relative_to(root).parts[0]  # also replica_group_G's job
    rank_zero_info(f"resuming from {checkpoint}")
    return str(checkpoint)


def log_root(trainer_config: Namespace) -> Path | None:
    """The TensorBoard logger's folder of run versions (save_dir/name); None for another logger."""
    logger = trainer_config.logger
    if not (hasattr(logger, "class_path") and logger.class_path.endswith("TensorBoardLogger")):
        return None
    return Path(logger.init_args.save_dir) / logger.init_args.name
