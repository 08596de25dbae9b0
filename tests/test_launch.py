"""Launching for real on CPU: torchrun with two node agents over loopback, and a rank that dies mid-run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import (
    DDP_2, ONE_STEP, QUIET, REPO_ROOT, assert_weights_equal, batch_sizes, free_port, last_checkpoint_weights,
    run_cohort, run_in_process,
)
from tests.processes import run_cohorts

pytestmark = pytest.mark.slow
TORCHRUN = str(REPO_ROOT / "scripts" / "torchrun.sh")



def launch(args: list[str], cwd: Path, prefix: list[str] | None = None, **env: str) -> subprocess.Popen:
    """scripts/torchrun.sh ARGS, optionally inside ``prefix`` (e.g. ``ip netns exec NS``)."""
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONWARNINGS": "ignore", **env}
    return subprocess.Popen([*(prefix or []), TORCHRUN, *args], cwd=cwd, env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def two_node_fit_args(debug_run_args: list[str], out_dir: Path) -> list[str]:
    """The multi-node GPU preset on CPUs: one process per node, keeping its strategy, bf16-mixed and clipping."""
    return ["fit", *debug_run_args, *QUIET, "-c", str(REPO_ROOT / "configs/trainer/multinode_gpu_bf16.yaml"),
            "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.gradient_clip_val", "0.1",
            "--trainer.max_steps", "3", *batch_sizes(4, 2), "--trainer.callbacks+=tests.helpers.RecordWorldSize",
            f"--trainer.callbacks.out_dir={out_dir}"]


def outputs_of(jobs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Each job's output; a job still running after ``timeout`` is killed with its process group."""
    try:
        return [job.communicate(timeout=timeout)[0] for job in jobs]
    finally:
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()


def assert_two_nodes_trained(nodes: list[subprocess.Popen], out_dir: Path) -> None:
    outputs = outputs_of(nodes, timeout=300)
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(output[-3000:] for output in outputs)
    seen = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [s["world_size"] for s in seen] == [2, 2] and [s["process_group_size"] for s in seen] == [2, 2]
    assert sorted(s["node_rank"] for s in seen) == [0, 1]
    checkpoints = list(out_dir.glob("node*/lightning_logs/version_0/checkpoints/last.ckpt"))
    assert len(checkpoints) == 1  # written by global rank 0 only
    assert "precision: bf16-mixed" in (checkpoints[0].parent.parent / "config.yaml").read_text()


def test_dry_run_prints_the_torchrun_command(tmp_path: Path) -> None:
    env = {**os.environ, "DRY_RUN": "1", "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "node0",
           "MASTER_PORT": "1234", "NPROC_PER_NODE": "8", "RUN_ID": "job7"}
    printed = subprocess.run([TORCHRUN, "fit", "-c", "x.yaml"], env=env, capture_output=True, text=True, check=True)
    assert printed.stdout.split() == [
        "env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", "TORCH_NCCL_ASYNC_ERROR_HANDLING=3", "python", "-m",
        "torch.distributed.run", "--nnodes=2",
        "--node_rank=1", "--nproc_per_node=8", "--max-restarts=3",
        "--rdzv_backend=c10d", "--rdzv_endpoint=node0:1234", "--rdzv_id=job7", "--rdzv_conf=is_host=0", "-m", "app", "fit", "-c", "x.yaml"]


def test_two_node_agents_over_loopback_train_together(tmp_path: Path, debug_run_args: list[str]) -> None:
    port = str(free_port())
    nodes = []
    for node_rank in (0, 1):
        (tmp_path / f"node{node_rank}").mkdir()
        nodes.append(launch(two_node_fit_args(debug_run_args, tmp_path), tmp_path / f"node{node_rank}",
                            NNODES="2", NODE_RANK=str(node_rank), NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=port, RUN_ID="loopback"))
    assert_two_nodes_trained(nodes, tmp_path)


