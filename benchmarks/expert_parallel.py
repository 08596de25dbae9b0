"""Expert parallelism vs FSDP2 alone on 2 CPU processes (gloo): the expert state each rank holds (weights, gradients,
Adam's moments), the step time and, under EP, the share of it in the forward's token exchanges, side by side.

    python -m benchmarks.expert_parallel --model small --steps 8

Each layout runs in its own 2 processes, built as the app builds it (models/parallel/parallelize.py build_network:
FSDP2 over both ranks, with expert_parallel_size 2 the experts split by expert instead and left out of FSDP2), and
trains ``steps`` optimizer steps of one micro-batch per rank with the app's AdamW groups and gradient reduction; the
first step (allocation, first collectives) is not timed, and the step time is the median over the rest of the
slower rank's. The layouts alternate over ``rounds``, so that a machine busy for a while slows both.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from benchmarks.sharding_memory import free_port, local_bytes
from core.precision import PRECISIONS
from core.run_plan import RunPlan
from models.moe.family import MoELanguageModel
from models.moe.network import MoE, moe_config
from models.optimizer import weight_decay_groups
from models.parallel.expert_parallel import expert_parallel_of, expert_weights, reduce_expert_gradients
from models.parallel.parallelize import build_network, choose_gradient_reduction

WORLD_SIZE = 2
LAYOUTS = {"FSDP2 over 2 (experts sharded by FSDP2)": 1, "EP 2 (experts split by expert) x FSDP2": 2}


def measure(rank: int, port: int, expert_parallel: int, model_name: str, micro_batch: int, steps: int,
            results: dict, key: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    mesh = init_device_mesh("cpu", (WORLD_SIZE, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    config = moe_config(model_name)
    model = build_network(lambda: MoE(config), torch.device("cpu"), 1337, mesh, expert_parallel_size=expert_parallel)
    family = MoELanguageModel(model_name=model_name)
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=1e-4, fused=True)
    plan = RunPlan(devices_per_node=WORLD_SIZE, num_nodes=1, data_parallel_size=WORLD_SIZE, tensor_parallel_size=1,
                   global_batch_size=WORLD_SIZE * micro_batch, micro_batch_size=micro_batch,
                   sequence_length=config.block_size, precision=PRECISIONS["32-true"], seed=1337,
                   expert_parallel_size=expert_parallel)
    state = expert_parallel_of(model)
    exchange_seconds = 0.0
    if state is not None:
        state.mark = time.perf_counter
    tokens = torch.randint(0, config.vocab_size, (steps, micro_batch, config.block_size + 1),
                           generator=torch.Generator().manual_seed(rank))
    step_seconds = []
    for step, sample in enumerate(tokens):
        if state is not None:
            state.exchanges.clear()
        start = time.perf_counter()
        choose_gradient_reduction(model, plan, step)
        family.batch_loss(model, (sample[:, :-1], sample[:, 1:])).backward()
        reduce_expert_gradients(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # the gradients stay, to be counted
        seconds = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # a step ends with its slowest rank
        if step > 0:
            step_seconds.append(seconds.item())
            if state is not None:
                exchange_seconds += sum(end - begin for begin, end in state.exchanges)
    experts = expert_weights(model)
    moments = [value for param in experts for value in optimizer.state[param].values() if value.dim() > 0]
    results[key + (rank,)] = {
        "expert_bytes": sum(map(local_bytes, experts)) + sum(local_bytes(param.grad) for param in experts)
        + sum(map(local_bytes, moments)),
        "whole_expert_bytes": 4 * sum(param.numel() for param in experts) * 4,  # weights, grads, 2 moments
        "step": statistics.median(step_seconds),
        "exchange_share": exchange_seconds / sum(step_seconds),
    }
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="a size from models.moe.network.MOE_CONFIGS")
    parser.add_argument("--micro_batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results = mp.Manager().dict()
    for round_index in range(args.rounds):
        for name, expert_parallel in LAYOUTS.items():
            mp.spawn(measure, args=(free_port(), expert_parallel, args.model, args.micro_batch, args.steps, results,
                                    (name, round_index)), nprocs=WORLD_SIZE)
    mib = 2**20
    print(f"{time.strftime('%Y-%m-%d')}, {platform.machine()} {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}; model {args.model}, micro batch {args.micro_batch} per rank, "
          f"{args.steps - 1} timed steps x {args.rounds} rounds")
    print("| layout | expert state per rank (MiB) | of the whole | step time (s) | x FSDP2's | all-to-all share |")
    print("| --- | --- | --- | --- | --- | --- |")
    baseline = None
    for name in LAYOUTS:
        rows = [results[(name, round_index, rank)] for round_index in range(args.rounds) for rank in range(WORLD_SIZE)]
        step = min(row["step"] for row in rows)  # the least disturbed round
        baseline = baseline or step
        held = max(row["expert_bytes"] for row in rows)
        share = statistics.median(row["exchange_share"] for row in rows)
        print(f"| {name} | {held / mib:.2f} | {held / rows[0]['whole_expert_bytes']:.2f} | {step:.3f} | "
              f"{step / baseline:.2f} | {share:.1%} |")


if __name__ == "__main__":
    main()
