"""Bad input gets one line that says what was wrong and what to do, no traceback, and nothing written."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from app.__main__ import main
from tests.helpers import QUIET, one_line_error, run_cohort


def assert_one_line_error(args: list[str], cwd: Path, expected: str) -> None:
    runs_before = sorted(cwd.glob("lightning_logs/version_*"))
    result = run_cohort(args, cwd=cwd, timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("cohort: error: ") and expected in last_line, result.stderr[-3000:]
    assert sorted(cwd.glob("lightning_logs/version_*")) == runs_before, "a failed start must not create a run"


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


ONE_STEP = ["--trainer.max_steps", "1"]  # should a check let a run start, it ends at once


@pytest.mark.parametrize("flags, expected", [
    (["--model.learning_rate", "0"], "model.learning_rate=0.0 must be > 0"),
    (["--model.min_learning_rate_ratio", "1.5"], "model.min_learning_rate_ratio=1.5 must be in [0, 1]"),
    (["--model.dropout", "1.0"], "model.dropout=1.0 must be in [0, 1)"),
    (["--model.dropout", "-0.1"], "model.dropout=-0.1 must be in [0, 1)"),
    (["--model.weight_decay", "-0.1"], "model.weight_decay=-0.1 must be >= 0"),
    (["--model.betas", "[0.9, 1.0]"], "model.betas=(0.9, 1.0) must be two numbers in [0, 1)"),
    (["--model.warmup_steps", "-1"], "model.warmup_steps=-1 must be >= 0"),
    (["--model.lr_decay_steps", "0"], "model.lr_decay_steps=0 must be > 0, or null for the whole run"),
    (["--model.temperature", "0"], "model.temperature=0.0 must be > 0"),
    (["--model.top_k", "0"], "model.top_k=0 must be >= 1, or null"),
    (["--data.num_workers", "-1"], "data.num_workers=-1 must be >= 0"),
    (["--preemption.grace_seconds", "0"], "preemption.grace_seconds=0.0 must be > 0"),
    (["--data.val_samples", "0"], "data.val_samples=0 must be a positive integer, or null"),
    (["--trainer.num_nodes", "2"], "trainer.num_nodes=2 but no launcher started this process"),
], ids=lambda value: value if isinstance(value, str) and value.startswith("--") else None)
def test_out_of_range_settings_stop_in_one_line(flags: list[str], expected: str, debug_run_args: list[str],
                                                tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert expected in one_line_error(["fit", *debug_run_args, *ONE_STEP, *flags], monkeypatch)
    assert not (tmp_path / "lightning_logs").exists()


def test_a_launcher_that_started_other_processes_than_the_config_says(debug_run_args: list[str], tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"TORCHELASTIC_RUN_ID": "job", "RANK": "0", "GROUP_RANK": "0", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "4"}.items():  # what torchrun --nproc_per_node 4 sets
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    assert "torchrun started 4 processes but trainer.devices=1 x trainer.num_nodes=1 = 1" in one_line_error(
        ["fit", *debug_run_args, "--trainer.devices", "1", *ONE_STEP], monkeypatch)


def test_torchrun_restarts_onto_its_shared_rendezvous_store_are_refused(debug_run_args: list[str], tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"TORCHELASTIC_RUN_ID": "none", "RANK": "0", "GROUP_RANK": "0", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "1", "TORCHELASTIC_MAX_RESTARTS": "1",
                        "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():  # torchrun --max-restarts 1, static rendezvous
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in one_line_error(["fit", *debug_run_args, *ONE_STEP], monkeypatch)


def test_log_and_checkpoint_folders_that_cannot_be_made(debug_run_args: list[str], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a_file").write_text("")
    monkeypatch.chdir(tmp_path)
    message = one_line_error(["fit", *debug_run_args, *ONE_STEP, "--trainer.logger.init_args.save_dir", "a_file/logs"],
                             monkeypatch)
    assert "the log folder a_file/logs/lightning_logs cannot be made: a_file is a file, not a folder" in message
    message = one_line_error(["fit", *debug_run_args, *ONE_STEP, "--checkpoint.dirpath", "a_file"], monkeypatch)
    assert "the checkpoint folder a_file cannot be made: a_file is a file, not a folder" in message


@pytest.mark.parametrize("field, expected", [("learning_rate: abc", "learning_rate"),
                                             ("learnin_rate: 0.1", "learnin_rate")], ids=["wrong-type", "unknown-key"])
def test_a_yaml_value_of_the_wrong_type_or_an_unknown_key_is_named(field: str, expected: str, debug_run_args: list[str],
                                                                   tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """jsonargparse's own message, before anything is built."""
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  {field}\n")
    monkeypatch.setattr(sys, "argv", ["cohort"])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *debug_run_args, *ONE_STEP, "-c", str(config)])
    assert exit_info.value.code == 2
    printed = capsys.readouterr().err
    assert "error:" in printed and expected in printed, printed
