"""Checkpoints are data: a pickle that asks for code is refused by fit, validate, predict, consolidate and
``GPTLanguageModel.load_from_checkpoint`` before any of it runs, and a torch file that is not a Lightning checkpoint
is named for what it is (in-process: the one-line plumbing itself is proven by tests/test_cli_errors.py). And no
checkpoint is written with NaN in it, and a plain optimizer's state is stored by parameter name."""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from app.safety.checkpoints import optimizer_state_by_name, optimizer_state_by_position, parameter_names
from models.gpt import gpt_config
from models.language_model import GPTLanguageModel, build_gpt
from models.optimizer import weight_decay_groups
from tests.helpers import DDP_2, QUIET, fit_in_process, one_line_error, run_cohort


class CreatesAFile:
    """What a hostile checkpoint holds: an object whose unpickling calls something, here ``open(path, "w")``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return open, (str(self.path), "w")


@pytest.fixture
def hostile_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    """A Lightning-looking checkpoint file whose loading would create ``marker``."""
    marker = tmp_path / "code-ran"
    path = tmp_path / "hostile.ckpt"
    torch.save({"pytorch-lightning_version": "2.6.0", "state_dict": {}, "payload": CreatesAFile(marker)}, path)
    return path, marker


@pytest.mark.parametrize("command", ["fit", "validate", "predict"])
def test_a_checkpoint_whose_pickle_runs_code_is_refused(command: str, hostile_checkpoint: tuple[Path, Path],
                                                        debug_run_args: list[str], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path, marker = hostile_checkpoint
    monkeypatch.chdir(tmp_path)
    message = one_line_error([command, *debug_run_args, "--trainer.max_steps", "1", "--ckpt_path", str(path)], monkeypatch)
    assert f"checkpoint {path} asks to run code (" in message and ".open')" in message  # io.open or builtins.open
    assert not marker.exists() and not (tmp_path / "lightning_logs").exists()


def test_consolidate_refuses_a_sharded_folder_whose_meta_runs_code(hostile_checkpoint: tuple[Path, Path],
                                                                  tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, marker = hostile_checkpoint
    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"")
    path.rename(folder / "meta.pt")
    message = one_line_error(["consolidate", str(folder)], monkeypatch)
    assert "meta.pt asks to run code (" in message and ".open')" in message
    assert not marker.exists() and not (tmp_path / "last.consolidated.ckpt").exists()


def test_load_from_checkpoint_refuses_a_checkpoint_whose_pickle_runs_code(hostile_checkpoint: tuple[Path, Path],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning passes weights_only=None, so torch's default (weights_only since torch 2.6) decides."""
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", raising=False)
    path, marker = hostile_checkpoint
    with pytest.raises(pickle.UnpicklingError, match=r"GLOBAL \w+\.open"):
        GPTLanguageModel.load_from_checkpoint(path)
    assert not marker.exists()


