"""Progress in optimizer steps: counts, totals, rate and ETA on a fake trainer with a fake clock; the lines real runs
print at accumulation 1 and 4 on 1 and 2 processes."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from app.observability.progress import StepProgress, format_duration
from core.errors import UserError
from core.precision import PRECISIONS
from core.run_plan import RunPlan
from tests.helpers import DDP_2, ONE_STEP, batch_sizes, run_cohort, run_in_process

TOKENS_PER_STEP = 32 * 128  # the fake runs' global batch x sequence length


class Clock:
    """Stands in for time.perf_counter: time moves only when a test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr("app.observability.progress.time.perf_counter", clock)
    return clock


def fake_run(world_size: int, accumulation: int, step: int = 0) -> tuple[SimpleNamespace, SimpleNamespace]:
    """A trainer at optimizer step ``step`` of 8, and a module whose plan has a global batch of 32 x 128 tokens."""
    plan = RunPlan(devices_per_node=world_size, num_nodes=1, data_parallel_size=world_size, tensor_parallel_size=1,
                   global_batch_size=32, micro_batch_size=32 // (world_size * accumulation), sequence_length=128,
                   precision=PRECISIONS["32-true"], seed=1)
    assert plan.accumulation == accumulation
    trainer = SimpleNamespace(global_step=step, estimated_stepping_batches=8, log_every_n_steps=2,
                              optimizers=[SimpleNamespace(param_groups=[{"lr": 1e-3}])], callback_metrics={},
                              state=SimpleNamespace(fn="fit"), sanity_checking=False)
    return trainer, SimpleNamespace(run_plan=plan)


def train(progress: StepProgress, trainer: SimpleNamespace, module: SimpleNamespace, steps: int, clock: Clock,
          seconds_per_step: float) -> None:
    """``steps`` optimizer steps of the module's accumulation, each taking ``seconds_per_step``."""
    accumulation = module.run_plan.accumulation
    for _ in range(steps):
        for micro_batch in range(accumulation):
            clock.now += seconds_per_step / accumulation
            if micro_batch == accumulation - 1:
                trainer.global_step += 1  # as Lightning does before the hook
            # Lightning hands back the micro-batch's loss divided by the accumulation steps
            progress.on_train_batch_end(trainer, module, {"loss": torch.tensor(2.5) / accumulation}, None, micro_batch)


def validate(progress: StepProgress, trainer: SimpleNamespace, clock: Clock, seconds: float) -> None:
    trainer.callback_metrics.update({"val/loss": torch.tensor(2.62), "val/perplexity": torch.tensor(13.74)})
    progress.on_validation_start(trainer, None)
    clock.now += seconds
    progress.on_validation_end(trainer, None)


def eight_steps_validated_after_four(progress: StepProgress, world_size: int, accumulation: int, clock: Clock,
                                     seconds_per_step: float, validation_seconds: float) -> None:
    trainer, module = fake_run(world_size, accumulation)
    progress.on_train_start(trainer, module)
    train(progress, trainer, module, 4, clock, seconds_per_step)
    validate(progress, trainer, clock, validation_seconds)
    train(progress, trainer, module, 4, clock, seconds_per_step)
    progress.on_train_end(trainer, module)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("accumulation", [1, 4])
def test_plain_lines_count_optimizer_steps_at_any_accumulation_and_world_size(
        world_size: int, accumulation: int, clock: Clock, capsys: pytest.CaptureFixture[str]) -> None:
    """0.5 s per step of 4,096 tokens is 8,192 tokens/s, however the batch is split; a line every 2 steps; the 4.1 s
    validation after step 4 counts in the elapsed time, not in the rate."""
    eight_steps_validated_after_four(StepProgress(interactive=False), world_size, accumulation, clock, 0.5, 4.1)
    assert capsys.readouterr().out.splitlines() == [
        "step 2/8  loss 2.5  lr 1.00e-03  8,192 tokens/s  elapsed 0:01  ETA 0:03",
        "step 4/8  loss 2.5  lr 1.00e-03  8,192 tokens/s  elapsed 0:02  ETA 0:02",
        "step 4/8  val/loss 2.62  val/perplexity 13.7  (4.1 s)",
        "step 6/8  loss 2.5  lr 1.00e-03  8,192 tokens/s  elapsed 0:07  ETA 0:01",
        "step 8/8  loss 2.5  lr 1.00e-03  8,192 tokens/s  elapsed 0:08  ETA 0:00",
    ]


