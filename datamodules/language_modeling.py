"""The LM DataModule: token files in, (input, target) micro-batches out, the same global batches at any scale.

With no ``data_dir`` it trains on the embedded corpus (the Python standard library's source, byte-level), built
once into ``data/python_stdlib`` by the first process of each node.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader

from core.errors import UserError, check_ranges
from core.run_plan import RunPlan, run_plan_of
from datamodules.encoding import BYTE_VOCAB_SIZE
from datamodules.prepare import DEFAULT_CORPUS_DIR, DEFAULT_SEQUENCE_LENGTH, prepare_corpus, stdlib_source_files
from datamodules.samplers import EvenShardSampler, GlobalBatchSampler
from datamodules.token_files import TokenWindows, check_token_folder


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
        sampler: GlobalBatchSampler = self.sampler  # type: ignore[assignment]
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


class LanguageModelingDataModule(L.LightningDataModule):
    def __init__(
        self,
        data_dir: str | None = None,
        vocab_size: int = BYTE_VOCAB_SIZE,
        sequence_length: int = DEFAULT_SEQUENCE_LENGTH,
        global_batch_size: int = 32,
        micro_batch_size: int = 8,
        val_samples: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        prompts: list[str] | None = None,
    ) -> None:
        """
        Args:
            data_dir: folder with train.bin and val.bin; None builds and uses the embedded stdlib corpus.
            vocab_size: tokenizer vocabulary; decides uint16 or uint32 token files, and must be the one the
                folder's meta.json records (if it has one: `cohort prepare` writes it).
            sequence_length: tokens per sample (at most the model's block_size).
            global_batch_size: samples per optimizer step, over all ranks and accumulation steps.
            micro_batch_size: samples per forward/backward on one device.
            val_samples: validate on N windows spread evenly over val.bin (window i * len // N), the same windows
                at any world size. An int trainer.limit_val_batches spreads its windows the same way: limit x
                micro_batch_size x data-parallel size of them, a total that grows with the world size because
                Lightning counts that limit per rank.
            num_workers: DataLoader worker processes per rank.
            pin_memory: page-locked host batches for faster copies to GPUs.
            prompts: texts that ``predict`` continues (byte-level vocabulary).
        """
        super().__init__()
        self.save_hyperparameters()
        check_ranges("data", {
            "sequence_length": (sequence_length >= 1, "a positive integer"),
            "vocab_size": (vocab_size >= 1, "a positive integer"),
            "val_samples": (val_samples is None or val_samples >= 1, "a positive integer, or null for all of val.bin"),
            "num_workers": (num_workers >= 0, ">= 0 (0 loads batches in the training process)"),
        }, locals())
        self.data_dir = Path(data_dir) if data_dir is not None else DEFAULT_CORPUS_DIR
        if data_dir is not None:  # check user data now, before any work starts
            check_token_folder(self.data_dir, vocab_size)
        elif vocab_size != BYTE_VOCAB_SIZE:
            raise UserError(f"the embedded corpus is byte-level (vocab_size {BYTE_VOCAB_SIZE}), not {vocab_size}: "
                            "leave data.vocab_size at 256 or set data.data_dir to your own token files")
        self.vocab_size = vocab_size
        self.sequence_length = sequence_length
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.val_samples = val_samples
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.prompts = prompts or ["def fibonacci(n):\n", "class Stack:\n"]
        self.run_plan: RunPlan | None = None  # handed over by the CLI: the ranks, sizes and accumulation
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None

    def prepare_data(self) -> None:
        """Build the embedded corpus once per node (Lightning calls this on local rank 0 only)."""
        built = all((self.data_dir / f"{split}.bin").exists() for split in ("train", "val"))
        if self.data_dir == DEFAULT_CORPUS_DIR and not built:
            train_tokens, val_tokens = prepare_corpus(stdlib_source_files(), self.data_dir)
            print(f"built the embedded corpus in {self.data_dir}: {train_tokens:,} train and {val_tokens:,} val tokens")

    def setup(self, stage: str) -> None:
        if stage in ("fit", "validate", "test") and self.val_set is None:
            self.train_set = TokenWindows(self.data_dir / "train.bin", self.sequence_length, self.vocab_size)
            self.val_set = TokenWindows(self.data_dir / "val.bin", self.sequence_length, self.vocab_size)
            if len(self.train_set) < self.global_batch_size:
                raise UserError(
                    f"{self.data_dir}/train.bin holds {len(self.train_set)} samples of {self.sequence_length} "
                    f"tokens, fewer than one global batch of {self.global_batch_size}: use more data or a smaller "
                    "data.global_batch_size"
                )

    def train_dataloader(self) -> DataLoader:
        return self.training_loader(self.trainer.global_rank, current_step=lambda: self.trainer.global_step)

    def training_loader(self, global_rank: int, current_step: Callable[[], int] = lambda: 0) -> ResumableDataLoader:
        """Rank ``global_rank``'s share of each global batch, from the optimizer step ``current_step()`` on (when
        resuming, the step restored from the checkpoint)."""
        assert self.train_set is not None
        plan = run_plan_of(self)
        sampler = GlobalBatchSampler(len(self.train_set), plan, plan.data_parallel_rank(global_rank), current_step)
        return ResumableDataLoader(self.train_set, sampler=sampler, **self.loader_options())

    def val_dataloader(self) -> DataLoader:
        return self.evaluation_dataloader("limit_val_batches", self.trainer.limit_val_batches)

    def test_dataloader(self) -> DataLoader:
        return self.evaluation_dataloader("limit_test_batches", self.trainer.limit_test_batches)

    def evaluation_dataloader(self, limit_name: str, limit_batches: int | float) -> DataLoader:
        """The val.bin windows that validation (or test) reads, spread evenly over the whole file."""
        assert self.val_set is not None
        plan = run_plan_of(self)
        rank, data_parallel_size = plan.data_parallel_rank(self.trainer.global_rank), plan.data_parallel_size
        num_chosen = self.evaluation_window_count(limit_name, limit_batches, data_parallel_size)
        sampler = EvenShardSampler(len(self.val_set), num_chosen, rank, data_parallel_size)
        return DataLoader(self.val_set, sampler=sampler, **self.loader_options())

    def evaluation_window_count(self, limit_name: str, limit_batches: int | float, data_parallel_size: int) -> int:
        """How many windows all ranks read together: data.val_samples, capped by an int Lightning limit (micro-batches
        per rank). Left to itself, Lightning would stop each rank after its first batches, which lie at the start of
        val.bin; a loader that holds only the windows to read, spread out, leaves it nothing to cut."""
        assert self.val_set is not None
        count = min(len(self.val_set), self.val_samples or len(self.val_set))
        if isinstance(limit_batches, float) and limit_batches < 1.0:
            raise UserError(f"trainer.{limit_name}={limit_batches} is a fraction, which Lightning takes from the start "
                            "of val.bin: give micro-batches per rank (an int) or set data.val_samples")
        if isinstance(limit_batches, int):
            count = min(count, limit_batches * self.micro_batch_size * data_parallel_size)
        if run_plan_of(self).pipeline_parallel_size > 1:
            # a pipeline's stages exchange tensors of the shapes they first agreed on: whole micro-batches only
            count -= count % (self.micro_batch_size * data_parallel_size)
            if count == 0:
                raise UserError(f"validation reads fewer windows than one micro batch on each of the "
                                f"{data_parallel_size} data-parallel ranks, which a pipeline needs: raise "
                                "data.val_samples or trainer.limit_val_batches")
        return count

    def predict_dataloader(self) -> DataLoader:
        if self.vocab_size != BYTE_VOCAB_SIZE:
            raise UserError("predict turns prompts into tokens byte by byte, which needs data.vocab_size 256")
        prompts = [torch.tensor(list(prompt.encode()), dtype=torch.long) for prompt in self.prompts]
        return DataLoader(prompts, batch_size=1)  # prompts differ in length

    def loader_options(self) -> dict[str, Any]:
        """DataLoader arguments shared by every split (and by ``cohort doctor``'s loader timing)."""
        return {
            "batch_size": self.micro_batch_size,
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
            "persistent_workers": self.num_workers > 0,
        }
