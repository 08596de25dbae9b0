"""A real single-node SLURM (slurmctld + slurmd from Debian, started here): the project's sbatch script trains, and
a preempted job, or one whose task crashed, requeues itself and resumes to the weights of an uninterrupted run.

.ci/run installs the daemons; where they are missing, these tests are skipped and say so.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    CONFIG_DIR, DDP_2, QUIET, REPO_ROOT, assert_weights_equal, batch_sizes, fit, free_port, last_checkpoint_weights,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("slurmctld") is None or shutil.which("sbatch") is None,
                       reason="SLURM is not installed (apt-get install slurmctld slurmd slurm-client)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the test cluster runs its daemons as root"),
]
SBATCH_SCRIPT = REPO_ROOT / "scripts" / "slurm" / "train.sbatch"
FAULT_TOLERANT_SCRIPT = REPO_ROOT / "scripts" / "slurm" / "fault_tolerant.sbatch"



def slurm_conf(state: Path) -> str:
    node = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    fields = dict(field.split("=", 1) for field in node.split())
    memory = int(int(fields["RealMemory"]) * 0.9)  # all of it and the node is drained for low memory
    return "\n".join([
        "ClusterName=cohort", f"SlurmctldHost={fields['NodeName']}", "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/none", "CredType=cred/none", "AuthInfo=cred_expire=10",  # requeued jobs restart in seconds
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "ReturnToService=2", "MailProg=/bin/true",
        "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
        "JobAcctGatherType=jobacct_gather/none", "SchedulerParameters=sched_interval=5,bf_interval=2",
        f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
        f"StateSaveLocation={state}/state", f"SlurmdSpoolDir={state}/spool",
        f"SlurmctldPidFile={state}/slurmctld.pid", f"SlurmdPidFile={state}/slurmd.pid",
        f"SlurmctldLogFile={state}/slurmctld.log", f"SlurmdLogFile={state}/slurmd.log",
        f"NodeName={fields['NodeName']} CPUs={fields['CPUs']} RealMemory={memory} State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", "",
    ])


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """slurmctld and slurmd on this machine; yields the environment that points SLURM's commands at them."""
    state = tmp_path_factory.mktemp("slurm")
    for folder in ("state", "spool"):
        (state / folder).mkdir()
    (state / "slurm.conf").write_text(slurm_conf(state))
    env = {**os.environ, "SLURM_CONF": str(state / "slurm.conf")}
    daemons = [subprocess.Popen(["slurmctld", "-D", "-c"], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT)]
    try:
        wait_for(lambda: "UP" in subprocess.run(["scontrol", "ping"], env=env, capture_output=True, text=True).stdout,
                 30, "slurmctld")
        daemons.append(subprocess.Popen(["slurmd", "-D"], env=env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.STDOUT))
        wait_for(lambda: "idle" in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                                  text=True).stdout, 30, "the node to be idle")
        yield env
    finally:
        for daemon in reversed(daemons):  # stop exactly the daemons started here, by PID
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def submit(slurm: dict[str, str], workdir: Path, args: list[str], script: Path = SBATCH_SCRIPT, **env: str) -> str:
    """sbatch SCRIPT ARGS from the repository's root (the fault-tolerant recipe runs its scripts/torchrun.sh), with
    two tasks of one CPU on this cluster's one node and ``env`` added."""
    env = {**slurm, "PYTHONPATH": str(REPO_ROOT), "PYTHONWARNINGS": "ignore", **env}
    result = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--mem=0", "--time=10",
         f"--chdir={workdir}", f"--output={workdir}/slurm-%j.out", str(script), *args],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True,
    )
    return result.stdout.strip().split(";")[0]


def job_state(slurm: dict[str, str], job_id: str) -> str:
    shown = subprocess.run(["scontrol", "show", "job", job_id], env=slurm, capture_output=True, text=True).stdout
    match = re.search(r"JobState=(\w+)", shown)
    return match.group(1) if match else "UNKNOWN"


def wait_until_finished(slurm: dict[str, str], job_id: str, timeout: float) -> str:
    finished = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
    wait_for(lambda: job_state(slurm, job_id) in finished, timeout, f"job {job_id}")
    return job_state(slurm, job_id)


