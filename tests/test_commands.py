"""One command surface: ``cohort --help`` describes Cohort and lists every command with its line, each command
answers its own ``--help``, ``cohort prepare`` prepares data (bytes or a tokenizer.json, split so that validation
gets data or nothing is written, the same with any number of workers), and an unknown command gets one line naming
the known ones."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from app.__main__ import main
from app.cli.commands import COMMANDS, LIGHTNING_COMMANDS, help_text
from tests.helpers import REPO_ROOT, one_line_error

EVERY_COMMAND = ["fit", "validate", "test", "predict", "prepare", "doctor", "plan", "comm", "consolidate", "export"]


def without_spaces(text: str) -> str:
    """``text`` with no whitespace, to find a sentence in help that argparse has wrapped at any width."""
    return "".join(text.split())


@pytest.mark.parametrize("args", [[], ["-h"], ["--help"]], ids=["no-arguments", "-h", "--help"])
def test_help_describes_cohort_and_lists_every_command(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    main(args)
    printed = capsys.readouterr().out
    assert printed.startswith("usage: cohort COMMAND") and "Cohort trains language models and image classifiers" in printed
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


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_prepare_writes_its_files_as_the_umask_allows(umask: int, tmp_path: Path) -> None:
    """As `cohort export` and open() do: readable by the group and others under 022, by the owner alone under 077."""
    text = tmp_path / "notes.txt"
    text.write_text("hello, tokens\n" * 100)
    previous = os.umask(umask)
    try:
        main(["prepare", str(text), "--out", str(tmp_path / "out"), "--val-fraction", "0.1"])
    finally:
        os.umask(previous)
    modes = {path.name: path.stat().st_mode & 0o777 for path in (tmp_path / "out").iterdir()}
    assert modes == dict.fromkeys(("train.bin", "val.bin", "meta.json"), 0o666 & ~umask)


def test_prepare_names_a_missing_input_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    message = one_line_error(["prepare", str(tmp_path / "nope"), "--out", str(tmp_path / "out")], monkeypatch)
    assert f"input {tmp_path / 'nope'} does not exist" in message
    assert not (tmp_path / "out").exists()


def tokenizer_file(folder: Path) -> Path:
    """A byte-level BPE tokenizer.json (GPT-2's kind, at a toy size) trained on a few strings."""
    tokenizers = pytest.importorskip("tokenizers",
                                     reason="the tokenizers package is not installed: pip install -e '.[tokenizers]'")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()  # every byte, so any text encodes
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(["the cat sat on the mat", "a dog ate the bone", "café au lait"], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def text_folder(folder: Path, num_files: int, lines: int = 20) -> list[str]:
    """``num_files`` text files of ``lines`` lines each in ``folder``; returns their texts in sorted order."""
    folder.mkdir()
    texts = [f"file {i}: the cat sat on the mat, café {i}\n" * lines for i in range(num_files)]
    for i, text in enumerate(texts):
        (folder / f"{i:02}.txt").write_text(text)
    return texts


def prepared(folder: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """train.bin, val.bin (uint16) and meta.json as ``cohort prepare`` wrote them into ``folder``."""
    train, val = (np.fromfile(folder / name, dtype="<u2") for name in ("train.bin", "val.bin"))
    return train, val, json.loads((folder / "meta.json").read_text())


def test_prepare_with_a_tokenizer_file_writes_ids_that_decode_back(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = tokenizer_file(tmp_path)
    texts = text_folder(tmp_path / "texts", 3)
    main(["prepare", str(tmp_path / "texts"), "--out", str(tmp_path / "out"), "--tokenizer", str(path),
          "--workers", "1", "--sequence-length", "16"])
    printed = capsys.readouterr()
    train, val, meta = prepared(tmp_path / "out")
    tokenizer = pytest.importorskip("tokenizers").Tokenizer.from_file(str(path))
    assert tokenizer.decode(np.concatenate([train, val]).tolist()) == "\n".join(texts)  # train, then val
    assert len(val) == len(train) + len(val) - int((len(train) + len(val)) * 0.95)  # the last 5% of the tokens
    vocab_size = tokenizer.get_vocab_size()
    assert meta == {"tokenizer": "tokenizer.json", "tokenizer_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                    "vocab_size": vocab_size, "dtype": "uint16", "train_tokens": len(train), "val_tokens": len(val),
                    "files": 3, "split": "last tokens", "val_fraction": 0.05}
    assert f"--data.vocab_size {vocab_size}" in printed.out
    assert f"encoded 3/3 files, {len(train) + len(val):,} tokens\n" in printed.err  # progress: plain lines, no TTY


def test_prepare_gives_a_folder_of_five_files_validation_data(tmp_path: Path) -> None:
    """Too few files for every 20th to go to val.bin: the last 5% of the tokens does."""
    texts = text_folder(tmp_path / "texts", 5)
    main(["prepare", str(tmp_path / "texts"), "--out", str(tmp_path / "out"), "--workers", "1"])
    train, val, meta = prepared(tmp_path / "out")
    assert len(val) >= 129 and meta["split"] == "last tokens"
    assert bytes(np.concatenate([train, val]).astype(np.uint8)) == "\n".join(texts).encode()


def test_prepare_splits_enough_files_as_whole_files(tmp_path: Path) -> None:
    texts = text_folder(tmp_path / "texts", 20)
    main(["prepare", str(tmp_path / "texts"), "--out", str(tmp_path / "out"), "--workers", "1"])
    train, val, meta = prepared(tmp_path / "out")
    assert bytes(val.astype(np.uint8)) == texts[19].encode() and meta["split"] == "whole files"
    assert bytes(train.astype(np.uint8)) == "\n".join(texts[:19]).encode()


def test_prepare_refuses_too_little_text_in_one_line_and_keeps_what_was_there(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    text_folder(tmp_path / "texts", 5)
    main(["prepare", str(tmp_path / "texts"), "--out", str(tmp_path / "out"), "--workers", "1"])
    before = {path.name: path.read_bytes() for path in (tmp_path / "out").iterdir()}
    (tmp_path / "small.txt").write_text("print('hello')\n" * 40)  # 600 bytes: 30 for validation
    for out in (tmp_path / "out", tmp_path / "new"):
        message = one_line_error(["prepare", str(tmp_path / "small.txt"), "--out", str(out)], monkeypatch)
        assert "val.bin would hold 30 tokens" in message and "--sequence-length 128 + 1 = 129" in message
    assert {path.name: path.read_bytes() for path in (tmp_path / "out").iterdir()} == before
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
@pytest.mark.parametrize("tokenizer", [False, True], ids=["bytes", "tokenizer.json"])
def test_prepare_with_two_workers_writes_what_one_does(tokenizer: bool, tmp_path: Path) -> None:
    text_folder(tmp_path / "texts", 30, lines=5)  # whole files, and more files than the workers hold at once
    options = ["--tokenizer", str(tokenizer_file(tmp_path)), "--sequence-length", "16"] if tokenizer else []
    written = []
    for workers in ("1", "2"):
        out = tmp_path / f"out{workers}"
        main(["prepare", str(tmp_path / "texts"), "--out", str(out), "--workers", workers, *options])
        written.append({name: (out / name).read_bytes() for name in ("train.bin", "val.bin", "meta.json")})
    assert written[0] == written[1]


def test_prepare_without_the_tokenizers_package_says_how_to_install_it(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers then fails, as when not installed
    (tmp_path / "tokenizer.json").write_text("{}")
    message = one_line_error(["prepare", "--out", str(tmp_path / "out"), "--tokenizer",
                              str(tmp_path / "tokenizer.json")], monkeypatch)
    assert "pip install -e '.[tokenizers]'" in message and not (tmp_path / "out").exists()
