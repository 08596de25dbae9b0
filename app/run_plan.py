"""Checks and derived settings that need the whole config: batch arithmetic, precision, where to resume from.

All batch-size arithmetic lives here: global = micro x devices x nodes x accumulation.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import lightning as L
import torch
from jsonargparse import Namespace
from lightning.pytorch.utilities import rank_zero_info

from app.errors import UserError
from datamodules.language_modeling import LanguageModelingDataModule
from models.language_model import GPTLanguageModel

PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true"}
SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


def gradient_accumulation(global_batch_size: int, micro_batch_size: int, world_size: int, num_nodes: int = 1) -> int:
    """Micro-batches per optimizer step on each rank; a UserError when the numbers do not divide."""
    per_pass = micro_batch_size * world_size
    if global_batch_size % per_pass != 0:
        devices = world_size // max(num_nodes, 1)
        raise UserError(
            f"data.global_batch_size={global_batch_size} is not a multiple of data.micro_batch_size={micro_batch_size}"
            f" x {world_size} processes ({devices} devices x {num_nodes} nodes) = {per_pass}: "
            f"choose a global batch that is a multiple of {per_pass}, or another micro batch"
        )
    return global_batch_size // per_pass


def apply_batch_plan(
    trainer: L.Trainer, model: GPTLanguageModel, datamodule: LanguageModelingDataModule, val_every_n_steps: int | None
) -> None:
    """Derive the trainer's accumulation (and validation cadence) from the global batch and the world size."""
    if trainer.accumulate_grad_batches != 1:
        raise UserError(
            f"trainer.accumulate_grad_batches={trainer.accumulate_grad_batches} is derived here: set "
            "data.global_batch_size and data.micro_batch_size instead and leave it at 1"
        )
    accumulation = gradient_accumulation(
        datamodule.global_batch_size, datamodule.micro_batch_size, trainer.world_size, trainer.num_nodes
    )
    trainer.accumulate_grad_batches = accumulation
    if val_every_n_steps is not None:
        trainer.val_check_interval = val_every_n_steps * accumulation  # Lightning counts micro-batches here
    block_size = model.model.config.block_size
    if datamodule.sequence_length > block_size:
        raise UserError(
            f"data.sequence_length={datamodule.sequence_length} exceeds the block_size {block_size} of model "
            f"'{model.hparams.model_name}': shorten the sequences or pick a larger model"
        )
    rank_zero_info(
        f"batch plan: global batch {datamodule.global_batch_size} = micro batch {datamodule.micro_batch_size} x "
        f"{trainer.world_size} processes x {accumulation} accumulation steps; "
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


def find_last_checkpoint(log_root: Path) -> Path | None:
    """The newest ``version_*/checkpoints/last.ckpt`` under a TensorBoard log root."""
    candidates = list(log_root.glob("version_*/checkpoints/last.ckpt"))
    return max(candidates, key=lambda path: path.stat().st_mtime) if candidates else None


def check_checkpoint(path: Path, model_config: Namespace) -> None:
    """A UserError, before anything starts, for a checkpoint that is missing, broken, or of another model."""
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist: pass a .ckpt file, or --ckpt_path last")
    if not os.access(path, os.R_OK):
        raise UserError(f"checkpoint {path} is not readable: fix its permissions")
    if not zipfile.is_zipfile(path):
        raise UserError(f"checkpoint {path} is not a torch checkpoint (truncated or another format): use another one")
    saved = torch.load(path, map_location="cpu", mmap=True, weights_only=False).get("hyper_parameters", {})
    for name in ("model_name", "vocab_size"):  # what decides the shapes of the weights
        if name in saved and saved[name] != model_config[name]:
            raise UserError(
                f"checkpoint {path} was trained with model.{name}={saved[name]!r} but the config says "
                f"{model_config[name]!r}: use that run's config.yaml, or another checkpoint"
            )
