"""The LM DataModule: token files in, (input, target) micro-batches out, the same global batches at any scale.

With no ``data_dir`` it trains on the embedded corpus (the Python standard library's source, byte-level), built
once into ``data/python_stdlib`` by the first process of each node.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import DataLoader

from core.errors import UserError, check_ranges
from core.run_plan import RunPlan
from core.tokens import BYTE_VOCAB_SIZE
from datamodules.base import ShardedDataModule
from datamodules.prepare import DEFAULT_CORPUS_DIR, DEFAULT_SEQUENCE_LENGTH, prepare_corpus, stdlib_source_files
from datamodules.token_files import TokenWindows, check_token_folder


class LanguageModelingDataModule(ShardedDataModule):
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
            val_samples: validate on N windows spread evenly over val.bin (window i * len // N), shared out over the
                data-parallel ranks: the same windows at any world size; None: all of them. An int
                trainer.limit_val_batches keeps Lightning's meaning (micro-batches per rank) and caps N at limit x
                micro_batch_size x data-parallel size, a total that grows with the world size.
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

    def predict_dataloader(self) -> DataLoader:
        check_byte_level_prompts(self.vocab_size)
        prompts = [torch.tensor(list(prompt.encode()), dtype=torch.long) for prompt in self.prompts]
        return DataLoader(prompts, batch_size=1)  # prompts differ in length


def check_byte_level_prompts(vocab_size: int) -> None:
    """A UserError unless ``predict``'s prompts, turned into tokens byte by byte, are tokens of the model's data:
    the pre-flight checks ask before a checkpoint is read, the predict loader again."""
    if vocab_size != BYTE_VOCAB_SIZE:
        raise UserError(f"predict turns its prompts into tokens byte by byte, so it continues them only for a model "
                        f"trained on byte-level tokens (data.vocab_size {BYTE_VOCAB_SIZE}), not data.vocab_size="
                        f"{vocab_size} (a tokenizer's): write the run as a Hugging Face folder with `cohort export "
                        "CHECKPOINT --out FOLDER` and generate there with transformers and the run's tokenizer")
