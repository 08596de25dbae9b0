"""Pipeline parallelism at pp=2 on CPU (gloo, 1 thread per process), side by side with one process:

    python -m benchmarks.pipeline                 # all three; about 6 minutes on 2 idle cores
    python -m benchmarks.pipeline --part memory   # or bubble, or speed

- memory: the bytes of parameters + gradients + AdamW state each rank holds after one optimizer step, for the
  gpt2 shape with the byte vocabulary (256) and with GPT-2's own (50257), the stages built as the app builds
  them (models/parallel/parallelize.py, models/parallel/pipeline.py). Goal (issue #10): the larger stage <= 0.55 x one process.
- bubble: each rank's share of the pipeline's time in which it did not compute (1 - its forward and backward
  compute / the longest time a rank spent in the schedule, as the monitor logs it) for m = 2, 4, 8 pipeline
  micro-batches under every schedule (the m it accepts), against its theory (models/parallel/pipeline.py
  theoretical_bubble), side by side in one run. Goals: within 0.05 once a pipeline micro-batch computes for a few
  ms; a zero-bubble schedule's below 1F1B's at the same m (issue #25).
- speed: the time of one micro batch's forward and backward through the pipeline under each schedule (side by side
  in one run) against the same on one process, and where the pipeline's time goes (compute and waiting per rank).
  Goal (issue #25): pp=2 with m=8 at <= 0.60 x one process.

Every number is a median over the timed steps that follow warm-up steps.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from core.errors import UserError
from core.pipeline_schedules import PIPELINE_SCHEDULES
from core.precision import PRECISIONS
from core.run_plan import RunPlan
from models.gpt.family import GPT_PIPELINE_SPLIT, build_gpt
from models.gpt.network import GPTConfig, gpt_config
from models.optimizer import weight_decay_groups
from models.parallel.pipeline import Pipeline, rank_stages, theoretical_bubble

SEED = 1337
# wide enough that one pipeline micro-batch (2 samples x 128 tokens through 2 blocks) computes for several ms; its 4
# blocks make 2 stages of 2 (GPipe, 1F1B) or 4 of 1, two on each rank (the others)
TIMING_CONFIG = GPTConfig(n_layer=4, n_head=8, n_embd=512, block_size=128, vocab_size=256)
WARMUP_STEPS, TIMED_STEPS = 2, 6


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def spawn(function: Callable, *args: object) -> dict:
    """Run ``function(rank, port, *args, results)`` on 2 gloo processes; returns what they put in ``results``."""
    results = mp.Manager().dict()
    mp.spawn(function, args=(free_port(), *args, results), nprocs=2)
    return dict(results)


def plan_of(schedule: str, microbatches: int, samples: int) -> RunPlan:
    """The run plan of a micro batch of ``samples`` on 2 pipeline ranks: its checks, and the stages' placement."""
    return RunPlan(devices_per_node=2, num_nodes=1, data_parallel_size=1, tensor_parallel_size=1,
                   global_batch_size=samples, micro_batch_size=samples, sequence_length=TIMING_CONFIG.block_size,
                   precision=PRECISIONS["32-true"], seed=SEED, pipeline_parallel_size=2, pipeline_schedule=schedule,
                   pipeline_microbatches=microbatches)


