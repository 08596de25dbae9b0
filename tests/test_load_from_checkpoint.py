"""A trained model is usable outside ``fit``: ``GPTLanguageModel.load_from_checkpoint`` in a plain Python process
(no Trainer) loads a file checkpoint (one process; DDP writes the same file) or a sharded run's folder after
``cohort consolidate``, and generates exactly the text that ``cohort predict`` generates from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.__main__ import main
from app.safety.checkpoint_reading import consolidate
from tests.helpers import QUIET, REPO_ROOT, fit, fit_in_process, last_checkpoint

pytestmark = pytest.mark.slow

MODEL_PARALLEL = ["-c", str(REPO_ROOT / "configs/trainer/model_parallel_cpu.yaml")]  # FSDP2 on 2 processes
LAYOUTS = {"one_process": [], "fsdp2": MODEL_PARALLEL}
PROMPT = "def fibonacci(n):\n"

# what a user would write, for each checkpoint named; prints the text and whether every weight is the checkpoint's
LOAD_AND_GENERATE = """
import json, sys, torch
from models.gpt.family import GPTLanguageModel
prompt = torch.tensor([list(sys.argv[1].encode())])
for path in sys.argv[2:]:
    model = GPTLanguageModel.load_from_checkpoint(path)
    saved = torch.load(path, weights_only=True)["state_dict"]
    loaded = model.state_dict()
    same = loaded.keys() == saved.keys() and all(torch.equal(loaded[name], saved[name]) for name in saved)
    print(json.dumps({"text": model.generate_text(prompt), "weights_equal": same}))
"""


@pytest.fixture(scope="module")
def run_args(debug_run_args: list[str]) -> list[str]:
    """3 optimizer steps of the debug model, no validation."""
    return [*debug_run_args, "--trainer.max_steps", "3", "--model.max_new_tokens", "24",
            "--data.prompts", json.dumps([PROMPT])]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, run_args: list[str]) -> dict[str, Path]:
    """Layout -> the file checkpoint of a finished run: last.ckpt, or FSDP2's folder consolidated."""
    files = {}
    for layout, placement in LAYOUTS.items():
        runner = fit_in_process if layout == "one_process" else fit
        path = last_checkpoint(runner(tmp_path_factory.mktemp(layout), run_args, *placement))
        assert path.is_dir() == (layout == "fsdp2")  # sharded: a folder, one file per rank
        if path.is_dir():
            consolidate(path, path.with_name("last.consolidated.ckpt"))  # what `cohort consolidate` does
            path = path.with_name("last.consolidated.ckpt")
        files[layout] = path
    return files


@pytest.fixture(scope="module")
def loaded(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Layout -> what LOAD_AND_GENERATE printed for its checkpoint, all in one fresh Python process."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-c", LOAD_AND_GENERATE, PROMPT, *map(str, checkpoints.values())],
                            cwd=tmp_path_factory.mktemp("python"), env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(zip(checkpoints, map(json.loads, result.stdout.strip().splitlines()), strict=True))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_load_from_checkpoint_generates_what_predict_generates(
    layout: str, checkpoints: dict[str, Path], loaded: dict[str, dict], run_args: list[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    assert loaded[layout]["weights_equal"]
    monkeypatch.chdir(tmp_path)  # predict's own lightning_logs
    monkeypatch.setattr(sys, "argv", ["cohort"])
    main(["predict", *run_args, *QUIET, "--ckpt_path", str(checkpoints[layout])])
    printed = capsys.readouterr().out  # app/cli/samples.py PrintPredictions: the header, the prompt, its continuation
    assert printed == f"--- prompt 0 (rank 0) ---\n{PROMPT}{loaded[layout]['text']}\n"
