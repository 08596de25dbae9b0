"""The Lightning subcommands of ``cohort`` (fit, validate, test, predict): LightningCLI over any model family and
its datamodule, chosen by ``model.class_path`` and ``data.class_path`` (GPT and the token files when a config names
none), with Cohort's checks before anything is built. ``app/__main__.py`` dispatches."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from jsonargparse import Namespace
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.callbacks import Callback, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from app.cli.argument_parser import CohortArgumentParser, replace_default_classes
from app.cli.commands import DESCRIPTION, LIGHTNING_COMMANDS, describe
from app.cli.preflight import Preflight, check_config, resolve_precision
from app.cli.run_plan_resolution import accelerator_name
from app.cli.run_record import RunConfig, log_beside_the_run, logs_under_the_root_dir
from app.cli.samples import PrintPredictions
from app.observability.flight_recorder import NcclFlightRecorder
from app.observability.monitor import RankMonitor
from app.observability.progress import StepProgress
from app.safety.bad_steps import BadStepGuard
from app.safety.checkpoint_reading import read_sharded_folders
from app.safety.checkpoint_writing import RunCheckpoint
from app.safety.determinism import PerRankSeed, SameThreadsOnEveryRank
from app.safety.preemption import PreemptionCheckpoint, preemption_callback
from app.safety.replica_check import ReplicaCheck, ReplicaDivergenceError
from app.strategies.gradient_compression import GradientCompression
from app.strategies.local_updates import LocalUpdates
from app.strategies.parameter_server.server import WorkerLost
from core.errors import UserError
from core.run_plan import RunPlan
from core.seeding import DEFAULT_SEED
from datamodules.base import ShardedDataModule
from datamodules.language_modeling import LanguageModelingDataModule
from datamodules.own_datamodule import share_out_training_samples
from models.class_paths import class_path_of, with_current_class_paths
from models.module import DERIVED_FROM_DATA, CohortModule
from models.registry import DEFAULT_FAMILY, families_help


class CohortCLI(LightningCLI):
    run_plan: RunPlan  # resolved by the pre-flight checks, before anything is built
    def __init__(self, args: list[str] | None = None, run: bool = True) -> None:
        # a parser for the command named first only (each of the four takes a quarter of the start-up's parsing);
        # all four for --help, a mistake, or options before the command
        given = sys.argv[1:] if args is None else args
        self.commands = given[:1] if given[:1] and given[0] in LIGHTNING_COMMANDS else list(LIGHTNING_COMMANDS)
        super().__init__(
            CohortModule,
            LightningDataModule,
            subclass_mode_model=True,  # the family: model.class_path (models/module.py)
            subclass_mode_data=True,
            trainer_defaults={
                "logger": {
                    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                    "init_args": {"save_dir": ".", "name": "lightning_logs"},
                },
                # each rank's samples are Cohort's choice (app/cli/run_plan_resolution.py's training_data)
                "use_distributed_sampler": False,
                # Lightning's table lists the metric modules and "Total Flops 0"; before_fit prints one line instead
                "enable_model_summary": False,
                "callbacks": [SameThreadsOnEveryRank(), PerRankSeed(), PrintPredictions()],
            },
            parser_class=CohortArgumentParser,
            # a resumed fit keeps its run's first config.yaml; other commands log into a folder of their own
            save_config_callback=RunConfig,
            save_config_kwargs={"overwrite": True},  # what a command writes again is its own
            parser_kwargs=self.parser_descriptions(),
            args=args,
            run=run,
        )

    def parser_descriptions(self) -> dict[str, Any]:
        """What ``--help`` says: Cohort and each subcommand, in app/cli/commands.py's words (Lightning's would be
        "Lightning Trainer command line tool" and the Trainer methods' docstrings), and the model families
        (models/registry.py)."""
        # allow_abbrev off: argparse would take --seed_everythin 3 as --seed_everything 3, a typo run without a word
        return {"prog": "cohort", "description": DESCRIPTION, "allow_abbrev": False,
                **{command: {"description": f"{describe(command)} {families_help()}", "allow_abbrev": False}
                   for command in self.commands}}

    def subcommands(self) -> dict[str, set[str]]:  # type: ignore[override]  (Lightning's is static: all four)
        return {command: skip for command, skip in LightningCLI.subcommands().items() if command in self.commands}

    def add_default_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Lightning's ``--seed_everything``, but an integer only: ``true`` would draw a random seed that a resumed
        run could not draw again."""
        parser.add_argument("--seed_everything", type=int, default=DEFAULT_SEED,
                            help="one seed for the data order, the initial weights and dropout on every rank")

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # a config that names no family trains the default one on token files, as every config did before there
        # were others
        parser.set_defaults({"model": {"class_path": DEFAULT_FAMILY.class_path},
                             "data": {"class_path": class_path_of(LanguageModelingDataModule)}})
        # what the model must agree with the data on; a link whose two ends are not both in the chosen classes is
        # skipped, so each family takes the ones it has
        parser.link_arguments("data.init_args.vocab_size", "model.init_args.vocab_size")
        parser.link_arguments("seed_everything", "model.init_args.seed")
        for derived in DERIVED_FROM_DATA:  # known once the datamodule has looked at its image folder
            parser.link_arguments(f"data.{derived}", f"model.init_args.{derived}", apply_on="instantiate")
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
        # DDP's gradient all-reduce: plain, bf16, fp16 or PowerSGD; registers the comm hook the monitor times
        parser.add_lightning_class_args(GradientCompression, "gradient_compression")
        # sync (DDP), local SGD or DiLoCo: ranks step on their own gradients and meet every sync_every steps
        parser.add_lightning_class_args(LocalUpdates, "local_updates")
        parser.add_lightning_class_args(RankMonitor, "monitor")  # per-rank timing, stragglers, MFU, memory
        # ranks that should hold the same weights do, under every strategy; the network sharded as the strategy says
        parser.add_lightning_class_args(ReplicaCheck, "replica_check")
        parser.add_lightning_class_args(BadStepGuard, "bad_steps")  # NaN, inf and loss spikes: stop, skip, rollback
        parser.add_lightning_class_args(PreemptionCheckpoint, "preemption")  # SIGTERM, SIGUSR1: checkpoint, then stop
        # not a callback key: instantiate_trainer adds it only where Lightning would add its own bar
        parser.add_class_arguments(StepProgress, "progress")
        parser.add_argument(
            "--val_every_n_steps", type=int | None, default=None,
            help="validate every N optimizer steps (whatever the accumulation); None: once per epoch",
        )

    def _parse_ckpt_path(self) -> None:
        """Keep the config the user wrote. Lightning would replace the model's arguments with those stored in the
        checkpoint (and unpickle the whole file to read them); instead ``check_checkpoint`` refuses, in one line,
        a checkpoint whose architecture differs from the config."""

    def parse_arguments(self, parser: LightningArgumentParser, args: list[str] | None) -> None:
        """``--print_config`` prints and exits while parsing; before that, check what the config alone decides, so
        that a config ``fit`` would refuse is refused here too, and one it accepts is accepted: with the precision a
        run on this machine's CPU would get (16-mixed runs as bf16-mixed there). A GPU config is checked as written:
        this machine may not be the one it runs on. A config that names a model family or datamodule other than the
        defaults is parsed twice: the second time, the classes it chose take their own defaults."""
        argv = sys.argv[1:] if args is None else args
        if not isinstance(argv, list):
            return super().parse_arguments(parser, args)
        argv = [with_current_class_paths(arg) for arg in argv]  # --model OLD_PATH, as a config file's (parse_string)
        given = [arg for arg in argv if not arg.startswith("--print_config")]
        parsed = parser.parse_args(given)
        subcommand = parsed.get("subcommand")
        if replace_default_classes(self._subcommand_parsers[subcommand] if subcommand else parser,
                                   parsed[subcommand] if subcommand else parsed):
            parsed = parser.parse_args(given)  # the classes chosen, with their own defaults
        if given == argv:
            self.config = parsed
            return None
        config = parsed[subcommand] if subcommand else parsed
        accelerator = accelerator_name(config.trainer)
        if accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available()):
            config.trainer.precision = resolve_precision(config.trainer.precision, "cpu")
        check_config(config)
        return super().parse_arguments(parser, argv)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        logs_under_the_root_dir(config.trainer)
        if SLURMEnvironment.detect():  # preemption is handled by PreemptionCheckpoint, across ranks
            config.trainer.plugins = [*(config.trainer.plugins or []), Namespace(
                class_path="lightning.fabric.plugins.environments.SLURMEnvironment",
                init_args=Namespace(auto_requeue=False))]
        self.run_plan = Preflight(config, self.subcommand).run()
        log_beside_the_run(config, self.subcommand, self.save_config_kwargs)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Lightning's trainer, with StepProgress where Lightning would add its own bar: when the progress bar is on
        and no ProgressBar is among the callbacks (one there while the bar is off would make Lightning raise); an
        accelerator whose package is missing in one line."""
        config = self.config_init[self.subcommand]
        given = config.trainer.callbacks or []
        callbacks = [given] if isinstance(given, Callback) else list(given)
        bar_on = config.trainer.enable_progress_bar is not False and not config.trainer.barebones
        if bar_on and not any(isinstance(callback, ProgressBar) for callback in callbacks):
            kwargs["callbacks"] = [*callbacks, config.progress]
        try:
            return super().instantiate_trainer(**kwargs)
        except ModuleNotFoundError as error:  # Lightning's accelerators import their package when made (tpu: torch_xla)
            raise UserError(f"trainer.accelerator={config.trainer.accelerator} needs a package that is not installed "
                            f"({error}): install it, or use configs/trainer/cpu.yaml or a GPU preset") from error

    def instantiate_classes(self) -> None:
        """Build the trainer, model and datamodule, and hand the run plan to them; one device and DDP read a sharded
        checkpoint folder too."""
        super().instantiate_classes()
        read_sharded_folders(self.trainer)
        plan = self.run_plan.for_rank(self.trainer.global_rank)
        self.model.run_plan = self.datamodule.run_plan = plan
        if not isinstance(self.datamodule, ShardedDataModule):  # one's own: Cohort shares its samples out
            share_out_training_samples(self.datamodule, plan, self.trainer.global_rank,
                                       current_step=lambda: self.trainer.global_step)
        self.trainer.accumulate_grad_batches = plan.accumulation
        val_every_n_steps = self.config[self.subcommand].val_every_n_steps
        if val_every_n_steps is not None and not self.trainer.fast_dev_run:  # which validates after its one batch
            self.trainer.val_check_interval = val_every_n_steps * plan.accumulation  # Lightning counts micro-batches

    def _run_subcommand(self, subcommand: str) -> None:
        """Lightning's; a collective that timed out (a rank that hangs) ends in one line saying what it means for
        the run, instead of gloo's or NCCL's traceback, and a validation interval longer than an epoch in one line
        instead of Lightning's traceback."""
        try:
            super()._run_subcommand(subcommand)
        except ValueError as error:
            beyond = VALIDATION_BEYOND_EPOCH.search(str(error))
            if beyond is None:
                raise
            every = self.config[subcommand].get("val_every_n_steps")
            asked = f"val_every_n_steps={every}" if every is not None else "trainer.val_check_interval"
            raise UserError(f"{asked} is {beyond[1]} micro-batches, more than the {beyond[2]} of one epoch: validate "
                            "more often, or set trainer.check_val_every_n_epoch null so that the count runs across "
                            "epochs (as configs/quickstart.yaml does)") from error
        except RuntimeError as error:
            if not COLLECTIVE_TIMEOUT.search(str(error)):
                raise
            # the ranks Lightning's launcher started here (none under torchrun or srun): a hung one would otherwise
            # live on, holding its memory and GPU
            kill = getattr(self.trainer.strategy.launcher, "kill", None)
            if kill is not None:
                kill(signal.SIGKILL)
            raise UserError(stopped_answering(self.trainer)) from error

    def before_fit(self) -> None:
        rank_zero_info(f"model: {self.model.describe()}")
        rank_zero_info(f"batch plan: {self.run_plan.describe()}")
        if isinstance(self.trainer.accelerator, CUDAAccelerator):
            self.trainer.callbacks.append(NcclFlightRecorder(Path(self.trainer.log_dir)))
        for callback in list(self.trainer.callbacks):
            if isinstance(callback, RankMonitor) and not callback.enabled:
                self.trainer.callbacks.remove(callback)


