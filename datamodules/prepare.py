"""``cohort prepare``: turn text files into token files (train.bin, val.bin and meta.json) for the LM datamodule.

    cohort prepare my_texts/ notes.txt --out data/my_corpus --val-fraction 0.05
    cohort prepare my_texts/ --out data/my_corpus --tokenizer gpt2/tokenizer.json --workers 8

Tokens are the text's bytes (vocabulary 256) or a Hugging Face tokenizer's ids (datamodules/encoding.py). Files
are joined by a newline, in sorted order. With enough files for every k-th one (k = 1 / val-fraction) to go to
val.bin, the split is by whole files, so that no file is in both; with fewer, the last val-fraction of the tokens
is the validation set. Either way both splits must hold one sample of ``--sequence-length`` + 1 tokens, or
nothing is written. meta.json records the tokenizer, its vocabulary and the token counts; ``fit`` checks them
(datamodules/token_files.py). Writes are atomic (temporary file, then rename), so that ranks or nodes building
the same folder at once never see half a file.

The embedded default corpus is built the same way from the Python standard library's own source files, which are
on every machine that runs this code.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, TextIO

import numpy as np

from core.errors import ArgumentParser, UserError, check_writable_folder
from datamodules.encoding import BYTES, Encoding, FileEncoder, encoded_files, load_tokenizer_file
from datamodules.token_files import TOKEN_META_FILE, token_dtype

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".json", ".csv", ".html", ".xml", ".yaml", ".yml", ".tex"}
DEFAULT_CORPUS_DIR = Path("data") / "python_stdlib"
DEFAULT_SEQUENCE_LENGTH = 128  # the datamodule's default data.sequence_length
DEFAULT_WORKERS = min(8, os.cpu_count() or 1)  # one process writes what they encode; more rarely pays


def collect_text_files(inputs: Sequence[Path]) -> list[Path]:
    """The files named, and the text files (by suffix) under the folders named, in sorted order."""
    files: list[Path] = []
    for path in inputs:
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES))
        elif path.is_file():
            files.append(path)
        else:
            raise UserError(f"input {path} does not exist: name text files or folders of them")
    if not files:
        raise UserError(f"no text files found in {', '.join(map(str, inputs))} (looked for {sorted(TEXT_SUFFIXES)})")
    return files


def stdlib_source_files() -> list[Path]:
    """The standard library's own modules, without its test suites and third-party packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


class Progress:
    """Files and tokens done: one line redrawn in place on a terminal, elsewhere (a log file) a plain line at every
    tenth of the files."""

    def __init__(self, total_files: int, stream: TextIO | None = None) -> None:
        self.total_files = total_files
        self.stream = stream or sys.stderr  # looked up now, not at import: tests and tools replace sys.stderr
        self.interactive = self.stream.isatty()
        self.shown_at = 0.0  # time.monotonic() of the last redraw
        self.shown_tenths = 0

    def update(self, files: int, tokens: int) -> None:
        line = f"encoded {files:,}/{self.total_files:,} files, {tokens:,} tokens"
        if self.interactive:
            if time.monotonic() - self.shown_at > 0.2 or files == self.total_files:
                self.stream.write(f"\r{line}" + ("\n" if files == self.total_files else ""))
                self.stream.flush()
                self.shown_at = time.monotonic()
        elif files * 10 // self.total_files > self.shown_tenths:
            self.shown_tenths = files * 10 // self.total_files
            print(line, file=self.stream, flush=True)


class TokenFileWriter:
    """Token arrays appended to a temporary file beside ``path``, joined by ``separator``; ``commit`` renames it to
    ``path``, ``discard`` removes it."""

    def __init__(self, path: Path, dtype: np.dtype, separator: np.ndarray) -> None:
        self.path = path
        self.dtype = dtype
        self.separator = separator
        self.handle = new_file_beside(path, "xb")
        self.num_tokens = 0

    def append(self, tokens: np.ndarray) -> None:
        if self.num_tokens > 0:
            self.separator.tofile(self.handle)
            self.num_tokens += len(self.separator)
        tokens.astype(self.dtype, copy=False).tofile(self.handle)
        self.num_tokens += len(tokens)

    def tokens(self) -> np.ndarray:
        """What has been written so far (memory-mapped, not read whole)."""
        self.handle.flush()
        return np.memmap(self.handle.name, dtype=self.dtype, mode="r") if self.num_tokens else np.empty(0, self.dtype)

    def truncate(self, num_tokens: int) -> None:
        self.handle.flush()
        self.handle.truncate(num_tokens * self.dtype.itemsize)
        self.handle.seek(0, os.SEEK_END)
        self.num_tokens = num_tokens

    def commit(self) -> None:
        self.handle.close()
        os.replace(self.handle.name, self.path)

    def discard(self) -> None:
        self.handle.close()
        Path(self.handle.name).unlink(missing_ok=True)


def write_text_atomically(text: str, path: Path) -> None:
    """``path`` holds ``text`` or what it held before, never a part of ``text``."""
    with new_file_beside(path, "x") as handle:
        handle.write(text)
    os.replace(handle.name, path)


