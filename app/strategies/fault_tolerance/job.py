"""The job of fault-tolerant replica groups, seen from outside the groups: ``cohort fit`` starting torchft's
lighthouse and one torchrun per group (telling each its group and the job's folder through the variables of
app/safety/launch_environment.py), forwarding stop signals to them and waiting; and the store where the groups count
themselves in at the start and say when they have finished. The groups themselves train under strategy.py beside
this file; what the launcher reads of their settings is settings.py's record.
"""

from __future__ import annotations

import inspect
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.strategies.launchers.launcher import _Launcher
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed import TCPStore

from app.safety.launch_environment import REPLICA_GROUP_ENV, RUN_VERSION_ENV
from app.strategies.fault_tolerance.settings import FaultToleranceSettings
from core.errors import UserError

JOB_STORE_ENV = "COHORT_JOB_STORE"  # host:port of the store where the job's groups count themselves in at the start
JOB_FINISHED = "job_finished"  # the store's key once a group has trained to the end
LIGHTHOUSE_START_SECONDS = 30.0


def job_store(timeout: timedelta) -> TCPStore | None:
    """The job's store at COHORT_JOB_STORE: the one ``cohort fit`` or scripts/torchrun.sh (beside the lighthouse)
    started; None where the groups were given none."""
    address = os.environ.get(JOB_STORE_ENV)
    if address is None:
        return None
    host, port = address.rsplit(":", 1)
    return TCPStore(host, int(port), is_master=False, timeout=timeout)


def wait_for_every_group(store: TCPStore, replica_groups: int, timeout: timedelta) -> None:
    """At the job's start, wait until every group is up, so that the first steps are not taken by the groups that
    happened to start first (a quorum counts only the groups already up)."""
    store.add("replica_groups_up", 1)
    deadline = time.monotonic() + timeout.total_seconds()
    while (up := store.add("replica_groups_up", 0)) < replica_groups:
        if time.monotonic() >= deadline:
            rank_zero_info(f"replica groups: {up} of {replica_groups} up after {timeout.total_seconds():.0f} s "
                           "(trainer.strategy.init_args.start_timeout): training without the others, which join "
                           "when they are up")
            return
        time.sleep(0.05)


