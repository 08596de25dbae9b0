"""Bad input gets one line that says what was wrong and what to do, no traceback, and nothing written.

The command itself (a subprocess, as a user runs it) is checked for a few bad inputs of different kinds; every
bad input's message is checked in this process, which is several times faster."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from datamodules.prepare import prepare_corpus
from tests.helpers import (
    CONFIG_DIR, DDP_2, ONE_STEP, QUIET, assert_one_line_error, assert_one_line_error_in_process, batch_sizes, fit,
    last_checkpoint, one_line_error, run_cohort, run_folders, run_in_process,
)


@pytest.fixture
def fit_args(debug_run_args: list[str]) -> list[str]:
    return ["fit", *debug_run_args, *QUIET, *ONE_STEP]


# Bad inputs: each makes what it needs in a folder and returns the flags that point at it and a part of the message
BadInput = Callable[[Path], tuple[list[str], str]]


def missing_data_dir(folder: Path) -> tuple[list[str], str]:
    return ["--data.data_dir", str(folder / "nope")], "does not exist"


def unreadable_token_file(folder: Path) -> tuple[list[str], str]:
    for split in ("train", "val"):
        np.zeros(1000, dtype="<u2").tofile(folder / f"{split}.bin")
    (folder / "train.bin").chmod(0)
    return ["--data.data_dir", str(folder)], "is not readable"


def token_file_with_partial_token(folder: Path) -> tuple[list[str], str]:
    np.zeros(1000, dtype="<u2").tofile(folder / "train.bin")
    (folder / "val.bin").write_bytes(b"\x00" * 1001)
    return ["--data.data_dir", str(folder)], "not a whole number"


def token_files_of_another_vocabulary(folder: Path) -> tuple[list[str], str]:
    (folder / "notes.txt").write_text("some notes\n" * 100)
    prepare_corpus([folder / "notes.txt"], folder / "data", sequence_length=8)  # bytes: vocabulary 256
    return ["--data.data_dir", str(folder / "data"), "--data.vocab_size", "300"], "set data.vocab_size 256"


def embedded_corpus_behind_a_broken_link(folder: Path) -> tuple[list[str], str]:
    (folder / "data").symlink_to(folder / "moved_away")  # data/ was a link to a disk that is gone
    return ["--data.data_dir", "null"], "data is a symbolic link to"


def non_dividing_batch_sizes(folder: Path) -> tuple[list[str], str]:
    return batch_sizes(10, 4), "data.global_batch_size=10 is not a multiple"


def unknown_model_name(folder: Path) -> tuple[list[str], str]:
    return ["--model.model_name", "gpt5"], "unknown model.model_name 'gpt5'"


def impossible_precision_for_the_cpu(folder: Path) -> tuple[list[str], str]:
    return ["--trainer.precision", "16-true"], "trainer.precision=16-true"


def gpu_asked_for_on_a_machine_without_one(folder: Path) -> tuple[list[str], str]:
    return ["--trainer.accelerator", "gpu"], "no CUDA GPU is visible"


def sequence_longer_than_the_model(folder: Path) -> tuple[list[str], str]:
    return ["--data.sequence_length", "65"], "exceeds the block_size 64"


def missing_checkpoint(folder: Path) -> tuple[list[str], str]:
    return ["--ckpt_path", str(folder / "x.ckpt")], "does not exist"


def corrupt_checkpoint(folder: Path) -> tuple[list[str], str]:
    (folder / "bad.ckpt").write_bytes(b"not a checkpoint")
    return ["--ckpt_path", str(folder / "bad.ckpt")], "not a torch checkpoint"


def incomplete_sharded_checkpoint(folder: Path) -> tuple[list[str], str]:
    (folder / "last.ckpt").mkdir()  # a folder, as model_parallel, pipeline and fsdp write, but without its shards
    return ["--ckpt_path", str(folder / "last.ckpt")], "is not a complete sharded checkpoint folder"


BAD_INPUTS = [
    missing_data_dir,
    pytest.param(unreadable_token_file, marks=pytest.mark.skipif(
        os.geteuid() == 0, reason="root reads any file, so an unreadable file cannot be made")),
    token_file_with_partial_token,
    token_files_of_another_vocabulary,
    embedded_corpus_behind_a_broken_link,
    non_dividing_batch_sizes,
    unknown_model_name,
    impossible_precision_for_the_cpu,
    pytest.param(gpu_asked_for_on_a_machine_without_one, marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="checks the no-GPU error")),
    sequence_longer_than_the_model,
    missing_checkpoint,
    corrupt_checkpoint,
    incomplete_sharded_checkpoint,
]


def input_name(bad_input: BadInput) -> str:
    return bad_input.__name__.replace("_", "-")


@pytest.mark.parametrize("bad_input", [missing_data_dir, non_dividing_batch_sizes, corrupt_checkpoint], ids=input_name)
def test_the_command_prints_one_line_without_a_traceback(bad_input: BadInput, fit_args: list[str],
                                                         tmp_path: Path) -> None:
    """The plumbing, as a user sees it: a data error, a batch-arithmetic error and a checkpoint error."""
    flags, expected = bad_input(tmp_path)
    assert_one_line_error([*fit_args, *flags], tmp_path, expected)


@pytest.mark.parametrize("bad_input", BAD_INPUTS, ids=input_name)
def test_bad_input_stops_in_one_line(bad_input: BadInput, fit_args: list[str], tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    flags, expected = bad_input(tmp_path)
    assert_one_line_error_in_process([*fit_args, *flags], tmp_path, expected, monkeypatch)


def test_checkpoint_of_another_model(tmp_path: Path, debug_run_args: list[str], fit_args: list[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    fit(tmp_path, [*debug_run_args, *ONE_STEP], "--checkpoint.every_n_train_steps", "1")  # a real checkpoint
    args = [*fit_args, "--model.model_name", "small", "--data.sequence_length", "64",
            "--ckpt_path", str(last_checkpoint(tmp_path))]
    assert_one_line_error_in_process(args, tmp_path, "was trained with model.model_name='debug'", monkeypatch)


@pytest.mark.parametrize("flags, expected", [
    (["--model.optimizer.learning_rate", "0"], "model.optimizer.learning_rate=0.0 must be > 0"),
    (["--model.optimizer.min_learning_rate_ratio", "1.5"], "model.optimizer.min_learning_rate_ratio=1.5 must be in [0, 1]"),
    (["--model.dropout", "1.0"], "model.dropout=1.0 must be in [0, 1)"),
    (["--model.dropout", "-0.1"], "model.dropout=-0.1 must be in [0, 1)"),
    (["--model.optimizer.weight_decay", "-0.1"], "model.optimizer.weight_decay=-0.1 must be >= 0"),
    (["--model.optimizer.betas", "[0.9, 1.0]"], "model.optimizer.betas=(0.9, 1.0) must be two numbers in [0, 1)"),
    (["--model.optimizer.warmup_steps", "-1"], "model.optimizer.warmup_steps=-1 must be >= 0"),
    (["--model.optimizer.lr_decay_steps", "0"], "model.optimizer.lr_decay_steps=0 must be > 0, or null for the whole run"),
    (["--model.temperature", "0"], "model.temperature=0.0 must be > 0"),
    (["--model.top_k", "0"], "model.top_k=0 must be >= 1, or null"),
    (["--data.num_workers", "-1"], "data.num_workers=-1 must be >= 0"),
    (["--preemption.grace_seconds", "0"], "preemption.grace_seconds=0.0 must be > 0"),
    (["--data.val_samples", "0"], "data.val_samples=0 must be a positive integer, or null"),
    (["--trainer.num_nodes", "2"], "trainer.num_nodes=2 but no launcher started this process"),
    (["--model", "models.gpt.network.GPT"],
     "model.class_path 'models.gpt.network.GPT' is not a model family Cohort can import"),
    (["--data", "datamodules.nope.Images"], "data.class_path 'datamodules.nope.Images' is not a datamodule"),
    (["--val_every_n_steps", "0"], "val_every_n_steps=0 must be at least 1"),
    (["--val_every_n_steps", "null", "--trainer.val_check_interval", "0"],
     "trainer.val_check_interval=0 must be at least 1"),
    (["--trainer.accelerator", "tpu"], "trainer.accelerator=tpu needs a package that is not installed"),
    (["--monitor.every_n_steps", "0"], "monitor.every_n_steps=0 must be >= 1, or null"),
    (["--monitor.straggler_factor", "0.5"], "monitor.straggler_factor=0.5 must be at least 1"),
    (["--trainer.strategy", "app.strategies.pipeline.NoSuchStrategy"],
     "trainer.strategy='app.strategies.pipeline.NoSuchStrategy' is neither a strategy Lightning knows by name"),
    (["-c", str(CONFIG_DIR / "trainer/pipeline_cpu.yaml"), "--trainer.strategy.init_args.pipeline_microbatches", "0"],
     "pipeline_microbatches=0 is fewer than the 2 pipeline stages"),
], ids=lambda value: value if isinstance(value, str) and value.startswith("--") else None)
def test_out_of_range_settings_stop_in_one_line(flags: list[str], expected: str, fit_args: list[str],
                                                tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert_one_line_error_in_process([*fit_args, *flags], tmp_path, expected, monkeypatch)


def test_predict_without_a_checkpoint_is_refused(debug_run_args: list[str], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Generating from random weights would print noise and exit 0."""
    assert_one_line_error_in_process(["predict", *debug_run_args, *QUIET], tmp_path,
                                     "predict continues prompts with trained weights: pass --ckpt_path", monkeypatch)