@pytest.fixture
def two_hosts() -> Iterator[list[tuple[str, str, str]]]:
    """Two network namespaces joined by a veth pair: (namespace, interface, address) each. Addresses are from the
    198.18.0.0/15 benchmarking range and exist only inside these namespaces."""
    hosts = [("cohort_a", "cohort_va", "198.18.7.1"), ("cohort_b", "cohort_vb", "198.18.7.2")]
    commands = [["ip", "netns", "add", hosts[0][0]], ["ip", "netns", "add", hosts[1][0]],
                ["ip", "link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1]]]
    for namespace, interface, address in hosts:
        commands += [["ip", "link", "set", interface, "netns", namespace],
                     ["ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", interface],
                     ["ip", "-n", namespace, "link", "set", interface, "up"],
                     ["ip", "-n", namespace, "link", "set", "lo", "up"]]
    try:
        for command in commands:
            made = subprocess.run(command, capture_output=True, text=True)
            if made.returncode != 0:
                pytest.skip(f"cannot make network namespaces here ({' '.join(command)}: {made.stderr.strip()})")
        yield hosts
    finally:
        for namespace, _, _ in hosts:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def test_two_hosts_with_their_own_addresses_train_together(tmp_path: Path, debug_run_args: list[str],
                                                           two_hosts: list[tuple[str, str, str]]) -> None:
    master_address = two_hosts[0][2]
    nodes = []
    for node_rank, (namespace, interface, address) in enumerate(two_hosts):
        (tmp_path / f"node{node_rank}").mkdir()
        # the hostname resolves to 127.0.0.1 here, as on many clusters: each node says its address and interface
        nodes.append(launch(two_node_fit_args(debug_run_args, tmp_path), tmp_path / f"node{node_rank}",
                            prefix=["ip", "netns", "exec", namespace], NNODES="2", NODE_RANK=str(node_rank),
                            NPROC_PER_NODE="1", MASTER_ADDR=master_address, MASTER_PORT="29400",
                            RUN_ID="namespaces", LOCAL_ADDR=address, GLOO_SOCKET_IFNAME=interface))
    assert_two_nodes_trained(nodes, tmp_path)


def test_a_killed_rank_stops_the_job_with_a_clear_message(tmp_path: Path, debug_run_args: list[str]) -> None:
    args = ["fit", *debug_run_args, *QUIET, *DDP_2, "--trainer.max_steps", "50", *batch_sizes(4, 2),
            "--trainer.callbacks+=tests.helpers.KillRank", "--trainer.callbacks.rank=1", "--trainer.callbacks.step=3"]
    job = launch(args, tmp_path, NPROC_PER_NODE="2", MASTER_PORT=str(free_port()), MAX_RESTARTS="0")
    # unnoticed, the dead rank would leave rank 0 in its all-reduce for the collective timeout (30 min): a hang
    # that outputs_of's timeout fails the test on
    output = outputs_of([job], timeout=180)[0]
    assert job.returncode != 0
    assert "Signal 9 (SIGKILL)" in output and "rank      : 1" in output, output[-3000:]


def test_a_killed_rank_is_restarted_and_the_job_ends_as_if_never_interrupted(tmp_path: Path,
                                                                              restart_run_args: list[str],
                                                                              restart_run_straight: Path) -> None:
    """SIGKILL of rank 1 in step 5, checkpoints every 3 steps: torchrun restarts both ranks, they resume from step 3
    by themselves (no --ckpt_path), and the final weights are bitwise those of a run never interrupted."""
    restarted = tmp_path / "restarted"
    restarted.mkdir()
    job = launch(["fit", *restart_run_args, *QUIET, "--trainer.callbacks+=tests.helpers.KillRank",
                  "--trainer.callbacks.rank=1", "--trainer.callbacks.step=5"], restarted, NPROC_PER_NODE="2",
                 MASTER_PORT=str(free_port()))
    output = outputs_of([job], timeout=300)[0]
    assert job.returncode == 0, output[-3000:]
    # it did die: torchrun names the first failure it sees, rank 1's SIGKILL or rank 0 leaving at once on the lost peer
    assert re.search(r"failed \(exitcode: (-9|1)\) local_rank: [01]", output), output[-3000:]
    assert output.count("resuming from lightning_logs/version_0/checkpoints/last.ckpt") == 1
    assert not (restarted / "lightning_logs" / "version_1").exists()
    assert_weights_equal(last_checkpoint_weights(restart_run_straight), last_checkpoint_weights(restarted))


def test_a_restart_does_not_resume_a_checkpoint_older_than_the_job(tmp_path: Path, debug_run_args: list[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An attempt that died before its first checkpoint leaves only an older run's in the folder: start anew."""
    old = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    old.parent.mkdir(parents=True)
    old.write_text("an older run's; read as a checkpoint, it would stop the run")
    os.utime(old, (time.time() - 86400,) * 2)
    for name, value in {"TORCHELASTIC_RUN_ID": "job", "RANK": "0", "GROUP_RANK": "0", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    run_in_process(["fit", *debug_run_args, *QUIET, *ONE_STEP, *batch_sizes(2, 2)], monkeypatch)
    assert (tmp_path / "lightning_logs" / "version_1" / "checkpoints" / "last.ckpt").exists()


def test_doctor_passes_on_a_good_setup(tmp_path: Path, byte_corpus: Path) -> None:
    """The two processes torchrun --nproc_per_node 2 starts, with the environment it gives each (the script that
    starts torchrun is the other tests')."""
    port = str(free_port())
    results = run_cohorts([(["doctor", "-c", str(REPO_ROOT / "configs/quickstart.yaml"), "-c",
                             str(REPO_ROOT / "configs/trainer/ddp_cpu.yaml"), "--data.data_dir", str(byte_corpus)],
                            {"TORCHELASTIC_RUN_ID": "job", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                             "WORLD_SIZE": "2", "RANK": str(rank), "GROUP_RANK": "0", "LOCAL_RANK": str(rank),
                             "LOCAL_WORLD_SIZE": "2"}) for rank in (0, 1)], tmp_path, timeout=180)
    assert [result.returncode for result in results] == [0, 0], results[0].stdout[-3000:] + results[0].stderr[-3000:]
    for check in ("world size", "precision", "run plan", "folders", "barrier", "all-reduce 64 MB", "data loader",
                  "log disk"):
        assert any(line.startswith("PASS") and check in line for line in results[0].stdout.splitlines()), check


def test_doctor_fails_when_slurm_tasks_do_not_match_the_config(tmp_path: Path, byte_corpus: Path) -> None:
    slurm = {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
             "SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "pretrain", "SLURM_NODELIST": "localhost"}
    [result] = run_cohorts([(["doctor", "-c", str(REPO_ROOT / "configs/quickstart.yaml"), "--data.data_dir",
                              str(byte_corpus)], slurm)], tmp_path, timeout=180)
    assert result.returncode != 0
    assert "FAIL  world size" in result.stdout
    assert "srun started 4 processes but trainer.devices=1 x trainer.num_nodes=1 = 1" in result.stdout
    assert "--ntasks-per-node = devices" in result.stdout
    # the run plan is the config's (1 process), as fit's: it passes, and the loader is timed for it
    assert "PASS  run plan" in result.stdout and "data loader" in result.stdout
    assert result.stderr.strip().splitlines()[-1] == "cohort doctor: 1 check(s) failed: world size"


def test_doctor_checks_the_pipeline_arithmetic(tmp_path: Path, byte_corpus: Path) -> None:
    """Stages against blocks, pipeline micro-batches against the micro batch: before the job, as fit checks them."""
    result = run_cohort(["doctor", "-c", str(REPO_ROOT / "configs/quickstart.yaml"),
                         "-c", str(REPO_ROOT / "configs/trainer/pipeline_cpu.yaml"), "--data.data_dir", str(byte_corpus),
                         "--trainer.strategy.init_args.pipeline_microbatches", "3"], tmp_path, timeout=180)
    assert result.returncode != 0
    assert "FAIL  run plan" in result.stdout
    assert "pipeline_microbatches=3 does not divide data.micro_batch_size=16" in result.stdout


def test_replica_groups_started_by_the_launch_script_wait_for_each_other_and_end_with_the_job(
        tmp_path: Path, debug_run_args: list[str]) -> None:
    """Two fault-tolerant groups, each its own torchrun job as on two machines, group 0's line starting the
    lighthouse and the job store. Group 1, started first, waits in the store for group 0: both take the first steps
    together. Group 0 dies at step 4 and comes back only once group 1 has trained to the end (step 6) and marked the
    job finished: alone, it reads the mark and ends with exit 0, where it would fail without the store."""
    job = {"LIGHTHOUSE": f"http://127.0.0.1:{free_port()}", "JOB_STORE": f"127.0.0.1:{free_port()}", "RUN_ID": "job7"}
    args = ["fit", *debug_run_args, *QUIET, "-c", str(REPO_ROOT / "configs/trainer/fault_tolerant_cpu.yaml"),
            *batch_sizes(8, 4), "--trainer.max_steps", "6", "--trainer.limit_val_batches", "0",
            "--trainer.callbacks+=tests.helpers.KillReplicaGroup", "--trainer.callbacks.group=0",
            "--trainer.callbacks.step=4", "--trainer.callbacks+=tests.helpers.RestartAfterJobFinished",
            "--trainer.callbacks.group=0"]
    jobs = [launch(args, tmp_path, **job, REPLICA_GROUP=str(group), MASTER_PORT=str(free_port()),
                   **({"START_LIGHTHOUSE": "1"} if group == 0 else {}))
            for group in (1, 0)]  # group 1 first: it waits for the lighthouse and the store that group 0's line starts
    outputs = outputs_of(jobs, timeout=240)
    assert [job.returncode for job in jobs] == [0, 0], "\n".join(output[-3000:] for output in outputs)
    assert "replica group 0 restarted after the job had finished: nothing to train" in outputs[1], outputs[1][-3000:]
    run = tmp_path / "lightning_logs/version_job7/replica_group_1"
    assert torch.load(run / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 6
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    quorum = [event.value for event in events.Scalars("fault_tolerance/quorum_size")]
    assert quorum[:4] == [2.0] * 4 and quorum[-1] == 1.0, quorum  # together from the start, alone at the end


def test_dry_run_prints_the_lighthouse_the_job_store_and_the_replica_groups_command() -> None:
    env = {**os.environ, "DRY_RUN": "1", "START_LIGHTHOUSE": "1", "REPLICA_GROUP": "1",
           "LIGHTHOUSE": "http://node0:29510", "RUN_ID": "job7"}
    lines = subprocess.run([TORCHRUN, "fit"], env=env, capture_output=True, text=True, check=True).stdout.splitlines()
    assert lines[0].split() == ["torchft_lighthouse", "--min_replicas", "1", "--bind", r"\[::\]:29510", "&"]
    assert lines[1].startswith("python -c ") and lines[1].endswith(" 29511 &")  # the store: the next port
    assert lines[2].split()[:5] == ["env", "COHORT_REPLICA_GROUP=1", "TORCHFT_LIGHTHOUSE=http://node0:29510",
                                    "COHORT_JOB_STORE=node0:29511", "COHORT_RUN_VERSION=version_job7"]
    alone = subprocess.run([TORCHRUN], env={**env, "REPLICA_GROUP": "", "JOB_STORE": "node0:7"}, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    assert len(alone) == 2 and alone[1].endswith(" 7 &")  # no arguments: the lighthouse and the store alone


def test_ctrl_c_under_torchrun_checkpoints_the_step_every_rank_reached(tmp_path: Path,
                                                                       debug_run_args: list[str]) -> None:
    """Ctrl-C reaches torchrun's agent alone (its workers have sessions of their own), which passes SIGINT on to
    each: both ranks finish step 5 and save it, and rank 0 says how to resume."""
    job = launch(["fit", *debug_run_args, *QUIET, *DDP_2, *batch_sizes(4, 2), "--trainer.max_steps", "20",
                  "--trainer.callbacks+=tests.helpers.CtrlCAtStep", "--trainer.callbacks.step=4",
                  "--trainer.callbacks.micro_batch=0"], tmp_path, NPROC_PER_NODE="2", MAX_RESTARTS="0",
                 MASTER_PORT=str(free_port()))
    output = outputs_of([job], timeout=300)[0]
    assert job.returncode != 0
    assert ("cohort: stopped by SIGINT after step 5; lightning_logs/version_0/checkpoints/last.ckpt holds that step: "
            "resume with the same command and --ckpt_path last") in output, output[-3000:]
    checkpoint = torch.load(tmp_path / "lightning_logs/version_0/checkpoints/last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 5