def join(rank: int, port: int) -> DeviceMesh:
    """This process's place in the 2 gloo processes, as a (pipeline, data, tensor) mesh of (2, 1, 1)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    return init_device_mesh("cpu", (2, 1, 1), mesh_dim_names=("pipeline_parallel", "data_parallel", "tensor_parallel"))


def pipeline_of(mesh: DeviceMesh, config: GPTConfig, plan: RunPlan) -> Pipeline:
    """This rank's stages of a GPT of ``config`` and the plan's schedule over them, as ``cohort fit`` builds them."""
    spans = rank_stages(config.n_layer, mesh, plan.pipeline_stage_ranks)
    stages = [build_gpt(config, torch.device("cpu"), SEED, mesh, stage=span) for span in spans]
    return Pipeline(stages, spans, mesh, torch.device("cpu"), plan.pipeline_schedule, plan.pipeline_microbatches,
                    GPT_PIPELINE_SPLIT, ["wte.weight"], plan.pipeline_ends_on_one_rank)


def batch(config: GPTConfig, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, config.vocab_size, (samples, config.block_size + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters, gradients and the optimizer's moments: what a rank must hold between steps."""
    def size(tensor: torch.Tensor) -> int:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return local.numel() * local.element_size()
    parameters = sum(size(p) + (size(p.grad) if p.grad is not None else 0) for p in model.parameters())
    return parameters + sum(size(value) for state in optimizer.state.values() for value in state.values()
                            if isinstance(value, torch.Tensor) and value.dim() > 0)


def memory_on_rank(rank: int, port: int, config: GPTConfig, results: dict) -> None:
    pipeline = pipeline_of(join(rank, port), config, plan_of("1F1B", 2, 2))
    model = pipeline.stages[0].submod
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=1e-4)
    pipeline.train_step(*batch(config, 2), accumulation=1)
    pipeline.finish_gradients()
    optimizer.step()  # gradients kept, so that they are counted
    results[rank] = held_bytes(model, optimizer)
    dist.barrier()
    dist.destroy_process_group()


def memory() -> None:
    print("memory: parameters + gradients + AdamW moments per rank, gpt2 shape, pp=2 vs 1 process")
    for vocab in (256, 50257):
        config = gpt_config("gpt2", vocab_size=vocab)
        config = GPTConfig(**{**config.__dict__, "block_size": 64})  # short sequences: only the state matters here
        whole = build_gpt(config, torch.device("cpu"), SEED)
        optimizer = torch.optim.AdamW(weight_decay_groups(whole, 0.1), lr=1e-4)
        inputs, targets = batch(config, 2)
        F.cross_entropy(whole(inputs).flatten(0, 1), targets.flatten()).backward()
        optimizer.step()
        one = held_bytes(whole, optimizer)
        del whole, optimizer
        ranks = spawn(memory_on_rank, config)
        print(f"  vocabulary {vocab:>6}: 1 process {one / 2**20:,.0f} MiB; rank 0 {ranks[0] / 2**20:,.0f} MiB "
              f"({ranks[0] / one:.3f}x), rank 1 {ranks[1] / 2**20:,.0f} MiB ({ranks[1] / one:.3f}x); "
              f"larger stage {max(ranks.values()) / one:.3f}x")


def timed_steps(step: Callable[[], None]) -> list[float]:
    for _ in range(WARMUP_STEPS):
        step()
    times = []
    for _ in range(TIMED_STEPS):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def pipeline_timing_on_rank(rank: int, port: int, plans: list[RunPlan], results: dict) -> None:
    """Each plan's pipeline, built side by side in these 2 processes and stepped in turn (one step of each, then the
    next round), so that the load of the machine weighs on all alike; per schedule the medians of the timed rounds:
    step time, compute, and the bubble as the monitor measures it (app/observability/monitor.py: 1 - this rank's
    compute / the longest time a rank spent in the schedule)."""
    mesh = join(rank, port)
    pipelines = [pipeline_of(mesh, TIMING_CONFIG, plan) for plan in plans]
    inputs, targets = batch(TIMING_CONFIG, plans[0].micro_batch_size)
    measured: list[dict[str, list[float]]] = [{"step": [], "bubble": [], "busy": []} for _ in plans]
    for round_ in range(WARMUP_STEPS + TIMED_STEPS):
        for pipeline, series in zip(pipelines, measured):
            compute, scheduled, start = pipeline.compute_seconds, pipeline.schedule_seconds, time.perf_counter()
            pipeline.train_step(inputs, targets, accumulation=1)
            step = time.perf_counter() - start
            times = torch.tensor([pipeline.compute_seconds - compute, pipeline.schedule_seconds - scheduled])
            gathered = [torch.empty_like(times) for _ in range(2)]
            dist.all_gather(gathered, times)
            if round_ >= WARMUP_STEPS:
                series["step"].append(step)
                series["busy"].append(times[0].item())
                series["bubble"].append(1 - times[0].item() / max(rank_times[1].item() for rank_times in gathered))
    results[rank] = {plan.pipeline_schedule: {name: statistics.median(values) for name, values in series.items()}
                     for plan, series in zip(plans, measured)}
    dist.barrier()
    dist.destroy_process_group()