def test_a_resumed_run_starts_at_its_step_and_times_only_its_own_steps(
        clock: Clock, capsys: pytest.CaptureFixture[str]) -> None:
    """Resumed at step 5 of 8: its first step is start-up (no rate yet), the ETA is the steps left at 2 s each."""
    trainer, module = fake_run(world_size=1, accumulation=2, step=5)
    progress = StepProgress(every_n_steps=1, interactive=False)
    progress.on_train_start(trainer, module)
    train(progress, trainer, module, 3, clock, 2.0)
    assert capsys.readouterr().out.splitlines() == [
        "step 6/8  loss 2.5  lr 1.00e-03  elapsed 0:02",
        "step 7/8  loss 2.5  lr 1.00e-03  2,048 tokens/s  elapsed 0:04  ETA 0:02",
        "step 8/8  loss 2.5  lr 1.00e-03  2,048 tokens/s  elapsed 0:06  ETA 0:00",
    ]


def test_a_terminal_gets_one_line_redrawn_and_a_line_per_validation(
        clock: Clock, capsys: pytest.CaptureFixture[str]) -> None:
    """Steps of 0.2 s, redrawn at most every 0.5 s and at the last step; the line drawn last is kept above a
    validation's result, and when training ends."""
    eight_steps_validated_after_four(StepProgress(interactive=True), 1, 4, clock, 0.2, 1.0)
    rows = capsys.readouterr().out.split("\n")
    assert [re.findall(r"step \d/8", row) for row in rows] == [
        ["step 3/8"],  # drawn at 0.6 s, kept at the validation after step 4
        ["step 4/8"],  # the validation's line
        ["step 5/8", "step 8/8"],  # the first step after it; the last step
        [],
    ]
    assert rows[0].endswith("\x1b[K\r") and rows[1].startswith("step 4/8  val/loss 2.62") and rows[2].endswith("\r")


def test_durations_read_as_clocks() -> None:
    assert [format_duration(seconds) for seconds in (0.4, 59.6, 108, 3723)] == ["0:00", "1:00", "1:48", "1:02:03"]


def test_every_n_steps_must_be_positive() -> None:
    with pytest.raises(UserError, match="progress.every_n_steps=0 must be >= 1"):
        StepProgress(every_n_steps=0)


STEPS = ["--trainer.max_steps", "8", "--val_every_n_steps", "4", "--trainer.log_every_n_steps", "2",
         "--trainer.limit_val_batches", "2", "--trainer.enable_model_summary", "false"]
LAYOUTS = {  # (processes, accumulation): the flags
    (1, 1): batch_sizes(4, 4),
    (1, 4): batch_sizes(8, 2),
    (2, 1): [*DDP_2, *batch_sizes(8, 4)],
    (2, 4): [*DDP_2, *batch_sizes(16, 2)],
}


@pytest.mark.parametrize(("processes", "accumulation"), [
    pytest.param(*layout, marks=[pytest.mark.slow] if layout[0] > 1 else []) for layout in LAYOUTS])
