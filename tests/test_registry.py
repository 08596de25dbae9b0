"""models/registry.py: one record per family, each family in its own folder, and what lists or looks up families
reads the records: a family added is one folder and one line there."""

from __future__ import annotations

import ast
import re
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
    assert [(family.name, family.model_types) for family in EXPORTED] == [
        ("gpt", ("gpt2",)), ("llama", ("llama",)), ("moe", ("mixtral", "qwen3_moe")), ("bert", ("bert",))]
    assert family_named("resnet").huggingface is None and family_named("resnet").model_types == ()
    assert labels(EXPORTED, "or") == "GPT, Llama, MoE or BERT"


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


# Where a family may be named: its folder, the registry and the class paths that moved. Everything else reads the
# registry, so a family added or renamed is changed in one place.
FAMILY_HOMES = [*(f"models/{family.name}/" for family in FAMILIES), "models/registry.py", "models/class_paths.py"]
# named, commented exceptions: a file that names a family anyway, and why
NAMED_ANYWAY = {
    # imports nothing, so that `cohort --help` loads no torch: it cannot read the registry. Its export line is held to
    # the registry by test_the_command_overview_names_the_families_export_writes; its test and predict lines say
    # "a GPT checkpoint"
    "app/cli/commands.py",
}

# how code names a family: its modules, the classes its folder defines, its label and its name
FAMILY_MODULES = re.compile(r"\bmodels\.(" + "|".join(family.name for family in FAMILIES) + r")\b")
FAMILY_CLASSES = {node.name for family in FAMILIES for path in (REPO_ROOT / "models" / family.name).rglob("*.py")
                  for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)}
FAMILY_LABELS = re.compile(r"\b(" + "|".join(family.label for family in FAMILIES) + r")\b")
FAMILY_NAMES = {family.name for family in FAMILIES}


def family_names_in(source: str) -> list[str]:
    """Where ``source`` names a family, one line each: an import of a family's modules, a class defined in a
    family's folder, or a string (not a docstring: prose may mention GPT) holding a family's module path, name or
    label ("GPT", or "gpt" as the whole string: Hugging Face's tensor names, "bert.pooler.", are not a family's).
    Comments are not code and are not read."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and ast.get_docstring(node, clean=False) is not None}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named = [alias.name for alias in node.names if FAMILY_MODULES.search(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            named = [f"{node.module}.{alias.name}" for alias in node.names
                     if FAMILY_MODULES.search(f"{node.module}.{alias.name}") or alias.name in FAMILY_CLASSES]
        elif isinstance(node, ast.Name):
            named = [node.id] if node.id in FAMILY_CLASSES else []
        elif isinstance(node, ast.Attribute):
            named = [node.attr] if node.attr in FAMILY_CLASSES else []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value
            named = [repr(text)] if (FAMILY_MODULES.search(text) or FAMILY_LABELS.search(text)
                                     or text in FAMILY_NAMES) else []
        else:
            named = []
        found += [f"line {node.lineno}: {name}" for name in named]
    return found


def test_no_family_is_named_outside_its_folder_and_the_registry() -> None:
    assert family_names_in("from models.gpt.family import GPTLanguageModel\nx = GPT\ny = 'a Llama run'\n"
                           "z = registry.family_named('bert')") == [
        "line 1: models.gpt.family.GPTLanguageModel", "line 2: GPT", "line 3: 'a Llama run'", "line 4: 'bert'"]
    assert family_names_in('"""a docstring may say GPT"""\nx = 1  # and so may a comment: BERT') == []
    sources = sorted(path.relative_to(REPO_ROOT).as_posix() for package in ("app", "core", "datamodules", "models")
                     for path in (REPO_ROOT / package).rglob("*.py"))
    outside = [source for source in sources if not source.startswith(tuple(FAMILY_HOMES))]
    assert "app/cli/lightning_cli.py" in outside and NAMED_ANYWAY <= set(outside)
    naming = {source: found for source in outside if source not in NAMED_ANYWAY
              and (found := family_names_in((REPO_ROOT / source).read_text()))}
    assert not naming, f"families named outside models/<family>/ and models/registry.py: {naming}"


def test_the_readme_lists_the_registered_families_in_order() -> None:
    """README's table of model families names each family by its class path, as the registry does, in its order."""
    section = (REPO_ROOT / "README.md").read_text().split(" model families\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| [^|`]*\(`([\w.]+)`\) \|", section, flags=re.MULTILINE)
    assert rows == [family.class_path for family in FAMILIES]
