"""Reading checkpoints: finding the newest (``--ckpt_path last``), checking one before a run starts, reading them as
data (a sharded folder also as one whole checkpoint), fitting its counts to this run, loading its training state into
a running model (a rollback), and consolidating a sharded one into one file.

A checkpoint is one file (one process, DDP) or a folder of shards (torch.distributed.checkpoint, under fsdp,
model_parallel and the pipeline) whose ``meta.pt`` holds everything but the weights and optimizer states. Sharded
strategies read a file or a folder of any sharding themselves; one device and DDP read a folder through
``FolderReadingCheckpointIO`` as if it had been consolidated, without writing the file. Every read goes through
torch's ``weights_only`` unpickler, which builds only tensors, containers and plain values: a file whose pickle
would import or call anything else is refused with the name of what it asked for, and nothing of it runs.
Cohort's own checkpoints need nothing beyond that unpickler's defaults. ``--weights_only false`` on the command
line is the documented escape hatch for a trusted file of another kind; it is off by default.
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from jsonargparse import Namespace
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.load import _load_distributed_checkpoint
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from app.safety.optimizer_state_keys import number_optimizer_states
from core.errors import UserError
from models.class_paths import current_class_path
from models.module import SHAPE_HYPERPARAMETERS

META_FILE = "meta.pt"  # what Lightning writes beside the shards: loop state, hyperparameters, callbacks


def find_last_checkpoint(log_root: Path) -> Path | None:
    """The newest ``version_*/checkpoints/last.ckpt`` under a TensorBoard log root, or a fault-tolerant job's
    ``version_*/replica_group_*/checkpoints/last.ckpt``."""
    candidates = [*log_root.glob("version_*/checkpoints/last.ckpt"),
                  *log_root.glob("version_*/replica_group_*/checkpoints/last.ckpt")]
    return max(candidates, key=lambda path: path.lstat().st_mtime) if candidates else None


def is_sharded_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` is a complete sharded checkpoint: the shards' index and Lightning's ``meta.pt``."""
    return (folder / ".metadata").is_file() and (folder / META_FILE).is_file()


def check_sharded_checkpoint(folder: Path) -> None:
    """A UserError unless ``folder`` is a complete sharded checkpoint."""
    if not is_sharded_checkpoint(folder):
        raise UserError(f"checkpoint {folder} is not a complete sharded checkpoint folder (it needs .metadata and "
                        f"{META_FILE}): pass one the fsdp or model_parallel strategy wrote, e.g. "
                        "lightning_logs/version_0/checkpoints/last.ckpt")


def read_checkpoint(path: Path, weights_only: bool = True) -> dict[str, Any]:
    """A checkpoint file (or a sharded folder's ``meta.pt``) read as data; a UserError for anything else: missing,
    unreadable, not a torch file, a pickle that asks for code, or a torch file that is not a Lightning checkpoint.
    ``weights_only=False`` (the user's ``--weights_only false``) unpickles anything: for trusted files only."""
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist: pass a .ckpt file or folder, or --ckpt_path last")
    if not os.access(path, os.R_OK):
        raise UserError(f"checkpoint {path} is not readable: fix its permissions")
    if not zipfile.is_zipfile(path):
        raise UserError(f"checkpoint {path} is not a torch checkpoint (truncated or another format): use another one")
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except RuntimeError:  # torch's reader on a zip archive it did not write
        raise UserError(f"checkpoint {path} is a zip archive but not a torch checkpoint: pass a checkpoint "
                        "written by cohort fit") from None
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL ([\w.]+)", str(error))  # torch names the global the pickle asked for
        what = f"'{found.group(1)}'" if found else "a type torch's safe loader does not allow"
        raise UserError(f"checkpoint {path} asks to run code ({what}) when loaded, so it was not loaded: Cohort reads "
                        "checkpoints as data only; use one written by cohort (fit, validate and predict "
                        "take --weights_only false for a file you trust completely)") from None
    if not isinstance(checkpoint, dict) or "pytorch-lightning_version" not in checkpoint:
        raise UserError(f"{path} is {describe(checkpoint)}, not a Lightning checkpoint: pass a checkpoint written by "
                        "cohort fit (lightning_logs/version_N/checkpoints/last.ckpt)")
    return checkpoint


def describe(content: object) -> str:
    """A few words on what a torch file that is not a Lightning checkpoint holds."""
    if isinstance(content, dict) and content and all(isinstance(value, torch.Tensor) for value in content.values()):
        return f"a bare state dict of {len(content)} tensors (weights only, no training state)"
    if isinstance(content, dict):
        return f"a dict with keys {sorted(map(str, content))[:5]}"
    return f"a {type(content).__name__}"


def check_checkpoint(path: Path, model_config: Namespace, weights_only: bool = True) -> None:
    """A UserError, before anything starts, for a checkpoint that is missing, broken, unsafe, or of another model
    (another family, or another size of this one). ``model_config`` is the config's model: class_path and init_args."""
    if path.is_dir():
        check_sharded_checkpoint(path)
    checkpoint = read_checkpoint(path / META_FILE if path.is_dir() else path, weights_only)
    family = checkpoint.get("cohort_model_class")
    if family is not None and current_class_path(family) != model_config.class_path:
        raise UserError(f"checkpoint {path} holds a {family.rsplit('.', 1)[-1]} but the config's model.class_path is "
                        f"{model_config.class_path}: use that run's config.yaml, or another checkpoint")
    saved, configured = checkpoint.get("hyper_parameters", {}), model_config.init_args
    for name in SHAPE_HYPERPARAMETERS:  # what decides the shapes of the weights
        if name in saved and name in configured and configured[name] is not None and saved[name] != configured[name]:
            raise UserError(
                f"checkpoint {path} was trained with model.{name}={saved[name]!r} but the config says "
                f"{configured[name]!r}: use that run's config.yaml, or another checkpoint"
            )