def test_a_run_prints_plain_lines_in_optimizer_steps(
        processes: int, accumulation: int, debug_run_args: list[str], tmp_path: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Not on a terminal (captured output): a line every log_every_n_steps optimizer steps, from rank 0 only, one
    line per validation, no carriage returns and none of Lightning's bars."""
    args = ["fit", *debug_run_args, *STEPS, *LAYOUTS[processes, accumulation]]
    if processes == 1:  # in this process: faster by the interpreter's and torch's start-up
        monkeypatch.chdir(tmp_path)
        run_in_process(args, monkeypatch)
        out, err = capsys.readouterr()
    else:
        result = run_cohort(args, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        out, err = result.stdout, result.stderr
    assert "\r" not in out + err and "it/s" not in out + err and "Epoch 0" not in out + err
    progress = [line for line in out.splitlines() if line.startswith("step ")]
    assert [re.match(r"(step \d+/\d+)  (\S+) ", line).groups() for line in progress] == [
        ("step 2/8", "loss"), ("step 4/8", "loss"), ("step 4/8", "val/loss"),
        ("step 6/8", "loss"), ("step 8/8", "loss"), ("step 8/8", "val/loss"),
    ], out
    step_lines = [line for line in progress if "val/loss" not in line]
    assert all(re.search(r"  [\d,]+ tokens/s  elapsed \d+:\d\d  ETA \d+:\d\d$", line) for line in step_lines), out


def test_a_progress_bar_the_user_chose_is_kept(debug_run_args: list[str], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """StepProgress replaces only the bar Lightning would add: beside a chosen one Lightning would refuse to start."""
    monkeypatch.chdir(tmp_path)
    run_in_process(["fit", *debug_run_args, *ONE_STEP, *batch_sizes(2, 2), "--trainer.enable_model_summary", "false",
                    "--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar"], monkeypatch)
    out = capsys.readouterr().out
    assert "Epoch 0: 100%" in out and "step 1/1" not in out


def test_the_console_says_what_the_model_is_in_one_line_without_lightnings_table(
        debug_run_args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """By default: no table of metric modules and zero FLOPs, no advertisement, no CUDA row on a CPU; one line
    with the model's size instead. Lightning logs through its own handler, bound to the stream it found at import,
    so its records are collected here from its logger."""
    records: list[logging.LogRecord] = []
    collector = logging.Handler()
    collector.emit = records.append  # type: ignore[method-assign]
    lightning_logger = logging.getLogger("lightning.pytorch")
    lightning_logger.addHandler(collector)
    monkeypatch.chdir(tmp_path)
    try:
        run_in_process(["fit", *debug_run_args, *ONE_STEP, *batch_sizes(2, 2)], monkeypatch)
    finally:
        lightning_logger.removeHandler(collector)
    console = capsys.readouterr().out + "\n".join(record.getMessage() for record in records)
    assert "model: GPT 'debug', 2 layers x 2 heads, width 32, context 64, vocabulary 256: " in console, console
    for noise in ("Total Flops", "MeanMetric", "Tip", "CUDA"):
        assert noise not in console, noise


def test_tensorboard_writes_every_series_at_the_step_the_console_prints(
        debug_run_args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The loss, gradient norm, learning rate and validation loss at the optimizer step that the console's line and
    the monitor's series name (step 4 after the fourth step), not Lightning's count of the steps before it."""
    monkeypatch.chdir(tmp_path)
    run_in_process(["fit", *debug_run_args, *STEPS, *batch_sizes(8, 4), "--trainer.gradient_clip_val", "1.0"],
                   monkeypatch)
    printed = sorted({int(step) for step in re.findall(r"^step (\d+)/8", capsys.readouterr().out, re.MULTILINE)})
    events = EventAccumulator(str(tmp_path / "lightning_logs" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    steps = {tag: [event.step for event in events.Scalars(tag)] for tag in (
        "train/loss", "train/grad_norm", "lr", "throughput/tokens_per_second", "monitor/step_s/median")}
    assert printed == [2, 4, 6, 8] and all(logged == printed for logged in steps.values()), steps
    assert [event.step for event in events.Scalars("val/loss")] == [4, 8]
