"""End-to-end runs of ``cohort fit`` on CPU: one process, DDP with two gloo processes, accumulation, exact resume."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import (
    DDP_2, QUIET, SAME_VALIDATION_LOSS, assert_comparable_runs_agree, assert_weights_equal, batch_sizes, cached_fits,
    fit, fit_in_process, fit_killed_mid_accumulation, last_checkpoint_weights, run_cohort, validate,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory: pytest.TempPathFactory, debug_run_args: list[str]) -> Path:
    """6 steps of the debug model on one process, validated every 3."""
    return fit_in_process(tmp_path_factory.mktemp("single_process"), debug_run_args, "--trainer.max_steps", "6",
                          "--val_every_n_steps", "3", *batch_sizes(8, 4))


def test_single_process_fit_logs_to_tensorboard(single_process_run: Path) -> None:
    log_dir = single_process_run / "lightning_logs" / "version_0"
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "val/loss", "val/perplexity", "lr", "throughput/tokens_per_second"} <= tags
    val_loss = [event.value for event in events.Scalars("val/loss")]
    perplexity = [event.value for event in events.Scalars("val/perplexity")]
    assert len(val_loss) == 2 and val_loss[1] < val_loss[0]
    assert perplexity[-1] == pytest.approx(torch.tensor(val_loss[-1]).exp().item(), rel=1e-5)
    assert (log_dir / "hparams.yaml").read_text().count("model_name: debug") == 1
    assert (log_dir / "checkpoints" / "last.ckpt").is_file()


class StopAtStep(Callback):
    """Asks the run to stop after optimizer step ``step``, as a preemption signal does."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


