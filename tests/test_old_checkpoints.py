"""A run written before the model families had folders of their own still loads, resumes and exports: its checkpoint
and config.yaml name the classes by the paths they had then (models.language_model.GPTLanguageModel).

The old run is made by the old code itself: main at afed102, taken from this clone's history (``git archive``), trains
one step of the debug GPT (bf16-true, as a user's run would be written) and its checkpoint and config.yaml are what the
tests read. A clone without that commit (a shallow one) skips them, saying how to get it.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
import torch
from safetensors.torch import load_file

from app.__main__ import main
from models.class_paths import with_current_class_paths
from models.gpt.family import GPTLanguageModel
from models.module import class_path_of
from tests.helpers import REPO_ROOT, fit_in_process, last_checkpoint, run_in_process

OLD_MAIN = "afed102"  # main before the families moved into models/<family>/
OLD_RUN = ["--trainer.accelerator", "cpu", "--trainer.precision", "bf16-true", "--model.model_name", "debug",
           "--data.sequence_length", "16", "--data.global_batch_size", "2", "--data.micro_batch_size", "2"]


@pytest.fixture(scope="module")
def old_run(tmp_path_factory: pytest.TempPathFactory, byte_corpus: Path) -> tuple[Path, Path]:
    """The checkpoint and config.yaml of one step of the debug GPT, written by main at afed102's own code."""
    found = subprocess.run(["git", "-C", str(REPO_ROOT), "cat-file", "-e", f"{OLD_MAIN}^{{commit}}"],
                           capture_output=True)
    if found.returncode != 0:
        pytest.skip(f"this clone lacks commit {OLD_MAIN}, whose code writes the old run: `git fetch --unshallow`")
    root = tmp_path_factory.mktemp("before_family_folders")
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", OLD_MAIN], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(root / "source", filter="data")
    subprocess.run([sys.executable, "-m", "app", "fit", *OLD_RUN, "--data.data_dir", str(byte_corpus),
                    "--trainer.max_steps", "1", "--trainer.limit_val_batches", "1"],
                   cwd=root, env={**os.environ, "PYTHONPATH": str(root / "source")}, capture_output=True, check=True)
    version = root / "lightning_logs" / "version_0"
    return next((version / "checkpoints").glob("*.ckpt")), version / "config.yaml"


def test_the_old_run_is_of_the_old_paths(old_run: tuple[Path, Path]) -> None:
    """What the other tests rely on: the files name the class by its path before the move."""
    checkpoint, saved_config = old_run
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert saved["cohort_model_class"] == "models.language_model.GPTLanguageModel"
    assert saved["hyper_parameters"]["_class_path"] == "models.language_model.GPTLanguageModel"
    assert "class_path: models.language_model.GPTLanguageModel" in saved_config.read_text()


@pytest.mark.parametrize("config", ["saved config.yaml", "new config"])
def test_an_old_checkpoint_resumes(tmp_path: Path, byte_corpus: Path, old_run: tuple[Path, Path],
                                   config: str) -> None:
    """One more step from the old checkpoint, with the config.yaml it was written with (old class paths) or with
    arguments that name no class (today's default path); the new checkpoint records today's path."""
    checkpoint, saved_config = old_run
    chosen = ["-c", str(saved_config)] if config == "saved config.yaml" else OLD_RUN
    run = fit_in_process(tmp_path / "run", [*chosen, "--data.data_dir", str(byte_corpus), "--trainer.max_steps", "2",
                                            "--trainer.limit_val_batches", "1", "--ckpt_path", str(checkpoint)])
    resumed = torch.load(last_checkpoint(run), map_location="cpu", weights_only=True)
    assert resumed["global_step"] == 2
    assert resumed["cohort_model_class"] == class_path_of(GPTLanguageModel)


def test_an_old_checkpoint_loads_outside_fit(old_run: tuple[Path, Path]) -> None:
    checkpoint = old_run[0]
    model = GPTLanguageModel.load_from_checkpoint(checkpoint)
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    assert model.state_dict().keys() == saved.keys()
    assert all(torch.equal(model.state_dict()[name], saved[name]) for name in saved)


def test_an_old_checkpoint_exports(tmp_path: Path, old_run: tuple[Path, Path]) -> None:
    checkpoint = old_run[0]
    main(["export", str(checkpoint), "--out", str(tmp_path / "gpt2")])
    config = json.loads((tmp_path / "gpt2/config.json").read_text())
    weights = load_file(tmp_path / "gpt2/model.safetensors")
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    assert (config["model_type"], config["n_layer"], config["n_embd"]) == ("gpt2", 2, 32)
    assert torch.equal(weights["transformer.wte.weight"], saved["model.wte.weight"])


def test_an_old_class_path_on_the_command_line_is_read_as_today(capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["fit", "--model", "models.masked_language_model.BertMaskedLanguageModel", "--model.model_name", "bert-tiny",
            "--data.data_dir", "corpus", "--data.sequence_length", "64", "--print_config"]
    with pytest.raises(SystemExit) as exit_info:
        run_in_process(args, monkeypatch)
    assert exit_info.value.code in (0, None)
    assert yaml.safe_load(capsys.readouterr().out)["model"]["class_path"] == "models.bert.family.BertMaskedLanguageModel"


def test_only_whole_old_paths_are_replaced() -> None:
    assert with_current_class_paths("[models.gpt.Block, models.gpt.BlockOfMine, my.models.gpt.Block]") == (
        "[models.gpt.network.Block, models.gpt.BlockOfMine, my.models.gpt.Block]")
