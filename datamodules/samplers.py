"""Which sample each rank reads, as a pure function of (seed, epoch, optimizer step, rank, index).

Training: optimizer step s consumes the global batch at positions [k*G, (k+1)*G) of its data epoch's
permutation (k = s mod steps per epoch), whatever the data-parallel size W or accumulation A (both from the run
plan). Micro-batch a of data-parallel rank r takes the ``micro_batch_size`` positions starting at
k*G + a*(micro*W) + r*micro. So a 1-process run and a 2-process run with the same global batch see the same samples
in every step, ranks never share a sample, and resuming at step s only needs s: the stream restarts there.
A fault-tolerant replica group (app/strategies/fault_tolerance/) reads the places its step's quorum gives it: of n
groups, group r reads places [r*G/n, (r+1)*G/n) of the committed step's global batch, so the job reads the same
stream as one process whatever the quorum.

Validation: of the N windows of val.bin it reads n (all, or ``data.val_samples``), chosen evenly over the whole file:
place i < n is window i * N // n. So the first is window 0, neighbours are floor(N/n) or ceil(N/n) apart, the last is
within one such stride of the end, and n alone decides which windows, whatever W (and after a resume). Rank r reads
places i = r, r + W, r + 2W, ... (``RunPlan.evaluation_place``): every chosen window exactly once. Ranks read equal
counts (``RunPlan.evaluation_samples_per_rank``: whole micro-batches under a pipeline), padded with PADDING_INDEX
samples that count for nothing, so no rank waits in a collective for another to finish.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from core.run_plan import RunPlan
from core.seeding import derive_seed
from datamodules.token_files import PADDING_INDEX


class GlobalBatchSampler(Sampler[int]):
    """This rank's sample indices, micro-batch after micro-batch; the DataLoader groups them by micro_batch_size.

    Each iteration starts at the optimizer step ``current_step()`` returns when it begins (Lightning starts one
    per epoch, and one when it resumes), so the data position follows the restored step and nothing else: not
    Lightning's epoch counter, which a run that stopped early has already advanced. Data epochs are whole passes
    over the samples, ``steps_per_epoch`` optimizer steps each, with a fresh permutation per pass.
    """

    def __init__(self, num_samples: int, plan: RunPlan, data_parallel_rank: int,
                 current_step: Callable[[], int] = lambda: 0, shuffle: bool = True) -> None:
        self.num_samples = num_samples
        self.shuffle = shuffle  # False: every data epoch reads the samples in their order (a loader without shuffle)
        self.plan = plan
        self.rank = data_parallel_rank
        self.current_step = current_step
        self.steps_per_epoch = num_samples // plan.global_batch_size
        # an asynchronous worker's steps, handed out by the parameter server (app/strategies/parameter_server/) until it
        # says stop: then the stream has no length, and no epochs
        self.assigned_steps: Callable[[], Iterator[int]] | None = None
        # a fault-tolerant replica group's steps (app/strategies/fault_tolerance/): (step, places) as its quorum gives
        # them, asked for as each step starts (the loader must not read ahead: no workers, a known length)
        self.next_step: Callable[[], tuple[int, range]] | None = None

    def __len__(self) -> int:
        if self.assigned_steps is not None:
            raise TypeError("an asynchronous worker's stream ends when the parameter server says so")
        return self.steps_per_epoch * self.plan.accumulation * self.plan.micro_batch_size

    def __iter__(self) -> Iterator[Any]:
        for step, places, indices in self.steps():
            yield from self.items(step, places, indices)

    def items(self, step: int, places: list[int], indices: list[int]) -> list[Any]:
        """What the DataLoader hands the dataset for a step's samples: their indices (a subclass adds more)."""
        return indices

    def micro_batches(self, accumulation: int) -> Iterator[list[Any]]:
        """Each step's items cut into ``accumulation`` equal micro-batches, whatever their number in the step (a
        fault-tolerant group reads more while the quorum is smaller)."""
        for step, places, indices in self.steps():
            items = self.items(step, places, indices)
            size = len(items) // accumulation
            for start in range(0, len(items), size):
                yield items[start:start + size]

    def places_in_step(self) -> torch.Tensor:
        """This rank's places in each step's global batch, in the order it reads them: micro-batch a takes the
        ``micro_batch_size`` places of its ``RunPlan.micro_batch_group``."""
        plan = self.plan
        groups = torch.tensor([plan.micro_batch_group(self.rank, a) for a in range(plan.accumulation)])
        return (groups.view(-1, 1) * plan.micro_batch_size + torch.arange(plan.micro_batch_size)).flatten()

    def steps(self) -> Iterator[tuple[int, list[int], list[int]]]:
        """(optimizer step, this rank's places in its global batch, the sample indices there), step after step."""
        first, plan = self.current_step(), self.plan
        fixed_places = self.places_in_step().tolist()
        steps: Iterable[tuple[int, Iterable[int]]] = ((step, fixed_places)
                                                       for step in range(first, first + self.steps_per_epoch))
        if self.assigned_steps is not None:
            steps = ((step, fixed_places) for step in self.assigned_steps())
        elif self.next_step is not None:
            steps = (self.next_step() for _ in range(self.steps_per_epoch))
        permutation, permutation_epoch = torch.empty(0, dtype=torch.long), -1
        for step, step_places in steps:
            data_epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
            if data_epoch != permutation_epoch:
                permutation, permutation_epoch = self.permutation(data_epoch), data_epoch
            places = list(step_places)
            yield step, places, permutation[step_in_epoch * plan.global_batch_size + torch.tensor(places)].tolist()


    def permutation(self, data_epoch: int) -> torch.Tensor:
        """The order in which data epoch ``data_epoch`` reads the samples: drawn from the seed and the epoch."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        generator = torch.Generator().manual_seed(derive_seed(self.plan.seed, data_epoch))
        return torch.randperm(self.num_samples, generator=generator)


class StepMicroBatches(Sampler[list[Any]]):
    """A DataLoader's batch sampler over ``sampler.micro_batches``: micro-batches whose size each step decides."""

    def __init__(self, sampler: GlobalBatchSampler, accumulation: int) -> None:
        self.sampler = sampler
        self.accumulation = accumulation

    def __len__(self) -> int:
        return self.sampler.steps_per_epoch * self.accumulation

    def __iter__(self) -> Iterator[list[Any]]:
        return self.sampler.micro_batches(self.accumulation)


class EvenShardSampler(Sampler[int]):
    """A data-parallel rank's share of the ``num_chosen`` windows spread over ``num_windows``: place i is window
    i * num_windows // num_chosen, and places past num_chosen are PADDING_INDEX. With num_chosen == num_windows that
    is every window."""

    def __init__(self, num_windows: int, num_chosen: int, plan: RunPlan, data_parallel_rank: int) -> None:
        if not 0 <= num_chosen <= num_windows:
            raise ValueError(f"num_chosen={num_chosen} must be between 0 and num_windows={num_windows}")
        self.num_windows = num_windows
        self.num_chosen = num_chosen
        self.plan = plan
        self.rank = data_parallel_rank

    def __len__(self) -> int:
        return self.plan.evaluation_samples_per_rank(self.num_chosen)

    def __iter__(self) -> Iterator[int]:
        for sample_in_rank in range(len(self)):
            place = self.plan.evaluation_place(self.rank, sample_in_rank)
            yield place * self.num_windows // self.num_chosen if place < self.num_chosen else PADDING_INDEX
