"""``cohort`` under ModelParallelStrategy on 2 CPU processes (gloo): FSDP2 and tensor parallel train as one process
does, sharded checkpoints resume exactly, consolidate, and move between strategies and world sizes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers import (
    MODEL_PARALLEL, QUIET, TENSOR_PARALLEL, assert_comparable_runs_agree, assert_one_line_error,
    assert_one_line_error_in_process, assert_sharded_resume_after_sigkill_is_bitwise_exact, assert_weights_agree, fit,
    last_checkpoint, run_cohort, validate,
)

pytestmark = pytest.mark.slow

SHARDED_ON_ONE_PROCESS = [*MODEL_PARALLEL, "--trainer.devices", "1",
                          "--trainer.strategy.init_args.data_parallel_size", "1"]


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory: pytest.TempPathFactory, comparable_run_args: list[str]) -> Path:
    return fit(tmp_path_factory.mktemp("fsdp2"), comparable_run_args, *MODEL_PARALLEL)


def test_fsdp2_trains_as_one_process_does(one_process_comparable_run: Path, fsdp2_run: Path) -> None:
    assert last_checkpoint(fsdp2_run).is_dir()  # sharded: one file per rank
    assert_comparable_runs_agree(one_process_comparable_run, fsdp2_run)


def test_tensor_parallel_with_activation_checkpointing_trains_as_one_process_does(
    tmp_path: Path, comparable_run_args: list[str], one_process_comparable_run: Path
) -> None:
    run = fit(tmp_path, comparable_run_args, *TENSOR_PARALLEL, "--model.activation_checkpointing", "true")
    assert_comparable_runs_agree(one_process_comparable_run, run)


def test_sharded_resume_after_sigkill_is_bitwise_exact(tmp_path: Path, comparable_run_args: list[str]) -> None:
    run = [*comparable_run_args, *MODEL_PARALLEL, "--trainer.max_steps", "6", "--checkpoint.every_n_train_steps", "3",
           "--model.dropout", "0.1", "--data.micro_batch_size", "2"]  # 2 micro-batches per step per rank
    assert_sharded_resume_after_sigkill_is_bitwise_exact(tmp_path, run)


def test_consolidated_checkpoint_validates_alike_in_one_process(fsdp2_run: Path, comparable_run_args: list[str]) -> None:
    consolidated = fsdp2_run / "consolidated.ckpt"
    result = run_cohort(["consolidate", str(last_checkpoint(fsdp2_run)), str(consolidated)], cwd=fsdp2_run)
    assert result.returncode == 0 and "at step 4" in result.stdout, result.stderr[-3000:]
    sharded_loss = validate(fsdp2_run, comparable_run_args, *MODEL_PARALLEL, "--ckpt_path", str(last_checkpoint(fsdp2_run)))
    single_loss = validate(fsdp2_run, comparable_run_args, "--ckpt_path", str(consolidated))
    assert single_loss == pytest.approx(sharded_loss, rel=1e-6)
    again = run_cohort(["consolidate", str(last_checkpoint(fsdp2_run)), str(consolidated)], cwd=fsdp2_run)
    assert again.returncode != 0 and "already exists" in again.stderr.splitlines()[-1]


def test_single_file_checkpoint_resumes_sharded(tmp_path: Path, comparable_run_args: list[str],
                                                one_process_comparable_run: Path,
                                                one_process_comparable_run_resumed: Path) -> None:
    """Weights and the optimizer's moments go from a one-process file into FSDP2 shards: the next steps match
    the one-process run resumed from the same file."""
    fsdp2 = fit(tmp_path / "fsdp2", comparable_run_args, *MODEL_PARALLEL, "--trainer.max_steps", "6",
                "--ckpt_path", str(last_checkpoint(one_process_comparable_run)))
    assert_weights_agree(one_process_comparable_run_resumed, fsdp2)


def test_sharded_checkpoint_resumes_on_another_world_size(tmp_path: Path, comparable_run_args: list[str], fsdp2_run: Path) -> None:
    """Written by 2 ranks, resumed by 2 and by 1 (torch.distributed.checkpoint reshards on load)."""
    resumed = {}
    for name, strategy in (("two_ranks", MODEL_PARALLEL), ("one_rank", SHARDED_ON_ONE_PROCESS)):
        run_dir = tmp_path / name
        shutil.copytree(fsdp2_run / "lightning_logs", run_dir / "lightning_logs")
        resumed[name] = fit(run_dir, comparable_run_args, *strategy, "--trainer.max_steps", "6", "--ckpt_path", "last")
    assert_weights_agree(resumed["two_ranks"], resumed["one_rank"])


def test_sharding_mistakes_get_one_line(tmp_path: Path, comparable_run_args: list[str], fsdp2_run: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each before any process starts, with no run folder made: one as a user runs it, end to end, the others in
    this process (faster by the interpreter's and torch's start-up)."""
    (first, expected_first), *cases = [
        (["--trainer.strategy", "fsdp"], "fsdp needs CUDA GPUs: on CPUs use configs/trainer/model_parallel_cpu.yaml"),
        ([*TENSOR_PARALLEL, "--trainer.devices", "3", "--trainer.strategy.init_args.tensor_parallel_size", "3"],
         "tensor_parallel_size=3 does not divide the model's 2 attention heads"),
        ([*MODEL_PARALLEL, "--trainer.strategy.init_args.tensor_parallel_size", "2"],
         "data_parallel_size=2 x tensor_parallel_size=2 must equal the world size 2"),
        ([*MODEL_PARALLEL, "--model.model_name", "small", "--ckpt_path", str(last_checkpoint(fsdp2_run))],
         "was trained with model.model_name='debug'"),
    ]
    assert_one_line_error(["fit", *comparable_run_args, *QUIET, *first], tmp_path, expected_first)
    for extra, expected in cases:
        assert_one_line_error_in_process(["fit", *comparable_run_args, *QUIET, *extra], tmp_path, expected, monkeypatch)