def new_file_beside(path: Path, mode: str) -> IO[Any]:
    """A new file, opened with ``mode`` ("x..."), in ``path``'s folder, to be renamed onto ``path`` once written.
    Made as open() makes files, readable as the umask allows (0644 under the usual 022), as ``cohort export``
    writes; tempfile's files are their owner's only whatever the umask."""
    return open(path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp"), mode)


def check_split_sizes(train: int, val: int, minimum: int, sequence_length: int, val_fraction: float) -> None:
    """A UserError if either split holds fewer than ``minimum`` tokens (one sample and its target)."""
    for split, count, change in (("val", val, "larger"), ("train", train, "smaller")):
        if count < minimum:
            raise UserError(
                f"{split}.bin would hold {count:,} tokens ({train + val:,} in all at --val-fraction {val_fraction}), "
                f"fewer than one sample of --sequence-length {sequence_length} + 1 = {minimum}: give more text, a "
                f"{change} --val-fraction or a shorter --sequence-length (the shortest data.sequence_length you "
                "will train with)"
            )


def prepare_corpus(files: Sequence[Path], out_dir: Path, *, encoding: Encoding = BYTES, val_fraction: float = 0.05,
                   sequence_length: int = DEFAULT_SEQUENCE_LENGTH, workers: int = 1,
                   progress: Progress | None = None) -> tuple[int, int]:
    """Write ``out_dir/train.bin``, ``out_dir/val.bin`` and ``out_dir/meta.json``; returns the two token counts.
    A UserError, with nothing written, if the text is too small for both splits to hold one sample."""
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"--val-fraction {val_fraction} must be between 0 and 1 (exclusive)")
    for option, value in (("--sequence-length", sequence_length), ("--workers", workers)):
        if value < 1:
            raise UserError(f"{option} {value} must be a positive integer")
    every = max(2, round(1.0 / val_fraction))
    by_file = len(files) >= every  # whole files only when the validation share gets at least one
    dtype = token_dtype(encoding.vocab_size)
    separator = FileEncoder(encoding, dtype).encode(b"\n", "a newline")
    check_writable_folder(out_dir, "output folder")
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    train = TokenFileWriter(out_dir / "train.bin", dtype, separator)
    val = TokenFileWriter(out_dir / "val.bin", dtype, separator)
    try:
        for i, tokens in enumerate(encoded_files(files, encoding, dtype, workers), start=1):
            (val if by_file and i % every == 0 else train).append(tokens)
            if progress is not None:
                progress.update(i, train.num_tokens + val.num_tokens)
        minimum = sequence_length + 1
        if by_file and min(train.num_tokens, val.num_tokens) < minimum:  # whole files left one split too small
            train.append(val.tokens())
            val.truncate(0)
            by_file = False
        if not by_file:  # the last val_fraction of the tokens
            cut = int(train.num_tokens * (1.0 - val_fraction))
            val.append(train.tokens()[cut:])
            train.truncate(cut)
        check_split_sizes(train.num_tokens, val.num_tokens, minimum, sequence_length, val_fraction)
    except BaseException:  # Ctrl-C too: leave no temporary files, and no folder this call made
        train.discard()
        val.discard()
        if created and not any(out_dir.iterdir()):
            out_dir.rmdir()
        raise
    (out_dir / TOKEN_META_FILE).unlink(missing_ok=True)  # a crash between the renames then leaves no stale meta.json
    train.commit()
    val.commit()
    meta = {**encoding.meta(), "dtype": dtype.name, "train_tokens": train.num_tokens, "val_tokens": val.num_tokens,
            "files": len(files), "split": "whole files" if by_file else "last tokens", "val_fraction": val_fraction}
    write_text_atomically(json.dumps(meta, indent=2) + "\n", out_dir / TOKEN_META_FILE)
    return train.num_tokens, val.num_tokens


def main(argv: Sequence[str] | None = None) -> None:
    """``cohort prepare ARGS``; a UserError for input it cannot use (app/__main__.py prints it as one line)."""
    parser = ArgumentParser(prog="cohort prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="*", type=Path, help="text files or folders (default: the Python stdlib)")
    parser.add_argument("--out", type=Path, required=True, help="folder to write train.bin and val.bin into")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="share of the text kept for validation")
    parser.add_argument("--tokenizer", type=Path, help="a Hugging Face tokenizer.json (default: byte-level tokens)")
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help="processes that encode files")
    parser.add_argument("--sequence-length", type=int, default=DEFAULT_SEQUENCE_LENGTH,
                        help="the shortest data.sequence_length you will train with: each split must hold one sample")
    args = parser.parse_args(argv)
    encoding = load_tokenizer_file(args.tokenizer) if args.tokenizer else BYTES
    files = collect_text_files(args.inputs) if args.inputs else stdlib_source_files()
    train_tokens, val_tokens = prepare_corpus(
        files, args.out, encoding=encoding, val_fraction=args.val_fraction, sequence_length=args.sequence_length,
        workers=args.workers, progress=Progress(len(files)),
    )
    print(
        f"wrote {args.out}/train.bin ({train_tokens:,} tokens) and {args.out}/val.bin ({val_tokens:,} tokens) "
        f"from {len(files)} files; train with --data.data_dir {args.out} --data.vocab_size {encoding.vocab_size}"
    )


if __name__ == "__main__":  # the older spelling of `cohort prepare`, kept for scripts that use it
    try:
        main()
    except UserError as error:
        sys.exit(f"cohort: error: {error}")
