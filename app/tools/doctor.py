"""``cohort doctor``: pre-flight checks, run with the same launcher and config as the long job it precedes.

    torchrun --nproc_per_node=2 -m app doctor -c configs/quickstart.yaml -c configs/trainer/ddp_cpu.yaml
    srun python -m app doctor -c configs/trainer/multinode_gpu_bf16.yaml -c configs/gpt2/pretrain.yaml

Checks: the pre-flight checks ``cohort fit`` runs (app/cli/preflight.py: the launcher's process count against
trainer.devices x trainer.num_nodes, the precision on this device, the run plan's sizes and batch arithmetic, a
checkpoint to resume, writable folders), each reported rather than stopping at the first; the model's line (size and
parameters, a mixture of experts' active ones too) and its memory estimate; then the doctor's own probes: every rank
reaching a barrier within a timeout, all-reduce bandwidth, the DataLoader's speed against the model's step, room for
checkpoints on the disks, addresses that other nodes cannot reach. Prints pass / warn / fail (and skip, with the
reason) with advice and exits non-zero when anything fails.

A GPU job can be checked from a machine without one (a GPU preset, or --device_memory): the precision and the
memory are judged for the GPU, and the DataLoader is timed without the model's compute, which only that GPU can
time.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from jsonargparse import Namespace
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningArgumentParser

from app.cli.commands import describe
from app.cli.launch import Launch, detect_launch, join_process_group, launch_device
from app.cli.lightning_cli import CohortCLI
from app.cli.preflight import Preflight, log_root, model_class
from app.cli.run_plan_resolution import class_of
from app.strategies.kind import StrategyKind
from app.tools.comm import time_collective
from app.tools.memory import estimate_memory, parse_memory_size, visible_device_memory
from app.tools.memory_profile import module_step_loss
from core.errors import UserError
from core.precision import precision_named
from core.run_plan import RunPlan
from core.sizes import format_bytes
from datamodules.base import ShardedDataModule
from datamodules.own_datamodule import share_out_training_samples
from models.module import DERIVED_FROM_DATA, CohortModule


@dataclass
class Check:
    name: str
    status: str  # "pass", "warn", "fail" or "skip" (not judged here; the detail says why)
    detail: str
    advice: str = ""


# the data loader's share of a micro-batch's time (loading + compute) from which it warns, and fails
DATA_WARN_SHARE, DATA_FAIL_SHARE = 0.1, 0.3
# free disk space against one checkpoint's size: a pass needs room for this many, less than WARN of them fails
DISK_PASS_CHECKPOINTS, DISK_WARN_CHECKPOINTS = 5, 2


def targets_gpu(config: Namespace) -> bool:
    """Whether the job runs on GPUs: its accelerator says so, or ("auto") this machine has one or --device_memory
    names one's size."""
    accelerator = config.trainer.accelerator
    return accelerator in ("gpu", "cuda") or (
        accelerator == "auto" and (torch.cuda.is_available() or config.device_memory is not None))


def judge_precision_for_gpu(config: Namespace) -> str:
    """The precision check of a GPU job checked from a machine without a GPU: the precision as the GPU runs it."""
    precision = precision_named(config.trainer.precision).name
    config.trainer.precision = precision
    unchecked = " (whether the GPU has bfloat16 is checked on it)" if precision.startswith("bf16") else ""
    return f"{precision}, judged for the GPU this job targets: none is visible here{unchecked}"


def check_rendezvous(launch: Launch, device: torch.device, timeout_s: float) -> tuple[Check, bool]:
    """Join the process group and meet at a barrier; returns whether collectives can follow."""
    start = time.perf_counter()
    try:
        join_process_group(launch, device, timeout=timedelta(seconds=timeout_s))
        dist.barrier()
    except Exception as error:  # any failure here is the finding, reported rather than raised
        return Check("barrier", "fail", f"{type(error).__name__}: {error}".splitlines()[0][:200],
                     "check MASTER_ADDR/MASTER_PORT reachability and firewalls between nodes"), False
    return Check("barrier", "pass", f"all {dist.get_world_size()} ranks met in {time.perf_counter() - start:.2f} s "
                 f"(fails after {timeout_s:.0f} s)"), True