@pytest.mark.parametrize("content, described", [
    ({"wte.weight": torch.zeros(2, 2), "ln.bias": torch.zeros(2)}, "is a bare state dict of 2 tensors (weights only, no training state)"),
    ({"epoch": 3, "model": [1, 2]}, "is a dict with keys ['epoch', 'model']"),
    ([torch.zeros(1)], "is a list"),
], ids=["state-dict", "dict", "list"])
def test_a_torch_file_that_is_not_a_lightning_checkpoint_is_named(content: object, described: str, tmp_path: Path,
                                                                  debug_run_args: list[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "weights.pt"
    torch.save(content, path)
    monkeypatch.chdir(tmp_path)
    message = one_line_error(["validate", *debug_run_args, "--ckpt_path", str(path)], monkeypatch)
    assert f"{path} {described}, not a Lightning checkpoint" in message


def test_a_zip_archive_that_is_not_a_torch_checkpoint_is_named(tmp_path: Path, debug_run_args: list[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "archive.ckpt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("notes.txt", "not weights")
    monkeypatch.chdir(tmp_path)
    message = one_line_error(["validate", *debug_run_args, "--ckpt_path", str(path)], monkeypatch)
    assert f"checkpoint {path} is a zip archive but not a torch checkpoint" in message


@pytest.mark.slow
def test_no_checkpoint_is_written_with_nan_on_any_rank(tmp_path: Path, debug_run_args: list[str]) -> None:
    """DDP-2: rank 1's weights turn NaN just before the step-4 checkpoint, which rank 0 (clean) would write. Both
    ranks refuse; the step-2 checkpoint stays the newest, whole and finite."""
    result = run_cohort(["fit", *debug_run_args, *QUIET, *DDP_2, "--trainer.max_steps", "6",
                         "--checkpoint.every_n_train_steps", "2", "--data.global_batch_size", "4",
                         "--data.micro_batch_size", "2", "--trainer.callbacks+=tests.helpers.PoisonWeightsBeforeCheckpoint",
                         "--trainer.callbacks.rank=1", "--trainer.callbacks.step=4"], cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("cohort: error: ")]
    assert {line.split(" (", 1)[0] for line in errors} == {
        "cohort: error: step 4: the weights or optimizer state hold NaN or inf"}, result.stderr[-3000:]
    assert "(rank 1: model.wte.weight)" in result.stderr  # each rank says what it found
    assert "(on another rank), so no checkpoint was written and lightning_logs/version_0/checkpoints/last.ckpt is " \
           "kept" in result.stderr
    checkpoint = torch.load(tmp_path / "lightning_logs/version_0/checkpoints/last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 2
    assert all(torch.isfinite(tensor).all() for tensor in checkpoint["state_dict"].values())
    assert not list((tmp_path / "lightning_logs/version_0/checkpoints").glob("*.partial"))


@pytest.mark.slow
def test_the_newest_step_checkpoints_are_kept_and_last_links_to_the_newest(tmp_path: Path,
                                                                            debug_run_args: list[str]) -> None:
    """Every 2 steps, keep 2 (the default), and the final step 7 saved too; the oldest go only after a new one."""
    fit_in_process(tmp_path, debug_run_args, "--trainer.max_steps", "7", "--checkpoint.every_n_train_steps", "2",
                   "--data.global_batch_size", "4", "--data.micro_batch_size", "4")
    folder = tmp_path / "lightning_logs/version_0/checkpoints"
    assert sorted(path.name for path in folder.iterdir()) == ["last.ckpt", "step=000006.ckpt", "step=000007.ckpt"]
    assert os.readlink(folder / "last.ckpt") == "step=000007.ckpt"
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 7


def test_optimizer_state_goes_by_parameter_name_into_another_parameter_order() -> None:
    """Stored by name, without activation checkpointing's wrapper; loaded into an optimizer that lists each
    group's parameters the other way round, every parameter gets its own moments back."""
    wrapped = build_gpt(gpt_config("debug"), torch.device("cpu"), seed=0, activation_checkpointing=True)
    optimizer = torch.optim.AdamW(weight_decay_groups(wrapped, 0.1))
    wrapped(torch.randint(0, 256, (2, 8))).sum().backward()
    optimizer.step()
    names = parameter_names(wrapped)
    by_name = optimizer_state_by_name(optimizer.state_dict(), optimizer, names)
    plain = build_gpt(gpt_config("debug"), torch.device("cpu"), seed=0)
    assert set(by_name["state"]) == {name for name, _ in plain.named_parameters()}
    reversed_groups = [{**group, "params": group["params"][::-1]} for group in weight_decay_groups(plain, 0.1)]
    other = torch.optim.AdamW(reversed_groups)
    other.load_state_dict(optimizer_state_by_position(by_name, other, parameter_names(plain)))
    moments = {names[id(param)]: state["exp_avg"] for param, state in optimizer.state.items()}
    for name, param in plain.named_parameters():
        assert torch.equal(other.state[param]["exp_avg"], moments[name]), name
