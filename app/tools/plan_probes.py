"""The measured constants of ``cohort plan``'s cost model (app/tools/cost_model.py), each a short probe on this
machine, or stated ones for a GPU that is not here.

- ``probe_device``: the model's own forward and backward timed at two micro batch sizes (the median of 7 each), on as
  many threads as each of the job's processes on this node gets (Lightning gives each CPU process cores / processes):
  the slope is the throughput on the counted FLOPs, the intercept the fixed time of a call. A square-matmul probe
  (app/observability/flops.py measured_peak_tflops) is reported beside it: a small model's matmuls run far below it.
  What fit does after a step's backward (the gradient norm and AdamW) gives the optimizer's seconds per
  parameter.
- ``probe_link``: all-reduces of 4 KiB and 4 MiB between ``processes`` local processes over gloo (NCCL on GPUs),
  timed as ``cohort comm`` times them, the fastest of 3 rounds: the small one is the latency, the difference the
  bandwidth.
- ``stated_device``: a GPU in app/observability/flops.py's data-sheet table, at its peak (an upper bound).
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as multiprocessing

from app.observability.flops import measured_peak_tflops, peak_tflops_per_device
from app.tools.comm import time_collective
from app.tools.cost_model import DeviceSpeed, Link
from core.errors import UserError
from models.module import CohortModule

SMALL_MESSAGE, LARGE_MESSAGE = 4 * 2**10, 4 * 2**20  # bytes of the link probe's two all-reduces


@contextmanager
def threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` for a probe, then back."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def threads_per_process(processes_per_node: int) -> int:
    """The cores Lightning gives each CPU process of a job of ``processes_per_node`` on this machine."""
    return max(1, (os.cpu_count() or 1) // processes_per_node)


def median_seconds(work: Callable[[], object], device: torch.device, repeats: int = 7) -> float:
    """The median time of ``repeats`` calls of ``work`` after one to warm up: a training step's typical time (the
    fastest would be the least disturbed one, which a run of many steps does not keep to)."""
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def time_step(model: CohortModule, network: torch.nn.Module, micro_batch_size: int, sequence_length: int,
              device: torch.device) -> float:
    """A forward and backward pass at ``micro_batch_size``."""
    batch = model.example_batch(micro_batch_size, sequence_length, device)
    return median_seconds(lambda: model.batch_loss(network, batch).backward(), device)


def time_optimizer_step(network: torch.nn.Module, device: torch.device) -> float:
    """What fit does after a step's last backward, on the gradients the probe's backward passes left: the global
    gradient norm (logged, and clipped by the recipes) and AdamW's update (zero_grad sets them to None: no work)."""
    optimizer = torch.optim.AdamW(network.parameters())

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(network.parameters(), 1.0)
        optimizer.step()

    step()  # the moments are made here
    return median_seconds(step, device, repeats=5)


def probe_device(model: CohortModule, sequence_length: int, micro_batch_size: int, processes_per_node: int,
                 device: torch.device) -> DeviceSpeed:
    """The model's step timed at micro batch 1 and ``micro_batch_size`` (at least 2) on this device, per the module
    docstring."""
    flops_per_sample = model.flops_per_sample(sequence_length)
    larger = max(2, micro_batch_size)
    with threads(threads_per_process(processes_per_node) if device.type == "cpu" else torch.get_num_threads()):
        with torch.device(device):
            network = model.plain_network()
        one, many = (time_step(model, network, size, sequence_length, device) for size in (1, larger))
        per_sample = max((many - one) / (larger - 1), 1e-9)
        optimizer_seconds = time_optimizer_step(network, device)
        matmul = measured_peak_tflops(device, torch.float32, seconds=0.1)
    parameters = sum(parameter.numel() for parameter in network.parameters())
    flops_per_second = flops_per_sample / per_sample
    source = (f"measured here: the model's forward and backward at micro batch 1 and {larger} "
              f"({one * 1e3:.1f} and {many * 1e3:.1f} ms), {flops_per_second / 1e9:.1f} GFLOP/s on the counted FLOPs "
              f"(a 512x512 matmul reaches {matmul * 1e3:.1f}), {max(0.0, one - per_sample) * 1e3:.2f} ms fixed per call; "
              f"gradient norm and AdamW {optimizer_seconds * 1e3:.1f} ms for {parameters:,} parameters")
    if device.type == "cpu":
        source += f"; {threads_per_process(processes_per_node)} thread(s) per process"
    return DeviceSpeed(flops_per_second, max(0.0, one - per_sample), optimizer_seconds / parameters,
                       overlaps_communication=device.type == "cuda", source=source)


def stated_device(name: str, compute_dtype: torch.dtype) -> DeviceSpeed:
    """A GPU of the data-sheet table at its dense peak: the compute is a lower bound, so predictions are optimistic."""
    peak = peak_tflops_per_device(name, compute_dtype)
    if peak is None:
        raise UserError(f"--gpu {name!r} is not in the data-sheet table (app/observability/flops.py): name one of "
                        "A100, H100, H200, or run cohort plan on the GPU itself to measure it")
    # AdamW reads and writes 16 bytes of state and weights per parameter and reads the gradient: HBM-bound, at the
    # data sheet's 2-3 TB/s about 1e-11 s per parameter
    return DeviceSpeed(peak * 1e12, 0.0, 1e-11, overlaps_communication=True,
                       source=f"stated: {name} dense peak {peak:g} TFLOP/s (data sheet), no fixed cost per call")


def probe_link(processes: int, use_gpu: bool) -> Link:
    """A local all-reduce probe between ``processes`` new processes, per the module docstring."""
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "link.txt"
        multiprocessing.start_processes(link_probe_rank, args=(processes, use_gpu, str(result), _free_port()),
                                        nprocs=processes, start_method="spawn")
        small, large = map(float, result.read_text().split())
    # an all-reduce of S bytes over n ranks: 2 (n - 1) (latency + S / (n x bandwidth))
    hops = 2 * (processes - 1)
    latency = max(small / hops, 1e-7)
    bandwidth = (LARGE_MESSAGE - SMALL_MESSAGE) * hops / processes / max(large - small, 1e-9)
    backend = "NCCL" if use_gpu else "gloo"
    return Link(bandwidth, latency, f"measured here: all-reduce of 4 KiB in {small * 1e6:.0f} us and 4 MiB in "
                f"{large * 1e3:.2f} ms over {processes} local processes ({backend})")


def link_probe_rank(rank: int, processes: int, use_gpu: bool, result: str, port: int) -> None:
    """One rank of ``probe_link``: rank 0 writes the two times."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if use_gpu else torch.device("cpu")
    torch.set_num_threads(threads_per_process(processes))
    dist.init_process_group("nccl" if use_gpu else "gloo", rank=rank, world_size=processes,
                            timeout=timedelta(minutes=1))
    try:
        # the fastest of 3 rounds of each: the least disturbed by other work on the machine
        times = [min(time_collective("all_reduce", size // 4, device, iterations=10, warmup=3) for _ in range(3))
                 for size in (SMALL_MESSAGE, LARGE_MESSAGE)]
        if rank == 0:
            Path(result).write_text(" ".join(map(str, times)))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