@pytest.mark.parametrize(("stop_at", "logged_steps"), [(2, [2]), (7, [5, 7]), (10, [5, 10])])
def test_a_steps_values_are_logged_on_the_loggers_steps_and_where_a_callback_stops(
        stop_at: int, logged_steps: list[int], tmp_path: Path, debug_run_args: list[str]) -> None:
    """Every 5 steps, and at the step a callback stops the run (Lightning writes that step too), with that step's
    values, not the last logged step's again."""
    run = fit_in_process(tmp_path, debug_run_args, "--trainer.max_steps", "20", "--trainer.log_every_n_steps", "5",
                         "--trainer.gradient_clip_val", "1.0", "--trainer.limit_val_batches", "0",
                         "--trainer.callbacks+=tests.test_training.StopAtStep", "--trainer.callbacks.step", str(stop_at))
    events = EventAccumulator(str(run / "lightning_logs" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    for tag in ("train/loss", "train/grad_norm", "lr"):
        points = events.Scalars(tag)
        assert [point.step for point in points] == logged_steps, tag  # the steps taken, as the console counts
        assert len({point.value for point in points}) == len(points), (tag, points)  # no stale value again


def test_ddp_two_processes_match_one_process(tmp_path: Path, comparable_run_args: list[str],
                                            one_process_comparable_run: Path) -> None:
    """Same global batch: 1 process x 2 accumulation steps and 2 processes x 1 step train the same weights."""
    assert_comparable_runs_agree(one_process_comparable_run, fit(tmp_path, comparable_run_args, *DDP_2))


def test_accumulation_matches_a_larger_micro_batch(tmp_path: Path, comparable_run_args: list[str],
                                                  one_process_comparable_run: Path) -> None:
    """Micro-batches of 4 accumulated twice, or one of 8: the same steps."""
    assert_comparable_runs_agree(one_process_comparable_run,
                                 fit_in_process(tmp_path, comparable_run_args, *batch_sizes(8, 8)))


def test_ddp_all_reduces_gradients_once_per_optimizer_step(tmp_path: Path, debug_run_args: list[str]) -> None:
    fit(tmp_path, debug_run_args, *DDP_2, "--trainer.max_steps", "4",
        *batch_sizes(16, 2),  # 4 micro-batches per step per rank
        "--trainer.callbacks+=tests.helpers.GradientAllReduceCounter",
        f"--trainer.callbacks.out_dir={tmp_path}")
    for rank in (0, 1):
        summary = json.loads((tmp_path / f"allreduce_rank{rank}.json").read_text())
        assert summary["accumulation"] == 4 and summary["batches"] == 16
        assert summary["reducing_batches"] == [3, 7, 11, 15]  # only the last micro-batch of each step


def resume_test_run(debug_run_args: list[str], layout: str) -> list[str]:
    """6 steps of 4 micro-batches per rank with dropout, checkpointing every 3 steps, on 1 process or DDP-2."""
    return [*debug_run_args, "--trainer.max_steps", "6", "--checkpoint.every_n_train_steps", "3",
            "--val_every_n_steps", "2", "--model.dropout", "0.1", *batch_sizes(8, 2),
            *(DDP_2 if layout == "ddp-2" else [])]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, debug_run_args: list[str]) -> Callable[[str, str], Path]:
    """The resume tests' run, never interrupted: ("32-true", layout) -> its folder. On one process it runs in this
    process: the weights are bitwise those of a subprocess's run (the same code, threads and seed), which the
    killed and stopped runs are."""
    return cached_fits(tmp_path_factory, lambda _, layout: resume_test_run(debug_run_args, layout),
                       in_process=lambda _, layout: layout == "1-process")


@pytest.mark.parametrize("layout", ["1-process", "ddp-2"])
def test_resume_after_sigkill_is_bitwise_exact(tmp_path: Path, debug_run_args: list[str], layout: str,
                                               uninterrupted: Callable[[str, str], Path]) -> None:
    """N steps straight == N/2 steps, SIGKILL inside an accumulation window, resume to N (dropout on)."""
    run = resume_test_run(debug_run_args, layout)
    interrupted = tmp_path / "interrupted"
    fit_killed_mid_accumulation(interrupted, run)
    checkpoint = torch.load(interrupted / "lightning_logs/version_0/checkpoints/last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 3  # the kill lost step 4's partial window and all of step 3 -> 4
    fit(interrupted, run, "--ckpt_path", "last")

    assert not (interrupted / "lightning_logs" / "version_1").exists()  # the resumed run logs into its own folder
    assert_weights_equal(last_checkpoint_weights(uninterrupted("32-true", layout)), last_checkpoint_weights(interrupted))


@pytest.mark.parametrize("layout", ["1-process", "ddp-2"])
def test_sigterm_checkpoints_its_step_exits_143_and_resumes_bitwise_exact(
        tmp_path: Path, debug_run_args: list[str], layout: str, uninterrupted: Callable[[str, str], Path]) -> None:
    """SIGTERM (Kubernetes, torchrun's agent, SLURM without --signal) inside step 5's accumulation window: every
    rank finishes that step, last.ckpt holds it (not the periodic one of step 3), the exit says how to resume."""
    run = resume_test_run(debug_run_args, layout)
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    result = run_cohort(["fit", *run, *QUIET, "--trainer.callbacks+=tests.helpers.SignalAtStep",
                         "--trainer.callbacks.signal_name=SIGTERM", "--trainer.callbacks.step=4",
                         "--trainer.callbacks.micro_batch=1"], cwd=stopped)
    assert result.returncode == 143, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "cohort: stopped by SIGTERM after step 5; lightning_logs/version_0/checkpoints/last.ckpt holds that step: "
        "resume with the same command and --ckpt_path last")
    assert "--- sample after" not in result.stdout  # the grace time goes to the checkpoint, not to generating text
    checkpoint = torch.load(stopped / "lightning_logs/version_0/checkpoints/last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 5
    fit(stopped, run, "--ckpt_path", "last")
    assert_weights_equal(last_checkpoint_weights(uninterrupted("32-true", layout)), last_checkpoint_weights(stopped))


def test_a_rank_blocked_in_a_collective_ends_within_the_grace_time_after_sigterm(tmp_path: Path,
                                                                                 debug_run_args: list[str]) -> None:
    """SIGTERM to both ranks while rank 1 hangs in step 3: rank 0 waits in the all-reduce and never reaches a step
    boundary, so after preemption.grace_seconds both processes end by themselves, exit 143, and say so in one line.
    Should they not, the hang (600 s) and the collective timeout (30 min) outlast run_cohort's timeout, which fails
    the test."""
    result = run_cohort(["fit", *debug_run_args, *QUIET, *DDP_2, "--trainer.max_steps", "50", *batch_sizes(4, 2),
                         "--preemption.grace_seconds", "3", "--trainer.callbacks+=tests.helpers.SignalAllThenHang",
                         "--trainer.callbacks.signal_name=SIGTERM", "--trainer.callbacks.rank=1",
                         "--trainer.callbacks.step=3"], cwd=tmp_path, timeout=240)
    assert result.returncode == 143, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "cohort: stopped by SIGTERM without a checkpoint: the ranks did not reach a step and save it within "
        "preemption.grace_seconds=3 (a rank blocked in a collective, or a step and save longer than that); resume "
        "from the newest checkpoint with the same command and --ckpt_path last")


def test_validation_loss_is_the_same_on_one_and_two_processes(tmp_path: Path, debug_run_args: list[str]) -> None:
    """Validation covers the same windows at any world size (here 9 windows: uneven across 2 ranks)."""
    losses = []
    for processes in (1, 2):
        run_dir = tmp_path / str(processes)
        run_dir.mkdir()
        losses.append(validate(run_dir, [*debug_run_args, "--data.val_samples", "9", "--trainer.limit_val_batches",
                                         "1.0", "--trainer.devices", str(processes),
                                         "--trainer.strategy", "ddp" if processes > 1 else "auto",
                                         "--ckpt_path", "initial"]))
    assert losses[0] == pytest.approx(losses[1], rel=SAME_VALIDATION_LOSS)


def test_predict_generates_text_from_a_checkpoint(tmp_path: Path, debug_run_args: list[str],
                                                  single_process_run: Path) -> None:
    shutil.copytree(single_process_run / "lightning_logs", tmp_path / "lightning_logs")  # "last" is found here
    result = run_cohort(["predict", *debug_run_args, *QUIET, "--ckpt_path", "last", "--model.max_new_tokens", "20",
                         "--data.prompts", "['import os']"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout.split("--- prompt 0 (rank 0) ---\n", 1)[1]
    assert output.startswith("import os") and len(output.encode()) >= len("import os") + 10
