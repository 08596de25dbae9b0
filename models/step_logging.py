"""When a LightningModule's values reach the loggers: a training step's (its loss, gradient norm, learning rate)
only on the steps the logger writes, and a step's values and a validation's under the step the console and the
monitor give them, not Lightning's count of the steps before it. ``CohortModule`` (models/module.py) is one."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn

from core.run_plan import run_plan_of


class StepLoggedModule(L.LightningModule):
    """Holds the step's values to log (``step_metrics``: its last micro-batch's loss, the gradient norm before
    clipping, ...), which training_step and clipping set and ``log_step_metrics`` logs, and the names logged in fit
    that ``write_logged_metrics`` hands to the loggers."""

    def __init__(self) -> None:
        super().__init__()
        self.step_metrics: dict[str, torch.Tensor] = {}
        self.metrics_to_write: set[str] = set()

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's step (after the step's last micro-batch, its clipping and the update); then the step's values
        are logged if the logger writes this step, so that callbacks read them in on_train_batch_end."""
        super().optimizer_step(*args, **kwargs)
        if self.trainer._logger_connector.should_update_logs:
            self.log_step_metrics()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """What the step logged (the callbacks' too: they have run) goes to the loggers here. A stop asked for in the
        callbacks' on_train_batch_end (a preemption signal) logs this step's values too, on a step the logger would
        not have written: the run ends with them."""
        if self.step_metrics and self.trainer.should_stop:
            self.log_step_metrics()
        if (self.metrics_to_write and run_plan_of(self).ends_optimizer_step(batch_idx)
                and self.trainer._logger_connector.should_update_logs):  # the steps Lightning's logger writes
            self.write_logged_metrics()

    def log_step_metrics(self) -> None:
        """The step's loss, gradient norm, ... and learning rate, once. Only on the steps the logger writes (every
        trainer.log_every_n_steps, and the step a run stops at): each self.log costs Lightning about 0.4 ms of
        Python, a tenth of a small model's step, and the logger drops the other steps' values."""
        for name, value in self.step_metrics.items():
            self.log(name, value, prog_bar=name == "train/loss")
        self.log("lr", self.lr_schedulers().get_last_lr()[0])  # the scheduler steps after on_train_batch_end
        self.step_metrics = {}

    def log(self, name: str, value: Any, prog_bar: bool = False, logger: bool | None = None,
            on_step: bool | None = None, on_epoch: bool | None = None, **kwargs: Any) -> None:
        """Lightning's self.log, except for what Lightning would write at its count of the steps before this one (the
        tenth step's loss, and the validation after it, at 9): that ``write_logged_metrics`` writes at the step the
        console's lines and the monitor's series give (10)."""
        deferred = logger is not False and self.written_a_step_behind(on_step, on_epoch)
        super().log(name, value, prog_bar=prog_bar, logger=False if deferred else logger, on_step=on_step,
                    on_epoch=on_epoch, **kwargs)
        if deferred:
            self.metrics_to_write.add(name)

    def written_a_step_behind(self, on_step: bool | None, on_epoch: bool | None) -> bool:
        """In fit, a value of one training step (one series: not also aggregated over the epoch) or of a validation.
        What a training epoch aggregates Lightning writes after the epoch's last step, at the step it counts."""
        trainer = self._trainer
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return False
        if trainer.validating:
            return not on_step
        if on_step is None:  # Lightning's default: per step, except in the epoch hooks
            on_step = self._current_fx_name not in ("on_train_epoch_start", "on_train_epoch_end")
        return on_step and not on_epoch

    def write_logged_metrics(self) -> None:
        """What ``log`` kept for the loggers, as the trainer's callback metrics hold it (a validation's values reduced
        over its batches and ranks), at Lightning's logging step plus one: the optimizer steps taken, or under the
        fault-tolerant strategy, which sets Lightning's step to the committed ones, the step being committed. Nothing
        of the sanity check's validation, as Lightning."""
        trainer, names = self.trainer, self.metrics_to_write
        self.metrics_to_write = set()
        if trainer.sanity_checking:
            return
        # read on every rank, as Lightning's own logging does (a value's first reading may reduce it across ranks)
        metrics = {name: value for name, value in trainer.callback_metrics.items() if name in names}
        if not trainer.is_global_zero or not metrics:
            return
        scalars = {name: float(value) for name, value in metrics.items()}
        step = trainer.fit_loop.epoch_loop._batches_that_stepped + 1
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step=step)

    def on_validation_end(self) -> None:
        if self.metrics_to_write:
            self.write_logged_metrics()
