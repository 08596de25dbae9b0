"""Per-rank memory of parameters + gradients + optimizer state: FSDP2 over 2 ranks vs DDP, side by side.

    python -m benchmarks.sharding_memory --model gpt2

Each mode runs in its own 2 processes (gloo, CPU): the model is built as the app builds it (models/parallel/parallelize.py),
trained for a few optimizer steps with the app's AdamW groups, then every rank counts the bytes of the local
tensors it holds (its shards under FSDP2; everything under DDP) and reports its peak resident memory.
Goal (issue #3): FSDP2 / DDP <= 0.52 (ideal 0.5).

Peak RSS is measured twice: with glibc's default allocator settings, and with MALLOC_MMAP_THRESHOLD_=65536, which
makes every allocation above 64 KiB its own mapping, returned to the system when freed. With the defaults, the
many short-lived buffers FSDP2 gathers and reduce-scatters per block stay in the heap after they are freed, and
the high-water mark says more about fragmentation than about what is alive at once.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from models.gpt.family import build_gpt
from models.gpt.network import gpt_config
from models.optimizer import weight_decay_groups


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def measure(rank: int, port: int, mode: str, model_name: str, steps: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    config = gpt_config(model_name, vocab_size=256)
    sharded = mode.startswith("fsdp2")
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("data_parallel", "tensor_parallel")) if sharded else None
    model = build_gpt(config, torch.device("cpu"), seed=1337, device_mesh=mesh)
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=1e-4, fused=True)
    trained = model if sharded else DistributedDataParallel(model)
    tokens = torch.randint(0, 256, (1, 65), generator=torch.Generator().manual_seed(rank))
    for _ in range(steps):
        logits = trained(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()  # gradients are kept (no zero_grad) so that they are counted
    parameters = sum(local_bytes(p) for p in model.parameters())
    gradients = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    optimizer_state = sum(local_bytes(value) for state in optimizer.state.values() for value in state.values()
                          if isinstance(value, torch.Tensor) and value.dim() > 0)  # moments, not the step counts
    results[(mode, rank)] = {"parameters": parameters, "gradients": gradients, "optimizer_state": optimizer_state,
                             "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", help="a size from models.gpt.network.GPT_CONFIGS")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    results = mp.Manager().dict()
    for allocator in ("default", "mmap"):
        if allocator == "mmap":
            os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc when the spawned ranks start
        for mode in ("ddp", "fsdp2"):
            mp.spawn(measure, args=(free_port(), f"{mode}/{allocator}", args.model, args.steps, results), nprocs=2)
    gib = 2**30
    print(f"model {args.model} (vocab 256), 2 ranks, gloo on CPU; per rank (GiB): params + grads + Adam moments, peak RSS")
    for mode in ("ddp", "fsdp2"):
        for rank in (0, 1):
            row = results[(f"{mode}/default", rank)]
            total = row["parameters"] + row["gradients"] + row["optimizer_state"]
            print(f"  {mode:5} rank {rank}: params {row['parameters'] / gib:.3f} + grads {row['gradients'] / gib:.3f} "
                  f"+ optimizer {row['optimizer_state'] / gib:.3f} = {total / gib:.3f}; peak RSS "
                  f"{row['peak_rss'] / gib:.2f} (default malloc), {results[(f'{mode}/mmap', rank)]['peak_rss'] / gib:.2f} (mmap)")

    def largest(mode: str, field: str) -> float:
        rows = [results[(mode, rank)] for rank in (0, 1)]
        if field == "state":
            return max(row["parameters"] + row["gradients"] + row["optimizer_state"] for row in rows)
        return max(row[field] for row in rows)

    print(f"FSDP2 / DDP, largest rank: state bytes {largest('fsdp2/default', 'state') / largest('ddp/default', 'state'):.4f} "
          f"(goal <= 0.52); peak RSS {largest('fsdp2/default', 'peak_rss') / largest('ddp/default', 'peak_rss'):.3f} "
          f"(default malloc), {largest('fsdp2/mmap', 'peak_rss') / largest('ddp/mmap', 'peak_rss'):.3f} (mmap)")

if __name__ == "__main__":
    main()
