"""Callbacks every run gets: the same CPU threads on every rank, per-rank seeding, generated text, NCCL's flight
recorder on GPUs (checkpoints: app/checkpoints.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from app.preemption import stopped_by_signal
from core.run_plan import run_plan_of
from core.seeding import derive_seed
from models.language_model import GPTLanguageModel


class SameThreadsOnEveryRank(Callback):
    """Every rank computes with the same number of CPU threads: OMP_NUM_THREADS where set (torchrun sets 1), else the
    CPUs this process may use divided by the processes on this machine, as Lightning's launchers choose. A CPU
    reduction split over another number of threads rounds differently, and ModelParallelStrategy's launcher sets
    the count in rank 0 only (the ranks it starts keep torch's default): ranks that compute the same thing, as
    tensor parallelism's replicated layers do, then drift apart by rounding until the replica check stops the run."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        given = os.environ.get("OMP_NUM_THREADS", "")
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(int(given) if given.isdigit() and int(given) > 0 else max(1, cpus // trainer.num_devices))


class PerRankSeed(Callback):
    """Randomness (dropout) that differs across ranks and steps and follows from the one seed.

    The global RNG is reseeded from (seed, rank, optimizer step, batch index) before every training batch, so a
    resumed run draws exactly what the uninterrupted run drew, and no rank's RNG state has to be saved. The rank
    is the data-parallel one: ranks of a tensor-parallel group must drop the same units of their replicated
    activations.
    """

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        plan = run_plan_of(pl_module)
        seed = derive_seed(plan.seed, plan.data_parallel_rank(trainer.global_rank), trainer.global_step, batch_idx)
        # the generators themselves: torch.manual_seed also probes every accelerator backend, ~1 ms per call
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed(seed)


class PrintGeneratedText(Callback):
    """At the end of training, continue the datamodule's first prompt so users see what was learned. Every rank
    generates (a sharded model needs them all); rank 0 prints. Not after a preemption signal: the time until the
    scheduler kills the job belongs to the checkpoint."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        datamodule = trainer.datamodule
        if datamodule.vocab_size != 256 or not isinstance(pl_module, GPTLanguageModel) or stopped_by_signal(trainer):
            return
        if pl_module.pipeline is not None:  # each rank holds one stage; sampling runs the whole model token by token
            rank_zero_info("\n--- no sample: generating needs the whole model; cohort consolidate the last checkpoint "
                           "and run cohort predict on one process ---")
            return
        prompt = torch.tensor([list(datamodule.prompts[0].encode())])
        completion = pl_module.generate_text(prompt)
        if trainer.is_global_zero:
            print(f"\n--- sample after {trainer.global_step} steps ---\n{datamodule.prompts[0]}{completion}\n---")


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


class PrintPredictions(Callback):
    """``cohort predict`` prints each prompt with its continuation."""

    def on_predict_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:
        print(f"--- prompt {batch_idx} (rank {trainer.global_rank}) ---\n{outputs['prompt']}{outputs['completion']}")
