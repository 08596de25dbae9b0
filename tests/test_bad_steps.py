"""Bad steps: a NaN on one rank of two is seen by both, and both stop, skip or roll back alike; no checkpoint with
NaN exists afterwards. The loss-spike rule is checked on its own, without processes."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from app.safety.bad_steps import MIN_SPIKE_HISTORY, BadStepGuard
from app.safety.checkpoint_reading import read_checkpoint
from tests.helpers import (
    DDP_2,
    MODEL_PARALLEL,
    QUIET,
    assert_only_step_skipped,
    batch_sizes,
    one_line_error,
    poison_gradient,
    record_weight_digests,
    run_cohort,
    run_in_process,
    scalars,
    weight_digests,
    weight_digests_per_rank,
)

POISONED_RANK = 1


def poisoned_run(run_dir: Path, debug_run_args: list[str], action: str, step: int, layout: list[str],
                 *extra: str) -> subprocess.CompletedProcess:
    """8 steps on 2 processes, checkpointing every 2, with rank 1's gradients poisoned at ``step``."""
    run_dir.mkdir()
    return run_cohort(["fit", *debug_run_args, *QUIET, *layout, "--trainer.max_steps", "8", *batch_sizes(8, 4),
                       "--checkpoint.every_n_train_steps", "2", "--bad_steps.action", action,
                       *poison_gradient(POISONED_RANK, step), *record_weight_digests(run_dir), *extra], cwd=run_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, debug_run_args: list[str]) -> Callable[[str, int], tuple]:
    """(action, poisoned step) -> (the finished process, its folder), each run once for the module."""
    done: dict[tuple[str, int], tuple[subprocess.CompletedProcess, Path]] = {}

    def get(action: str, step: int) -> tuple[subprocess.CompletedProcess, Path]:
        if (action, step) not in done:
            run_dir = tmp_path_factory.mktemp(action) / "run"
            done[action, step] = poisoned_run(run_dir, debug_run_args, action, step, DDP_2), run_dir
        return done[action, step]

    return get


def assert_no_checkpoint_holds_nan(run_dir: Path) -> list[Path]:
    checkpoints = sorted((run_dir / "lightning_logs" / "version_0" / "checkpoints").glob("step=*.ckpt"))
    for path in checkpoints:
        weights = read_checkpoint(path)["state_dict"]
        assert all(torch.isfinite(tensor).all() for tensor in weights.values()), path
    return checkpoints


@pytest.mark.slow
def test_skip_drops_the_update_on_every_rank_and_goes_on(runs: Callable) -> None:
    result, run_dir = runs("skip", 3)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"step 3: the loss or gradients were NaN or inf on rank {POISONED_RANK} of 2" in result.stderr
    assert_only_step_skipped(weight_digests(run_dir), skipped=3, steps=8)
    assert scalars(run_dir, "train/skipped_steps")[-1] == 1
    assert len(assert_no_checkpoint_holds_nan(run_dir)) == 2


@pytest.mark.slow
def test_stop_ends_both_ranks_with_one_line_and_keeps_the_last_good_checkpoint(runs: Callable) -> None:
    result, run_dir = runs("stop", 3)
    assert result.returncode == 1
    errors = {line for line in result.stderr.splitlines() if line.startswith("cohort: error:")}
    assert len(errors) == 1, errors  # each rank says the same
    assert f"step 3: the loss or gradients were NaN or inf on rank {POISONED_RANK} of 2" in min(errors)
    assert "last.ckpt is kept, the newest good checkpoint" in min(errors)
    after = weight_digests(run_dir)
    assert max(after) == 4 and after[3] == after[2]  # stopped after reading step 3's verdict, one step later
    assert [path.name for path in assert_no_checkpoint_holds_nan(run_dir)] == ["step=000002.ckpt"]


@pytest.mark.slow
def test_rollback_reloads_the_last_checkpoint_on_every_rank_and_goes_on(runs: Callable) -> None:
    result, run_dir = runs("rollback", 5)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rolled back every rank to" in result.stderr and "step=000004.ckpt" in result.stderr
    after = weight_digests(run_dir)
    assert after[5] == after[4]  # the bad step's update was skipped at once
    assert after[6] == after[4]  # read one step later: step 6's update was replaced by step 4's checkpoint
    assert after[7] != after[6] and max(after) == 8  # and training went on to the end
    assert len(assert_no_checkpoint_holds_nan(run_dir)) == 2


