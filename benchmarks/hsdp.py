"""Hybrid sharding: bytes each rank sends per optimizer step over the shard and the replicate dimension, and the
state it holds, for 4 ranks as replicas x shards = 4 x 1 (replicate only: DDP's traffic, through FSDP2), 2 x 2
(HSDP) and 1 x 4 (FSDP2 over all), side by side; then HSDP 2 x 2 accumulating 4 micro-batches, reducing once per
optimizer step or reduce-scattering every micro-batch.

    python -m benchmarks.hsdp --model small

Each layout runs in its own 4 processes (gloo, CPU): the model is built as the app builds it (models/parallel/
parallelize.py, FSDP2 over the replicas x shards grid), trained a few optimizer steps with the app's AdamW
groups and its choice of gradient collectives (models/parallel/parallelize.py choose_gradient_reduction), while
app/tools/comm.py's CollectiveCounter records every all-gather, reduce-scatter and all-reduce FSDP2 calls with its
process group and buffer. Bytes sent per rank = buffer x (n - 1) / n for an all-gather or reduce-scatter over n
ranks, x 2 (n - 1) / n for an all-reduce (what any ring or tree must send, as nccl-tests' bus bandwidth counts).
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from app.tools.comm import CollectiveCounter
from benchmarks.sharding_memory import free_port, local_bytes
from core.precision import PRECISIONS
from core.run_plan import RunPlan
from models.gpt.family import build_gpt
from models.gpt.network import gpt_config
from models.optimizer import weight_decay_groups
from models.parallel.parallelize import choose_gradient_reduction

WORLD_SIZE = 4
# (name, replicas, accumulation, reduce_gradients_every_micro_batch); shards = WORLD_SIZE / replicas
LAYOUTS = [("replicate 4 x shard 1", 4, 1, False), ("HSDP 2 x 2", 2, 1, False), ("shard 4 (FSDP2)", 1, 1, False),
           ("HSDP 2 x 2, accumulation 4, reduce once", 2, 4, False),
           ("HSDP 2 x 2, accumulation 4, reduce every micro-batch", 2, 4, True)]


def measure(rank: int, port: int, layout: tuple, model_name: str, steps: int, results: dict) -> None:
    name, replicas, accumulation, every_micro_batch = layout
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    mesh = init_device_mesh("cpu", (WORLD_SIZE, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    config = gpt_config(model_name, vocab_size=256)
    model = build_gpt(config, torch.device("cpu"), seed=1337, device_mesh=mesh, data_parallel_replicas=replicas)
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=1e-4, fused=True)
    plan = RunPlan(devices_per_node=WORLD_SIZE, num_nodes=1, data_parallel_size=WORLD_SIZE, tensor_parallel_size=1,
                   global_batch_size=WORLD_SIZE * accumulation, micro_batch_size=1, sequence_length=64,
                   precision=PRECISIONS["32-true"], seed=1337, data_parallel_replicate_size=replicas,
                   reduce_gradients_every_micro_batch=every_micro_batch)
    tokens = torch.randint(0, 256, (steps * accumulation, 1, 65), generator=torch.Generator().manual_seed(rank))
    # FSDP2's mesh: (data_parallel_replicate, data_parallel_shard), or with one replica (data_parallel), all shards
    fsdp_mesh = next(model.parameters()).device_mesh
    groups = {fsdp_mesh.get_group(dimension): "replicate" if dimension.endswith("replicate") else "shard"
              for dimension in fsdp_mesh.mesh_dim_names}
    with CollectiveCounter(groups) as counter:
        for batch_index, sample in enumerate(tokens):
            choose_gradient_reduction(model, plan, batch_index)
            logits = model(sample[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), sample[:, 1:].flatten()).backward()
            if plan.ends_optimizer_step(batch_index):
                optimizer.step()
                if batch_index < len(tokens) - 1:  # the last step's gradients are kept, to be counted
                    optimizer.zero_grad()
    sent: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for call in counter.calls:
        sent[call.operation, call.group][0] += 1
        sent[call.operation, call.group][1] += call.bytes_sent
    grads = [param.grad for param in model.parameters() if param.grad is not None]
    moments = [value for state in optimizer.state.values() for value in state.values()
               if isinstance(value, (torch.Tensor, DTensor)) and value.dim() > 0]
    results[(name, rank)] = {
        "sent": {key: (count / steps, total / steps) for key, (count, total) in sent.items()},
        "state": sum(map(local_bytes, model.parameters())) + sum(map(local_bytes, grads))
        + sum(map(local_bytes, moments)),
    }
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="a size from models.gpt.network.GPT_CONFIGS")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    results = mp.Manager().dict()
    for layout in LAYOUTS:
        mp.spawn(measure, args=(free_port(), layout, args.model, args.steps, results), nprocs=WORLD_SIZE)
    mib = 2**20
    print(f"model {args.model} (vocab 256), {WORLD_SIZE} ranks, gloo on CPU; per rank and optimizer step: MiB sent "
          "(calls) over the shard dimension (all-gathers, reduce-scatters) and the replicate dimension (all-reduces); "
          "params + grads + Adam moments held (MiB)")
    for name, *_ in LAYOUTS:
        row = results[(name, 0)]
        assert all(results[(name, rank)] == row for rank in range(WORLD_SIZE)), f"{name}: ranks differ"

        def cell(operation: str, dimension: str) -> str:
            count, total = row["sent"].get((operation, dimension), (0, 0.0))
            return f"{total / mib:.3f} ({count:g})"

        shard_total = sum(total for (_, group), (_, total) in row["sent"].items() if group == "shard")
        replicate_total = sum(total for (_, group), (_, total) in row["sent"].items() if group == "replicate")
        print(f"| {name} | {cell('all_gather', 'shard')} | {cell('reduce_scatter', 'shard')} | "
              f"{cell('all_reduce', 'replicate')} | {shard_total / mib:.3f} | {replicate_total / mib:.3f} | "
              f"{row['state'] / mib:.3f} |")


if __name__ == "__main__":
    main()
