"""``cohort`` run as a user runs it, in a process of its own, without paying the interpreter's start-up each time.

A ``cohort`` process spends about 3 s of a short test run importing torch, Lightning and Cohort (measured on 2
cores: 8.0 s for a 4-step run on 2 processes started afresh, 4.9 s forked). So each run is forked from one
interpreter that has imported them once and run nothing (multiprocessing's forkserver; a fork after torch has run
ops could inherit its thread pools), then behaves as ``python -m app ARGS`` would: its own session (a test can
SIGKILL it with every rank it started), working folder, environment, output and exit code.

The further ranks that Lightning's launcher starts (``python -m app.__main__ ARGS`` with LOCAL_RANK set) would each
be a fresh interpreter again, about 4.8 s of CPU before a 2-process run could begin. So each run forks SPARE_RANKS
copies of itself before it runs anything, and the launcher's subprocess.Popen hands the command and environment to a
spare instead, which becomes that rank: a child of the run, as Popen's would be, signalled and waited for alike.
A run of more processes than spares starts the rest as fresh interpreters. What concerns the interpreter's own start
(which modules a command imports) runs afresh: ``run_cohort(..., fresh_interpreter=True)``.

Fault-tolerant jobs start one torchrun agent per replica group (app/strategies/fault_tolerance/job.py's Popen of
``python -m torch.distributed.run``), and each agent its group's processes (``python -u -m app``, through torch's
SubprocessHandler): a spare becomes the agent, and the agent hands its processes to spares of its own
(SPARE_WORKERS, enough for a group's first attempt and one restart).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
# the modules ``python -m app`` imports for its commands (app/__main__.py), imported once by the server
PRELOADED = ["app.cli.lightning_cli", "app.tools.comm", "app.tools.consolidate", "app.tools.doctor",
             "app.tools.export", "datamodules.prepare"]
FORKS = multiprocessing.get_context("forkserver")
FORKS.set_forkserver_preload(PRELOADED)
SPARE_RANKS = 3  # the further ranks of a run of up to 4 processes, the most any test starts on one machine
SPARE_WORKERS = 4  # a torchrun agent's: a group of 2 processes, restarted once
APP = [sys.executable, "-m", "app.__main__"]  # a further rank, as Lightning's launcher starts it
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # a replica group's agent, as the job starts it
WORKER = [sys.executable, "-u", "-m", "app"]  # a process of a group, as torchrun's agent starts it


def run_cohort(args: list[str], cwd: Path, timeout: float = 300,
               fresh_interpreter: bool = False) -> subprocess.CompletedProcess:
    """Run ``python -m app ARGS`` in its own process group, as a user would from ``cwd``. A run still going after
    ``timeout`` seconds hangs: it is killed with every rank it started, and subprocess.TimeoutExpired fails the
    test."""
    if fresh_interpreter:
        return run_afresh([sys.executable, "-m", "app", *args], cwd, cohort_environment(), timeout)
    return run_cohorts([(args, {})], cwd, timeout)[0]


def run_cohorts(runs: list[tuple[list[str], dict[str, str]]], cwd: Path,
                timeout: float) -> list[subprocess.CompletedProcess]:
    """``python -m app ARGS`` for each (ARGS, environment added) of ``runs``, all at once, as run_cohort runs one:
    the processes of one job on separate machines, each given its rank by its environment as torchrun gives it. A
    process still going ``timeout`` seconds after the start hangs: every one still going is killed with the ranks it
    started, and subprocess.TimeoutExpired fails the test."""
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory() as outputs:
        started = []
        for index, (args, added) in enumerate(runs):
            stdout, stderr = Path(outputs, f"stdout{index}"), Path(outputs, f"stderr{index}")
            stdout.touch()
            stderr.touch()  # read back even if the process dies before it writes
            process = FORKS.Process(target=cohort_main, args=(args, cwd, {**cohort_environment(), **added}, stdout,
                                                              stderr))
            process.start()
            started.append((process, [sys.executable, "-m", "app", *args], stdout, stderr))
        for process, *_ in started:
            process.join(max(deadline - time.monotonic(), 0))
        hung = [run for run in started if run[0].exitcode is None]
        for process, *_ in hung:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.killpg(process.pid, signal.SIGKILL)  # the ranks too
            process.join()
        if hung:
            _, command, stdout, stderr = hung[0]
            raise subprocess.TimeoutExpired(command, timeout, stdout.read_text(), stderr.read_text())
        return [subprocess.CompletedProcess(command, process.exitcode, stdout.read_text(), stderr.read_text())
                for process, command, stdout, stderr in started]


def cohort_environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONWARNINGS": "ignore"}


def run_afresh(command: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # so a test can SIGKILL the run and every rank it started
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the ranks too, not only the launcher subprocess.run would kill
        process.communicate()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def cohort_main(args: list[str], cwd: Path, env: dict[str, str], stdout: Path, stderr: Path) -> None:
    """In the forked process: become ``python -m app ARGS`` started in ``cwd`` with ``env`` in a session of its own,
    with spares for the ranks its launcher may start."""
    os.setsid()
    for stream, path in ((1, stdout), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), stream)
    from lightning.pytorch.strategies.launchers import subprocess_script

    from app.strategies.fault_tolerance import job

    spares = SpareRanks(SPARE_RANKS)
    subprocess_script.subprocess = spares  # the launcher's only use of the module is its Popen
    job.subprocess = spares  # the job's Popens: a group's torchrun (others, with more options, start as Popen would)
    become_cohort(args, cwd, env)


def become_cohort(args: list[str], cwd: Path, env: dict[str, str]) -> None:
    """Run as ``python -m app ARGS`` started in ``cwd`` with ``env``, then exit with its exit status, as the
    interpreter would (a SystemExit's code or message, 1 and the traceback for an exception)."""
    from app.__main__ import main

    # Lightning's launcher restarts this command for each further rank from sys.argv and __main__'s module
    sys.modules["__main__"].__spec__ = importlib.util.find_spec("app.__main__")
    become(lambda: main(args), [str(REPO_ROOT / "app" / "__main__.py"), *args], cwd, env)


def become_torchrun(args: list[str], cwd: Path, env: dict[str, str]) -> None:
    """Run as ``python -m torch.distributed.run ARGS``, its workers handed to spares of this process."""
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    subprocess_handler.Popen = SpareRanks(SPARE_WORKERS).Popen  # the handler's only use of subprocess
    become(lambda: torch.distributed.run.main(args), [torch.distributed.run.__file__, *args], cwd, env)


def become(main: Callable[[], None], argv: list[str], cwd: Path, env: dict[str, str]) -> None:
    """Run ``main`` as the interpreter would run a command line ``argv`` started in ``cwd`` with ``env``, then exit
    with its exit status (a SystemExit's code or message, 1 and the traceback for an exception)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = argv
    # what an interpreter reads from its environment once, at its start or at first use, read again
    warnings.simplefilter("ignore")  # PYTHONWARNINGS=ignore
    tempfile.tempdir = None  # TMPDIR
    if "OMP_NUM_THREADS" in env:  # torch's intra-op threads, which torchrun and the fault-tolerant job set
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        main()
        status = 0
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        status = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class SpareRanks:
    """Stands for the subprocess module in Lightning's launcher: its Popen of a further rank is answered by a spare
    copy of this process, forked before it ran anything (a fork after torch has run ops could inherit its thread
    pools), which becomes the rank; any other command, or a rank beyond the spares, is started as Popen would."""

    def __init__(self, count: int) -> None:
        pipes = [os.pipe() for _ in range(count)]
        self.spares: list[tuple[int, int]] = []  # (pid, the pipe to send it a rank's command on)
        for read, write in pipes:
            pid = os.fork()
            if pid == 0:
                # every other end closed, so that the spare reads its pipe's end when the run ends without it
                for fd in {fd for pipe in pipes for fd in pipe} - {read}:
                    os.close(fd)
                wait_to_become_a_rank(read)
            self.spares.append((pid, write))
        for read, _ in pipes:
            os.close(read)

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    def Popen(self, args: list[str], env: dict[str, str] | None = None, cwd: str | None = None,
              **options: Any) -> subprocess.Popen | SpareRank:  # noqa: N802 (subprocess's name)
        command = list(args)
        new_session = options.pop("start_new_session", False)
        start = next((length for length in (3, 4) if command[:length] in (APP, TORCHRUN, WORKER)), None)
        # a spare inherits this process's output: a command given other output, or other options, starts afresh
        if any(value is not None for value in options.values()) or start is None or not self.spares:
            return subprocess.Popen(command, env=env, cwd=cwd, start_new_session=new_session, **options)
        pid, pipe = self.spares.pop(0)
        with os.fdopen(pipe, "wb") as request:
            pickle.dump((command[:start], command[start:], cwd or os.getcwd(),
                         dict(os.environ) if env is None else env, new_session), request)
        return SpareRank(pid, command)


def wait_to_become_a_rank(pipe: int) -> None:
    """In a spare: wait for a command (its program, ARGS, working folder, environment, whether in a session of its
    own), then become it; exit at once if the run ends without asking."""
    with os.fdopen(pipe, "rb") as requests:
        request = requests.read()
    if not request:
        os._exit(0)
    program, args, cwd, env, new_session = pickle.loads(request)
    if new_session:
        os.setsid()
    if program == TORCHRUN:
        become_torchrun(args, cwd, env)
    if program == WORKER:  # -u: what it prints reaches the log even if it is killed
        sys.stdout.reconfigure(line_buffering=True)
    become_cohort(args, cwd, env)


class SpareRank:
    """The part of subprocess.Popen's handle that Lightning's launcher and its process observer use, for a spare
    become a rank (a child of this process, waited for with waitpid)."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._waiting = threading.Lock()  # the process observer's thread polls too

    def poll(self) -> int | None:
        with self._waiting:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # an unwaited child keeps its pid, so this cannot reach another process
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
