"""``cohort prepare``: turn text files into byte-level token files (vocabulary 256) for the LM datamodule.

    cohort prepare my_texts/ notes.txt --out data/my_corpus --val-fraction 0.05

Files are split between train.bin and val.bin as whole files (every k-th file, in sorted order) so that no text
is in both; with a single input file its last ``val-fraction`` of bytes is the validation set. Writes are atomic
(temporary file, then rename), so that ranks or nodes building the same folder at once never see half a file.

The embedded default corpus is built the same way from the Python standard library's own source files, which are
on every machine that runs this code.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from core.errors import UserError

BYTE_VOCAB_SIZE = 256
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".json", ".csv", ".html", ".xml", ".yaml", ".yml", ".tex"}
DEFAULT_CORPUS_DIR = Path("data") / "python_stdlib"


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


def write_tokens_atomically(tokens: np.ndarray, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as handle:
        tokens.astype("<u2").tofile(handle)
    os.replace(handle.name, path)


def prepare_byte_corpus(files: Sequence[Path], out_dir: Path, val_fraction: float = 0.05) -> tuple[int, int]:
    """Write ``out_dir/train.bin`` and ``out_dir/val.bin``; returns their token counts."""
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"val_fraction={val_fraction} must be between 0 and 1 (exclusive)")
    try:
        texts = [path.read_bytes() for path in files]
    except OSError as error:
        raise UserError(f"cannot read {error.filename}: {error.strerror}") from None
    if len(texts) == 1:
        cut = int(len(texts[0]) * (1.0 - val_fraction))
        train_bytes, val_bytes = texts[0][:cut], texts[0][cut:]
    else:
        every = max(2, round(1.0 / val_fraction))
        train_bytes = b"\n".join(text for i, text in enumerate(texts) if i % every != every - 1)
        val_bytes = b"\n".join(text for i, text in enumerate(texts) if i % every == every - 1)
    train = np.frombuffer(train_bytes, dtype=np.uint8)
    val = np.frombuffer(val_bytes, dtype=np.uint8)
    write_tokens_atomically(train, out_dir / "train.bin")
    write_tokens_atomically(val, out_dir / "val.bin")
    return len(train), len(val)


def main(argv: Sequence[str] | None = None) -> None:
    """``cohort prepare ARGS``; a UserError for input it cannot use (app/__main__.py prints it as one line)."""
    parser = argparse.ArgumentParser(prog="cohort prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="*", type=Path, help="text files or folders (default: the Python stdlib)")
    parser.add_argument("--out", type=Path, required=True, help="folder to write train.bin and val.bin into")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="share of the text kept for validation")
    args = parser.parse_args(argv)
    files = collect_text_files(args.inputs) if args.inputs else stdlib_source_files()
    train_tokens, val_tokens = prepare_byte_corpus(files, args.out, args.val_fraction)
    print(
        f"wrote {args.out}/train.bin ({train_tokens:,} tokens) and {args.out}/val.bin ({val_tokens:,} tokens) "
        f"from {len(files)} files; train with --data.data_dir {args.out} --data.vocab_size {BYTE_VOCAB_SIZE}"
    )


if __name__ == "__main__":  # the older spelling of `cohort prepare`, kept for scripts that use it
    try:
        main()
    except UserError as error:
        sys.exit(f"cohort: error: {error}")
