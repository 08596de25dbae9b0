"""A run written before the model families had folders of their own still loads, resumes and exports: its checkpoint
and config.yaml name the classes by the paths they had then (models.language_model.GPTLanguageModel).

tests/data/before_family_folders/ holds what main at afed102 wrote for one step of the debug GPT (bf16-true, so the
file stays small):

    cohort fit --trainer.accelerator cpu --trainer.precision bf16-true --trainer.max_steps 1
        --trainer.limit_val_batches 1 --model.model_name debug --data.data_dir CORPUS --data.sequence_length 16
        --data.global_batch_size 2 --data.micro_batch_size 2

with CORPUS the byte_corpus fixture's files; config.yaml is the one that run wrote beside its checkpoints.
"""

from __future__ import annotations

import json
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

BEFORE = REPO_ROOT / "tests/data/before_family_folders"
CHECKPOINT, CONFIG = BEFORE / "gpt-debug-step1.ckpt", BEFORE / "config.yaml"


def test_the_old_run_is_of_the_old_paths() -> None:
    """What the other tests rely on: the files name the class by its path before the move."""
    saved = torch.load(CHECKPOINT, map_location="cpu", weights_only=True)
    assert saved["cohort_model_class"] == "models.language_model.GPTLanguageModel"
    assert saved["hyper_parameters"]["_class_path"] == "models.language_model.GPTLanguageModel"
    assert "class_path: models.language_model.GPTLanguageModel" in CONFIG.read_text()


@pytest.mark.parametrize("config", ["saved config.yaml", "new config"])
def test_an_old_checkpoint_resumes(tmp_path: Path, byte_corpus: Path, config: str) -> None:
    """One more step from the old checkpoint, with the config.yaml it was written with (old class paths) or with
    arguments that name no class (today's default path); the new checkpoint records today's path."""
    chosen = ["-c", str(CONFIG)] if config == "saved config.yaml" else [
        "--trainer.accelerator", "cpu", "--trainer.precision", "bf16-true", "--model.model_name", "debug",
        "--data.sequence_length", "16", "--data.global_batch_size", "2", "--data.micro_batch_size", "2"]
    run = fit_in_process(tmp_path / "run", [*chosen, "--data.data_dir", str(byte_corpus), "--trainer.max_steps", "2",
                                            "--trainer.limit_val_batches", "1", "--ckpt_path", str(CHECKPOINT)])
    resumed = torch.load(last_checkpoint(run), map_location="cpu", weights_only=True)
    assert resumed["global_step"] == 2
    assert resumed["cohort_model_class"] == class_path_of(GPTLanguageModel)


def test_an_old_checkpoint_loads_outside_fit() -> None:
    model = GPTLanguageModel.load_from_checkpoint(CHECKPOINT)
    saved = torch.load(CHECKPOINT, map_location="cpu", weights_only=True)["state_dict"]
    assert model.state_dict().keys() == saved.keys()
    assert all(torch.equal(model.state_dict()[name], saved[name]) for name in saved)


def test_an_old_checkpoint_exports(tmp_path: Path) -> None:
    main(["export", str(CHECKPOINT), "--out", str(tmp_path / "gpt2")])
    config = json.loads((tmp_path / "gpt2/config.json").read_text())
    weights = load_file(tmp_path / "gpt2/model.safetensors")
    saved = torch.load(CHECKPOINT, map_location="cpu", weights_only=True)["state_dict"]
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
