"""``cohort plan --try K``: the best K layouts run for a few steps each with the real ``cohort fit`` (a new process,
in a temporary folder), their measured step time printed against the predicted one, and the fastest named.

Measured step time: the median over the steps after the first two (start-up, the optimizer's moments) of the
monitor's slowest rank per step (``monitor/step_s/max``: a step ends when its last rank does). Each run is also held
to one process running the same steps (the recipe on its single-process preset): the global gradient norm of every
step must agree within the tolerance the arithmetic allows (sums taken in another order: 1e-4 relative in float32,
as tests/helpers.py assert_comparable_runs_agree; 2e-2 with a 16-bit compute dtype, one bfloat16 rounding step).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from app.tools.cost_model import ModelFacts, Prediction
from app.tools.layouts import CONFIG_DIR, PRESETS
from core.errors import UserError

WARMUP_STEPS = 2  # steps left out of the measured median
# what a short trial needs of fit: a monitor window and a log line per step, no validation and no checkpoints
TRIAL = ["--trainer.log_every_n_steps", "1", "--monitor.every_n_steps", "1", "--trainer.limit_val_batches", "0",
         "--checkpoint.every_n_train_steps", "1000000", "--trainer.enable_progress_bar", "false"]


def scalars(run_dir: Path, tag: str) -> list[float]:
    """What the run whose log folder is ``run_dir`` (lightning_logs/version_N) logged under ``tag``, in step order."""
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return [event.value for event in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


def run_fit(arguments: Sequence[str], steps: int, folder: Path) -> Path:
    """``cohort fit`` with ``arguments`` for ``steps`` steps in ``folder`` (where the runs before it left the data
    they built), returning its log folder; a UserError with its last line if it fails."""
    logs = folder / "lightning_logs"
    before = set(logs.glob("version_*"))
    result = subprocess.run([sys.executable, "-m", "app", "fit", *arguments, *TRIAL, "--trainer.max_steps", str(steps)],
                            cwd=folder, capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        last = last.removeprefix("cohort: error: ").split(" (COHORT_TRACEBACK")[0]
        raise UserError(f"cohort plan --try: cohort fit {' '.join(arguments)} failed: {last}")
    return (set(logs.glob("version_*")) - before).pop()


def measured_step_seconds(run_dir: Path) -> float:
    return statistics.median(scalars(run_dir, "monitor/step_s/max")[WARMUP_STEPS:])


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
    print(f"\n--try {len(ranked)}: {steps} steps each (median of steps {WARMUP_STEPS + 1}-{steps}, the slowest rank's), "
          f"and one process for the same steps")
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