@pytest.mark.slow
def test_rollback_reloads_a_sharded_checkpoint(tmp_path: Path, debug_run_args: list[str]) -> None:
    """FSDP2 over 2 processes: each rank reloads its own shards from the checkpoint folder."""
    result = poisoned_run(tmp_path / "run", debug_run_args, "rollback", 5, MODEL_PARALLEL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rolled back every rank to" in result.stderr and "step=000004.ckpt" in result.stderr
    for after in weight_digests_per_rank(tmp_path / "run"):  # the ranks hold different shards: each against itself
        assert after[5] == after[4] and after[6] == after[4] and after[7] != after[6] and max(after) == 8


@pytest.mark.slow
def test_rollback_reads_a_checkpoint_written_in_the_background(tmp_path: Path, debug_run_args: list[str]) -> None:
    """checkpoint.async_save, step 4's write held until step 5 has changed the weights: the rollback after the bad
    step 5 waits for that write to be in place and reloads step 4's state, not step 2's, on both ranks."""
    result = poisoned_run(tmp_path / "run", debug_run_args, "rollback", 5, DDP_2, "--checkpoint.async_save", "true",
                          "--trainer.callbacks+=tests.helpers.HoldCheckpointWrites", "--trainer.callbacks.steps=1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rolled back every rank to" in result.stderr and "step=000004.ckpt" in result.stderr
    after = weight_digests(tmp_path / "run")
    assert after[6] == after[4] and after[7] != after[6] and max(after) == 8


def test_a_diverging_run_stops_at_its_first_nan(debug_run_args: list[str], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The quickstart's mistake, made small: a learning rate of 50 without clipping."""
    monkeypatch.chdir(tmp_path)
    message = one_line_error(["fit", *debug_run_args, *QUIET, "--model.optimizer.learning_rate", "50",
                              "--trainer.gradient_clip_val", "null", "--trainer.max_steps", "30"], monkeypatch)
    assert "the loss or gradients were NaN or inf on rank 0 of 1" in message and "no checkpoint was written" in message


def test_the_guard_and_clipping_share_one_pass_over_the_gradients(debug_run_args: list[str], tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard checks the gradients for NaN and inf, clipping needs their norm: one norm per optimizer step
    (here 5 steps of 2 micro-batches), and the norm, loss and learning rate logged on the logger's steps (2 and 4)."""
    monkeypatch.chdir(tmp_path)
    passes = []  # calls of the kernel that reads every gradient for their norms (torch's get_total_norm's)
    foreach_norm = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda *args, **kwargs: passes.append(1) or
                        foreach_norm(*args, **kwargs))
    run_in_process(["fit", *debug_run_args, *QUIET, "--trainer.max_steps", "5", *batch_sizes(8, 4),
                    "--trainer.gradient_clip_val", "1.0", "--trainer.log_every_n_steps", "2",
                    "--trainer.limit_val_batches", "0"], monkeypatch)
    assert len(passes) == 5
    assert [len(scalars(tmp_path, tag)) for tag in ("train/grad_norm", "train/loss", "lr")] == [2, 2, 2]


def test_a_loss_far_above_the_recent_ones_is_a_spike() -> None:
    guard = BadStepGuard(spike_zscore=6.0, spike_window=MIN_SPIKE_HISTORY)
    losses = 3.0 + 0.01 * torch.randn(MIN_SPIKE_HISTORY, generator=torch.Generator().manual_seed(0))
    no = torch.tensor(False)
    assert not any(guard._spike(loss, no, step) for step, loss in enumerate(losses))
    assert guard._spike(torch.tensor(3.2), no, MIN_SPIKE_HISTORY)  # 20 deviations up
    assert guard._spike(torch.tensor(3.2), no, MIN_SPIKE_HISTORY + 1)  # the spike did not join the window
    assert not guard._spike(torch.tensor(3.02), no, MIN_SPIKE_HISTORY + 2)  # 2 deviations: noise
    assert not guard._spike(torch.tensor(2.5), no, MIN_SPIKE_HISTORY + 3)  # a drop is no spike
    guard._spike(torch.tensor(9.0), torch.tensor(True), MIN_SPIKE_HISTORY + 4)  # a step bad for another reason
    assert guard._recent_losses.max() < 3.1  # neither spikes nor bad steps joined the window


def test_spikes_need_history() -> None:
    guard = BadStepGuard(spike_zscore=1.0)
    assert not any(guard._spike(torch.tensor(float(step)), torch.tensor(False), step)
                   for step in range(MIN_SPIKE_HISTORY - 1))


@pytest.mark.parametrize(("setting", "value"), [("patience", "0"), ("spike_zscore", "-1"), ("spike_window", "3")])
def test_bad_step_settings_are_checked(setting: str, value: str, debug_run_args: list[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    message = one_line_error(["fit", *debug_run_args, f"--bad_steps.{setting}", value], monkeypatch)
    assert f"bad_steps.{setting}" in message


def test_an_unknown_action_is_named(debug_run_args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """jsonargparse's own message, from the type of the setting, in one line."""
    message = one_line_error(["fit", *debug_run_args, "--bad_steps.action", "ignore"], monkeypatch)
    assert "bad_steps.action" in message
