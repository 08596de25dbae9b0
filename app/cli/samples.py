"""What the model writes, printed: a sample after ``fit`` (when the config asks for it) and ``predict``'s
continuations."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from app.safety.preemption import stopped_by_signal
from core.tokens import BYTE_VOCAB_SIZE


@runtime_checkable
class WritesText(Protocol):
    """A family that continues a (1, T) byte-level prompt (the GPT family's ``generate_text``)."""

    def generate_text(self, prompt: torch.Tensor) -> str: ...


class PrintGeneratedText(Callback):
    """At the end of training, continue the datamodule's first prompt so users see what was learned. Every rank
    generates (a sharded model needs them all); rank 0 prints. Not after a preemption signal: the time until the
    scheduler kills the job belongs to the checkpoint."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        datamodule = trainer.datamodule
        # a datamodule of one's own may have no vocab_size
        byte_level = getattr(datamodule, "vocab_size", None) == BYTE_VOCAB_SIZE
        if not byte_level or not isinstance(pl_module, WritesText) or stopped_by_signal(trainer):
            return
        if pl_module.pipeline is not None:  # each rank holds one stage; sampling runs the whole model token by token
            rank_zero_info("\n--- no sample: generating needs the whole model; run cohort predict on one process with "
                           "--ckpt_path last ---")
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
