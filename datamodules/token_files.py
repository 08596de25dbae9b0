"""Flat token files, the format common to GPT training repos: token ids back to back, little-endian, uint16
(uint32 when the vocabulary has more than 65,536 entries), no header. They are read through ``np.memmap`` so
that a file of any size costs only the pages a sample touches.

``cohort prepare`` writes a ``meta.json`` beside them: the tokenizer (``bytes``, or a tokenizer file's name and the
SHA-256 of its text), ``vocab_size``, ``dtype`` and the token counts of each split. Folders without one (older ones,
or made by other tools) are read as before.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from core.errors import UserError
from core.tokens import IGNORE_INDEX

PADDING_INDEX = -1  # a sample index that stands for "no sample" (see EvenShardSampler)
TOKEN_META_FILE = "meta.json"  # beside train.bin and val.bin (a sharded checkpoint's meta.pt is another thing)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def check_token_file(path: Path, vocab_size: int) -> int:
    """Number of tokens in ``path``; a UserError if it is missing, unreadable or not whole tokens."""
    dtype = token_dtype(vocab_size)
    if not path.is_file():
        raise UserError(
            f"token file {path} does not exist: point data.data_dir at a folder with train.bin and val.bin "
            "(make them with `cohort prepare`)"
        )
    if not os.access(path, os.R_OK):
        raise UserError(f"token file {path} is not readable: fix its permissions")
    size = path.stat().st_size
    if size % dtype.itemsize != 0:
        raise UserError(
            f"token file {path} has {size} bytes, not a whole number of {dtype.itemsize}-byte tokens "
            f"(vocab_size={vocab_size} means {dtype.name}): the file is truncated or was written with another dtype"
        )
    return size // dtype.itemsize


def check_token_folder(data_dir: Path, vocab_size: int) -> None:
    """A UserError if train.bin or val.bin cannot be read as ``vocab_size`` tokens, or if the folder's meta.json
    records another vocabulary, or token counts that the files no longer hold."""
    meta_path = data_dir / TOKEN_META_FILE
    meta = None
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
            if not isinstance(meta, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as error:
            raise UserError(f"{meta_path} cannot be read as JSON ({error}): prepare the folder again with "
                            "`cohort prepare`, or delete it") from None
        if meta.get("vocab_size") != vocab_size:
            raise UserError(
                f"{data_dir} holds tokens of {meta.get('tokenizer')} with vocabulary size {meta.get('vocab_size')} "
                f"(its {TOKEN_META_FILE}), not data.vocab_size={vocab_size}: set data.vocab_size "
                f"{meta.get('vocab_size')}"
            )
    for split in ("train", "val"):
        num_tokens = check_token_file(data_dir / f"{split}.bin", vocab_size)
        if meta is not None and meta.get(f"{split}_tokens") != num_tokens:
            raise UserError(
                f"{data_dir}/{split}.bin holds {num_tokens} tokens, but its {TOKEN_META_FILE} says "
                f"{meta.get(f'{split}_tokens')}: the files changed after `cohort prepare` wrote them; prepare the "
                f"folder again, or delete {TOKEN_META_FILE}"
            )


class TokenWindows(Dataset):
    """Non-overlapping windows of ``sequence_length + 1`` tokens; sample i is (input, next-token target).

    The memmap is opened lazily so that the dataset pickles cheaply into DataLoader workers.
    """

    def __init__(self, path: Path, sequence_length: int, vocab_size: int) -> None:
        self.path = path
        self.sequence_length = sequence_length
        self.vocab_size = vocab_size
        self.num_tokens = check_token_file(path, vocab_size)
        if self.num_tokens < sequence_length + 1:
            raise UserError(
                f"token file {path} has {self.num_tokens} tokens, fewer than one sample of "
                f"sequence_length + 1 = {sequence_length + 1}: use more data or a shorter data.sequence_length"
            )
        self._tokens: np.memmap | None = None

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.sequence_length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.sequence_length
        if index == PADDING_INDEX:
            return torch.zeros(T, dtype=torch.long), torch.full((T,), IGNORE_INDEX, dtype=torch.long)
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=token_dtype(self.vocab_size), mode="r")
        window = torch.from_numpy(self._tokens[index * T : index * T + T + 1].astype(np.int64))
        if int(window.max()) >= self.vocab_size:
            raise UserError(
                f"token file {self.path} holds id {int(window.max())} near token {index * T}, outside "
                f"vocab_size={self.vocab_size}: set data.vocab_size to the tokenizer's vocabulary size"
            )
        return window[:-1], window[1:]
