"""``cohort comm``: collective bandwidth of the current process group, measured as nccl-tests measures it.

    torchrun --nproc_per_node=8 -m app comm                   # one node
    srun --ntasks-per-node=8 python -m app comm --csv comm.csv  # under SLURM

For each operation and message size it reports the time per call, the algorithm bandwidth (bytes / time) and the
bus bandwidth, which corrects for how much each rank must send whatever the algorithm, so that it can be compared
with the link's speed: all-reduce x 2(n-1)/n, all-gather and reduce-scatter x (n-1)/n (n = world size, bytes =
the full buffer). NCCL on GPUs, gloo on CPUs. Rank and world size come from torchrun's or SLURM's environment.
"""

from __future__ import annotations

import csv
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from app.cli.launch import detect_launch, join_process_group, launch_device
from core.errors import ArgumentParser, UserError
from core.sizes import parse_byte_size

BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}


@dataclass
class Measurement:
    operation: str
    bytes: int
    seconds: float
    algorithm_gbps: float  # GB/s, 1e9 bytes
    bus_gbps: float


def message_sizes(smallest: int, largest: int) -> list[int]:
    """Powers of 4 from smallest to largest, as nccl-tests' -f 4 steps."""
    sizes, size = [], smallest
    while size <= largest:
        sizes.append(size)
        size *= 4
    return sizes


def time_collective(operation: str, elements: int, device: torch.device, iterations: int, warmup: int) -> float:
    """Seconds per call on a float32 buffer of ``elements``, the slowest rank's (a collective ends with its last
    rank)."""
    world_size = dist.get_world_size()
    full = torch.ones(elements, dtype=torch.float32, device=device)
    shard = torch.empty(elements // world_size, dtype=torch.float32, device=device)
    run = {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: dist.all_gather_into_tensor(full, shard),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full),
    }[operation]
    for _ in range(warmup):
        run()
    synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        run()
    synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iterations], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


@dataclass(frozen=True)
class Collective:
    operation: str  # a key of BUS_FACTOR
    group: str  # the name the counter was given for its process group
    ranks: int  # the group's size
    bytes: int  # the full buffer, as nccl-tests counts it: the gathered or reduced tensor, not one shard

    @property
    def bytes_sent(self) -> float:
        """What each rank sends of it, whatever the algorithm: the full buffer times its bus factor."""
        return self.bytes * BUS_FACTOR[self.operation](self.ranks)


class CollectiveCounter:
    """Records the gradient and weight collectives this process calls while it is entered: torch.distributed's
    all_gather_single and reduce_scatter_single (FSDP2's) and all_reduce (HSDP's across replicas, DDP's), which their
    callers look up on the module at each call. ``group_names`` names the process groups to tell apart (a device mesh
    dimension's ``get_group()``); a collective on another group is recorded under "other"."""

    FUNCTIONS = {"all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter",
                 "all_reduce": "all_reduce"}

    def __init__(self, group_names: dict[dist.ProcessGroup, str]) -> None:
        self.group_names = group_names
        self.calls: list[Collective] = []
        self.originals: dict[str, Callable[..., object]] = {}

    def __enter__(self) -> CollectiveCounter:
        for function, operation in self.FUNCTIONS.items():
            self.originals[function] = original = getattr(dist, function)
            setattr(dist, function, self.recording(operation, original))
        return self

    def __exit__(self, *exception: object) -> None:
        for function, original in self.originals.items():
            setattr(dist, function, original)

    def recording(self, operation: str, original: Callable[..., object]) -> Callable[..., object]:
        def record(*args: object, **kwargs: object) -> object:
            group = kwargs.get("group")
            # the full buffer: all-gather's output, reduce-scatter's input, the all-reduced tensor
            tensor = kwargs["input"] if "input" in kwargs else args[1] if operation == "reduce_scatter" else args[0]
            assert isinstance(tensor, torch.Tensor)
            self.calls.append(Collective(operation, self.group_names.get(group, "other"),  # type: ignore[arg-type]
                                         dist.get_world_size(group), tensor.numel() * tensor.element_size()))
            return original(*args, **kwargs)
        return record


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(operations: Sequence[str], sizes: Sequence[int], device: torch.device, iterations: int,
            warmup: int) -> list[Measurement]:
    world_size = dist.get_world_size()
    results = []
    for operation in operations:
        for size in sizes:
            elements = max(world_size, size // 4 // world_size * world_size)  # float32, whole shards per rank
            seconds = time_collective(operation, elements, device, iterations, warmup)
            algorithm = elements * 4 / seconds / 1e9
            bus = algorithm * BUS_FACTOR[operation](world_size)
            results.append(Measurement(operation, elements * 4, seconds, algorithm, bus))
    return results


def format_table(results: Sequence[Measurement], world_size: int, backend: str) -> str:
    lines = [f"collectives over {world_size} ranks ({backend})",
             f"{'operation':<15}{'size':>12}{'time (us)':>14}{'algbw (GB/s)':>15}{'busbw (GB/s)':>15}"]
    for m in results:
        lines.append(f"{m.operation:<15}{m.bytes:>12,}{m.seconds * 1e6:>14.1f}{m.algorithm_gbps:>15.4g}{m.bus_gbps:>15.4g}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = ArgumentParser(prog="cohort comm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-size", default="1K", help="smallest message (default 1K = 1024 bytes)")
    parser.add_argument("--max-size", default="256M", help="largest message (default 256M = 256 x 2^20 bytes)")
    parser.add_argument("--operations", nargs="+", default=list(BUS_FACTOR), choices=list(BUS_FACTOR))
    parser.add_argument("--iterations", type=int, default=20, help="timed calls per size")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per size first")
    parser.add_argument("--csv", help="also write the results to this CSV file (rank 0)")
    args = parser.parse_args(argv)
    sizes = message_sizes(parse_byte_size(args.min_size, "--min-size"), parse_byte_size(args.max_size, "--max-size"))
    if not sizes:
        raise UserError(f"cohort comm: --min-size {args.min_size} is larger than --max-size {args.max_size}")
    launch = detect_launch()
    device = launch_device(launch)
    join_process_group(launch, device)
    try:
        results = measure(args.operations, sizes, device, args.iterations, args.warmup)
        if dist.get_rank() == 0:
            print(format_table(results, dist.get_world_size(), dist.get_backend()))
            if args.csv:
                with open(args.csv, "w", newline="") as handle:
                    writer = csv.DictWriter(handle, fieldnames=list(asdict(results[0])))
                    writer.writeheader()
                    writer.writerows(asdict(m) for m in results)
    finally:
        dist.destroy_process_group()