def load_training_state(trainer: L.Trainer, path: str) -> None:
    """Weights and optimizer state from one of this run's checkpoints into the running model, on every rank, as
    Lightning loads them on resume; the loops, the LR schedule and the data position stay where they are."""
    checkpoint = trainer.strategy.load_checkpoint(path, weights_only=True)  # sharded: loads in place
    number_optimizer_states(trainer, checkpoint)
    trainer.strategy.load_model_state_dict(checkpoint, strict=True)
    trainer.strategy.load_optimizer_state_dict(checkpoint)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint file or sharded folder read as data, in this one process, with its weights as full tensors
    under ``state_dict`` either way; a UserError for anything that is not a Lightning checkpoint."""
    return load_sharded_checkpoint(path) if path.is_dir() else read_checkpoint(path)


def consolidate(folder: Path, output: Path) -> dict[str, Any]:
    """Write the sharded checkpoint ``folder`` as the single file ``output``, in this one process (the whole
    checkpoint must fit in its CPU memory); returns the checkpoint."""
    check_sharded_checkpoint(folder)
    if output.exists():
        raise UserError(f"{output} already exists: remove it or name another output file")
    checkpoint = load_sharded_checkpoint(folder)
    partial = output.with_name(f"{output.name}.partial")
    torch.save(checkpoint, partial)
    partial.replace(output)
    return checkpoint


class FolderReadingCheckpointIO(TorchCheckpointIO):
    """Lightning's reader and writer of one-file checkpoints that also reads a sharded checkpoint folder, whole, in
    every process, as ``load_sharded_checkpoint`` makes it: what a strategy that loads a checkpoint whole (one
    device, DDP) restores from as if the folder had been consolidated. Each process then holds the whole checkpoint,
    as each DDP rank holds the whole model anyway."""

    def load_checkpoint(self, path: str | Path, **options: Any) -> dict[str, Any]:
        if Path(path).is_dir():  # read as data whatever weights_only says: Cohort's folders need nothing else
            return load_sharded_checkpoint(Path(path))
        return super().load_checkpoint(path, **options)


def read_sharded_folders(trainer: L.Trainer) -> None:
    """Give the trainer's strategy, if it loads a checkpoint whole through Lightning's own CheckpointIO (one device,
    DDP and the strategies built on them), a ``FolderReadingCheckpointIO`` instead, so that it resumes from a sharded
    folder too. Sharded strategies load a file or a folder of any sharding themselves; a CheckpointIO of the user's
    stays."""
    strategy = trainer.strategy
    sharded = isinstance(strategy, (FSDPStrategy, ModelParallelStrategy))
    if not sharded and type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = FolderReadingCheckpointIO()


def load_sharded_checkpoint(folder: Path) -> dict[str, Any]:
    """A sharded checkpoint folder as one single-file checkpoint in memory (weights and optimizer states as full
    tensors, laid out as a one-process run saves them); all of it must fit in this process's CPU memory."""
    check_sharded_checkpoint(folder)
    read_checkpoint(folder / META_FILE)  # refuses a meta.pt whose pickle asks for code, before Lightning reads it
    checkpoint = _load_distributed_checkpoint(folder)  # shards and meta.pt, as full tensors
    # ModelParallelStrategy saves the weights as "state_dict", FSDPStrategy as "model"; the optimizers as
    # optimizer_0, optimizer_1, ... where a single-file checkpoint has the list "optimizer_states"
    if "model" in checkpoint:
        checkpoint["state_dict"] = checkpoint.pop("model")
    optimizer_keys = sorted((key for key in checkpoint if re.fullmatch(r"optimizer_\d+", key)), key=lambda k: int(k[10:]))
    if optimizer_keys:
        checkpoint["optimizer_states"] = [checkpoint.pop(key) for key in optimizer_keys]
    return checkpoint


def recount_micro_batches(trainer: L.Trainer, checkpoint: dict[str, Any]) -> None:
    """Lightning's count of the micro-batches in ``checkpoint``'s training epoch made, in place, what this run's
    accumulation would have counted for the same optimizer steps. Lightning ends an optimizer step, validates and
    ends an epoch by that count, and a run of another data-parallel size (the same global batch in other
    micro-batch counts) counted its own: resumed as it is, a step would end after the wrong number of micro-batches.
    Every checkpoint is written at the end of an optimizer step, where the count is steps x accumulation; the counts
    of earlier epochs, which no decision reads, keep their difference to this one's."""
    progress = checkpoint.get("loops", {}).get("fit_loop")
    if progress is None:  # a checkpoint of weights only
        return
    micro_batches = progress["epoch_loop.batch_progress"]
    optimizer_steps = progress["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["current"]
    shift = optimizer_steps["completed"] * trainer.accumulate_grad_batches - micro_batches["current"]["processed"]
    for counts in (micro_batches["current"], micro_batches["total"]):  # ready, started, processed, completed
        for name in counts:
            counts[name] += shift
