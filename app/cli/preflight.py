"""Pre-flight: every check that can stop a run before anything is built, run alike by fit, validate, test and
predict (app/cli/lightning_cli.py), by ``cohort doctor`` (which adds only its probes) and, for what the config alone
decides, by ``--print_config``. In order: the launcher's process count, the precision on this device, the run plan
(core/run_plan.py, resolved with the strategy's kind in app/cli/run_plan_resolution.py), each feature's own
``check_config`` (beside the feature) and the model family's against it, the checkpoint to resume, a replica group's
folders, and writable folders.

A failing check raises a UserError whose one line says what was wrong and what to do, before any process group,
model or file exists.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from jsonargparse import Namespace
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.utilities import rank_zero_info

from app.cli.launch import parent_start_time
from app.cli.run_plan_resolution import (
    accelerator_name, bad_steps_action, class_of, devices_per_node, resolve_run_plan, settings_from,
)
from app.safety.checkpoint_reading import check_checkpoint, find_last_checkpoint
from app.strategies import gradient_compression, local_updates
from app.safety.launch_environment import RUN_VERSION_ENV, replica_group, torchrun_restart
from app.strategies.gradient_compression import CompressionSettings
from app.strategies.kind import ConfiguredStrategy, StrategyKind
from app.strategies.local_updates import LocalUpdateSettings
from core.errors import UserError, check_writable_folder
from core.precision import precision_named
from core.run_plan import RunPlan
from datamodules.language_modeling import LanguageModelingDataModule, check_byte_level_prompts
from datamodules.prepare import DEFAULT_CORPUS_DIR
from models.module import CohortModule


class Preflight:
    """The checks of one command's config, in order. ``run`` raises at the first failure; ``cohort doctor`` runs
    ``checks`` one by one and reports each. The strategy and the run plan are set once resolved (before the
    features' and the family's checks against them)."""

    def __init__(self, config: Namespace, subcommand: str | None) -> None:
        self.config = config
        self.subcommand = subcommand
        self.strategy: ConfiguredStrategy | None = None
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
        self.strategy, self.plan = resolve_run_plan(self.config)
        check_config_against_plan(self.config, self.plan, self.strategy)
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
        if issubclass(class_of(data.class_path), LanguageModelingDataModule) and data.init_args.data_dir is None:
            folders["embedded corpus folder"] = DEFAULT_CORPUS_DIR  # built there on first use
        for what, folder in folders.items():
            if folder is not None:
                check_writable_folder(Path(folder), what)
        return ", ".join(str(folder) for folder in folders.values() if folder is not None) + " writable"


INITIAL_WEIGHTS = "initial"  # --ckpt_path for validate and test to score the untrained weights on purpose


def check_config(config: Namespace) -> RunPlan:
    """What the config alone decides, on any machine (``--print_config`` checks this much): the strategy, the sizes
    and the batch arithmetic, and whether the model fits them. Returns the run plan."""
    strategy, plan = resolve_run_plan(config)
    check_config_against_plan(config, plan, strategy)
    return plan


def check_config_against_plan(config: Namespace, plan: RunPlan, strategy: ConfiguredStrategy) -> None:
    """The features' options and the model family against the strategy and the run plan, in this order: a
    UserError for what they cannot do with them."""
    data = config.data.get("init_args") or Namespace()
    compression = settings_from(getattr(config, "gradient_compression", None), CompressionSettings)
    gradient_compression.check_config(compression, plan, strategy)
    local_updates.check_config(settings_from(getattr(config, "local_updates", None), LocalUpdateSettings), plan,
                               strategy, compression, bad_steps_action(config), config.trainer.max_steps,
                               getattr(config, "val_every_n_steps", None))
    family = model_class(config)
    check_family_honours_strategy(family, plan, strategy.kind)
    family.check_config(config.model.init_args, data, plan)
    if (plan.pipeline_parallel_size > 1 and plan.schedule.zero_bubble
            and getattr(config.model.init_args, "compile", False)):
        raise UserError(f"model.compile=true with pipeline_schedule={plan.pipeline_schedule}: a zero-bubble "
                        "schedule runs each backward in two halves (the inputs' gradients, later the weights'), which "
                        "a compiled block cannot; set model.compile false, or use 1F1B or Interleaved1F1B")
    if strategy.kind is StrategyKind.FSDP and getattr(config.model.init_args, "activation_checkpointing", False):
        raise UserError("model.activation_checkpointing is for DDP and model_parallel; under fsdp set "
                        "trainer.strategy.init_args.activation_checkpointing_policy (see configs/trainer/fsdp_gpu_bf16.yaml)")


def check_family_honours_strategy(family: type[CohortModule], plan: RunPlan, kind: StrategyKind) -> None:
    """A UserError, naming what the family lacks, for a layout its network cannot be given: pipeline stages without
    ``pipeline_split``, tensor parallelism without ``tensor_parallel_plan``, expert parallelism without experts
    (``routes_to_experts``), and any sharded strategy for a family that builds its network in its own
    ``configure_model`` (where Cohort cannot shard it, each rank would train a replica of its own)."""
    name = family.__name__
    if plan.pipeline_parallel_size > 1 and not overrides(family, "pipeline_split"):
        raise UserError(f"{name} has no pipeline split (CohortModule.pipeline_split): train it without pipeline "
                        "stages (configs/trainer/ddp_cpu.yaml, model_parallel_cpu.yaml or their GPU versions)")
    if plan.tensor_parallel_size > 1 and not overrides(family, "tensor_parallel_plan"):
        raise UserError(f"{name} has no tensor-parallel plan (CohortModule.tensor_parallel_plan): set "
                        "trainer.strategy.init_args.tensor_parallel_size 1, or give the family a plan")
    if plan.expert_parallel_size > 1 and not family.routes_to_experts:
        raise UserError(f"{name} has no experts to split over expert_parallel_size={plan.expert_parallel_size} ranks: "
                        "set trainer.strategy.init_args.expert_parallel_size 1, or train a mixture-of-experts family")
    if kind.shards_layers and plan.world_size > 1 and overrides(family, "configure_model"):
        raise UserError(f"{name} builds its network in its own configure_model, which Cohort cannot shard over "
                        f"{plan.world_size} processes: remove configure_model and let Cohort build plain_network() "
                        "(README: 'A family of your own'), or train it with DDP (configs/trainer/ddp_cpu.yaml)")


def overrides(family: type[CohortModule], method: str) -> bool:
    """Whether the family gives its own ``method`` rather than CohortModule's."""
    return getattr(family, method) is not getattr(CohortModule, method)


def model_class(config: Namespace) -> type[CohortModule]:
    """The model family the config names (the parser has already checked that the class exists and is one)."""
    return class_of(config.model.class_path)


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
