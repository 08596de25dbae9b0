"""Damaged or misplaced inputs to the newer commands and features stop in one line that names the file, as the
checks in test_cli_errors.py do for a run's config, data and checkpoint: a Hugging Face folder whose files are cut
short or are not what their names say (--model.init_from), a model family that defines none of what a family
must, and output paths of cohort export, consolidate and prepare that cannot be written, all before any work."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from core.errors import UserError
from models.interchange import HuggingFaceFolder
from models.llama.huggingface import LLAMA_HUGGING_FACE
from models.module import CohortModule
from tests.helpers import CONFIG_DIR, QUIET, one_line_error, run_folders
from tests.test_pretrained import DEBUG, write_llama_folder


def cut_short(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])  # a download that stopped halfway


def weights(folder: Path) -> Path:
    return folder / "model.safetensors"


@pytest.mark.parametrize("damage, expected", [
    (lambda folder: cut_short(weights(folder)), "model.safetensors is damaged or not a safetensors file"),
    (lambda folder: weights(folder).write_bytes(b"\xff" * 100 + weights(folder).read_bytes()[100:]),
     "model.safetensors is damaged or not a safetensors file (Error while deserializing header"),
    (lambda folder: weights(folder).write_text("version https://git-lfs.github.com/spec/v1\n"),  # an LFS pointer
     "model.safetensors is damaged or not a safetensors file"),
    (lambda folder: cut_short(folder / "config.json"), "config.json is not valid JSON"),
    (lambda folder: (folder / "config.json").write_text("[]"), "config.json holds a list, not the JSON object"),
    (lambda folder: (folder / "config.json").write_text(json.dumps({"model_type": "llama"})),
     "its config.json lacks, or has no number for, a setting the model is built from (KeyError: 'hidden_size')"),
    (lambda folder: (folder / "model.safetensors.index.json").write_text('{"weight_map": {'),
     "model.safetensors.index.json is not valid JSON"),
    (lambda folder: (folder / "model.safetensors.index.json").write_text("{}"),
     "model.safetensors.index.json has no weight_map"),
], ids=["weights-cut-short", "weights-garbage-header", "weights-lfs-pointer", "config-cut-short", "config-not-object",
        "config-without-sizes", "index-cut-short", "index-without-map"])
def test_a_damaged_hugging_face_folder_is_refused_in_one_line(damage: Callable[[Path], None], expected: str,
                                                              tmp_path: Path) -> None:
    folder = tmp_path / "llama"
    write_llama_folder(folder)
    damage(folder)
    with pytest.raises(UserError) as error:
        LLAMA_HUGGING_FACE.check_pretrained(HuggingFaceFolder(folder), DEBUG, "debug")
    assert f"model.init_from={folder}" in str(error.value) and expected in str(error.value), str(error.value)
    assert "\n" not in str(error.value)


def test_the_command_refuses_damaged_weights_before_it_starts(tmp_path: Path, byte_corpus: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    write_llama_folder(tmp_path / "llama")
    cut_short(weights(tmp_path / "llama"))
    monkeypatch.chdir(tmp_path)
    refusal = one_line_error(["fit", "-c", str(CONFIG_DIR / "llama-small/pretrain.yaml"), *QUIET, "--model.model_name",
                              "debug", "--data.data_dir", str(byte_corpus), "--data.sequence_length", "64",
                              "--model.init_from", str(tmp_path / "llama")], monkeypatch)
    assert "model.safetensors is damaged or not a safetensors file" in refusal, refusal
    assert run_folders(tmp_path) == []


def test_a_family_that_defines_none_of_its_methods_is_named(tmp_path: Path, debug_run_args: list[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    refusal = one_line_error(["fit", *debug_run_args, *QUIET, "--trainer.max_steps", "1", "--model",
                              "tests.test_damaged_inputs.FamilyOfNothing"], monkeypatch)
    assert "the model family tests.test_damaged_inputs.FamilyOfNothing defines no plain_network and no batch_loss" \
        in refusal, refusal


class FamilyOfNothing(CohortModule):
    """A family that says neither how to build its network nor what its loss is."""


@pytest.mark.parametrize("command", [
    ["export", "any.ckpt", "--out", "a_file/hf"],
    ["consolidate", "any.ckpt", "a_file/full.ckpt"],
    ["prepare", "--out", "a_file/data"],
], ids=["export", "consolidate", "prepare"])
def test_an_output_under_a_file_is_refused_before_any_work(command: list[str], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a_file").write_text("")
    monkeypatch.chdir(tmp_path)
    refusal = one_line_error(command, monkeypatch)
    assert "cannot be made: a_file is a file, not a folder" in refusal, refusal


@pytest.mark.parametrize("command, expected", [
    (["export", "any.ckpt"], "cohort export: the following arguments are required: --out"),
    (["consolidate"], "cohort consolidate: the following arguments are required: checkpoint"),
    (["prepare", "--out", "data", "--workers", "many"], "cohort prepare: argument --workers: invalid int value"),
    (["consolidate", "any.ckpt", "."], "the output . is a folder: name the file to write"),
    (["comm", "--iterations", "many"], "cohort comm: argument --iterations: invalid int value"),
    (["comm", "--operations", "broadcast"], "cohort comm: argument --operations: invalid choice: 'broadcast'"),
], ids=["export-without-out", "consolidate-without-checkpoint", "prepare-workers-not-a-number",
        "consolidate-into-a-folder", "comm-iterations-not-a-number", "comm-unknown-operation"])
def test_what_the_own_commands_refuse_is_one_line(command: list[str], expected: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Instead of argparse's usage and error (exit 2)."""
    monkeypatch.chdir(tmp_path)
    assert expected in one_line_error(command, monkeypatch)