def test_predict_for_a_model_of_a_tokenizers_data_is_refused_before_its_checkpoint_is_read(
        debug_run_args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts become tokens byte by byte, which are not a tokenizer's; setting data.vocab_size 256 instead would
    only be refused by the token files and the checkpoint in turn: the advice is to generate elsewhere."""
    (tmp_path / "data").mkdir()
    for split in ("train", "val"):
        np.zeros(1000, dtype="<u2").tofile(tmp_path / "data" / f"{split}.bin")
    message = assert_one_line_error_in_process(
        ["predict", *debug_run_args, *QUIET, "--data.data_dir", str(tmp_path / "data"), "--data.vocab_size", "300",
         "--ckpt_path", str(tmp_path / "not_read.ckpt")], tmp_path, "not data.vocab_size=300", monkeypatch)
    assert "cohort export" in message and "set data.vocab_size" not in message, message


def test_a_launcher_that_started_other_processes_than_the_config_says(fit_args: list[str], tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"TORCHELASTIC_RUN_ID": "job", "RANK": "0", "GROUP_RANK": "0", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "4"}.items():  # what torchrun --nproc_per_node 4 sets
        monkeypatch.setenv(name, value)
    assert_one_line_error_in_process([*fit_args, "--trainer.devices", "1"], tmp_path,
                                     "torchrun started 4 processes but trainer.devices=1 x trainer.num_nodes=1 = 1",
                                     monkeypatch)


def test_torchrun_restarts_onto_its_shared_rendezvous_store_are_refused(fit_args: list[str], tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"TORCHELASTIC_RUN_ID": "none", "RANK": "0", "GROUP_RANK": "0", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "1", "TORCHELASTIC_MAX_RESTARTS": "1",
                        "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():  # torchrun --max-restarts 1, static rendezvous
        monkeypatch.setenv(name, value)
    assert_one_line_error_in_process(fit_args, tmp_path, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", monkeypatch)


def test_log_and_checkpoint_folders_that_cannot_be_made(fit_args: list[str], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a_file").write_text("")
    assert_one_line_error_in_process(
        [*fit_args, "--trainer.logger.init_args.save_dir", "a_file/logs"], tmp_path,
        "the log folder a_file/logs/lightning_logs cannot be made: a_file is a file, not a folder", monkeypatch)
    assert_one_line_error_in_process(
        [*fit_args, "--checkpoint.dirpath", "a_file"], tmp_path,
        "the checkpoint folder a_file cannot be made: a_file is a file, not a folder", monkeypatch)


@pytest.mark.parametrize("field, expected", [
    ("learning_rate: abc", "model.optimizer.learning_rate"),
    ("learnin_rate: 0.1", "unknown option model.optimizer.learnin_rate (did you mean model.optimizer.learning_rate?)"),
], ids=["wrong-type", "unknown-key"])
def test_a_yaml_value_of_the_wrong_type_or_an_unknown_key_is_named(field: str, expected: str, fit_args: list[str],
                                                                   tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """jsonargparse's reason, taken out of its report on the model's class, in one line before anything is built."""
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  optimizer:\n    {field}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        run_in_process([*fit_args, "-c", str(config)], monkeypatch)
    message = str(exit_info.value.code)
    assert message.startswith("cohort: error: ") and expected in message and "\n" not in message, message
    assert run_folders(tmp_path) == []


@pytest.mark.parametrize("flags, expected", [
    (["--trainer.max_stepz", "3"], "unknown option trainer.max_stepz (did you mean trainer.max_steps?)"),
    (["--val_every_n_stepz", "3"], "unknown option val_every_n_stepz (did you mean val_every_n_steps?)"),
    (["--checkpoint.every_n_train_stepz=3"],
     "unknown option checkpoint.every_n_train_stepz (did you mean checkpoint.every_n_train_steps?)"),
    (["--seed_everythin", "3"], "unknown option seed_everythin (did you mean seed_everything?)"),  # not a prefix
    (["--trainer.max_step", "3"], "unknown option trainer.max_step (did you mean trainer.max_steps?)"),
    (["--modell.dropout", "0.1"], "unknown option modell.dropout (did you mean model.dropout?)"),
    (["--model.dropoutt", "0.1"], "unknown option model.dropoutt (did you mean model.dropout?)"),
    (["-c", str(CONFIG_DIR / "trainer/ddp_cpu.yml")],
     f"the config file {CONFIG_DIR / 'trainer/ddp_cpu.yml'} (-c) does not exist (did you mean "
     f"{CONFIG_DIR / 'trainer/ddp_cpu.yaml'}?)"),
    (["--trainer.precision", "7"], "trainer.precision=7 is refused: Expected a typing.Literal"),
    (["--trainer.max_steps"], "argument --trainer.max_steps: expected one argument"),
    (["--trainer.callbacks+=nope.Nope"], "trainer.callbacks: the class_path 'nope.Nope' cannot be imported"),
    (["--trainer.strategy.init_args.timeoutt", "3"], "trainer.strategy.timeoutt=3 cannot be set"),
    (["-c", str(CONFIG_DIR / "trainer/ddp_cpu.yaml"), "--trainer.strategy.init_args.timeoutt", "3"],
     "unknown option trainer.strategy.timeoutt (did you mean trainer.strategy.timeout?)"),
], ids=lambda value: " ".join(value).replace(f"{CONFIG_DIR}/", "") if isinstance(value, list) else "")
def test_what_the_parser_refuses_is_one_line_naming_the_key(flags: list[str], expected: str, fit_args: list[str],
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Instead of the whole usage (a hundred lines) or a report of every type a union tried; a typo is answered
    with the nearest valid key."""
    assert_one_line_error_in_process([*fit_args, *flags], tmp_path, expected, monkeypatch)


@pytest.mark.parametrize("config, expected", [
    ("trainer:\n  max_stepz: 3\n", "unknown option trainer.max_stepz (did you mean trainer.max_steps?)"),
    ("val_every_n_stepz: 3\n", "unknown option val_every_n_stepz (did you mean val_every_n_steps?)"),
    ("trainer: [1\n", "a config file is not valid YAML"),
], ids=["trainer-key", "top-level-key", "not-yaml"])
def test_a_config_file_typo_is_one_line_naming_the_key(config: str, expected: str, fit_args: list[str],
                                                        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.yaml").write_text(config)
    assert_one_line_error_in_process([*fit_args, "-c", str(tmp_path / "config.yaml")], tmp_path, expected,
                                     monkeypatch)


def test_a_typo_from_the_command_is_one_line_without_the_usage(fit_args: list[str], tmp_path: Path) -> None:
    assert_one_line_error([*fit_args, "--trainer.max_stepz", "3"], tmp_path, "did you mean trainer.max_steps?")


@pytest.mark.parametrize("flags", [
    ["--trainer.devices", "-1"],
    ["-c", str(CONFIG_DIR / "trainer/ddp_gpu_bf16.yaml"), "--trainer.accelerator", "auto"],  # devices -1
], ids=["devices-1", "gpu-preset-accelerator-auto"])
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a run on the CPU says")
def test_devices_that_pick_gpus_on_the_cpu_are_one_line(flags: list[str], fit_args: list[str], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's would be a TypeError ("devices selected with CPUAccelerator should be an int > 0")."""
    assert_one_line_error_in_process([*fit_args, *flags], tmp_path, "trainer.devices=-1 picks GPUs, but this run is "
                                     "on the CPU", monkeypatch)


def test_fast_dev_run_runs_one_batch_of_each_and_writes_nothing(fit_args: list[str], tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's fast_dev_run validates after its one batch; val_every_n_steps (several batches) would make
    Lightning refuse it in a traceback."""
    monkeypatch.chdir(tmp_path)
    run_in_process([*fit_args, "--val_every_n_steps", "2", "--trainer.fast_dev_run", "true"], monkeypatch)
    assert run_folders(tmp_path) == []


def test_validation_less_often_than_once_an_epoch_is_one_line(fit_args: list[str], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning, validating per epoch, refuses an interval longer than the epoch in a traceback, once the data
    is loaded (so after the run folder is made)."""
    monkeypatch.chdir(tmp_path)
    message = one_line_error([*fit_args, "--trainer.limit_train_batches", "8", "--val_every_n_steps", "100"],
                             monkeypatch)
    assert "val_every_n_steps=100 is 400 micro-batches, more than the 8 of one epoch" in message, message


@pytest.mark.parametrize("limit", ["2", "0.5"])
def test_a_training_batches_limit_that_ends_an_epoch_inside_a_step_is_one_line(
        fit_args: list[str], limit: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning would step the optimizer at the epoch's end on part of the global batch (4 micro-batches here)."""
    message = one_line_error([*fit_args, "--trainer.limit_train_batches", limit, "--print_config"], monkeypatch)
    assert (f"trainer.limit_train_batches={limit} would end an epoch inside an optimizer step of 4 micro-batches"
            in message), message


def test_a_command_run_in_this_process_leaves_the_process_as_it_was(fit_args: list[str], tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-process checks above rely on it: a run that reaches training (it seeds, and installs its preemption
    handlers) must not leave its environment variables or signal handlers to the tests after it."""
    def process_state() -> tuple[dict[str, str], list[object], int]:
        wakeup_fd = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(wakeup_fd)
        return dict(os.environ), [signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)], wakeup_fd

    before = process_state()
    monkeypatch.chdir(tmp_path)
    run_in_process(fit_args, monkeypatch)
    assert last_checkpoint(tmp_path).exists()  # it did train
    assert process_state() == before


@pytest.mark.slow
def test_a_rank_that_dies_mid_run_stops_the_other_with_one_line(debug_run_args: list[str], tmp_path: Path) -> None:
    """Rank 1 of 2 SIGKILLed in step 3 (as the OOM killer would): rank 0's collective fails at once, and it says so
    in one line that points at the dead process's own log and at resuming, instead of gloo's traceback."""
    result = run_cohort(["fit", *debug_run_args, *QUIET, *DDP_2, "--trainer.max_steps", "50", *batch_sizes(4, 2),
                         "--trainer.callbacks+=tests.helpers.KillRank", "--trainer.callbacks.rank=1",
                         "--trainer.callbacks.step=3"], cwd=tmp_path, timeout=180)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("cohort: error: another process of this run ended in the middle of a step"), last_line
    assert "--ckpt_path last" in last_line


@pytest.mark.slow
def test_a_rank_that_hangs_stops_the_other_with_one_line(debug_run_args: list[str], tmp_path: Path) -> None:
    """Rank 1 of 2 stopped (SIGSTOP) in step 4: rank 0's collective times out, and it says in one line which rank
    never answered, after which step, the checkpoint kept and how to resume, instead of gloo's traceback. The
    strategy's timeout is 30 s, not less: it also bounds the start-up rendezvous, which a busy machine may take
    seconds for; once training starts, StopRank shortens it to 10 s (a step here takes milliseconds)."""
    result = run_cohort(["fit", *debug_run_args, *QUIET, "-c", str(CONFIG_DIR / "trainer/ddp_cpu.yaml"),
                         "--trainer.strategy.init_args.timeout", "0:00:30", "--trainer.max_steps", "50",
                         *batch_sizes(4, 2), "--checkpoint.every_n_train_steps", "2",
                         "--trainer.callbacks+=tests.helpers.StopRank", "--trainer.callbacks.rank=1",
                         "--trainer.callbacks.step=3", "--trainer.callbacks.collective_timeout=10"],
                        cwd=tmp_path, timeout=240)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("cohort: error: rank 0 waited in a collective after step 3 for rank 1, which never "
                                "answered within trainer.strategy.init_args.timeout"), last_line
    assert "checkpoints/last.ckpt is kept" in last_line and "--ckpt_path last" in last_line, last_line
    assert not stopped_processes_running_in(tmp_path), "the hung rank must not outlive the run"


def stopped_processes_running_in(folder: Path) -> list[int]:
    """The ids of this user's stopped (SIGSTOP) processes whose working folder is ``folder``."""
    stopped = []
    for process in Path("/proc").iterdir():
        try:
            state = (process / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "T" and (process / "cwd").resolve() == folder.resolve():
                stopped.append(int(process.name))
        except (OSError, IndexError):  # not a process, or one that ended meanwhile
            continue
    return stopped
