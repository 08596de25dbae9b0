"""What a run's TensorBoard folder holds beyond the logged scalars: a custom-scalars layout that draws every rank's
series of a monitor field as one chart, beside a min/median/max band (and a mixture of experts' routing charts in a
category of their own), and the final validation loss for the HParams tab.

The layout is in the CUSTOM SCALARS tab. The HPARAMS tab compares runs by ``hp_metric``: Lightning declares it with
the hyperparameters at fit start (-1, a placeholder), and the monitor logs the run's last ``val/loss`` to it when
training ends.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger

from app.observability.fields import PIPELINE_COMPUTE, WindowField


def custom_scalars_layout(fields: tuple[WindowField, ...]) -> dict[str, dict[str, list[Any]]]:
    """The layout of the monitor's ``fields`` that a run logs (app/observability/fields.py logged_fields) in
    ``SummaryWriter.add_custom_scalars``' form, {category: {chart title: [kind, tags]}}: each charted field gives
    "TITLE — every rank" and "TITLE — min, median, max".

    A multi-line chart's tags are regular expressions, matched from the start of a tag, so one covers every rank
    at any world size; a margin chart takes exactly three tags: the value, its lower and its upper bound.
    """
    charts: dict[str, list[Any]] = {}
    for field in fields:
        if field.chart is not None:
            charts[f"{field.chart} — every rank"] = ["Multiline", [field.tag(r"rank\d+$")]]
            charts[f"{field.chart} — min, median, max"] = ["Margin", [field.tag(s) for s in ("median", "min", "max")]]
    if PIPELINE_COMPUTE in fields:  # the measured share beside the schedule's theory
        charts["pipeline bubble — every rank and theory"] = [
            "Multiline", [r"monitor/pipeline_bubble/rank\d+$", r"monitor/pipeline_bubble_theory$"]]
    return {"every rank": charts}


def tensorboard_loggers(trainer: L.Trainer) -> list[TensorBoardLogger]:
    return [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]


def write_layout(trainer: L.Trainer, fields: tuple[WindowField, ...],
                 more: dict[str, dict[str, list[Any]]] | None = None) -> None:
    """Rank 0 writes the layout of the monitor's ``fields``, and the categories of charts in ``more`` after it (a
    mixture of experts': app/observability/routing.py), into each TensorBoard run, once per run (TensorBoard reads
    one per writer)."""
    if trainer.is_global_zero:
        for logger in tensorboard_loggers(trainer):
            logger.experiment.add_custom_scalars({**custom_scalars_layout(fields), **(more or {})})


def log_final_val_loss(trainer: L.Trainer) -> None:
    """The last validation loss as ``hp_metric``, the metric Lightning declared with the hyperparameters.

    Not a second ``log_hyperparams(params, metrics)``: TensorBoard keeps only the first declaration a run holds, and
    the HParams tab shows the last value of each declared metric's scalar.
    """
    val_loss = trainer.callback_metrics.get("val/loss")
    if trainer.is_global_zero and val_loss is not None:
        for logger in tensorboard_loggers(trainer):
            logger.log_metrics({"hp_metric": float(val_loss)}, step=trainer.global_step)
