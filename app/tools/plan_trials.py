"""Runs of the real ``cohort fit`` (a new process, in a temporary folder) for ``cohort plan``:

- ``--try K``: the best K layouts run for a few steps each, their measured step time printed against the predicted
  one, and the fastest named. Each run is also held to one process running the same steps (the recipe on its
  single-process preset): the global gradient norm of every step must agree within the tolerance the arithmetic
  allows (sums taken in another order: 1e-4 relative in float32, as tests/helpers.py assert_comparable_runs_agree;
  2e-2 with a 16-bit compute dtype, one bfloat16 rounding step).
- ``--calibrate``: two runs per strategy (its fastest layout at the recipe's micro batch without activation
  checkpointing, and the same at half the micro batch: twice the calls) give what its steps take beyond the model,
  fitted as a time per step and per forward and backward call (cost_model.Overhead), which every layout of the
  strategy is given: the loop's, hooks' and dispatch's cost the model does not count.

Measured step time: each run trains twice the timed steps, with one monitor window over each half; the second
window's step time of its slowest rank (``monitor/step_s/max``: the rank's mean over the window; a step ends when
its last rank does) is the measurement. The first half is the warm-up (start-up, the optimizer's moments, the
allocator), and a window per step would time the monitor's own report, which a run pays once per window. Every run
logs every step (the gradient norms compared), which costs a small model a few tenths of a millisecond per value.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from app.tools.cost_model import Layout, ModelFacts, Overhead, Prediction, calibrated, fastest_first
from app.tools.layouts import CONFIG_DIR, PRESETS
from core.errors import UserError

# what a short trial needs of fit: a log line per step (the gradient norms compared), no validation and no checkpoints
TRIAL = ["--trainer.log_every_n_steps", "1", "--trainer.limit_val_batches", "0",
         "--checkpoint.every_n_train_steps", "1000000", "--trainer.enable_progress_bar", "false"]


def scalars(run_dir: Path, tag: str) -> list[float]:
    """What the run whose log folder is ``run_dir`` (lightning_logs/version_N) logged under ``tag``, in step order."""
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return [event.value for event in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


def run_fit(arguments: Sequence[str], steps: int, folder: Path) -> Path:
    """``cohort fit`` with ``arguments`` for ``steps`` timed steps after as many to warm up, in ``folder`` (where the
    runs before it left the data they built), returning its log folder; a UserError with its last line if it
    fails."""
    logs = folder / "lightning_logs"
    before = set(logs.glob("version_*"))
    result = subprocess.run([sys.executable, "-m", "app", "fit", *arguments, *TRIAL, "--monitor.every_n_steps", str(steps),
                             "--trainer.max_steps", str(2 * steps)],
                            cwd=folder, capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        last = last.removeprefix("cohort: error: ").split(" (COHORT_TRACEBACK")[0]
        raise UserError(f"cohort plan --try: cohort fit {' '.join(arguments)} failed: {last}")
    return (set(logs.glob("version_*")) - before).pop()


def measured_step_seconds(run_dir: Path) -> float:
    """The timed window's step time (the second window; the first is the warm-up)."""
    return scalars(run_dir, "monitor/step_s/max")[1]


def norms_agree(one: list[float], other: list[float], tolerance: float) -> bool:
    return len(one) == len(other) > 0 and all(abs(a - b) <= tolerance * abs(a) for a, b in zip(one, other))


def absolute(arguments: Sequence[str]) -> list[str]:
    """The arguments with the config files they name made absolute (from here, or from the repository, where the
    presets are): the runs start in folders of their own."""
    made = []
    for argument in arguments:
        if argument.endswith((".yaml", ".yml")):
            here, in_repository = Path(argument).resolve(), CONFIG_DIR.parent / argument
            argument = str(here if here.exists() or not in_repository.exists() else in_repository)
        made.append(argument)
    return made


