from __future__ import annotations

from pathlib import Path

import pytest

from datamodules.prepare import prepare_corpus, stdlib_source_files


@pytest.fixture(scope="session")
def byte_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level corpus (about 1 MB of stdlib source) in train.bin / val.bin."""
    out = tmp_path_factory.mktemp("corpus")
    prepare_corpus(stdlib_source_files()[:60], out, val_fraction=0.1)
    return out


@pytest.fixture(scope="session")
def debug_run_args(byte_corpus: Path) -> list[str]:
    """CLI arguments for a tiny, fast, fully deterministic CPU run of the debug model."""
    return [
        "--trainer.accelerator", "cpu",
        "--trainer.precision", "32-true",
        "--trainer.log_every_n_steps", "1",
        "--trainer.limit_val_batches", "4",
        "--model.model_name", "debug",
        "--model.warmup_steps", "2",
        "--data.data_dir", str(byte_corpus),
        "--data.sequence_length", "64",
    ]
