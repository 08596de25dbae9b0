"""One command surface: ``cohort --help`` describes Cohort and lists every command with its line, each command
answers its own ``--help``, ``cohort prepare`` prepares data, and an unknown command gets one line naming the
known ones."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from app.__main__ import main
from app.commands import COMMANDS, LIGHTNING_COMMANDS, help_text
from tests.helpers import REPO_ROOT, one_line_error

EVERY_COMMAND = ["fit", "validate", "test", "predict", "prepare", "doctor", "comm", "consolidate"]


def without_spaces(text: str) -> str:
    """``text`` with no whitespace, to find a sentence in help that argparse has wrapped at any width."""
    return "".join(text.split())


@pytest.mark.parametrize("args", [[], ["-h"], ["--help"]], ids=["no-arguments", "-h", "--help"])
def test_help_describes_cohort_and_lists_every_command(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    main(args)
    printed = capsys.readouterr().out
    assert printed.startswith("usage: cohort COMMAND") and "Cohort trains GPT language models" in printed
    listed = re.findall(r"^  (\w+) +(.+)$", printed, re.MULTILINE)
    assert listed == [(command, COMMANDS[command]) for command in EVERY_COMMAND]


@pytest.mark.slow
def test_python_m_app_help_answers_without_loading_torch(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "app", "--help"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == help_text() + "\n"
    assert not re.search(r"\| +torch$", result.stderr, re.MULTILINE)  # -X importtime names each module imported


@pytest.mark.parametrize("command", EVERY_COMMAND)
def test_each_command_answers_its_own_help(command: str, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["cohort"])
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert printed.startswith("usage: cohort") and f"cohort {command}" in " ".join(printed.split())
    if command in (*LIGHTNING_COMMANDS, "doctor"):  # LightningCLI's parsers: Cohort's words, not the Trainer's
        assert without_spaces(COMMANDS[command]) in without_spaces(printed)


def test_an_unknown_command_gets_one_line_naming_the_known_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    message = one_line_error(["trian", "-c", "configs/quickstart.yaml"], monkeypatch)
    assert "unknown command 'trian'" in message and all(command in message for command in EVERY_COMMAND)


def test_prepare_writes_token_files_and_says_how_to_train_on_them(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello, tokens\n" * 100)
    main(["prepare", str(text), "--out", str(tmp_path / "out"), "--val-fraction", "0.1"])
    assert f"--data.data_dir {tmp_path / 'out'} --data.vocab_size 256" in capsys.readouterr().out
    train, val = (np.fromfile(tmp_path / "out" / name, dtype="<u2") for name in ("train.bin", "val.bin"))
    assert bytes(np.concatenate([train, val]).astype(np.uint8)) == text.read_bytes() and len(val) == 140


def test_prepare_names_a_missing_input_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    message = one_line_error(["prepare", str(tmp_path / "nope"), "--out", str(tmp_path / "out")], monkeypatch)
    assert f"input {tmp_path / 'nope'} does not exist" in message
    assert not (tmp_path / "out").exists()
