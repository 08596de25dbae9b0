"""Ranks that should compute the same numbers do, and ranks that should draw different random numbers do: two
callbacks every run gets."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from core.run_plan import run_plan_of
from core.seeding import derive_seed


class SameThreadsOnEveryRank(Callback):
    """Every rank computes with the same number of CPU threads: OMP_NUM_THREADS where set (torchrun sets 1), else the
    CPUs this process may use divided by the processes on this machine, as Lightning's launchers choose. A CPU
    reduction split over another number of threads rounds differently, and ModelParallelStrategy's launcher sets
    the count in rank 0 only (the ranks it starts keep torch's default): ranks that compute the same thing, as
    tensor parallelism's replicated layers do, then drift apart by rounding until the replica check stops the run."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        given = os.environ.get("OMP_NUM_THREADS", "")
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        wanted = int(given) if given.isdigit() and int(given) > 0 else max(1, cpus // trainer.num_devices)
        # only if it differs: at::set_num_threads also turns MKL's dynamic threading off, which made one process's
        # step 2 % (small GPT) to 10 % (debug GPT) slower on 2 cores at the count it had (benchmarks/RESULTS.md)
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        advice = oversubscription_advice(wanted, trainer.num_devices, cpus, load)
        if advice is not None:
            rank_zero_info(advice)


def oversubscription_advice(threads: int, processes: int, cpus: int, load: float) -> str | None:
    """One line, where this machine's processes want more threads than the cores other work leaves them (the load
    average of the last minute, measured as they start, is that other work): the threads then wait for each other
    at every parallel op, which made one process on a busy 2-core machine 20-70x slower than with one thread."""
    free = max(1, round(cpus - load))
    if threads <= 1 or threads * processes <= free:
        return None
    return (f"threads: {processes} process{'es' if processes > 1 else ''} x {threads} threads on {cpus} CPUs that "
            f"other work keeps {load:.1f} busy (the last minute's load average): threads beyond the free cores wait "
            f"on each other and can make every step many times slower; set OMP_NUM_THREADS={max(1, free // processes)}")


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
