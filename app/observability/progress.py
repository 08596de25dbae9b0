"""Progress in optimizer steps, printed by rank 0: the default bar of every ``cohort`` run (Lightning's own counts
micro-batches):

    step 100/500  loss 2.494  lr 2.92e-03  17,611 tokens/s  elapsed 0:23  ETA 1:33
    step 100/500  val/loss 2.41  val/perplexity 11.1  (0.9 s)

On a terminal the step line is redrawn in place, at most every REFRESH_SECONDS; elsewhere (SLURM output files, CI
logs) a plain line is printed every N optimizer steps and at the last one, with no carriage returns. Each validation
during fit prints one line with its result (on a terminal, below the last step line drawn).

The rate is a moving average of rank 0's step times (the ranks keep in step through the gradient all-reduce), so
it needs no collective; validation time is left out of it, and so is a run's first step (start-up). A resumed run
starts at its restored step, and its ETA is the steps left at the current rate. The loss is read only when a line is
printed: turning the step's loss tensor into a number waits for the device.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ProgressBar

from core.errors import check_ranges
from core.run_plan import run_plan_of

REFRESH_SECONDS = 0.5  # a terminal line: often enough to watch, rarely enough that reading the loss costs nothing
SMOOTHING = 0.1  # weight of the newest step time in the rate: about the last ten steps count
CLEAR_TO_END = "\x1b[K"  # the rest of a longer line drawn before


def format_duration(seconds: float) -> str:
    """``1:48``, ``1:02:03``."""
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


class StepProgress(ProgressBar):
    def __init__(self, every_n_steps: int | None = None, interactive: bool | None = None) -> None:
        """
        Args:
            every_n_steps: optimizer steps between lines when the output is not a terminal; None:
                trainer.log_every_n_steps.
            interactive: redraw one line in place; None: when stdout is a terminal.
        """
        super().__init__()
        check_ranges("progress", {"every_n_steps": (every_n_steps is None or every_n_steps >= 1, ">= 1, or null")},
                     {"every_n_steps": every_n_steps})
        self.every_n_steps = every_n_steps
        self.interactive = interactive
        self.enabled = True
        self.line_open = False  # a terminal line drawn, not yet ended

    def disable(self) -> None:
        self.enabled = False

    def enable(self) -> None:
        self.enabled = True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.terminal = sys.stdout.isatty() if self.interactive is None else self.interactive
        self.every = trainer.log_every_n_steps if self.every_n_steps is None else self.every_n_steps
        self.total = trainer.estimated_stepping_batches  # max_steps, or what max_epochs allows; inf: unbounded
        self.tokens_per_step = run_plan_of(pl_module).tokens_per_step
        self.unit = run_plan_of(pl_module).unit
        self.started = self.step_started = self.drawn_at = time.perf_counter()
        self.paused = 0.0  # validation inside the current step's interval
        self.steps_timed = 0
        self.seconds_per_step: float | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self.enabled or not run_plan_of(pl_module).ends_optimizer_step(batch_idx):
            return
        now = time.perf_counter()
        self.time_step(now - self.step_started - self.paused)
        self.step_started, self.paused = now, 0.0
        step = trainer.global_step
        last = step >= self.total
        # Lightning hands back the loss divided by the accumulation steps (a tensor: read only if a line is printed)
        loss = outputs["loss"]
        if self.terminal and (last or now - self.drawn_at >= REFRESH_SECONDS):
            self.write(f"{self.step_line(trainer, pl_module, loss, now)}{CLEAR_TO_END}\r")  # the cursor stays put
            self.drawn_at, self.line_open = now, True
        elif not self.terminal and (last or step % self.every == 0):
            self.write(f"{self.step_line(trainer, pl_module, loss, now)}\n")

    def time_step(self, seconds: float) -> None:
        self.steps_timed += 1
        if self.steps_timed == 1:  # start-up: the data loader, lazy initialisation, the first allocations
            return
        previous = self.seconds_per_step
        self.seconds_per_step = seconds if previous is None else SMOOTHING * seconds + (1 - SMOOTHING) * previous

    def step_line(self, trainer: L.Trainer, pl_module: L.LightningModule, scaled_loss: torch.Tensor, now: float) -> str:
        """The step's loss (its last micro-batch's, as logged; ``scaled_loss`` is it divided by the accumulation)
        and learning rate (the scheduler steps after on_train_batch_end), rate, elapsed time and ETA."""
        step = trainer.global_step
        loss = float(scaled_loss) * run_plan_of(pl_module).accumulation
        parts = [self.step_of_total(step), f"loss {loss:.4g}"]
        if trainer.optimizers:
            parts.append(f"lr {trainer.optimizers[0].param_groups[0]['lr']:.2e}")
        if self.seconds_per_step:
            parts.append(f"{self.tokens_per_step / self.seconds_per_step:,.0f} {self.unit}/s")
        parts.append(f"elapsed {format_duration(now - self.started)}")
        if self.seconds_per_step and math.isfinite(self.total):
            parts.append(f"ETA {format_duration(max(self.total - step, 0) * self.seconds_per_step)}")
        return "  ".join(parts)

    def step_of_total(self, step: int) -> str:
        return f"step {step}/{self.total}" if math.isfinite(self.total) else f"step {step}"

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.validation_started = time.perf_counter()
        # the last step line drawn stays above the result (redrawing it here could not read the step's loss: the
        # trainer's metrics are the validation's now)
        self.end_line()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.validating_in_fit(trainer):
            return
        seconds = time.perf_counter() - self.validation_started
        self.paused += seconds
        results = [f"{name} {float(value):.3g}" for name, value in trainer.callback_metrics.items()
                   if name.startswith("val/")]
        self.write(f"{self.step_of_total(trainer.global_step)}  {'  '.join(results)}  ({seconds:.1f} s)\n")

    def validating_in_fit(self, trainer: L.Trainer) -> bool:
        """One line per validation during fit; none for the sanity check, nor in ``cohort validate`` (which prints
        Lightning's table)."""
        return self.enabled and trainer.state.fn == "fit" and not trainer.sanity_checking

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.end_line()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.end_line()

    def end_line(self) -> None:
        """Keep the last step line and move below it, so what is printed next does not overwrite it."""
        if self.enabled and self.line_open:
            self.write("\n")
            self.line_open = False

    def write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
