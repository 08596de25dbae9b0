"""Which sample each rank reads, as a pure function of (seed, epoch, optimizer step, rank, index).

Training: optimizer step s of an epoch consumes the global batch at positions [s*G, (s+1)*G) of that epoch's
permutation, whatever the world size W or accumulation A. Micro-batch a of rank r takes the
``micro_batch_size`` positions starting at s*G + a*(micro*W) + r*micro. So a 1-process run and a 2-process run
with the same global batch see the same samples in every step, ranks never share a sample, and resuming at step
s only needs s: the stream restarts there.

Validation: every window exactly once, whatever W; ranks get equal counts, padded with PADDING_INDEX, so no
rank waits in a collective for another to finish.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from datamodules.token_files import PADDING_INDEX


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that depends on every part; nearby inputs give unrelated seeds."""
    digest = hashlib.sha256("/".join(str(part) for part in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class GlobalBatchSampler(Sampler[int]):
    """This rank's sample indices, micro-batch after micro-batch; the DataLoader groups them by micro_batch_size."""

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        start_step: int = 0,
    ) -> None:
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.start_step = start_step  # the optimizer step this run resumes at; earlier steps are not replayed
        self.accumulation = global_batch_size // (micro_batch_size * world_size)
        self.steps_per_epoch = num_samples // global_batch_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at the start of every epoch."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps_per_epoch * self.accumulation * self.micro_batch_size

    def __iter__(self) -> Iterator[int]:
        permutation = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.epoch_seed()))
        steps = torch.arange(self.steps_per_epoch).view(-1, 1, 1) * self.global_batch_size
        micro_batches = torch.arange(self.accumulation).view(1, -1, 1) * (self.micro_batch_size * self.world_size)
        within = self.rank * self.micro_batch_size + torch.arange(self.micro_batch_size).view(1, 1, -1)
        positions = (steps + micro_batches + within).flatten()  # (steps * accumulation * micro,)
        first_step_of_epoch = self.epoch * self.steps_per_epoch
        skip_steps = min(max(self.start_step - first_step_of_epoch, 0), self.steps_per_epoch)
        skip = skip_steps * self.accumulation * self.micro_batch_size
        return iter(permutation[positions[skip:]].tolist())

    def epoch_seed(self) -> int:
        return derive_seed(self.seed, self.epoch)


class EvenShardSampler(Sampler[int]):
    """Windows rank, rank + W, rank + 2W, ...; ranks short of ceil(N / W) windows are padded."""

    def __init__(self, num_samples: int, rank: int, world_size: int) -> None:
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size

    def __len__(self) -> int:
        return math.ceil(self.num_samples / self.world_size)

    def __iter__(self) -> Iterator[int]:
        for index in range(self.rank, len(self) * self.world_size, self.world_size):
            yield index if index < self.num_samples else PADDING_INDEX
