"""Launching for real on CPU: torchrun with two node agents over loopback, and a rank that dies mid-run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import QUIET, REPO_ROOT

pytestmark = pytest.mark.slow
TORCHRUN = str(REPO_ROOT / "scripts" / "torchrun.sh")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(args: list[str], cwd: Path, **env: str) -> subprocess.Popen:
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONWARNINGS": "ignore", **env}
    return subprocess.Popen([TORCHRUN, *args], cwd=cwd, env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_dry_run_prints_the_torchrun_command(tmp_path: Path) -> None:
    env = {**os.environ, "DRY_RUN": "1", "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "node0",
           "MASTER_PORT": "1234", "NPROC_PER_NODE": "8", "RUN_ID": "job7"}
    printed = subprocess.run([TORCHRUN, "fit", "-c", "x.yaml"], env=env, capture_output=True, text=True, check=True)
    assert printed.stdout.split() == [
        "python", "-m", "torch.distributed.run", "--nnodes=2", "--node_rank=1", "--nproc_per_node=8",
        "--rdzv_backend=c10d", "--rdzv_endpoint=node0:1234", "--rdzv_id=job7", "-m", "app", "fit", "-c", "x.yaml"]


def test_two_node_agents_over_loopback_train_together(tmp_path: Path, debug_run_args: list[str]) -> None:
    port = str(free_port())
    nodes = []
    for node_rank in (0, 1):
        node_dir = tmp_path / f"node{node_rank}"
        node_dir.mkdir()
        args = ["fit", *debug_run_args, *QUIET, "--trainer.strategy", "ddp", "--trainer.num_nodes", "2",
                "--trainer.devices", "1", "--trainer.max_steps", "3", "--data.global_batch_size", "4",
                "--data.micro_batch_size", "2", "--trainer.callbacks+=tests.helpers.RecordWorldSize",
                f"--trainer.callbacks.out_dir={tmp_path}"]
        nodes.append(launch(args, node_dir, NNODES="2", NODE_RANK=str(node_rank), NPROC_PER_NODE="1",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RUN_ID="loopback"))
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(output[-3000:] for output in outputs)
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [s["world_size"] for s in seen] == [2, 2] and [s["process_group_size"] for s in seen] == [2, 2]
    assert sorted(s["node_rank"] for s in seen) == [0, 1]
    checkpoints = list(tmp_path.glob("node*/lightning_logs/version_0/checkpoints/last.ckpt"))
    assert len(checkpoints) == 1  # written by global rank 0 only


def test_a_killed_rank_stops_the_job_with_a_clear_message(tmp_path: Path, debug_run_args: list[str]) -> None:
    args = ["fit", *debug_run_args, *QUIET, "--trainer.strategy", "ddp", "--trainer.devices", "2",
            "--trainer.max_steps", "50", "--data.global_batch_size", "4", "--data.micro_batch_size", "2",
            "--trainer.callbacks+=tests.helpers.KillRank", "--trainer.callbacks.rank=1", "--trainer.callbacks.step=3"]
    start = time.monotonic()
    job = launch(args, tmp_path, NPROC_PER_NODE="2", MASTER_PORT=str(free_port()))
    output = job.communicate(timeout=180)[0]
    elapsed = time.monotonic() - start
    assert job.returncode != 0
    assert elapsed < 120, f"took {elapsed:.0f} s to notice a dead rank"
    assert "Signal 9 (SIGKILL)" in output and "rank      : 1" in output, output[-3000:]
