"""Training through failures: fault-tolerant replica groups (configs/trainer/fault_tolerant_cpu.yaml) against DDP
restarted by torchrun, with a process SIGKILLed every ``--kill-every`` steps.

    python -m benchmarks.fault_tolerance                          # 300 steps, 3 groups / 3 ranks, a kill every 50
    python -m benchmarks.fault_tolerance --steps 60 --kill-every 20   # a quick look
    python -m benchmarks.fault_tolerance --groups 2 --group-size 2    # 2 groups of 2 processes (FSDP2) / 4 ranks

Each job trains the quickstart's small GPT (global batch 8 samples of 128 tokens per process: 24 on 3) for the same
number of steps and validates at the end on the same 320 windows:

    no failures     the fault-tolerant job, left alone: the reference validation loss
    fault tolerant  the same job, with a process SIGKILLed every kill-every steps, half-way between two multiples
                    (ChaosKill below); torchrun restarts its group, which rejoins with a live group's state
    torchrun        DDP on as many processes under torchrun --max-restarts, checkpointing every kill-every steps,
                    with the same kills: every kill restarts all ranks, which resume from the newest checkpoint

For each: wall time, steps committed / attempted (fault tolerant: attempted = committed + failed commits), steps
redone (torchrun: the steps since the checkpoint, trained again), and the final validation loss against the
reference. For the fault-tolerant job, each recovery: the step of the kill, the step it rejoined at, and the seconds
the group was away (from its TensorBoard wall times).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from datamodules.prepare import prepare_corpus, stdlib_source_files

REPO_ROOT = Path(__file__).resolve().parent.parent
MICRO_BATCH = 8  # samples per process and step with every group up


def recipe(processes: int) -> list[str]:
    return ["-c", str(REPO_ROOT / "configs/quickstart.yaml"), "--data.global_batch_size", str(MICRO_BATCH * processes),
            "--data.micro_batch_size", str(MICRO_BATCH), "--data.val_samples", "320", "--trainer.limit_val_batches",
            "null", "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false"]


class ChaosKill(Callback):
    """SIGKILL this process at steps every/2, every/2 + every, ... when the turn is this process's: process
    (step // every) % processes, counted by rank (DDP), or by replica group then rank in it (fault tolerance: group
    g's rank r is process g x group_size + r). Half-way between two multiples of ``every``, where torchrun's job
    checkpoints: a failure strikes on average half a checkpoint interval after the last save. A marker file per
    step makes each kill happen once, also after the restarted process passes the step again."""

    def __init__(self, every: int, markers: str, processes: int, group_size: int = 1) -> None:
        self.every = every
        self.markers = Path(markers)
        self.processes = processes
        self.group_size = group_size

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        group = os.environ.get("COHORT_REPLICA_GROUP")
        me = trainer.global_rank if group is None else int(group) * self.group_size + trainer.global_rank
        if (step - self.every // 2) % self.every or (step // self.every) % self.processes != me:
            return
        marker = self.markers / f"killed_at_step_{step}"
        if marker.exists():
            return
        marker.write_text(f"{time.time()}\n")
        os.kill(os.getpid(), signal.SIGKILL)


def run_job(name: str, preset: list[str], steps: int, kill_every: int | None, data_dir: Path, run_dir: Path,
            torchrun: bool, processes: int, group_size: int) -> float:
    """Run one job to the end; returns its wall time."""
    run_dir.mkdir(parents=True)
    args = ["fit", *recipe(processes), *preset, "--data.data_dir", str(data_dir), "--trainer.max_steps", str(steps),
            "--val_every_n_steps", str(steps)]
    if kill_every is not None:
        args += ["--trainer.callbacks+=benchmarks.fault_tolerance.ChaosKill", f"--trainer.callbacks.every={kill_every}",
                 f"--trainer.callbacks.markers={run_dir}", f"--trainer.callbacks.processes={processes}",
                 f"--trainer.callbacks.group_size={1 if torchrun else group_size}"]
    command = [sys.executable, "-m", "app", *args]
    if torchrun:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
                   "--max-restarts=20", "-m", "app", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    start = time.perf_counter()
    result = subprocess.run(command, cwd=run_dir, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"{name} failed:\n{result.stderr[-4000:]}")
    return seconds


def events(folder: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    return accumulator


def fault_tolerant_figures(run_dir: Path, kill_every: int | None, replica_groups: int,
                           group_size: int) -> dict[str, Any]:
    """Committed and failed steps, the final validation loss, and each recovery, from the groups' TensorBoard."""
    job = run_dir / "lightning_logs" / "version_0"
    groups = [events(job / f"replica_group_{group}") for group in range(replica_groups)]
    finals = [group for group in groups if "val/loss" in group.Tags()["scalars"]]
    failed = max(group.Scalars("fault_tolerance/failed_commits")[-1].value for group in groups)
    committed = len({event.step for group in groups for event in group.Scalars("train/loss")})
    recoveries = []
    for step_file in sorted(run_dir.glob("killed_at_step_*"), key=lambda path: int(path.name.rsplit("_", 1)[1])):
        killed_step = int(step_file.name.rsplit("_", 1)[1])
        group = (killed_step // kill_every) % (replica_groups * group_size) // group_size
        killed_at = float(step_file.read_text())
        # the group's first logged step after the kill: its first step with a live group's state
        back = next((event for event in groups[group].Scalars("train/loss") if event.wall_time > killed_at), None)
        recoveries.append({"group": group, "killed at step": killed_step,
                           "rejoined at step": back.step if back else None,
                           "seconds away": round(back.wall_time - killed_at, 1) if back else None})
    quorum = [event.value for event in groups[0].Scalars("fault_tolerance/quorum_size")]
    return {"val/loss": finals[0].Scalars("val/loss")[-1].value, "committed": committed,
            "attempted": committed + int(failed), "recoveries": recoveries,
            "mean quorum": sum(quorum) / len(quorum)}


def torchrun_figures(run_dir: Path, steps: int) -> dict[str, Any]:
    """Steps trained again after each restart (the logged steps beyond the ``steps`` the run needed) and the final
    validation loss, from the DDP job's TensorBoard (every attempt logs into the same version folder)."""
    versions = sorted((run_dir / "lightning_logs").glob("version_*"))
    logged = [event for version in versions for event in events(version).Scalars("train/loss")]
    final = events(versions[-1])
    return {"val/loss": final.Scalars("val/loss")[-1].value, "attempted": len(logged),
            "redone": len(logged) - steps, "restarts": len(list(run_dir.glob("killed_at_step_*")))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kill-every", type=int, default=50)
    parser.add_argument("--groups", type=int, default=3, help="fault-tolerant replica groups")
    parser.add_argument("--group-size", type=int, default=1, help="processes per group (FSDP2 within a group)")
    args = parser.parse_args()
    processes = args.groups * args.group_size
    fault_tolerant = ["-c", str(REPO_ROOT / "configs/trainer/fault_tolerant_cpu.yaml"),
                      "--trainer.strategy.init_args.replica_groups", str(args.groups),
                      "--trainer.devices", str(args.group_size), "--trainer.strategy.init_args.max_restarts", "20"]
    ddp = ["-c", str(REPO_ROOT / "configs/trainer/ddp_cpu.yaml"), "--trainer.devices", str(processes),
           "--checkpoint.every_n_train_steps", str(args.kill_every)]
    sizes = {"processes": processes, "group_size": args.group_size}
    with tempfile.TemporaryDirectory() as scratch:
        data_dir = Path(scratch, "corpus")
        prepare_corpus(stdlib_source_files()[:200], data_dir, val_fraction=0.1)
        seconds = {"no failures": run_job("no failures", fault_tolerant, args.steps, None, data_dir,
                                          Path(scratch, "reference"), torchrun=False, **sizes)}
        seconds["fault tolerant"] = run_job("fault tolerant", fault_tolerant, args.steps, args.kill_every, data_dir,
                                            Path(scratch, "chaos"), torchrun=False, **sizes)
        seconds["torchrun"] = run_job("torchrun", ddp, args.steps, args.kill_every, data_dir,
                                      Path(scratch, "torchrun"), torchrun=True, **sizes)
        reference = fault_tolerant_figures(Path(scratch, "reference"), None, args.groups, args.group_size)
        chaos = fault_tolerant_figures(Path(scratch, "chaos"), args.kill_every, args.groups, args.group_size)
        restarted = torchrun_figures(Path(scratch, "torchrun"), args.steps)
    print("| job | wall s | steps committed / attempted | steps redone | val/loss | vs no failures |")
    print("| --- | --- | --- | --- | --- | --- |")
    base = reference["val/loss"]
    for name, figures, redone in (("no failures", reference, 0), ("fault tolerant", chaos,
                                                                   chaos["attempted"] - chaos["committed"]),
                                  ("torchrun", restarted, restarted["redone"])):
        committed = figures.get("committed", args.steps)
        print(f"| {name} | {seconds[name]:.0f} | {committed} / {figures['attempted']} "
              f"({committed / figures['attempted']:.1%}) | {redone} | {figures['val/loss']:.4f} | "
              f"{figures['val/loss'] / base - 1:+.2%} |")
    print(f"mean quorum size under chaos: {chaos['mean quorum']:.2f} of {args.groups}; torchrun restarts: "
          f"{restarted['restarts']}")
    for recovery in chaos["recoveries"]:
        print(recovery)


if __name__ == "__main__":
    main()
