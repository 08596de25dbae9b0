"""What every Cohort datamodule shares: training loaders that read the run plan's global batches (the same samples
in every step at any world size, from the restored step on a resume) and evaluation loaders spread evenly over the
validation set (see datamodules/samplers.py for the arithmetic).

A subclass sets the attributes below in ``__init__``, ``train_set`` and ``val_set`` in ``setup``, and overrides
``training_stream`` if its training samples need more than an index (the image datamodule's augmentation).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from core.errors import UserError
from core.run_plan import RunPlan, run_plan_of
from datamodules.samplers import EvenShardSampler, GlobalBatchSampler


class ResumableDataLoader(DataLoader):
    """A DataLoader that Lightning treats as resumable, and that counts the time the loop waits for batches.

    The position in the stream is not state: it follows from the optimizer step that Lightning restores. What
    is saved is what the stream depends on, so that a resume that would not continue the same stream says so.
    """

    wait_seconds = 0.0  # time spent inside next(): the data stall the monitor reports

    def __iter__(self) -> Iterator[Any]:
        batches = super().__iter__()
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            finally:
                self.wait_seconds += time.perf_counter() - start
            yield batch

    def state_dict(self) -> dict[str, int]:
        sampler: GlobalBatchSampler = self.batch_sampler.sampler  # type: ignore[union-attr]  # torch's BatchSampler or StepMicroBatches
        return {
            "seed": sampler.plan.seed,
            "global_batch_size": sampler.plan.global_batch_size,
            "num_samples": sampler.num_samples,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        current = self.state_dict()
        changed = [f"{key} {value} -> {current.get(key)}" for key, value in state.items() if current.get(key) != value]
        if changed:
            rank_zero_warn(f"resuming with a different data stream ({', '.join(changed)}): training continues, "
                           "but not exactly as the checkpointed run would have")


class ShardedDataModule(L.LightningDataModule):
    micro_batch_size: int
    val_samples: int | None  # validate on this many samples spread evenly over the set; None: all
    num_workers: int
    pin_memory: bool
    run_plan: RunPlan | None  # handed over by the CLI: the ranks, sizes and accumulation
    train_set: Dataset | None
    val_set: Dataset | None
    # what makes a micro-batch of the training dataset's samples; None: the DataLoader's default_collate
    training_collate: Callable[[Any], Any] | None = None

    def train_dataloader(self) -> DataLoader:
        return self.training_loader(self.trainer.global_rank, current_step=lambda: self.trainer.global_step)

    def training_loader(self, global_rank: int, current_step: Callable[[], int] = lambda: 0) -> ResumableDataLoader:
        """Rank ``global_rank``'s share of each global batch, from the optimizer step ``current_step()`` on (when
        resuming, the step restored from the checkpoint)."""
        plan = run_plan_of(self)
        dataset, sampler = self.training_stream(plan, plan.data_parallel_rank(global_rank), current_step)
        return ResumableDataLoader(dataset, sampler=sampler, collate_fn=self.training_collate,
                                   **self.loader_options())

    def training_stream(self, plan: RunPlan, data_parallel_rank: int,
                        current_step: Callable[[], int]) -> tuple[Dataset, GlobalBatchSampler]:
        """The dataset and the sampler of one data-parallel rank's training stream."""
        assert self.train_set is not None
        return self.train_set, GlobalBatchSampler(len(self.train_set), plan, data_parallel_rank, current_step)

    def val_dataloader(self) -> DataLoader:
        return self.evaluation_dataloader("limit_val_batches", self.trainer.limit_val_batches)

    def test_dataloader(self) -> DataLoader:
        return self.evaluation_dataloader("limit_test_batches", self.trainer.limit_test_batches)

    def evaluation_dataloader(self, limit_name: str, limit_batches: int | float) -> DataLoader:
        """The validation samples that validation (or test) reads, spread evenly over the whole set and dealt out over
        the data-parallel ranks (datamodules/samplers.py)."""
        assert self.val_set is not None
        plan = run_plan_of(self)
        num_chosen = self.evaluation_sample_count(limit_name, limit_batches, plan)
        rank = plan.data_parallel_rank(self.trainer.global_rank)
        sampler = EvenShardSampler(len(self.val_set), num_chosen, plan, rank)
        return DataLoader(self.val_set, sampler=sampler, **self.loader_options())

    def evaluation_sample_count(self, limit_name: str, limit_batches: int | float, plan: RunPlan) -> int:
        """How many samples all ranks read together: ``val_samples`` (None: the whole set), the same at any world size.
        An int Lightning limit keeps the meaning Lightning gives it, micro-batches per rank, so it caps the count at
        limit x micro batch x data-parallel size, a count that grows with the world size: when it is what decides the
        count, one line says so. Left to itself, Lightning would stop each rank after its first batches, which lie at
        the start of the set; a loader that holds only the samples to read, spread out, leaves it nothing to cut."""
        assert self.val_set is not None
        count = min(len(self.val_set), self.val_samples or len(self.val_set))
        if isinstance(limit_batches, float) and limit_batches < 1.0:
            raise UserError(f"trainer.{limit_name}={limit_batches} is a fraction, which Lightning takes from the start "
                            "of the validation set: set data.val_samples (a count of samples spread over the set, the "
                            "same at any world size) instead")
        if isinstance(limit_batches, int):
            limited = limit_batches * self.micro_batch_size * plan.data_parallel_size
            if 0 < limited < count:
                rank_zero_info(f"trainer.{limit_name}={limit_batches} reads {limited} samples: Lightning counts it in "
                               f"micro-batches of {self.micro_batch_size} on each of {plan.data_parallel_size} "
                               "data-parallel ranks, so it changes with the world size; data.val_samples sets a count "
                               "that does not")
            count = min(count, limited)
        return count

    def loader_options(self) -> dict[str, Any]:
        """DataLoader arguments shared by every split (and by ``cohort doctor``'s loader timing)."""
        return {
            "batch_size": self.micro_batch_size,
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
            "persistent_workers": self.num_workers > 0,
        }