def bubble() -> None:
    print(f"bubble at pp=2, 2 samples x {TIMING_CONFIG.block_size} tokens per pipeline micro-batch, "
          f"width {TIMING_CONFIG.n_embd}, 4 blocks (measured per rank vs theory; the schedules side by side)")
    for microbatches in (2, 4, 8):
        plans = []
        for schedule in PIPELINE_SCHEDULES:
            try:
                plans.append(plan_of(schedule, microbatches, 2 * microbatches))
            except UserError as error:  # DualPipeV needs m >= 4 here
                print(f"  {schedule:>21} m={microbatches}: not run ({error})")
        ranks = spawn(pipeline_timing_on_rank, plans)
        one_f_one_b = {name: max(ranks[rank]["1F1B"][name] for rank in (0, 1)) for name in ("bubble", "step")}
        for plan in plans:
            schedule, theory = plan.pipeline_schedule, theoretical_bubble(plan)
            first, second = ranks[0][schedule], ranks[1][schedule]
            larger, step = max(first["bubble"], second["bubble"]), max(first["step"], second["step"])
            print(f"  {schedule:>21} m={microbatches}: theory {theory:.3f}; measured rank 0 {first['bubble']:.3f} "
                  f"({first['bubble'] - theory:+.3f}), rank 1 {second['bubble']:.3f} "
                  f"({second['bubble'] - theory:+.3f}); larger / 1F1B's {larger / one_f_one_b['bubble']:.2f}; step "
                  f"{1000 * step:.0f} ms ({step / one_f_one_b['step']:.2f}x 1F1B's); rank 0 computes "
                  f"{1000 * first['busy'] / microbatches:.1f} ms per pipeline micro-batch")


def speed() -> None:
    samples, microbatches = 16, 8
    torch.set_num_threads(1)
    whole = build_gpt(TIMING_CONFIG, torch.device("cpu"), SEED)
    inputs, targets = batch(TIMING_CONFIG, samples)

    def one_process_step() -> None:
        F.cross_entropy(whole(inputs).flatten(0, 1), targets.flatten()).backward()

    one = statistics.median(timed_steps(one_process_step))
    plans = [plan_of(schedule, microbatches, samples) for schedule in PIPELINE_SCHEDULES]
    ranks = spawn(pipeline_timing_on_rank, plans)
    print(f"speed: micro batch of {samples} x {TIMING_CONFIG.block_size} tokens, forward + backward, 1 thread per "
          f"process; 1 process {one * 1000:.0f} ms; pp=2 with m={microbatches}, the schedules side by side:")
    for plan in plans:
        schedule = plan.pipeline_schedule
        pipelined = max(ranks[rank][schedule]["step"] for rank in ranks)
        busy = [ranks[rank][schedule]["busy"] for rank in sorted(ranks)]
        print(f"  {schedule:>21}: {pipelined * 1000:.0f} ms, ratio {pipelined / one:.3f} (ideal with its bubble "
              f"{0.5 / (1 - theoretical_bubble(plan)):.3f}); ranks compute "
              + ", ".join(f"{seconds * 1000:.0f}" for seconds in busy) + " ms, idle "
              + ", ".join(f"{(pipelined - seconds) * 1000:.0f}" for seconds in busy) + " ms")


PARTS = {"memory": memory, "bubble": bubble, "speed": speed}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=[*PARTS, "all"], default="all")
    chosen = parser.parse_args().part
    for name, part in PARTS.items():
        if chosen in (name, "all"):
            part()