class ReplicaGroupsLauncher(_Launcher):
    """``cohort fit`` under this strategy: start the lighthouse (unless given) and one torchrun per replica group,
    forward SIGTERM and SIGUSR1 to them, and wait. Other commands (validate, test, predict) run here, on one
    process."""

    def __init__(self, settings: FaultToleranceSettings) -> None:
        self.settings = settings

    @property
    def is_interactive_compatible(self) -> bool:
        return False

    def launch(self, function: Callable, *args: Any, trainer: L.Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return function(*args, **kwargs)
        if self.settings.lighthouse:
            check_lighthouse_answers(self.settings.lighthouse)
        fit_arguments = inspect.signature(function).bind(*args, **kwargs).arguments
        # what Lightning does once per machine before training (build the embedded corpus), done here once for all
        # groups: each group is a machine of its own to Lightning, and they would build it at the same time
        if fit_arguments.get("datamodule") is not None:
            fit_arguments["datamodule"].prepare_data()
        run_dir = run_folder(trainer)
        run_dir.mkdir(parents=True, exist_ok=True)
        lighthouse = None if self.settings.lighthouse else start_lighthouse(self.settings, run_dir)
        address = self.settings.lighthouse or f"http://{socket.gethostname()}:{lighthouse[1]}"
        store = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)  # where the groups count themselves in
        job = {"TORCHFT_LIGHTHOUSE": address, JOB_STORE_ENV: f"{socket.gethostname()}:{store.port}"}
        # the checkpoint the job resumes (fit's ckpt_path), resolved once here: a restarted group takes a live group's
        # state instead of reading it again
        ckpt_path = fit_arguments.get("ckpt_path")
        resume = [f"--ckpt_path={ckpt_path}"] if ckpt_path else []
        groups = [self._start_group(group, job, resume, run_dir, trainer.num_devices)
                  for group in range(self.settings.replica_groups)]
        stop = forward_stop_signals(groups)
        try:
            codes = wait_for_groups(groups, lighthouse[0] if lighthouse else None, run_dir)
        finally:
            for process in groups:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
            if lighthouse is not None:
                lighthouse[0].terminate()
                lighthouse[0].wait()
        if stop.signal:
            raise SystemExit(128 + stop.signal)
        failed = {group: code for group, code in enumerate(codes) if code != 0}
        if len(failed) == len(codes):
            raise UserError(f"every replica group failed (exit codes {list(codes)}) after torchrun's "
                            f"{self.settings.max_restarts} restarts each: their output above says why")
        for group, code in failed.items():
            print(f"cohort: replica group {group} ended with exit code {code} after torchrun's restarts; the others "
                  "trained to the end without it", file=sys.stderr)
        return None

    def _start_group(self, group: int, job: dict[str, str], resume: list[str], run_dir: Path,
                     processes: int = 1) -> subprocess.Popen:
        """One torchrun of ``processes`` for replica group ``group``, in a session of its own (a signal reaches its
        processes)."""
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        env = {**os.environ, **job, REPLICA_GROUP_ENV: str(group), RUN_VERSION_ENV: run_dir.name,
               # torchrun's agent would lend its rendezvous store to a restarted attempt (pytorch/pytorch#135712)
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
               # the groups share this machine's cores
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS",
                                                 str(max(1, cpus // (self.settings.replica_groups * processes)))),
               "RUST_LOG": os.environ.get("RUST_LOG", "warn")}  # torchft's own log: a few lines per step otherwise
        if torch.cuda.is_available():  # group G of n processes on GPUs Gn to Gn + n - 1; more than there are share them
            env["CUDA_VISIBLE_DEVICES"] = group_devices(group, processes, torch.cuda.device_count(),
                                                        os.environ.get("CUDA_VISIBLE_DEVICES"))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
                   "--max-restarts", str(self.settings.max_restarts), "-m", "app", *sys.argv[1:], *resume]
        return subprocess.Popen(command, env=env, start_new_session=True)


def group_devices(group: int, processes: int, gpus: int, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for group ``group`` of ``processes``: the (group x processes + rank)-th of the ``gpus``
    this process sees, named as the parent's CUDA_VISIBLE_DEVICES names them (a child reads the names as the
    machine's, not as the parent's indices: with 4,5,6,7 visible, group 0 takes 4, not 0)."""
    names = visible.split(",") if visible else [str(index) for index in range(gpus)]
    return ",".join(names[(group * processes + rank) % gpus] for rank in range(processes))


def run_folder(trainer: L.Trainer) -> Path:
    """The job's lightning_logs/version_N, the same for every group (each writes into replica_group_G in it)."""
    logger = trainer.logger
    if isinstance(logger, TensorBoardLogger):
        version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
        return Path(logger.root_dir) / version
    return Path(trainer.default_root_dir) / "fault_tolerant_job"


def start_lighthouse(settings: FaultToleranceSettings, run_dir: Path) -> tuple[subprocess.Popen, int]:
    """torchft's lighthouse on a free port of this machine, its output in the run folder; a UserError if it does not
    answer within LIGHTHOUSE_START_SECONDS."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    heartbeat_ms = int(settings.heartbeat_timeout.total_seconds() * 1000)
    with open(run_dir / "lighthouse.log", "ab") as log:  # the lighthouse writes to its own copy of the file
        process = subprocess.Popen(
            [lighthouse_program(), "--min_replicas", str(settings.min_replicas),
             "--bind", f"[::]:{port}", "--heartbeat_timeout_ms", str(heartbeat_ms),
             # a quorum waits this long for a group that is alive but late before it starts without it
             "--join_timeout_ms", str(heartbeat_ms)],
            stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + LIGHTHOUSE_START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise UserError(f"torchft's lighthouse exited with code {process.returncode} at start: "
                            f"{run_dir / 'lighthouse.log'} says why")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process, port
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise UserError(f"torchft's lighthouse did not answer on port {port} within {LIGHTHOUSE_START_SECONDS:.0f} s: "
                    f"{run_dir / 'lighthouse.log'} says why")


def check_lighthouse_answers(address: str, wait: timedelta = timedelta(0)) -> None:
    """A UserError unless something listens at the lighthouse's http://host:port within ``wait`` (a group started
    by a launch script may come up before the line that starts the lighthouse)."""
    parsed = urllib.parse.urlparse(address)
    if parsed.hostname is None or parsed.port is None:
        raise UserError(f"lighthouse {address!r} is not an address: give http://host:port of a running "
                        "torchft_lighthouse, or null to start one with the job")
    deadline = time.monotonic() + wait.total_seconds()
    while True:
        try:
            socket.create_connection((parsed.hostname, parsed.port), timeout=5).close()
            return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise UserError(f"the lighthouse at {address} does not answer ({error.strerror or error}): start it "
                                "(torchft_lighthouse --min_replicas N --bind [::]:PORT) or give trainer.strategy."
                                "init_args.lighthouse null to let cohort start one") from None
            time.sleep(0.2)


def lighthouse_program() -> str:
    """torchft's lighthouse, installed with it beside this interpreter (a virtual environment's bin/), or on PATH."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    found = str(beside) if beside.is_file() else shutil.which("torchft_lighthouse")
    if found is None:
        raise UserError("torchft_lighthouse, which comes with torchft, is neither beside this Python nor on PATH: "
                        "pip install -e '.[ft]' in the environment that runs cohort")
    return found


class StopSignals:
    """The stop signal the job received (0: none), forwarded to every group."""

    def __init__(self, groups: list[subprocess.Popen]) -> None:
        self.groups = groups
        self.signal = 0

    def forward(self, signum: int, frame: Any) -> None:
        self.signal = signum
        for process in self.groups:  # torchrun's agent stops its processes with SIGTERM: they checkpoint and stop
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)


def forward_stop_signals(groups: list[subprocess.Popen]) -> StopSignals:
    stop = StopSignals(groups)
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(signum, stop.forward)
    return stop


def wait_for_groups(groups: list[subprocess.Popen], lighthouse: subprocess.Popen | None, run_dir: Path) -> list[int]:
    """The groups' exit codes once all have ended; a UserError if the lighthouse this job started dies first."""
    while any(process.poll() is None for process in groups):
        if lighthouse is not None and lighthouse.poll() is not None:
            raise UserError(f"torchft's lighthouse exited with code {lighthouse.returncode} while the groups trained, "
                            f"so they could not agree on another step: {run_dir / 'lighthouse.log'} says why; resume "
                            "with the same command and --ckpt_path last")
        time.sleep(0.2)
    return [process.returncode for process in groups]