def check_bandwidth(device: torch.device) -> Check:
    size = 64 * 2**20
    seconds = time_collective("all_reduce", size // 4, device, iterations=5, warmup=2)
    n = dist.get_world_size()
    bus = size / seconds / 1e9 * 2 * (n - 1) / n
    return Check("all-reduce 64 MB", "pass", f"{seconds * 1e3:.1f} ms, bus bandwidth {bus:.2f} GB/s",
                 "" if n > 1 else "one process: nothing to measure")


def instantiate_family(config: Namespace) -> tuple[LightningDataModule | None, CohortModule | None, list[Check]]:
    """The config's datamodule and model, as the CLI would make them, without building the network (the model's
    configure_model does that): what the datamodule derives from its data (an image folder's classes) is handed
    to the model as the CLI's instantiation links hand it. A model that needs nothing from the data is made even
    when the data is missing, so that the memory estimate can be given before the data exists."""
    data, problems = None, []
    try:
        data = class_of(config.data.class_path)(**vars(config.data.get("init_args") or Namespace()))
    except UserError as error:
        problems.append(Check("data", "fail", str(error)))
    derived = {name: getattr(data, name) for name in DERIVED_FROM_DATA if hasattr(data, name)}
    try:
        return data, model_class(config)(**vars(config.model.get("init_args") or Namespace()) | derived), problems
    except UserError as error:
        return data, None, problems if data is None else [*problems, Check("model", "fail", str(error))]


def check_memory(config: Namespace, model: CohortModule, plan: RunPlan, kind: StrategyKind) -> Check:
    """Per-device memory of a training step under the config's strategy (of this kind) and precision
    (app/tools/memory.py), against --device_memory or, on a GPU, its size. Sharded runs shard over the data-parallel
    shard size (all data-parallel ranks but under hybrid sharding, whose replicas each hold a whole sharded copy)."""
    trainer = config.trainer
    on_gpu = targets_gpu(config)
    sharded = kind is StrategyKind.FSDP or kind.shards_layers
    strategy = "fsdp" if sharded else "ddp" if plan.data_parallel_size > 1 else "single"
    fsdp_checkpointing = getattr(getattr(trainer.strategy, "init_args", None), "activation_checkpointing_policy", None)
    # FSDP2 (not under a pipeline, whose schedule reduces itself) keeps whole gradients while it accumulates them,
    # unless told to reduce-scatter every micro-batch (models/parallel/parallelize.py choose_gradient_reduction);
    # over one shard its gradients are whole already (tensor parallelism alone: measured, benchmarks/plan_memory.py)
    held_whole = (kind in (StrategyKind.MODEL_PARALLEL, StrategyKind.FAULT_TOLERANT) and plan.accumulation > 1
                  and plan.data_parallel_shard_size > 1 and not plan.reduce_gradients_every_micro_batch)
    estimate = estimate_memory(
        model.plain_network, module_step_loss(model, plan.sequence_length), plan.micro_batch_size,
        plan.precision.name, strategy, plan.data_parallel_shard_size if sharded else plan.data_parallel_size,
        plan.tensor_parallel_size, plan.pipeline_parallel_size,
        plan.pipeline_microbatches if plan.pipeline_parallel_size > 1 else None,
        activation_checkpointing=bool(model.hparams.get("activation_checkpointing") or fsdp_checkpointing),
        device_type="cuda" if on_gpu else "cpu", unsharded_gradients=held_whole,
    )
    if config.device_memory is not None:
        size = parse_memory_size(config.device_memory)
    elif on_gpu and torch.cuda.is_available():
        size = visible_device_memory()
    else:
        return Check("memory", "pass", estimate.describe(), "add --device_memory 16GiB (any size) to check it fits a GPU")
    return Check("memory", "pass" if estimate.fits(size) else "fail", estimate.describe(size))


def check_data(data: LightningDataModule, model: CohortModule, plan: RunPlan, rank: int,
               device: torch.device | None) -> Check:
    """The loader's time per micro-batch against the model's compute per micro-batch on ``device``; None: the job's
    device is not here, and the loader is timed alone."""
    data.run_plan = plan
    data.prepare_data()
    data.setup("fit")
    if isinstance(data, ShardedDataModule):
        loader, settings = data.training_loader(rank), ("data.num_workers", "data.pin_memory")
    else:  # a datamodule of one's own: its loader as fit hands it to this rank (datamodules/own_datamodule.py)
        share_out_training_samples(data, plan, rank, current_step=lambda: 0)
        loader = data.train_dataloader()
        settings = (f"the num_workers of {type(data).__name__}'s train_dataloader", "its pin_memory")
    batches = iter(loader)
    next(batches)  # workers start
    start = time.perf_counter()
    timed = sum(1 for _ in islice(batches, 10))  # up to 10: an iterable dataset's loader may have no length
    if not timed:
        return Check("data loader", "skip", "the training loader yields one micro-batch: too few to time")
    loader_seconds = (time.perf_counter() - start) / timed
    loading = f"{loader_seconds * 1e3:.1f} ms per micro-batch"
    if device is None:
        return Check("data loader", "skip", f"{loading}; the model's compute is not timed: this job runs on a GPU and "
                     "none is visible here", "run cohort doctor on a GPU node to compare the two")
    compute_seconds = micro_batch_compute_seconds(model, plan, device)
    if compute_seconds is None:
        return Check("data loader", "skip", f"{loading}; the model's compute is not timed: over 1.5B parameters, it "
                     "needs sharding", "compare with the step time once training runs")
    share = loader_seconds / (loader_seconds + compute_seconds)
    detail = (f"{loading} vs {compute_seconds * 1e3:.1f} ms of compute: {share:.0%} of the time (warns from "
              f"{DATA_WARN_SHARE:.0%}, fails from {DATA_FAIL_SHARE:.0%})")
    advice = f"raise {settings[0]} (now {loader.num_workers}), set {settings[1]}, keep data on local disk"
    status = "pass" if share < DATA_WARN_SHARE else "warn" if share < DATA_FAIL_SHARE else "fail"
    return Check("data loader", status, detail, advice if status != "pass" else "")


def micro_batch_compute_seconds(model: CohortModule, plan: RunPlan, device: torch.device) -> float | None:
    """Forward + backward of one micro-batch of the family's example batch (the shape training sees, with no trainer
    needed to prepare it), for models up to 1.5B parameters (larger ones need sharding)."""
    if model.num_parameters() > 1.5e9:
        return None
    network = model.plain_network().to(device)
    batch = model.example_batch(plan.micro_batch_size, plan.sequence_length, device)
    for _ in range(2):  # the first pass warms up allocators and kernels
        start = time.perf_counter()
        model.batch_loss(network, batch).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return time.perf_counter() - start


def check_disk_space(config: Namespace, parameters: int) -> list[Check]:
    """Room for checkpoints in the log and checkpoint folders (whether they can be written is a pre-flight check)."""
    root = log_root(config.trainer) or Path(".")
    checkpoint_bytes = parameters * 12  # fp32 weights + two AdamW moments
    checks = []
    for name, folder in (("log disk", root), ("checkpoint disk", Path(config.checkpoint.dirpath or root))):
        existing = next(parent for parent in (folder, *folder.parents) if parent.exists())
        free = shutil.disk_usage(existing).free
        status = ("pass" if free >= DISK_PASS_CHECKPOINTS * checkpoint_bytes
                  else "warn" if free >= DISK_WARN_CHECKPOINTS * checkpoint_bytes else "fail")
        detail = (f"{folder}: {format_bytes(free, 'GiB')} free, a checkpoint (weights and AdamW state in float32) "
                  f"is {format_bytes(checkpoint_bytes, 'GiB', 2)}: passes with room for {DISK_PASS_CHECKPOINTS} "
                  f"({format_bytes(DISK_PASS_CHECKPOINTS * checkpoint_bytes, 'GiB', 2)}), fails below "
                  f"{DISK_WARN_CHECKPOINTS} ({format_bytes(DISK_WARN_CHECKPOINTS * checkpoint_bytes, 'GiB', 2)})")
        checks.append(Check(name, status, detail, "free space or move the folder" if status != "pass" else ""))
    return checks


def check_addresses(num_nodes: int) -> Check:
    """The gotcha of hosts whose name resolves to loopback: other nodes are told to connect to 127.0.0.1."""
    address = socket.gethostbyname(socket.gethostname())
    pinned = os.environ.get("NCCL_SOCKET_IFNAME") or os.environ.get("GLOO_SOCKET_IFNAME")
    if num_nodes > 1 and address.startswith("127.") and not pinned:
        return Check("node address", "warn", f"hostname {socket.gethostname()} resolves to {address}",
                     "set NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME (and LOCAL_ADDR for scripts/torchrun.sh)")
    return Check("node address", "pass", f"hostname resolves to {address}" + (f", interface {pinned}" if pinned else ""))


def format_table(checks: list[Check]) -> str:
    width = max(len(check.name) for check in checks)
    lines = []
    for check in checks:
        lines.append(f"{check.status.upper():<5} {check.name:<{width}}  {check.detail}")
        if check.advice:
            lines.append(f"{'':<5} {'':<{width}}  -> {check.advice}")
    return "\n".join(lines)


class DoctorCLI(CohortCLI):
    """Parses a run's config exactly as ``cohort fit`` would, and instantiates nothing."""

    def __init__(self, args: list[str]) -> None:
        super().__init__(args, run=False)

    def parser_descriptions(self) -> dict[str, Any]:
        return {"prog": "cohort doctor", "description": describe("doctor")}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_argument("--device_memory", type=str | None, default=None,
                            help="check the memory estimate against a GPU of this size, e.g. 16GiB or 80GB (default: "
                                 "the visible GPU's)")

    def before_instantiate_classes(self) -> None:
        """The checks below report problems as findings instead of stopping at the first."""

    def instantiate_classes(self) -> None:
        """Nothing: a multi-billion-parameter model must not be built just to read its config."""


def main(argv: list[str]) -> None:
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")  # argv is the doctor's, on purpose
    config = DoctorCLI(argv).config
    try:
        launch = detect_launch()
    except (RuntimeError, ValueError) as error:  # e.g. Lightning refusing SLURM's --ntasks without --ntasks-per-node
        sys.exit(f"cohort doctor: error: the launcher's environment is not usable: {error}")
    rank, world_size = launch.rank, launch.world_size
    device = launch_device(launch, use_gpu=config.trainer.accelerator != "cpu")
    gpu_elsewhere = targets_gpu(config) and not torch.cuda.is_available()  # checked from a machine without one
    preflight = Preflight(config, subcommand=None)
    checks = []
    for name, check in preflight.checks():  # the checks fit runs, each reported instead of stopping at the first
        if gpu_elsewhere and check == preflight.resolve_trainer_precision:
            check = partial(judge_precision_for_gpu, config)
        try:
            checks.append(Check(name, "pass", check()))
        except UserError as error:
            checks.append(Check(name, "fail", str(error)))
    checks.append(check_addresses(int(config.trainer.num_nodes)))
    joined = False
    if checks[0].status == "fail":
        checks.append(Check("barrier", "warn", "skipped: the processes do not form the job the config describes"))
    elif launch.launcher != "none":
        barrier, joined = check_rendezvous(launch, device, timeout_s=60)
        checks.append(barrier)
        if joined:
            checks.append(check_bandwidth(device))
    data, model, problems = instantiate_family(config)
    checks += problems
    if model is not None:  # the family's line of a run's start: size, parameters (a mixture of experts': active too)
        checks.append(Check("model", "pass", model.describe()))
    if model is None or preflight.plan is None:
        unknown = "the model" if model is None else "the run plan's sizes"
        checks.append(Check("memory", "skip", f"not estimated: {unknown} could not be resolved (see above)"))
    else:
        try:
            checks.append(check_memory(config, model, preflight.plan, preflight.strategy.kind))
        except UserError as error:  # --device_memory that is not a size
            checks.append(Check("memory", "fail", f"--device_memory: {error}"))
    if data is not None and model is not None and preflight.plan is not None:
        try:
            checks.append(check_data(data, model, preflight.plan, rank, None if gpu_elsewhere else device))
        except UserError as error:
            checks.append(Check("data", "fail", str(error)))
    if model is not None:
        checks += check_disk_space(config, model.num_parameters())
    if rank == 0:
        print(f"cohort doctor: rank 0 of {world_size} on {socket.gethostname()}\n{format_table(checks)}")
    if joined:
        dist.destroy_process_group()
    failed = [check.name for check in checks if check.status == "fail"]
    if failed:
        sys.exit(f"cohort doctor: {len(failed)} check(s) failed: {', '.join(failed)}" if rank == 0 else 1)
