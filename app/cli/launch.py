"""Which launcher started this process (torchrun, SLURM's srun, or none), and joining its process group.

Used by the commands that run outside Lightning's Trainer (``comm``, ``doctor``); training itself lets Lightning
read the same environments.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment


@dataclass(frozen=True)
class Launch:
    launcher: str  # "torchrun", "slurm" or "none"
    rank: int
    local_rank: int
    world_size: int


def detect_launch() -> Launch:
    """Rank and world size from torchrun's or SLURM's variables; also sets MASTER_ADDR/PORT for SLURM, whose srun
    does not. A process started by hand is rank 0 of 1."""
    for environment, name in ((TorchElasticEnvironment, "torchrun"), (SLURMEnvironment, "slurm")):
        if environment.detect():
            env = environment()
            os.environ.setdefault("MASTER_ADDR", env.main_address)
            os.environ.setdefault("MASTER_PORT", str(env.main_port))
            return Launch(name, env.global_rank(), env.local_rank(), env.world_size())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    return Launch("none", 0, 0, 1)


def launch_device(launch: Launch, use_gpu: bool = True) -> torch.device:
    """This rank's GPU (by local rank) where there is one, else the CPU."""
    if use_gpu and torch.cuda.is_available():
        device = torch.device("cuda", launch.local_rank)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def join_process_group(launch: Launch, device: torch.device, timeout: timedelta = timedelta(minutes=10)) -> None:
    """NCCL on GPUs, gloo on CPUs; a rank that does not arrive within ``timeout`` fails the others."""
    if device.type == "cuda":
        dist.init_process_group("nccl", rank=launch.rank, world_size=launch.world_size, timeout=timeout,
                                device_id=device)
    else:
        dist.init_process_group("gloo", rank=launch.rank, world_size=launch.world_size, timeout=timeout)


def parent_start_time() -> float:
    """When this process's parent started, in seconds since the epoch; for torchrun's ranks the parent is its agent,
    which lives as long as the job. Linux's /proc counts a process's start in clock ticks after boot."""
    stat = Path(f"/proc/{os.getppid()}/stat").read_text()
    ticks = int(stat.rsplit(")", 1)[1].split()[19])  # starttime, field 22; the name before ")" may hold spaces
    boot = int(re.search(r"^btime (\d+)$", Path("/proc/stat").read_text(), re.MULTILINE).group(1))
    return boot + ticks / os.sysconf("SC_CLK_TCK")
