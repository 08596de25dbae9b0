"""Callbacks every run gets: per-rank seeding, checkpoints written atomically and kept at the end, generated text."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from datamodules.samplers import derive_seed
from models.language_model import GPTLanguageModel


class PerRankSeed(Callback):
    """Randomness (dropout) that differs across ranks and steps and follows from the one seed.

    The global RNG is reseeded from (seed, rank, optimizer step, batch index) before every training batch, so a
    resumed run draws exactly what the uninterrupted run drew, and no rank's RNG state has to be saved.
    """

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        seed = derive_seed(int(os.environ.get("PL_GLOBAL_SEED", 0)), trainer.global_rank, trainer.global_step, batch_idx)
        # the generators themselves: torch.manual_seed also probes every accelerator backend, ~1 ms per call
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed(seed)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes a checkpoint next to its target, then renames it into place: a process killed mid-write leaves
    the previous checkpoint intact instead of a truncated one."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        partial = f"{path}.partial"
        super().save_checkpoint(checkpoint, partial, storage_options)
        os.replace(partial, path)


class PrintGeneratedText(Callback):
    """At the end of training, rank 0 continues the datamodule's first prompt so users see what was learned."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        datamodule = trainer.datamodule
        if not trainer.is_global_zero or datamodule.vocab_size != 256 or not isinstance(pl_module, GPTLanguageModel):
            return
        prompt = torch.tensor([list(datamodule.prompts[0].encode())])
        print(f"\n--- sample after {trainer.global_step} steps ---\n{datamodule.prompts[0]}"
              f"{pl_module.generate_text(prompt)}\n---")


class PrintPredictions(Callback):
    """``cohort predict`` prints each prompt with its continuation."""

    def on_predict_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:
        print(f"--- prompt {batch_idx} (rank {trainer.global_rank}) ---\n{outputs['prompt']}{outputs['completion']}")


class RunCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that also writes ``last.ckpt`` when training ends between two periodic saves, so the
    final weights are never lost (Lightning's own only does so when nothing was saved at all)."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
