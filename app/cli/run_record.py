"""What a run's folder keeps of the commands run on it, and that none of them overwrites another's.

``config.yaml`` is the config of the fit that started the run, and stays so: every checkpoint-mismatch error sends
the user to it. A resumed fit leaves it as it is and appends to ``resumes.yaml`` beside it the step it resumed at and
each setting it changed against the first (the layout, ``trainer.max_steps``, the batch sizes...); a changed
``trainer.max_steps`` is also said in one line, with what it does to the learning-rate schedule at that step.

``validate``, ``test`` and ``predict`` of a run's checkpoint log into a folder of their own inside the run,
``version_N/validate/`` and so on, with their own ``config.yaml``, ``hparams.yaml`` and TensorBoard events (the
TensorBoard logger's ``sub_dir``): where a Lightning user looks for a command's logs, in the run's folder, and shown
by TensorBoard as a run of their own beside the training curves. Under another logger, whose folder is shared, such
a command saves its config as ``<command>_config.yaml``.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import yaml
from jsonargparse import Namespace
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.utilities import rank_zero_info

from app.cli.preflight import log_root

RESUMES_FILE = "resumes.yaml"
# what every resume sets differently by itself: not a change the user made
SET_BY_RESUMING = ("ckpt_path", "trainer.logger.init_args.version")


def logs_under_the_root_dir(trainer_config: Namespace) -> None:
    """``trainer.default_root_dir`` moves the default TensorBoard logger's folder (``./lightning_logs``) under it, as
    Lightning's own default logger does; a logger with a save_dir of its own keeps it."""
    logger = trainer_config.logger
    root_dir = trainer_config.default_root_dir
    if root_dir is None or not (hasattr(logger, "class_path") and logger.class_path.endswith("TensorBoardLogger")):
        return
    if logger.init_args.save_dir == ".":
        logger.init_args.save_dir = str(root_dir)


def log_beside_the_run(config: Namespace, subcommand: str, save_config_kwargs: dict[str, Any]) -> None:
    """Point an evaluating command's logs and config at a folder of its own in the run's folder (under another
    logger: at a config file name of its own), so that nothing of the run is written over."""
    if subcommand == "fit":
        return
    root = log_root(config.trainer)
    if root is None:
        save_config_kwargs["config_filename"] = f"{subcommand}_config.yaml"
        return
    logger = config.trainer.logger.init_args
    if logger.version is None and config.ckpt_path is not None:  # a run's checkpoint named by its path: that run's
        logger.version = run_version_of(Path(config.ckpt_path), root)
    logger.sub_dir = str(Path(logger.sub_dir, subcommand)) if logger.sub_dir else subcommand  # inside a replica group's


def run_version_of(checkpoint: Path, root: Path) -> str | None:
    """The run folder (``version_N``) under ``root`` that holds ``checkpoint``; None for a checkpoint elsewhere."""
    try:
        folder = checkpoint.resolve().relative_to(root.resolve()).parts[0]
    except ValueError:
        return None
    return folder if folder.startswith("version_") else None


class RunConfig(SaveConfigCallback):
    """Lightning's SaveConfigCallback, except that a fit resumed in its run's folder keeps the first ``config.yaml``
    and records its own changes to it in ``resumes.yaml``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.first_config: Path | None = None  # set on rank 0 of a resumed fit

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or self.config.ckpt_path is None or self.already_saved:
            return super().setup(trainer, pl_module, stage)
        first = Path(trainer.log_dir, self.config_filename)  # log_dir broadcasts: every rank comes here alike
        resumed_in_its_folder = trainer.strategy.broadcast(trainer.is_global_zero and first.is_file())
        if not resumed_in_its_folder:  # a new folder for a run from another run's checkpoint: its own first config
            return super().setup(trainer, pl_module, stage)
        self.first_config = first if trainer.is_global_zero else None
        self.already_saved = True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After the checkpoint is restored: its step and the schedule's state at it are known."""
        if self.first_config is None:
            return
        first = flat(yaml.safe_load(self.first_config.read_text()))
        now = flat(yaml.safe_load(self.parser.dump(self.config, skip_none=False)))
        resumes = self.first_config.with_name(RESUMES_FILE)
        records = yaml.safe_load(resumes.read_text()) if resumes.is_file() else []
        changed = {key: {"first": first.get(key), "now": now.get(key)} for key in sorted(first.keys() | now.keys())
                   if key not in SET_BY_RESUMING and first.get(key) != now.get(key)}
        records.append({"step": trainer.global_step, "ckpt_path": str(self.config.ckpt_path), "changed": changed})
        resumes.write_text(yaml.safe_dump(records, sort_keys=False))
        # the max_steps the checkpoint's run planned its schedule with: the newest resume's, else the first's
        before = records[-2]["changed"] if len(records) > 1 else {}
        max_steps_before = before.get("trainer.max_steps", {}).get("now", first.get("trainer.max_steps"))
        if max_steps_before != trainer.max_steps:
            rank_zero_info(max_steps_change(trainer, max_steps_before))


def flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as {"trainer.max_steps": 500, ...}; lists stay whole values."""
    items: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            items.update(flat(value, f"{prefix}{key}."))
        else:
            items[f"{prefix}{key}"] = value
    return items


def max_steps_change(trainer: L.Trainer, max_steps_before: int) -> str:
    """One line on a resume's new ``trainer.max_steps`` and what it does to the learning rate, from the restored
    scheduler: the step at which training goes on runs at the rate the checkpoint's run planned for it (the
    optimizer's restored rate), the next at the rate the schedule planned over the new max_steps gives."""
    step, line = trainer.global_step, f"resume: trainer.max_steps {max_steps_before} -> {trainer.max_steps}"
    if not trainer.lr_scheduler_configs:
        return f"{line}: no learning-rate schedule depends on it"
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    planned = scheduler.get_last_lr()[0]  # restored from the checkpoint: the rate its run planned for this step
    with warnings.catch_warnings():  # torch warns that get_lr is meant for step(); here it is asked on purpose
        warnings.simplefilter("ignore")
        replanned = scheduler.get_lr()[0]  # the new plan's rate for this step
        scheduler.last_epoch += 1
        try:
            next_rate = scheduler.get_lr()[0]  # what the scheduler's step after this step will set
        finally:
            scheduler.last_epoch -= 1
    if math.isclose(planned, replanned, rel_tol=1e-6):
        return f"{line}: the learning-rate schedule does not depend on it ({planned:.2e} at step {step}, as planned)"
    return (f"{line}: the learning-rate schedule is re-planned over {trainer.max_steps} steps; the learning rate jumps "
            f"from {planned:.2e} at step {step} (as planned before) to {next_rate:.2e} at step {step + 1} "
            f"(model.optimizer.lr_decay_steps {max_steps_before} would keep that plan)")
