"""A datamodule of one's own: any LightningDataModule that is not a ShardedDataModule (datamodules/base.py), named by
``data.class_path``. Cohort reads the batch plan off its training loader and gives each data-parallel rank its own
samples, deciding how from what the loader's sampler is:

    shuffling or in order       Cohort's sampler (datamodules/samplers.py) in its place, in the same order kind:
    (shuffle=True or False)     every step reads the global batch one process would, under every strategy (the
                                parameter server and fault-tolerant groups hand out steps by number)
    a DistributedSampler        the loader shares the samples out itself: kept as it is where every process is a
                                data-parallel rank of its own (DDP, FSDP2)
    anything else (a sampler    kept on one process; refused on more, where Cohort cannot know that each rank
    of its own, an iterable)    reads its own samples

The micro batch is the loader's ``batch_size`` (a ``micro_batch_size`` the datamodule states must agree). The global
batch is the datamodule's ``global_batch_size`` where it states one, a multiple of the micro batch times the
data-parallel ranks (and replica groups); else one micro batch per data-parallel rank and replica group. Throughput
is counted in the datamodule's ``unit`` (default "samples") times its ``sequence_length`` (default 1) per sample.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import lightning as L
from torch.utils.data import (
    BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler,
)

from core.errors import UserError
from core.run_plan import RunPlan
from datamodules.base import ResumableDataLoader
from datamodules.samplers import GlobalBatchSampler

COHORT, ITSELF, UNKNOWN = "Cohort's sampler", "its own DistributedSampler", "unknown"


@dataclass(frozen=True)
class TrainingLoader:
    """What Cohort reads off a datamodule's training loader before the run starts."""

    datamodule: str  # the class's name, for messages
    micro_batch_size: int
    global_batch_size: int | None  # as the datamodule states it; None: it states none
    sharing: str  # COHORT, ITSELF or UNKNOWN (sharing_of)
    sampler: str  # the sampler's class name, for messages
    num_workers: int
    sequence_length: int
    unit: str

    def default_global_batch_size(self, data_parallel_size: int, replica_groups: int) -> int:
        """The stated global batch, else one micro batch per data-parallel rank and replica group."""
        per_pass = self.micro_batch_size * data_parallel_size * replica_groups
        stated = self.global_batch_size
        if stated is None:
            return per_pass
        if not isinstance(stated, int) or stated < 1 or stated % per_pass:
            groups = f" x {replica_groups} replica groups" if replica_groups > 1 else ""
            raise UserError(f"{self.datamodule}.global_batch_size={stated!r} is not a multiple of its "
                            f"train_dataloader's batch_size {self.micro_batch_size} x {data_parallel_size} "
                            f"data-parallel ranks{groups} = {per_pass}: state a multiple of {per_pass}, or None for "
                            f"{per_pass}")
        return stated

    def check_strategy(self, world_size: int, data_parallel_size: int, steps_by_number: str | None) -> None:
        """A UserError where the ranks could not each read their own samples: ``steps_by_number`` names a strategy
        that hands out global batches by number (only Cohort's sampler can read those)."""
        if self.sharing == ITSELF and data_parallel_size != world_size and steps_by_number is None:
            raise UserError(f"{self.datamodule}'s train_dataloader shares its samples out with a DistributedSampler, "
                            f"over the {world_size} processes, but only {data_parallel_size} of them are data-parallel "
                            "ranks (tensor-parallel ranks and pipeline stages read the same samples): give the "
                            "DataLoader shuffle=True (or False) and no sampler, and Cohort shares them out")
        if steps_by_number is not None and self.sharing != COHORT:
            raise UserError(f"{self.datamodule}'s train_dataloader reads with {self.sampler}, but {steps_by_number} "
                            "hands out global batches by number, which only Cohort's sampler reads: give the "
                            "DataLoader shuffle=True (or False) and no sampler, or subclass "
                            "datamodules.base.ShardedDataModule")
        if world_size > 1 and self.sharing == UNKNOWN:
            raise UserError(f"{self.datamodule}'s train_dataloader reads with {self.sampler}, which Cohort cannot "
                            f"share out over {world_size} processes: give the DataLoader shuffle=True (or False) and "
                            "no sampler, or a DistributedSampler, or subclass datamodules.base.ShardedDataModule")


