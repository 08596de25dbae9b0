"""The Lightning subcommands of ``cohort`` (fit, validate, test, predict): LightningCLI over the GPT language model
and the token-file datamodule, with Cohort's checks before anything is built. ``app/__main__.py`` dispatches."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from app.bad_steps import BadStepGuard
from app.callbacks import NcclFlightRecorder, PerRankSeed, PrintPredictions
from app.checkpoints import RunCheckpoint, check_checkpoint, find_last_checkpoint
from app.launch import parent_start_time, torchrun_restart
from app.monitoring import RankMonitor, ReplicaDivergenceError
from app.preemption import PreemptionCheckpoint, preemption_callback
from app.run_plan import apply_batch_plan, check_launch, check_strategy, check_writable_folder, resolve_precision
from core.errors import UserError
from datamodules.language_modeling import LanguageModelingDataModule
from models.language_model import GPTLanguageModel

DEFAULT_SEED = 1337  # fixed, not random: a resumed run must draw the same data and dropout as the first


class CohortCLI(LightningCLI):
    def __init__(self, args: list[str] | None = None, run: bool = True) -> None:
        super().__init__(
            GPTLanguageModel,
            LanguageModelingDataModule,
            seed_everything_default=DEFAULT_SEED,
            trainer_defaults={
                "logger": {
                    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                    "init_args": {"save_dir": ".", "name": "lightning_logs"},
                },
                "use_distributed_sampler": False,  # the datamodule shards by rank itself
                "callbacks": [PerRankSeed(), PrintPredictions()],
            },
            save_config_kwargs={"overwrite": True},  # a resumed run rewrites its own config.yaml
            args=args,
            run=run,
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.vocab_size", "model.vocab_size")
        parser.link_arguments("data.global_batch_size", "model.global_batch_size")
        parser.add_lightning_class_args(RunCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.save_last": "link",  # last.ckpt: a link to the newest step checkpoint, no second copy
                "checkpoint.monitor": "step",  # with mode max: keep the newest save_top_k checkpoints
                "checkpoint.mode": "max",
                "checkpoint.save_top_k": 2,
                "checkpoint.filename": "step={step:06d}",
                "checkpoint.auto_insert_metric_name": False,
                "checkpoint.every_n_train_steps": 100,
                "checkpoint.enable_version_counter": False,  # resumed runs keep writing last.ckpt
            }
        )
        parser.add_lightning_class_args(RankMonitor, "monitor")  # per-rank timing, stragglers, MFU, memory
        parser.add_lightning_class_args(BadStepGuard, "bad_steps")  # NaN, inf and loss spikes: stop, skip, rollback
        parser.add_lightning_class_args(PreemptionCheckpoint, "preemption")  # SIGTERM, SIGUSR1: checkpoint, then stop
        parser.add_argument(
            "--val_every_n_steps", type=int | None, default=None,
            help="validate every N optimizer steps (whatever the accumulation); None: once per epoch",
        )

    def _parse_ckpt_path(self) -> None:
        """Keep the config the user wrote. Lightning would replace the model's arguments with those stored in the
        checkpoint (and unpickle the whole file to read them); instead ``check_checkpoint`` refuses, in one line,
        a checkpoint whose architecture differs from the config."""

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        trainer = config.trainer
        if trainer.use_distributed_sampler:
            raise UserError("trainer.use_distributed_sampler must stay false: the datamodule gives each rank its "
                            "own samples, and Lightning's sampler would reorder them")
        if SLURMEnvironment.detect():  # preemption is handled by PreemptionCheckpoint, across ranks
            trainer.plugins = [*(trainer.plugins or []), Namespace(
                class_path="lightning.fabric.plugins.environments.SLURMEnvironment",
                init_args=Namespace(auto_requeue=False))]
        accelerator = trainer.accelerator if isinstance(trainer.accelerator, str) else "custom"
        check_strategy(trainer.strategy, accelerator)
        check_launch(trainer)
        trainer.precision = resolve_precision(trainer.precision, accelerator)
        if config.weights_only is None:  # checkpoints are data: refuse a pickle that asks for code, whatever torch's default
            config.weights_only = True
        if config.ckpt_path == "last":
            config.ckpt_path = self._resume_last(trainer)
        elif config.ckpt_path is None and self.subcommand == "fit" and torchrun_restart() > 0:
            # torchrun restarted the ranks after one failed: continue this job's run, not an older one in the folder
            config.ckpt_path = self._resume_last(trainer, written_since=parent_start_time())
        if config.ckpt_path not in (None, "last"):
            check_checkpoint(Path(config.ckpt_path), config.model, config.weights_only)
        for what, folder in (("log folder", log_root(trainer)), ("checkpoint folder", config.checkpoint.dirpath)):
            if folder is not None:
                check_writable_folder(Path(folder), what)

    def _resume_last(self, trainer_config: Namespace, written_since: float = 0.0) -> str | None:
        """Resolve ``--ckpt_path last`` to the newest run's last.ckpt, if written after ``written_since`` (seconds
        since the epoch), and log into that run's folder again."""
        root = log_root(trainer_config)
        if root is None:
            return "last"  # another logger: Lightning's own lookup
        checkpoint = find_last_checkpoint(root)
        if checkpoint is None or checkpoint.lstat().st_mtime < written_since:
            rank_zero_info(f"--ckpt_path last: no checkpoint under {root}/version_*/checkpoints"
                           f"{' from this job' if written_since else ''}, starting a new run")
            return None
        trainer_config.logger.init_args.version = checkpoint.parent.parent.name
        rank_zero_info(f"resuming from {checkpoint}")
        return str(checkpoint)

    def before_fit(self) -> None:
        apply_batch_plan(self.trainer, self.model, self.datamodule, self.config.fit.val_every_n_steps)
        if isinstance(self.trainer.accelerator, CUDAAccelerator):
            self.trainer.callbacks.append(NcclFlightRecorder(Path(self.trainer.log_dir)))
        for callback in list(self.trainer.callbacks):
            if isinstance(callback, RankMonitor) and not callback.enabled:
                self.trainer.callbacks.remove(callback)


def log_root(trainer_config: Namespace) -> Path | None:
    """The TensorBoard logger's folder of run versions (save_dir/name); None for another logger."""
    logger = trainer_config.logger
    if not (hasattr(logger, "class_path") and logger.class_path.endswith("TensorBoardLogger")):
        return None
    return Path(logger.init_args.save_dir) / logger.init_args.name


def run_cli(args: list[str] | None) -> None:
    """The Lightning subcommands; a run stopped by a signal exits non-zero, saying how to resume."""
    cli = CohortCLI(args=args)
    preemption = preemption_callback(cli.trainer)
    if preemption is not None and (message := preemption.stop_message(cli.trainer)):
        if cli.trainer.is_global_zero:
            print(f"cohort: {message}", file=sys.stderr)
        sys.exit(128 + preemption.stopped_by)


def run_reporting_errors(command: Callable[[Any], object], args: Any) -> None:
    """Run a command; a user's mistake ends it with one line on stderr instead of a traceback."""
    try:
        command(args)
    except (UserError, MisconfigurationException, ReplicaDivergenceError) as error:
        if os.environ.get("COHORT_TRACEBACK"):
            raise
        message = re.sub(r"\s+", " ", str(error)).strip()  # one line, also for Lightning's wrapped messages
        sys.exit(f"cohort: error: {message} (COHORT_TRACEBACK=1 shows where)")
