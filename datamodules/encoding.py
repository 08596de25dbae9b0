"""How ``cohort prepare`` turns a text file into token ids: its bytes (vocabulary 256, no package needed), or any
Hugging Face tokenizer given as its ``tokenizer.json`` file, read from that file alone (nothing is downloaded;
the ``tokenizers`` package is the optional extra ``pip install -e '.[tokenizers]'``).

Files are encoded in worker processes when there are many; each worker builds the tokenizer once, from the file's
text handed to it at start, so that a task carries only a path.
"""

from __future__ import annotations

import hashlib
import multiprocessing
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import UserError
from core.tokens import BYTE_VOCAB_SIZE


@dataclass(frozen=True)
class Encoding:
    """A tokenizer as ``cohort prepare`` records it: its name, its vocabulary and, for a tokenizer file, its text."""

    name: str  # "bytes", or the tokenizer file's name
    vocab_size: int
    tokenizer_json: str | None = None  # None: byte-level

    def meta(self) -> dict[str, Any]:
        """What meta.json records of the tokenizer: enough to tell whether two folders used the same one."""
        if self.tokenizer_json is None:
            return {"tokenizer": self.name, "vocab_size": self.vocab_size}
        digest = hashlib.sha256(self.tokenizer_json.encode()).hexdigest()
        return {"tokenizer": self.name, "tokenizer_sha256": digest, "vocab_size": self.vocab_size}


BYTES = Encoding("bytes", BYTE_VOCAB_SIZE)


def load_tokenizer_file(path: Path) -> Encoding:
    """The Hugging Face tokenizer in ``path`` (a ``tokenizer.json``); a UserError if it cannot be used."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UserError("--tokenizer needs the `tokenizers` package: pip install -e '.[tokenizers]' "
                        "(or leave --tokenizer out for byte-level tokens)") from None
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise UserError(f"cannot read tokenizer file {path}: {error.strerror}; give the path of a Hugging Face "
                        "tokenizer.json") from None
    except UnicodeDecodeError:
        raise UserError(f"{path} is not a Hugging Face tokenizer.json (not UTF-8 text): give the tokenizer.json "
                        "file of a Hugging Face tokenizer") from None
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as error:  # the Rust library raises its own exception types, all with a message
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"{path} is not a Hugging Face tokenizer.json ({first_line}): give the tokenizer.json file "
                        "of a Hugging Face tokenizer") from None
    return Encoding(path.name, tokenizer.get_vocab_size(with_added_tokens=True), text)


class FileEncoder:
    """Reads a file and returns its token ids as ``dtype`` (the token files' dtype, so workers send no more bytes
    than the files will hold)."""

    def __init__(self, encoding: Encoding, dtype: np.dtype) -> None:
        self.dtype = dtype
        self.tokenizer = None
        if encoding.tokenizer_json is not None:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_str(encoding.tokenizer_json)

    def encode(self, data: bytes, source: Path | str) -> np.ndarray:
        """The ids of ``data``, the content of ``source`` (named in errors)."""
        if self.tokenizer is None:
            return np.frombuffer(data, dtype=np.uint8).astype(self.dtype)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise UserError(f"{source} is not UTF-8 text (byte {error.start}): convert it to UTF-8 or leave it out "
                            "(byte-level tokens, without --tokenizer, take any bytes)") from None
        # the text's own ids: no special tokens that a post-processor would add to each file
        return np.array(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=self.dtype)

    def __call__(self, path: Path) -> np.ndarray:
        try:
            data = path.read_bytes()
        except OSError as error:
            raise UserError(f"cannot read {path}: {error.strerror}") from None
        return self.encode(data, path)


_worker_encoder: FileEncoder | None = None  # each worker process's own, built once by _start_worker


def _start_worker(encoding: Encoding, dtype: np.dtype) -> None:
    global _worker_encoder
    _worker_encoder = FileEncoder(encoding, dtype)


def _encode_in_worker(path: Path) -> np.ndarray:
    assert _worker_encoder is not None
    return _worker_encoder(path)


def encoded_files(files: Sequence[Path], encoding: Encoding, dtype: np.dtype, workers: int) -> Iterator[np.ndarray]:
    """Each file's token ids, in the order of ``files``, encoded by ``workers`` processes (1: in this one)."""
    workers = min(workers, len(files))
    if workers <= 1:
        yield from map(FileEncoder(encoding, dtype), files)
        return
    # spawn, not fork: the parent may hold torch's threads, and a forked copy of a lock held by one can deadlock
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_worker, initargs=(encoding, dtype))
    pending: deque[Future[np.ndarray]] = deque()
    try:
        for path in files:
            pending.append(pool.submit(_encode_in_worker, path))
            if len(pending) >= 4 * workers:  # a few tasks ahead per worker, so memory holds no more than that
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(cancel_futures=True)
