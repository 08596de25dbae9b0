"""Checks and derived settings that need the whole config: batch arithmetic, precision, strategy, launcher, folders.

All batch-size arithmetic lives here: global = micro x devices x nodes x accumulation.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import torch
from jsonargparse import Namespace
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info

from core.errors import UserError
from datamodules.language_modeling import LanguageModelingDataModule
from models.language_model import GPTLanguageModel
from models.parallelize import check_tensor_parallel_size

PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true"}
SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


def gradient_accumulation(
    global_batch_size: int, micro_batch_size: int, world_size: int, num_nodes: int = 1, tensor_parallel_size: int = 1
) -> int:
    """Micro-batches per optimizer step on each rank; a UserError when the numbers do not divide.

    Ranks of one tensor-parallel group work on the same samples, so the batch is split over
    world_size / tensor_parallel_size data-parallel ranks."""
    data_parallel_size = world_size // tensor_parallel_size
    per_pass = micro_batch_size * data_parallel_size
    if global_batch_size % per_pass != 0:
        devices = world_size // max(num_nodes, 1)
        ranks = f"{world_size} processes ({devices} devices x {num_nodes} nodes)"
        if tensor_parallel_size > 1:
            ranks = f"{data_parallel_size} data-parallel ranks ({ranks} / tensor_parallel_size {tensor_parallel_size})"
        raise UserError(
            f"data.global_batch_size={global_batch_size} is not a multiple of data.micro_batch_size={micro_batch_size}"
            f" x {ranks} = {per_pass}: choose a global batch that is a multiple of {per_pass}, or another micro batch"
        )
    return global_batch_size // per_pass


def parallel_sizes(trainer: L.Trainer) -> tuple[int, int]:
    """(data-parallel size, tensor-parallel size) of the run; a UserError for sizes that cannot work.

    Read before the processes start, so that a bad size fails in one line instead of in every rank."""
    strategy = trainer.strategy
    if not isinstance(strategy, ModelParallelStrategy):
        return trainer.world_size, 1
    # the strategy resolves "auto" only once the processes run: data parallel over nodes, tensor parallel within
    data_parallel = strategy._data_parallel_size
    tensor_parallel = strategy._tensor_parallel_size
    data_parallel = trainer.num_nodes if data_parallel == "auto" else data_parallel
    tensor_parallel = trainer.num_devices if tensor_parallel == "auto" else tensor_parallel
    if data_parallel * tensor_parallel != trainer.world_size:
        raise UserError(
            f"data_parallel_size={data_parallel} x tensor_parallel_size={tensor_parallel} must equal the world size "
            f"{trainer.world_size} ({trainer.num_devices} devices x {trainer.num_nodes} nodes): change the sizes in "
            "trainer.strategy.init_args or the devices"
        )
    return data_parallel, tensor_parallel


def check_strategy(strategy: str | Namespace | None, accelerator: str) -> None:
    """FSDP (version 1) needs GPUs; on CPUs the same sharding runs as FSDP2 under ModelParallelStrategy."""
    name = strategy if isinstance(strategy, str) else getattr(strategy, "class_path", "")
    is_fsdp = name == "fsdp" or str(name).endswith("FSDPStrategy")
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if is_fsdp and on_cpu:
        raise UserError("trainer.strategy fsdp needs CUDA GPUs: on CPUs use configs/trainer/model_parallel_cpu.yaml "
                        "(FSDP2 through ModelParallelStrategy over gloo)")


def apply_batch_plan(
    trainer: L.Trainer, model: GPTLanguageModel, datamodule: LanguageModelingDataModule, val_every_n_steps: int | None
) -> None:
    """Derive the trainer's accumulation (and validation cadence) from the global batch and the world size."""
    if trainer.accumulate_grad_batches != 1:
        raise UserError(
            f"trainer.accumulate_grad_batches={trainer.accumulate_grad_batches} is derived here: set "
            "data.global_batch_size and data.micro_batch_size instead and leave it at 1"
        )
    _, tensor_parallel = parallel_sizes(trainer)
    try:
        check_tensor_parallel_size(model.config.n_head, tensor_parallel)
    except ValueError as error:
        raise UserError(f"{error} (model '{model.hparams.model_name}')") from None
    if isinstance(trainer.strategy, FSDPStrategy) and model.hparams.activation_checkpointing:
        raise UserError("model.activation_checkpointing is for DDP and model_parallel; under fsdp set "
                        "trainer.strategy.init_args.activation_checkpointing_policy (see configs/trainer/fsdp_gpu_bf16.yaml)")
    accumulation = gradient_accumulation(
        datamodule.global_batch_size, datamodule.micro_batch_size, trainer.world_size, trainer.num_nodes,
        tensor_parallel,
    )
    trainer.accumulate_grad_batches = accumulation
    if val_every_n_steps is not None:
        trainer.val_check_interval = val_every_n_steps * accumulation  # Lightning counts micro-batches here
    block_size = model.config.block_size
    if datamodule.sequence_length > block_size:
        raise UserError(
            f"data.sequence_length={datamodule.sequence_length} exceeds the block_size {block_size} of model "
            f"'{model.hparams.model_name}': shorten the sequences or pick a larger model"
        )
    rank_zero_info(
        f"batch plan: global batch {datamodule.global_batch_size} = micro batch {datamodule.micro_batch_size} x "
        f"{trainer.world_size // tensor_parallel} data-parallel ranks x {accumulation} accumulation steps; "
        f"{datamodule.global_batch_size * datamodule.sequence_length:,} tokens per optimizer step"
    )


def resolve_precision(precision: str | int | None, accelerator: str) -> str:
    """The precision Lightning should get; a UserError where the device cannot run the one asked for."""
    requested = "32-true" if precision is None else PRECISION_ALIASES.get(str(precision), str(precision))
    if requested not in SUPPORTED_PRECISIONS:
        raise UserError(f"trainer.precision={precision!r} is not supported: use one of {', '.join(SUPPORTED_PRECISIONS)}")
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


def expected_world_size(trainer: Namespace) -> int:
    """trainer.devices x trainer.num_nodes, with Lightning's "auto" / -1 / list forms of devices counted."""
    devices = trainer.devices
    if devices in ("auto", -1, "-1"):
        devices = torch.cuda.device_count() if torch.cuda.is_available() and trainer.accelerator != "cpu" else 1
    elif isinstance(devices, (list, tuple)) or (isinstance(devices, str) and "," in devices):
        devices = len(devices) if isinstance(devices, (list, tuple)) else len(devices.strip(",").split(","))
    return int(devices) * int(trainer.num_nodes)


def check_launch(trainer: Namespace) -> None:
    """A UserError, in seconds, when the processes that exist cannot form the job the config describes; otherwise
    the ranks would wait for each other until a timeout. Lightning alone starts processes on this machine only."""
    expected = expected_world_size(trainer)
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


def check_writable_folder(folder: Path, what: str) -> Path:
    """A UserError unless ``folder`` is, or can be made as, a writable folder; creates nothing. Returns the nearest
    folder that exists (``folder`` itself or a parent), where its files will go."""
    existing = next(parent for parent in (folder, *folder.parents) if parent.exists())
    if not existing.is_dir():
        raise UserError(f"the {what} {folder} cannot be made: {existing} is a file, not a folder: point it at a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"the {what} {folder} cannot be written: {existing} is not writable (permissions or a "
                        "read-only file system): point it at a writable folder")
    return existing
