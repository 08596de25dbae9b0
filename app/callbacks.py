"""Callbacks every run gets: per-rank seeding, checkpoints that are never half-written and kept at the end, text."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from datamodules.language_modeling import data_parallel_rank_and_size
from datamodules.samplers import derive_seed
from models.language_model import GPTLanguageModel


class PerRankSeed(Callback):
    """Randomness (dropout) that differs across ranks and steps and follows from the one seed.

    The global RNG is reseeded from (seed, rank, optimizer step, batch index) before every training batch, so a
    resumed run draws exactly what the uninterrupted run drew, and no rank's RNG state has to be saved. The rank
    is the data-parallel one: ranks of a tensor-parallel group must drop the same units of their replicated
    activations.
    """

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        rank, _ = data_parallel_rank_and_size(trainer)
        seed = derive_seed(int(os.environ.get("PL_GLOBAL_SEED", 0)), rank, trainer.global_step, batch_idx)
        # the generators themselves: torch.manual_seed also probes every accelerator backend, ~1 ms per call
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed(seed)


class PrintGeneratedText(Callback):
    """At the end of training, continue the datamodule's first prompt so users see what was learned. Every rank
    generates (a sharded model needs them all); rank 0 prints."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        datamodule = trainer.datamodule
        if datamodule.vocab_size != 256 or not isinstance(pl_module, GPTLanguageModel):
            return
        prompt = torch.tensor([list(datamodule.prompts[0].encode())])
        completion = pl_module.generate_text(prompt)
        if trainer.is_global_zero:
            print(f"\n--- sample after {trainer.global_step} steps ---\n{datamodule.prompts[0]}{completion}\n---")


class PrintPredictions(Callback):
    """``cohort predict`` prints each prompt with its continuation."""

    def on_predict_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:
        print(f"--- prompt {batch_idx} (rank {trainer.global_rank}) ---\n{outputs['prompt']}{outputs['completion']}")


class RunCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that never leaves a half-written checkpoint in place and that also writes ``last.ckpt``
    when training ends between two periodic saves, so the final weights are never lost (Lightning's own only
    does so when nothing was saved at all).

    Every checkpoint, a single file or a sharded folder (torch.distributed.checkpoint), is written next to its
    target as ``NAME.partial`` by all ranks, then moved into place by rank 0: a run killed mid-write keeps the
    previous checkpoint.
    """

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        partial = Path(f"{filepath}.partial")
        if trainer.is_global_zero:
            remove_path(partial)  # left by a run killed while writing
        trainer.strategy.barrier("RunCheckpoint.partial")
        super()._save_checkpoint(trainer, str(partial))  # returns once every rank has written its part
        if trainer.is_global_zero:
            replace_path(partial, Path(filepath))
        trainer.strategy.barrier("RunCheckpoint.replace")
        self._last_checkpoint_saved = filepath

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


def replace_path(source: Path, target: Path) -> None:
    """Move ``source`` to ``target``: atomically for two files; a folder on either side is renamed aside first,
    so a crash between the two renames leaves the previous checkpoint as ``NAME.old``."""
    if not target.exists() or (source.is_file() and target.is_file()):
        os.replace(source, target)
        return
    previous = target.with_name(f"{target.name}.old")
    remove_path(previous)
    os.replace(target, previous)
    os.replace(source, target)
    remove_path(previous)


def remove_path(path: Path) -> None:
    """Delete a file or a folder, if there is one."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