def index_reader(loader: DataLoader) -> object:
    """What decides which samples the loader reads: its sampler, a batch sampler of its own, or its dataset where
    that is iterable."""
    if isinstance(loader.dataset, IterableDataset):
        return loader.dataset
    batch_sampler = loader.batch_sampler
    return batch_sampler.sampler if type(batch_sampler) is BatchSampler else batch_sampler


def sharing_of(loader: DataLoader) -> str:
    """How the loader's samples reach the ranks: COHORT (a shuffling or in-order sampler, which Cohort's replaces),
    ITSELF (a DistributedSampler) or UNKNOWN."""
    reader = index_reader(loader)
    if isinstance(reader, DistributedSampler):
        return ITSELF
    if type(reader) is RandomSampler and (reader.replacement or reader.num_samples != len(reader.data_source)):
        return UNKNOWN  # draws with replacement, or a number of samples of its own: not one pass in some order
    return COHORT if type(reader) in (RandomSampler, SequentialSampler) else UNKNOWN


def read_training_loader(datamodule: L.LightningDataModule) -> TrainingLoader:
    """The datamodule's training loader as ``setup("fit")`` makes it (after ``prepare_data``, on a node's first
    process only, as Lightning calls it), and what it yields."""
    name = type(datamodule).__name__
    try:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            datamodule.prepare_data()
        datamodule.setup("fit")
        loader = datamodule.train_dataloader()
    except UserError:
        raise
    except Exception as error:
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        raise UserError(f"{name}'s training loader could not be made before start ({reason}): Cohort reads the batch "
                        "plan off it before any process group or trainer exists, so make it from the datamodule's "
                        "own state (no DistributedSampler needed: with shuffle=True or False and no sampler, Cohort "
                        "gives each rank its own samples)") from error
    if not isinstance(loader, DataLoader):
        raise UserError(f"{name}.train_dataloader returned a {type(loader).__name__}: return one torch DataLoader")
    micro_batch_size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise UserError(f"{name}'s train_dataloader has no batch size Cohort can read (batch_sampler "
                        f"{type(loader.batch_sampler).__name__}): give the DataLoader batch_size")
    stated = getattr(datamodule, "micro_batch_size", micro_batch_size)
    if stated != micro_batch_size:
        raise UserError(f"{name}.micro_batch_size={stated} but its train_dataloader yields batches of "
                        f"{micro_batch_size}: make the two agree (or drop micro_batch_size: Cohort reads the loader's)")
    return TrainingLoader(
        datamodule=name, micro_batch_size=micro_batch_size,
        global_batch_size=getattr(datamodule, "global_batch_size", None), sharing=sharing_of(loader),
        sampler=type(index_reader(loader)).__name__,
        num_workers=loader.num_workers, sequence_length=getattr(datamodule, "sequence_length", 1),
        unit=getattr(datamodule, "unit", "samples"))


def share_out_training_samples(datamodule: L.LightningDataModule, plan: RunPlan, global_rank: int,
                               current_step: Callable[[], int]) -> None:
    """Make ``datamodule.train_dataloader`` give this rank its data-parallel share of each global batch, from the
    optimizer step ``current_step()`` on, where its loader's sampler shuffles or reads in order: the same loader
    around Cohort's sampler (shuffling where the loader shuffled). Other loaders it returns as they are."""
    own_train_dataloader = datamodule.train_dataloader

    def train_dataloader() -> DataLoader:
        loader = own_train_dataloader()
        if sharing_of(loader) != COHORT:
            return loader
        shuffle = isinstance(index_reader(loader), RandomSampler)
        rank = plan.data_parallel_rank(global_rank)
        samples = len(loader.dataset)  # type: ignore[arg-type]  # a map-style dataset: sharing_of said so
        sampler = GlobalBatchSampler(samples, plan, rank, current_step, shuffle=shuffle)
        return ResumableDataLoader(
            loader.dataset, batch_size=plan.micro_batch_size, sampler=sampler, collate_fn=loader.collate_fn,
            num_workers=loader.num_workers, pin_memory=loader.pin_memory, timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
            prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers)

    datamodule.train_dataloader = train_dataloader  # type: ignore[method-assign]
