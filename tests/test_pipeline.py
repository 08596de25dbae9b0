"""``cohort fit`` with PipelineParallelStrategy on 2 CPU processes (gloo): GPipe and 1F1B train as one process
does on the same global batch, with clipping that bites; a pipelined run resumes exactly after SIGKILL; its
checkpoint validates alike on one process; pipeline mistakes get one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import (
    CONFIG_DIR, QUIET, assert_one_line_error, assert_sharded_resume_after_sigkill_is_bitwise_exact,
    assert_weights_close, fit, last_checkpoint, last_checkpoint_weights, run_cohort, scalars, validate,
)

pytestmark = pytest.mark.slow

PIPELINE = ["-c", str(CONFIG_DIR / "trainer/pipeline_cpu.yaml")]


def schedule(name: str, microbatches: int) -> list[str]:
    return [*PIPELINE, "--trainer.strategy.init_args.pipeline_schedule", name,
            "--trainer.strategy.init_args.pipeline_microbatches", str(microbatches)]


@pytest.fixture(scope="module")
def pipelined_runs(tmp_path_factory: pytest.TempPathFactory, comparable_run_args: list[str]) -> dict[str, Path]:
    """The debug model's 2 blocks as 2 stages, its micro batch of 4 cut into 2 (GPipe) or 4 (1F1B) pieces."""
    return {name: fit(tmp_path_factory.mktemp(name), comparable_run_args, *schedule(name, microbatches))
            for name, microbatches in (("GPipe", 2), ("1F1B", 4))}


@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
def test_pipeline_trains_as_one_process_does(one_process_comparable_run: Path, pipelined_runs: dict[str, Path], name: str) -> None:
    """Every step's training and validation loss, and the final weights (the optimizer's sums are the same sums
    taken in another order: float32 rounding only)."""
    run = pipelined_runs[name]
    assert last_checkpoint(run).is_dir()  # sharded: each stage writes its own weights
    for tag in ("train/loss", "val/loss", "train/grad_norm"):
        assert scalars(run, tag) == pytest.approx(scalars(one_process_comparable_run, tag), rel=1e-5), tag
    assert scalars(one_process_comparable_run, "train/grad_norm")[0] > 2 * 0.1  # clipping (0.1) bit
    assert_weights_close(last_checkpoint_weights(one_process_comparable_run), last_checkpoint_weights(run), rtol=1e-5)


def test_pipelined_checkpoint_validates_alike_in_one_process(pipelined_runs: dict[str, Path], comparable_run_args: list[str]) -> None:
    run = pipelined_runs["1F1B"]
    consolidated = run / "consolidated.ckpt"
    result = run_cohort(["consolidate", str(last_checkpoint(run)), str(consolidated)], cwd=run)
    assert result.returncode == 0, result.stderr[-3000:]
    pipelined_loss = validate(run, comparable_run_args, *PIPELINE, "--ckpt_path", str(last_checkpoint(run)))
    assert validate(run, comparable_run_args, "--ckpt_path", str(consolidated)) == pytest.approx(pipelined_loss, rel=1e-6)


def test_pipelined_resume_after_sigkill_is_bitwise_exact(tmp_path: Path, comparable_run_args: list[str]) -> None:
    run = [*comparable_run_args, *PIPELINE, "--trainer.max_steps", "6", "--checkpoint.every_n_train_steps", "3",
           "--model.dropout", "0.1", "--data.micro_batch_size", "2",  # 2 micro-batches per step
           "--trainer.strategy.init_args.pipeline_microbatches", "2"]
    assert_sharded_resume_after_sigkill_is_bitwise_exact(tmp_path, run)


def test_pipeline_mistakes_get_one_line(tmp_path: Path, comparable_run_args: list[str]) -> None:
    cases = [
        (["--trainer.strategy.init_args.data_parallel_size", "2"],
         "pipeline_parallel_size=2 x data_parallel_size=2 x tensor_parallel_size=1 must equal the world size 2"),
        (["--trainer.strategy.init_args.pipeline_parallel_size", "3", "--trainer.devices", "3"],
         "pipeline_parallel_size=3 is more stages than model 'debug' has blocks (2)"),
        (["--trainer.strategy.init_args.pipeline_microbatches", "1"],
         "pipeline_microbatches=1 is fewer than the 2 pipeline stages"),
        (["--trainer.strategy.init_args.pipeline_microbatches", "3"],
         "pipeline_microbatches=3 does not divide data.micro_batch_size=4"),
        (["--trainer.strategy.init_args.pipeline_schedule", "ZeroBubble"],
         "pipeline_schedule='ZeroBubble' is not a schedule: use one of GPipe, 1F1B"),
    ]
    for extra, expected in cases:
        assert_one_line_error(["fit", *comparable_run_args, *QUIET, *PIPELINE, *extra], tmp_path, expected)
    assert_one_line_error(["predict", *comparable_run_args, *QUIET, *PIPELINE], tmp_path, "run cohort consolidate on the checkpoint")
