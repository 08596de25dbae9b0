"""models/registry.py: one record per family, each family in its own folder, and what lists or looks up families
reads the records: a family added is one folder and one line there."""

from __future__ import annotations

import pytest
import yaml

from app.cli.commands import COMMANDS
from models.module import CohortModule
from models.registry import EXPORTED, FAMILIES, families_help, family_named, family_of, labels
from tests.helpers import CONFIG_DIR, REPO_ROOT, one_line_error, run_in_process


def test_each_family_is_a_folder_of_its_own_with_one_record() -> None:
    folders = sorted(path.parent.name for path in (REPO_ROOT / "models").glob("*/family.py"))
    assert sorted(family.name for family in FAMILIES) == folders
    for family in FAMILIES:
        assert issubclass(family.module_class, CohortModule)
        assert family.module_class.__module__ == f"models.{family.name}.family"
        assert family_named(family.name) is family and family_of(family.class_path) is family


def test_the_families_that_read_and_write_hugging_face_folders() -> None:
    assert [(family.name, family.model_type) for family in EXPORTED] == [
        ("gpt", "gpt2"), ("llama", "llama"), ("bert", "bert")]
    assert family_named("resnet").huggingface is None and family_named("resnet").model_type is None
    assert labels(EXPORTED, "or") == "GPT, Llama or BERT"


def test_an_old_class_path_finds_its_family() -> None:
    assert family_of("models.masked_language_model.BertMaskedLanguageModel") is family_named("bert")
    assert family_of("my_models.Family") is None


def test_every_shipped_config_names_a_registered_family() -> None:
    named = {path.relative_to(CONFIG_DIR): yaml.safe_load(path.read_text()).get("model", {}).get("class_path")
             for path in CONFIG_DIR.rglob("*.yaml")}
    assert {class_path for class_path in named.values() if class_path} <= {family.class_path for family in FAMILIES}


def test_the_command_overview_names_the_families_export_writes() -> None:
    """commands.py imports nothing (``cohort --help`` loads no torch), so it cannot read the registry: held here."""
    assert f"write a {labels(EXPORTED, 'or')} checkpoint" in COMMANDS["export"]


def test_fit_help_lists_every_family(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit):
        run_in_process(["fit", "--help"], monkeypatch)
    printed = " ".join(capsys.readouterr().out.split())
    assert all(family.class_path in printed for family in FAMILIES) and families_help() in printed


def test_an_unknown_family_is_refused_naming_every_registered_one(monkeypatch: pytest.MonkeyPatch) -> None:
    message = one_line_error(["fit", "--model", "models.nope.Family", "--print_config"], monkeypatch)
    assert all(family.class_path in message for family in FAMILIES), message
