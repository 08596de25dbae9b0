"""The layouts a recipe can run on a cluster, as ``cohort plan`` enumerates them, and the trainer preset and the
overrides that run each one with ``cohort fit``.

Every split of the world size into pipeline x data-parallel x tensor-parallel ranks, with, for each: DDP, FSDP2
(ModelParallelStrategy's data_parallel_size) and HSDP with each replica count that divides the data-parallel ranks
(app/strategies/hybrid_sharding.py) when it is data-parallel only; ModelParallelStrategy with
tensor_parallel_size; PipelineParallelStrategy with each schedule (core/pipeline_schedules.py) and each number of
pipeline micro-batches that divides the micro batch; each micro batch that divides the global batch's share of a
data-parallel rank (the accumulation follows); activation checkpointing off and on where the family has it. A
layout is kept when the run plan (core/run_plan.py) and the family's own checks (app/cli/preflight.py) accept it,
the same checks ``cohort fit`` runs first.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import yaml
from jsonargparse import Namespace

from app.cli.preflight import check_family_honours_strategy
from app.strategies.kind import StrategyKind
from app.tools.cost_model import Layout
from core.errors import UserError
from core.pipeline_schedules import PIPELINE_SCHEDULES
from core.run_plan import RunPlan
from models.module import CohortModule

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
KINDS = {"single": StrategyKind.OTHER, "ddp": StrategyKind.DDP, "fsdp": StrategyKind.MODEL_PARALLEL,
         "hsdp": StrategyKind.MODEL_PARALLEL, "tp": StrategyKind.MODEL_PARALLEL, "pipeline": StrategyKind.PIPELINE}
# the trainer preset that runs each strategy, on CPUs and on GPUs (configs/trainer/)
PRESETS = {
    "cpu": {"single": "cpu.yaml", "ddp": "ddp_cpu.yaml", "fsdp": "model_parallel_cpu.yaml", "hsdp": "hsdp_cpu.yaml",
            "tp": "model_parallel_cpu.yaml", "pipeline": "pipeline_cpu.yaml"},
    "gpu": {"single": "gpu_bf16.yaml", "ddp": "ddp_gpu_bf16.yaml", "fsdp": "model_parallel_gpu_bf16.yaml",
            "hsdp": "hsdp_gpu_bf16.yaml", "tp": "model_parallel_gpu_bf16.yaml", "pipeline": "pipeline_gpu_bf16.yaml"},
}


@dataclass(frozen=True)
class Candidate:
    """A layout and the run plan ``cohort fit`` would resolve for it."""

    layout: Layout
    plan: RunPlan


def splits(world_size: int) -> Iterator[tuple[int, int, int]]:
    """(pipeline, data-parallel, tensor-parallel) sizes whose product is ``world_size``."""
    for pipeline in divisors(world_size):
        for tensor in divisors(world_size // pipeline):
            yield pipeline, world_size // pipeline // tensor, tensor


def divisors(number: int) -> list[int]:
    return [divisor for divisor in range(1, number + 1) if number % divisor == 0]


def has_activation_checkpointing(family: type[CohortModule]) -> bool:
    return "activation_checkpointing" in inspect.signature(family.__init__).parameters


def enumerate_layouts(template: RunPlan, devices: int, nodes: int, family: type[CohortModule], model: Namespace,
                      data: Namespace) -> list[Candidate]:
    """Every layout of ``template``'s global batch on ``nodes`` x ``devices`` that the run plan and the family accept
    (module docstring); ``model`` and ``data`` are the config's init_args, for the family's checks."""
    base = replace(template, devices_per_node=1, num_nodes=1, data_parallel_size=1, tensor_parallel_size=1,
                   pipeline_parallel_size=1, micro_batch_size=1)  # the sizes come back in plan_of, all at once
    world, batch = devices * nodes, template.global_batch_size
    checkpointing = (False, True) if has_activation_checkpointing(family) else (False,)
    candidates = []
    for pipeline, data_parallel, tensor in splits(world):
        if batch % data_parallel:
            continue
        for micro in divisors(batch // data_parallel):
            for strategy, schedule, microbatches, replicas in strategies(pipeline, data_parallel, tensor, micro):
                plan = plan_of(base, devices, nodes, (pipeline, data_parallel, tensor), micro, schedule, microbatches,
                               replicas)
                if plan is None or not accepted(plan, family, KINDS[strategy], model, data):
                    continue
                for recompute in checkpointing:
                    layout = Layout(strategy, data_parallel, tensor, pipeline, micro, plan.accumulation, recompute,
                                    schedule, microbatches, plan.stages_per_rank if pipeline > 1 else 1, replicas)
                    candidates.append(Candidate(layout, plan))
    return candidates


def strategies(pipeline: int, data_parallel: int, tensor: int, micro: int) -> Iterator[tuple[str, str, int, int]]:
    """(strategy, schedule, pipeline micro-batches, HSDP replicas) for these sizes; the run plan then drops what it
    refuses."""
    if pipeline > 1:
        for schedule in PIPELINE_SCHEDULES:
            for microbatches in divisors(micro):
                if microbatches >= pipeline:
                    yield "pipeline", schedule, microbatches, 1
    elif tensor > 1:
        yield "tp", "", 1, 1
    elif data_parallel > 1:
        yield from (("ddp", "", 1, 1), ("fsdp", "", 1, 1))
        # replicas of 1 are FSDP2's layout and of data_parallel (shards of one rank) DDP's, with FSDP2's overhead
        yield from (("hsdp", "", 1, replicas) for replicas in divisors(data_parallel)[1:-1])
    else:
        yield "single", "", 1, 1


def plan_of(base: RunPlan, devices: int, nodes: int, sizes: tuple[int, int, int], micro: int, schedule: str,
            microbatches: int, replicas: int = 1) -> RunPlan | None:
    """The run plan of these (pipeline, data-parallel, tensor-parallel) sizes, or None where it refuses them."""
    pipeline, data_parallel, tensor = sizes
    try:
        return replace(base, devices_per_node=devices, num_nodes=nodes, data_parallel_size=data_parallel,
                       tensor_parallel_size=tensor, pipeline_parallel_size=pipeline, micro_batch_size=micro,
                       pipeline_schedule=schedule or base.pipeline_schedule, pipeline_microbatches=microbatches,
                       data_parallel_replicate_size=replicas)
    except UserError:
        return None


def accepted(plan: RunPlan, family: type[CohortModule], kind: StrategyKind, model: Namespace, data: Namespace) -> bool:
    """Whether the family runs this plan (its pipeline split, tensor-parallel plan, head and block counts)."""
    try:
        check_family_honours_strategy(family, plan, kind)
        family.check_config(model, data, plan)
    except UserError:
        return False
    return True


def fit_arguments(layout: Layout, accelerator: str, devices: int, nodes: int, precision: str) -> list[str]:
    """The trainer preset and the overrides after the recipe that run ``layout`` with ``cohort fit``."""
    preset = CONFIG_DIR / "trainer" / PRESETS[accelerator][layout.strategy]
    trainer = yaml.safe_load(preset.read_text())["trainer"]
    arguments = ["-c", str(preset.relative_to(CONFIG_DIR.parent))]
    wanted = {"devices": devices, "num_nodes": nodes, "precision": precision}
    for name, value in wanted.items():
        if trainer.get(name, 1) != value:
            arguments += [f"--trainer.{name}", str(value)]
    sizes = {"data_parallel_size": layout.data_parallel, "tensor_parallel_size": layout.tensor_parallel}
    if layout.strategy == "pipeline":
        sizes |= {"pipeline_parallel_size": layout.pipeline_parallel, "pipeline_schedule": layout.schedule,
                  "pipeline_microbatches": layout.pipeline_microbatches}
    if layout.strategy == "hsdp":
        sizes["data_parallel_replicate_size"] = layout.replicas
    given = (trainer.get("strategy") or {}).get("init_args", {}) if isinstance(trainer.get("strategy"), dict) else {}
    if layout.strategy in ("fsdp", "hsdp", "tp", "pipeline"):
        for name, value in sizes.items():
            if given.get(name) != value:
                arguments += [f"--trainer.strategy.init_args.{name}", str(value)]
    arguments += ["--data.micro_batch_size", str(layout.micro_batch_size)]
    if layout.activation_checkpointing:
        arguments += ["--model.activation_checkpointing", "true"]
    return arguments