def test_sbatch_script_trains_with_two_tasks(slurm: dict[str, str], tmp_path: Path,
                                             debug_run_args: list[str]) -> None:
    job_id = submit(slurm, tmp_path, [*debug_run_args, *QUIET, *DDP_2, "--trainer.max_steps", "4", *batch_sizes(4, 2)])
    state = wait_until_finished(slurm, job_id, timeout=240)
    log = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    assert "2 tasks" in log and "x 2 data-parallel ranks x" in log  # world size 2, from SLURM's environment
    assert list((tmp_path / "lightning_logs" / "version_0").glob("events.out.tfevents.*"))
    assert (tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").is_file()


def test_fault_tolerant_recipe_trains_two_replica_groups(slurm: dict[str, str], tmp_path: Path,
                                                        debug_run_args: list[str]) -> None:
    """scripts/slurm/fault_tolerant.sbatch: the lighthouse and the job store beside the batch script, one srun step
    per replica group (both on this node), each group training to the end in the job's folder, as one."""
    args = [*debug_run_args, *QUIET, "-c", str(CONFIG_DIR / "trainer/fault_tolerant_cpu.yaml"), *batch_sizes(8, 4),
            "--trainer.max_steps", "3", "--trainer.limit_val_batches", "0"]
    job_id = submit(slurm, tmp_path, args, script=FAULT_TOLERANT_SCRIPT, REPLICA_GROUPS="2",
                    LIGHTHOUSE_PORT=str(free_port()), JOB_STORE=f"127.0.0.1:{free_port()}")
    state = wait_until_finished(slurm, job_id, timeout=240)
    log = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    assert "2 replica groups" in log and "replica groups' exit codes: 0 0" in log
    finals = [torch.load(tmp_path / f"lightning_logs/version_{job_id}/replica_group_{group}/checkpoints/last.ckpt",
                         weights_only=True) for group in (0, 1)]
    assert [final["global_step"] for final in finals] == [3, 3]
    assert_weights_equal(finals[0]["state_dict"], finals[1]["state_dict"])


def test_preempted_job_requeues_and_resumes_to_the_same_weights(slurm: dict[str, str], tmp_path: Path,
                                                                debug_run_args: list[str]) -> None:
    run = [*debug_run_args, *QUIET, *DDP_2, "--trainer.max_steps", "8", *batch_sizes(4, 2),
           "--checkpoint.every_n_train_steps", "1000"]
    held = ["--trainer.callbacks+=tests.helpers.HoldForRequeueSignalAtStep", "--trainer.callbacks.step=3"]
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    job_id = submit(slurm, job_dir, [*run, *held])
    log_path = job_dir / f"slurm-{job_id}.out"
    wait_for(lambda: log_path.exists() and "preemption: SIGUSR1 will checkpoint" in log_path.read_text(), 120,
             "the training loop to install its preemption handler")
    subprocess.run(["scancel", "--signal=USR1", job_id], env=slurm, check=True)
    state = wait_until_finished(slurm, job_id, timeout=300)
    log = log_path.read_text()
    assert state == "COMPLETED", log[-4000:]
    assert "preemption: SIGUSR1 received, stopping after step" in log and f"job {job_id} requeued" in log
    assert "(restart 1)" in log and "resuming from" in log
    stopped_at = int(re.search(r"stopping after step (\d+)", log).group(1))
    assert 0 < stopped_at <= 4  # the ranks hold in step 4 until the signal has come: it stops the run by then

    straight = fit(tmp_path / "straight", run)  # not held: a wait changes no weight
    assert_weights_equal(last_checkpoint_weights(straight), last_checkpoint_weights(job_dir))


def test_a_crashed_task_requeues_the_job_which_resumes_to_the_same_weights(slurm: dict[str, str], tmp_path: Path,
                                                                           restart_run_args: list[str],
                                                                           restart_run_straight: Path) -> None:
    """SIGKILL of rank 1 in step 5, checkpoints every 3 steps: srun ends the step, the script requeues the job, the
    requeued job resumes from step 3 and ends with the weights of a run never interrupted."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    job_id = submit(slurm, job_dir, [*restart_run_args, *QUIET, "--trainer.callbacks+=tests.helpers.KillRank",
                                     "--trainer.callbacks.rank=1", "--trainer.callbacks.step=5"])
    state = wait_until_finished(slurm, job_id, timeout=300)
    log = (job_dir / f"slurm-{job_id}.out").read_text()
    assert state == "COMPLETED", log[-4000:]
    assert "(restart 1)" in log and "resuming from lightning_logs/version_0/checkpoints/last.ckpt" in log

    assert_weights_equal(last_checkpoint_weights(restart_run_straight), last_checkpoint_weights(job_dir))