def try_layouts(fit_args: Sequence[str], ranked: Sequence[Prediction], runs: Sequence[Sequence[str]],
                facts: ModelFacts, steps: int, accelerator: str, tolerance: float) -> None:
    """Run each of ``ranked`` (with its ``runs`` arguments after ``fit_args``) and one process, and print the table."""
    with tempfile.TemporaryDirectory(prefix="cohort-plan-") as folder:
        reference_preset = str(CONFIG_DIR / "trainer" / PRESETS[accelerator]["single"])
        reference = run_fit([*absolute(fit_args), "-c", reference_preset], steps, Path(folder))
        reference_norms = scalars(reference, "train/grad_norm")
        rows = []
        for place, (prediction, run) in enumerate(zip(ranked, runs), start=1):
            run_dir = run_fit([*absolute(fit_args), *absolute(run)], steps, Path(folder))
            same = norms_agree(reference_norms, scalars(run_dir, "train/grad_norm"), tolerance)
            rows.append((place, prediction, measured_step_seconds(run_dir), same))
    print(f"\n--try {len(ranked)}: {2 * steps} steps each (the mean of the last {steps}, the slowest rank's), and one "
          f"process for the same steps")
    width = max(len(prediction.layout.describe()) for _, prediction, _, _ in rows)
    print(f"{'#':>2}  {'layout':<{width}}  {'predicted':>10}  {'measured':>10}  {'error':>6}  trains as one process")
    for place, prediction, measured, same in rows:
        error = (prediction.step_seconds - measured) / measured
        print(f"{place:>2}  {prediction.layout.describe():<{width}}  {prediction.step_seconds * 1e3:>7.1f} ms  "
              f"{measured * 1e3:>7.1f} ms  {error:>+6.0%}  {'yes' if same else 'NO'} (gradient norm per step, "
              f"within {tolerance:g})")
    place, prediction, measured, _ = min(rows, key=lambda row: row[2])
    tokens = facts.samples_per_step * facts.units_per_sample / measured
    print(f"winner: #{place} {prediction.layout.describe()}, {measured * 1e3:.1f} ms per step measured "
          f"({tokens:,.0f} {facts.unit}/s)")


def calibration_layouts(ranked: Sequence[Prediction], micro_batch_size: int) -> dict[str, list[int]]:
    """Per strategy, the places in ``ranked`` of the layouts its calibration runs: its fastest at
    ``micro_batch_size`` without activation checkpointing (else its fastest), and the same split at half (else
    twice) that micro batch, which makes other calls per step, where the strategy has it."""
    def plain(prediction: Prediction) -> bool:
        return prediction.layout.micro_batch_size == micro_batch_size and not prediction.layout.activation_checkpointing

    chosen: dict[str, list[int]] = {}
    for place, prediction in sorted(enumerate(ranked), key=lambda item: (not plain(item[1]), item[0])):
        chosen.setdefault(prediction.layout.strategy, [place])
    places = {prediction.layout: place for place, prediction in enumerate(ranked)}
    for strategy, (place,) in chosen.items():
        layout = ranked[place].layout
        samples = layout.micro_batch_size * layout.accumulation
        twins = [replace(layout, micro_batch_size=size, accumulation=samples // size)
                 for size in (layout.micro_batch_size // 2, layout.micro_batch_size * 2) if size and samples % size == 0]
        chosen[strategy] += [places[twin] for twin in twins if twin in places][:1]
    return chosen


@dataclass(frozen=True)
class CalibrationRun:
    """A calibration run's layout, and its step time measured and modelled."""

    layout: Layout
    measured: float
    modelled: float

    def describe(self) -> str:
        return f"{self.layout.describe()}: {self.measured * 1e3:.1f} ms (modelled {self.modelled * 1e3:.1f})"


@dataclass(frozen=True)
class Calibration:
    """One strategy's calibration: its runs, and the overhead fitted to them."""

    strategy: str
    runs: tuple[CalibrationRun, ...]
    overhead: Overhead

    def describe(self) -> str:
        return (f"{', '.join(run.describe() for run in self.runs)}: {self.overhead.per_step * 1e3:.1f} ms a step + "
                f"{self.overhead.per_call * 1e3:.2f} ms a forward and backward")


def calibrate(fit_args: Sequence[str], ranked: Sequence[Prediction], runs: Sequence[Sequence[str]],
              micro_batch_size: int, steps: int) -> tuple[list[Prediction], list[Calibration]]:
    """``ranked`` (whose layouts ``runs`` run) with each strategy's measured overhead added, fastest first again, and
    the calibrations."""
    calibrations = {}
    with tempfile.TemporaryDirectory(prefix="cohort-plan-") as folder:
        for strategy, places in calibration_layouts(ranked, micro_batch_size).items():
            measured = [CalibrationRun(ranked[place].layout,
                                       measured_step_seconds(run_fit([*absolute(fit_args), *absolute(runs[place])],
                                                                     steps, Path(folder))),
                                       ranked[place].step_seconds) for place in places]
            overhead = Overhead.fitted([(run.layout, run.measured - run.modelled) for run in measured])
            calibrations[strategy] = Calibration(strategy, tuple(measured), overhead)
    scaled = [calibrated(prediction, calibrations[prediction.layout.strategy].overhead) for prediction in ranked]
    return fastest_first(scaled), list(calibrations.values())
