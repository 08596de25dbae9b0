"""Bad input gets one line that says what was wrong and what to do, no traceback, and nothing written."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import QUIET, run_cohort


def assert_one_line_error(args: list[str], cwd: Path, expected: str) -> None:
    result = run_cohort(args, cwd=cwd, timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("cohort: error: ") and expected in last_line, result.stderr[-3000:]
    assert not (cwd / "lightning_logs" / "version_1").exists(), "a failed start must not create a run"


@pytest.fixture
def fit_args(debug_run_args: list[str]) -> list[str]:
    return ["fit", *debug_run_args, *QUIET, "--trainer.max_steps", "1"]


def test_missing_data_dir(tmp_path: Path, fit_args: list[str]) -> None:
    assert_one_line_error([*fit_args, "--data.data_dir", str(tmp_path / "nope")], tmp_path, "does not exist")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file, so an unreadable file cannot be made")
def test_unreadable_token_file(tmp_path: Path, fit_args: list[str]) -> None:
    for split in ("train", "val"):
        np.zeros(1000, dtype="<u2").tofile(tmp_path / f"{split}.bin")
    (tmp_path / "train.bin").chmod(0)
    assert_one_line_error([*fit_args, "--data.data_dir", str(tmp_path)], tmp_path, "is not readable")


def test_token_file_with_partial_token(tmp_path: Path, fit_args: list[str]) -> None:
    np.zeros(1000, dtype="<u2").tofile(tmp_path / "train.bin")
    (tmp_path / "val.bin").write_bytes(b"\x00" * 1001)
    assert_one_line_error([*fit_args, "--data.data_dir", str(tmp_path)], tmp_path, "not a whole number")


def test_non_dividing_batch_sizes(tmp_path: Path, fit_args: list[str]) -> None:
    args = [*fit_args, "--data.global_batch_size", "10", "--data.micro_batch_size", "4"]
    assert_one_line_error(args, tmp_path, "data.global_batch_size=10 is not a multiple")


def test_unknown_model_name(tmp_path: Path, fit_args: list[str]) -> None:
    assert_one_line_error([*fit_args, "--model.model_name", "gpt5"], tmp_path, "unknown model.model_name 'gpt5'")


def test_impossible_precision_for_the_cpu(tmp_path: Path, fit_args: list[str]) -> None:
    assert_one_line_error([*fit_args, "--trainer.precision", "16-true"], tmp_path, "trainer.precision=16-true")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU error")
def test_gpu_asked_for_on_a_machine_without_one(tmp_path: Path, fit_args: list[str]) -> None:
    assert_one_line_error([*fit_args, "--trainer.accelerator", "gpu"], tmp_path, "no CUDA GPU is visible")


def test_sequence_longer_than_the_model(tmp_path: Path, fit_args: list[str]) -> None:
    assert_one_line_error([*fit_args, "--data.sequence_length", "65"], tmp_path, "exceeds the block_size 64")


def test_missing_and_corrupt_checkpoints(tmp_path: Path, fit_args: list[str]) -> None:
    assert_one_line_error([*fit_args, "--ckpt_path", str(tmp_path / "x.ckpt")], tmp_path, "does not exist")
    (tmp_path / "bad.ckpt").write_bytes(b"not a checkpoint")
    assert_one_line_error([*fit_args, "--ckpt_path", str(tmp_path / "bad.ckpt")], tmp_path, "not a torch checkpoint")


def test_checkpoint_of_another_model(tmp_path: Path, fit_args: list[str]) -> None:
    result = run_cohort([*fit_args, "--checkpoint.every_n_train_steps", "1"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    args = [*fit_args, "--model.model_name", "small", "--data.sequence_length", "64", "--ckpt_path", str(checkpoint)]
    assert_one_line_error(args, tmp_path, "was trained with model.model_name='debug'")
