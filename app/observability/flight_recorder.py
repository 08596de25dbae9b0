"""NCCL's flight recorder, on for every GPU run: what each rank's last collectives were when one hung."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback


class NcclFlightRecorder(Callback):
    """NCCL's flight recorder, for GPU runs: each rank keeps its last collectives in memory and, when one times out,
    dumps them to ``<run folder>/flight_recorder/rank_<N>``; ``torchfrtrace <folder>`` then names the first collective
    that not every rank joined, and the ranks missing from it. NCCL reads the buffer size and the dump switch when its
    process group is made, so they are set here, before; the folder is made after, on every rank (nodes may have disks
    of their own): a rank that made it earlier could change the run version that another rank has yet to pick."""

    def __init__(self, run_dir: Path) -> None:
        self.folder = run_dir / "flight_recorder"
        for name, value in {
            "TORCH_FR_BUFFER_SIZE": "2000",  # collectives kept per rank: several steps of a sharded model's
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": str(self.folder / "rank_"),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # a timeout ends the process without an abort that can hang
        }.items():
            os.environ.setdefault(name, value)  # the user's own settings win

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