def without_advertisements(record: logging.LogRecord) -> bool:
    """A logging filter: Lightning's tips to install its cloud products are nothing a user of this run acts on."""
    return not record.getMessage().startswith("💡 Tip")


def run_cli(args: list[str] | None) -> None:
    """The Lightning subcommands; a run stopped by a signal exits non-zero, saying how to resume."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(without_advertisements)  # rank_zero_info's
    cli = CohortCLI(args=args)
    exit_code = 0
    preemption = preemption_callback(cli.trainer)
    if preemption is not None and (message := preemption.stop_message(cli.trainer)):
        if cli.trainer.is_global_zero:
            print(f"cohort: {message}", file=sys.stderr)
        exit_code = 128 + preemption.stopped_by
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank has finished its command
        dist.destroy_process_group()
        exit_now(exit_code)
    if exit_code:
        sys.exit(exit_code)


USER_ERRORS = (UserError, MisconfigurationException, ReplicaDivergenceError, WorkerLost)  # one line: what to do
# what gloo says on a rank whose peer's process ended mid-collective (the peer's sockets closed with it)
LOST_PEER = re.compile(r"Connection (closed|reset) by peer")


# Lightning's refusal of a validation interval longer than an epoch while it validates per epoch
VALIDATION_BEYOND_EPOCH = re.compile(r"`val_check_interval` \((\d+)\) must be less than or equal to the number of "
                                     r"the training batches \((\d+)\)")
# what gloo (on the rank that waited, or on one whose peer gave up waiting) and NCCL's watchdog say of a collective
# that did not complete within the process group's timeout
COLLECTIVE_TIMEOUT = re.compile(r"Timed out waiting \d+ms for (recv|send) operation|Application timeout caused pair "
                                r"closure|Watchdog caught collective operation timeout")


def stopped_answering(trainer: Trainer) -> str:
    """What a collective timeout means for the run: which rank did not answer (where there is only one other),
    after which step, the checkpoint kept and how to resume. Reads nothing that would need the ranks to meet again
    (Trainer.log_dir broadcasts)."""
    others = [rank for rank in range(trainer.world_size) if rank != trainer.global_rank]
    silent = f"rank {others[0]}" if len(others) == 1 else f"one of the other {len(others)} ranks"
    checkpoint, logger = trainer.checkpoint_callback, trainer.logger
    kept, resume = "no checkpoint was written yet", "--ckpt_path last"
    if checkpoint is not None and checkpoint.last_model_path:
        kept = f"{os.path.normpath(checkpoint.last_model_path)} is kept"
        in_run_folder = logger is not None and logger.log_dir is not None and checkpoint.dirpath is not None and (
            Path(checkpoint.dirpath).resolve() == Path(logger.log_dir, "checkpoints").resolve())
        # --ckpt_path last looks in the logger's run folders only
        resume = resume if in_run_folder else f"--ckpt_path {os.path.normpath(checkpoint.last_model_path)}"
    return (f"rank {trainer.global_rank} waited in a collective after step {trainer.global_step} for "
            f"{silent}, which never answered within trainer.strategy.init_args.timeout (hung, stopped, or its node "
            f"unreachable): {kept}; find why it hung (its own output; py-spy dump --pid), then resume with the same "
            f"command and {resume}")


def run_reporting_errors(command: Callable[[Any], object], args: Any) -> None:
    """Run a command; a user's mistake, or a peer rank that died, ends it with one line on stderr instead of a
    traceback."""
    try:
        command(args)
    except Exception as error:
        error = user_error_within(error) or error
        lost_peer = isinstance(error, RuntimeError) and LOST_PEER.search(str(error)) is not None
        if os.environ.get("COHORT_TRACEBACK") or not (isinstance(error, USER_ERRORS) or lost_peer):
            raise
        message = re.sub(r"\s+", " ", str(error)).strip()  # one line, also for Lightning's wrapped messages
        if lost_peer:
            message = ("another process of this run ended in the middle of a step (killed, out of memory, or its node "
                       "failed), so this one stopped too: that process's own output or the scheduler's log says why; "
                       "resume with the same command and --ckpt_path last")
        exit_with_error(f"cohort: error: {message} (COHORT_TRACEBACK=1 shows where)")


def exit_with_error(line: str) -> NoReturn:
    """Print ``line`` on stderr and exit 1; a rank of a multi-process run leaves as ``exit_now`` says, and a peer
    that failed alike, or died, may never reach the barrier that a successful run passes. Lightning has already torn
    the trainer down (loggers finalised, callbacks told) when an error reaches here."""
    if dist.is_available() and dist.is_initialized():
        print(line, file=sys.stderr)
        exit_now(1)
    sys.exit(line)


def exit_now(exit_code: int) -> NoReturn:
    """End a rank of a multi-process run without the interpreter's finalisation. Objects that outlive the run (the
    preemption flag's group, DTensor parameters' device mesh, the pipeline's and the parameter server's groups) keep
    gloo's worker threads alive after ``destroy_process_group``; finalisation would tear the interpreter down under
    them and abort the process ("terminate called without an active exception", exit -6) after a run that succeeded
    or failed cleanly (seen after a resumed PowerSGD run, and after a full disk)."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(exit_code)


def user_error_within(error: BaseException) -> BaseException | None:
    """The user's mistake that ``error`` wraps, if any: jsonargparse reports a model or datamodule that refused its
    arguments as "does not validate against any of the Union subtypes", with the refusal as its cause."""
    while error is not None:
        if isinstance(error, USER_ERRORS):
            return error
        error = error.__cause__ or error.__context__
    return None
