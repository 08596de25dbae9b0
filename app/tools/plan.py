"""``cohort plan``: the layouts a recipe can run on a cluster, ranked by predicted step time, with the memory each
needs per device, where its time goes and the ``cohort fit`` arguments that run it.

    cohort plan -c configs/quickstart.yaml --devices 2                       # 2 CPU processes on this machine
    cohort plan -c configs/gpt2/pretrain.yaml --nodes 2 --devices 8 --gpu H100 --bandwidth 100GB/s --latency 20us \
        --node_bandwidth 20GB/s --node_latency 40us
    cohort plan -c configs/quickstart.yaml --devices 2 --calibrate           # with each strategy's measured overhead
    cohort plan -c configs/quickstart.yaml --devices 2 --try 3               # and run the best 3 for a few steps

Layouts: app/tools/layouts.py (every split the run plan and the family accept). Memory per device: cohort doctor's
estimate (app/tools/memory.py); layouts over ``--device_memory`` are dropped. Step time: app/tools/cost_model.py,
from constants measured here by short probes or stated (app/tools/plan_probes.py); the output says which. With
``--calibrate``, what two short runs of each strategy here take beyond the model is added (app/tools/plan_trials.py).
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import textwrap
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from jsonargparse import Namespace

from app.cli.commands import describe
from app.cli.run_plan_resolution import resolve_run_plan
from app.tools.cost_model import (DeviceSpeed, Link, Links, ModelFacts, Prediction, fastest_first, predict,
                                  tokens_per_second)
from app.tools.doctor import DoctorCLI, instantiate_family
from app.tools.layouts import Candidate, enumerate_layouts, fit_arguments
from app.tools.memory import parse_memory_size, spread, visible_device_memory
from app.tools.memory_profile import NetworkProfile, module_step_loss, profile_network
from app.tools.plan_probes import probe_device, probe_link, stated_device
from app.tools.plan_trials import Calibration, calibrate, try_layouts
from core.errors import ArgumentParser, UserError
from core.run_plan import RunPlan
from core.sizes import format_bytes, parse_byte_size
from models.module import CohortModule
from models.parallel.pipeline import theoretical_bubble

LARGER_CLUSTERS = (2, 4, 8, 16, 32, 64)  # devices per node tried, as multiples, to say what would fit
# the data sheets' memory of the --gpu names with one size (SXM); an A100 has 40 or 80 GB
GPU_MEMORY = {"H100": 80 * 10**9, "H200": 141 * 10**9}
TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True)
class Recipe:
    """What the config trains, as the planner needs it."""

    template: RunPlan  # the recipe's plan on one process: the global batch, sequence, precision
    config: Namespace
    model: CohortModule
    accelerator: str  # "cpu" or "gpu": which trainer presets run it


def parser() -> ArgumentParser:
    examples = __doc__.split("\n\n")[1]  # the module docstring's commands
    description = describe("plan") + (" Any other argument is cohort fit's (-c RECIPE, -c PRESET, "
                                       "--data.global_batch_size ...), read as fit reads them.")
    parser = ArgumentParser(prog="cohort plan", description=textwrap.fill(description, 100),
                            epilog=f"examples:\n{examples}\n\nREADME.md (Which layout?) shows what it prints.",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1, help="machines in the job (default 1)")
    parser.add_argument("--devices", type=int, default=1, help="devices (processes) per machine (default 1)")
    parser.add_argument("--device_memory", help="memory of one device, e.g. 80GiB (default: the visible GPU's; with "
                        "--gpu H100 or H200 its data sheet's; on a CPU the machine's memory / devices)")
    parser.add_argument("--gpu", help="plan for this GPU from its data sheet (A100, H100, H200) instead of measuring "
                        "this machine")
    parser.add_argument("--bandwidth", help="per-rank bus bandwidth between the ranks of a node, e.g. 25GB/s "
                        "(default: measured between local processes; cohort comm measures it on a cluster)")
    parser.add_argument("--latency", help="latency of one message within a node, e.g. 20us (with --bandwidth)")
    parser.add_argument("--node_bandwidth", help="per-rank bus bandwidth of a collective across nodes, e.g. 20GB/s "
                        "(needed with --nodes over 1; cohort comm over two nodes measures it)")
    parser.add_argument("--node_latency", help="latency of one message across nodes, e.g. 40us (with "
                        "--node_bandwidth)")
    parser.add_argument("--top", type=int, default=5, help="layouts printed (default 5)")
    parser.add_argument("--try", dest="trials", type=int, default=0,
                        help="run the best K for a few steps each (cohort fit) and compare measured with predicted")
    parser.add_argument("--calibrate", action="store_true",
                        help="add to each strategy's predictions what two short cohort fit runs of it here take "
                        "beyond the model (the loop, the hooks, dispatch)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps each --try or --calibrate run times, "
                        "after as many to warm up (default 20: fewer leave a busy spell of the machine in the time)")
    return parser


def read_recipe(fit_args: list[str], gpu: bool) -> Recipe:
    """The recipe as ``cohort fit`` reads it, resolved on one process; a UserError for one that cannot run."""
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
    config = DoctorCLI(fit_args).config
    accelerator = "gpu" if gpu or config.trainer.accelerator in ("gpu", "cuda") else "cpu"
    single = copy.deepcopy(config)
    single.trainer.strategy, single.trainer.devices, single.trainer.num_nodes = "auto", 1, 1
    _, template = resolve_run_plan(single)
    _, model, problems = instantiate_family(config)
    if model is None:
        raise UserError(f"cohort plan: the recipe's model cannot be made: {problems[-1].detail}")
    # what fit refuses whatever the layout (a sequence longer than the model's context), refused here first
    type(model).check_config(config.model.init_args, config.data.get("init_args") or Namespace(), template)
    return Recipe(template, config, model, accelerator)


def model_facts(model: CohortModule, profile: NetworkProfile, plan: RunPlan) -> ModelFacts:
    blocks = len(profile.block_parameters)
    return ModelFacts(
        flops_per_sample=model.flops_per_sample(plan.sequence_length), parameters=profile.parameter_count,
        blocks=blocks, parameter_bytes=plan.precision.parameter_dtype.itemsize,
        compute_bytes=plan.precision.compute_dtype.itemsize,
        block_input_bytes_per_sample=profile.block_input_bytes[0] // profile.micro_batch_size if blocks else 0,
        samples_per_step=plan.global_batch_size, units_per_sample=plan.sequence_length, unit=plan.unit)


def memory_bytes(profile: NetworkProfile, candidate: Candidate, device_type: str) -> int:
    """cohort doctor's estimate of the layout (app/tools/doctor.py check_memory), without the advice: HSDP holds
    what FSDP2 over one replica's ranks holds, and FSDP2 over several shards outside a pipeline holds the whole
    gradients while it accumulates (models/parallel/parallelize.py choose_gradient_reduction)."""
    layout = candidate.layout
    strategy = "fsdp" if layout.sharded or layout.strategy in ("tp", "pipeline") else (
        "ddp" if layout.data_parallel > 1 else "single")
    return spread(profile, layout.micro_batch_size, strategy, layout.shards if layout.sharded else layout.data_parallel,
                  layout.tensor_parallel, layout.pipeline_parallel,
                  layout.pipeline_microbatches if layout.pipeline_parallel > 1 else None,
                  layout.activation_checkpointing, device_type,
                  unsharded_gradients=layout.strategy != "pipeline" and layout.shards > 1
                  and layout.accumulation > 1).total


def predictions(candidates: Sequence[Candidate], profile: NetworkProfile, facts: ModelFacts, device: DeviceSpeed,
                links: Links, device_type: str) -> list[Prediction]:
    """Every candidate's prediction, fastest first (the smaller memory first among equals)."""
    return fastest_first(predict(candidate.layout, facts, device, links,
                                 theoretical_bubble(candidate.plan) if candidate.layout.pipeline_parallel > 1 else 0.0,
                                 memory_bytes(profile, candidate, device_type)) for candidate in candidates)


def smallest_memory(recipe: Recipe, profile: NetworkProfile, devices: int, nodes: int,
                    device_type: str) -> tuple[int, str] | None:
    """The least memory per device of any layout on nodes x devices, and that layout; None: no layout runs there."""
    candidates = enumerate_layouts(recipe.template, devices, nodes, type(recipe.model),
                                   recipe.config.model.init_args, recipe.config.data.get("init_args") or Namespace())
    sized = [(memory_bytes(profile, candidate, device_type), candidate.layout.describe()) for candidate in candidates]
    return min(sized, default=None)


def refusal(recipe: Recipe, profile: NetworkProfile, devices: int, nodes: int, device_memory: int,
            device_type: str) -> UserError:
    """The one line for a cluster no layout fits: the smallest need here, and the cluster that would fit."""
    cluster = f"{nodes} node(s) x {devices} device(s)"
    smallest = smallest_memory(recipe, profile, devices, nodes, device_type)
    if smallest is None:
        return UserError(f"cohort plan: no layout runs global batch {recipe.template.global_batch_size} on {cluster}: "
                         f"use a world size whose data-parallel share divides the global batch, or another global batch")
    need, layout = smallest
    for factor in LARGER_CLUSTERS:
        larger = smallest_memory(recipe, profile, devices * factor, nodes, device_type)
        if larger is not None and larger[0] <= device_memory:
            return UserError(
                f"cohort plan: no layout fits {cluster} of {format_bytes(device_memory)}: the smallest "
                f"({layout}) needs {format_bytes(need)} per device; devices of at least that would fit, or "
                f"{nodes} x {devices * factor} devices ({larger[1]}: {format_bytes(larger[0])})")
    return UserError(f"cohort plan: the model is too large for devices of {format_bytes(device_memory)}: its "
                     f"smallest layout on {cluster} ({layout}) needs {format_bytes(need)} per device and none "
                     f"on up to {LARGER_CLUSTERS[-1]}x the devices fits; use devices of at least "
                     f"{format_bytes(need)}")


def parse_seconds(text: str) -> float:
    match = re.fullmatch(r"\s*([0-9.]+(?:e-?\d+)?)\s*(us|ms|s)\s*", text)
    if match is None:
        raise UserError(f"--latency {text!r} is not a time: write it as 20us, 0.5ms or 1e-5s")
    return float(match.group(1)) * TIME_UNITS[match.group(2)]


def given_link(bandwidth: str | None, latency: str | None, names: str) -> Link | None:
    """The link of a bandwidth and a latency given together; None where neither is."""
    if (bandwidth is None) != (latency is None):
        raise UserError(f"cohort plan: give {names} together (e.g. {' 25GB/s '.join(names.split(' and '))} 20us)")
    if bandwidth is None:
        return None
    bytes_per_second = parse_byte_size(bandwidth.removesuffix("/s"), names.split()[0])
    if bytes_per_second <= 0:
        raise UserError(f"cohort plan: {names.split()[0]} {bandwidth} is no bandwidth: give bytes per second, e.g. "
                        "25GB/s")
    return Link(bytes_per_second, parse_seconds(latency), f"given: {bandwidth}, {latency} per message")


def links_of(args: Namespace, devices: int, nodes: int, device: torch.device) -> Links:
    """The links given within and across nodes, or a probe between local processes; a UserError where neither can
    be had."""
    within = given_link(args.bandwidth, args.latency, "--bandwidth and --latency")
    across = given_link(args.node_bandwidth, args.node_latency, "--node_bandwidth and --node_latency")
    if nodes > 1 and across is None:
        raise UserError(f"cohort plan: {nodes} nodes need the link between them: give --node_bandwidth and "
                        "--node_latency (cohort comm launched over two nodes measures them)")
    if within is None:
        if devices * nodes == 1:
            within = Link(1.0, 0.0, "none: one device")
        elif nodes == 1 and args.gpu is None and (device.type == "cpu" or torch.cuda.device_count() >= devices):
            within = probe_link(devices, device.type == "cuda")
        else:
            raise UserError(f"cohort plan: the links of {nodes} node(s) x {devices} device(s) cannot be measured from "
                            "here: give --bandwidth and --latency (cohort comm measures them on the cluster)")
    return Links(within, across or within, devices)


def device_memory_of(args: Namespace, device: torch.device, devices: int) -> tuple[int, str]:
    if args.device_memory is not None:
        return parse_memory_size(args.device_memory), "given"
    if args.gpu is not None:  # not this machine's: the named GPU's
        if args.gpu not in GPU_MEMORY:
            raise UserError(f"cohort plan: --gpu {args.gpu} comes in more than one memory size: give --device_memory "
                            "too (e.g. 80GiB)")
        return GPU_MEMORY[args.gpu], f"the {args.gpu}'s data sheet"
    if device.type == "cuda":
        return visible_device_memory(), "the visible GPU's"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // devices, "this machine's memory / devices"


def format_table(ranked: Sequence[Prediction], facts: ModelFacts, commands: Sequence[str]) -> str:
    """The best layouts, one row each with the command that runs it under it."""
    width = max(len(prediction.layout.describe()) for prediction in ranked)
    lines = [f"{'#':>2}  {'layout':<{width}}  {'memory':>10}  {'step':>10}  {facts.unit + '/s':>10}  where the time goes"]
    for place, (prediction, command) in enumerate(zip(ranked, commands), start=1):
        total = prediction.step_seconds
        shares = ", ".join(f"{name} {seconds / total:.0%}" for name, seconds in prediction.parts.items()
                           if abs(seconds) / total >= 0.005)
        lines.append(f"{place:>2}  {prediction.layout.describe():<{width}}  {format_bytes(prediction.memory_bytes):>10}"
                     f"  {total * 1e3:>7.1f} ms  {tokens_per_second(prediction, facts):>10,.0f}  {shares}")
        lines.append(f"    {command}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Ranking:
    """What ``cohort plan`` found: the layouts that fit, fastest first, and where its constants came from."""

    recipe: Recipe
    facts: ModelFacts
    layouts: int  # enumerated
    ranked: list[Prediction]  # those that fit, fastest first
    capacity: str  # the device memory and where it came from
    speed: DeviceSpeed
    links: Links
    device_type: str
    calibration: tuple[Calibration, ...] = ()  # each strategy's --calibrate runs and overhead; empty: not calibrated

    def communication_source(self) -> str:
        within, across = self.links.within_node, self.links.across_nodes
        return within.source if across is within else f"within a node, {within.source}; across nodes, {across.source}"


def rank_layouts(args: Namespace, fit_args: list[str], speed: DeviceSpeed | None = None,
                 links: Links | None = None) -> Ranking:
    """The recipe's layouts on the cluster of ``args`` ranked; ``speed`` and ``links`` replace the probes if
    given."""
    recipe = read_recipe(fit_args, args.gpu is not None)
    template, model = recipe.template, recipe.model
    device_type = "cuda" if recipe.accelerator == "gpu" else "cpu"
    device = torch.device("cuda" if device_type == "cuda" and torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and device.type == "cpu" and args.gpu is None and speed is None:
        raise UserError("cohort plan: the recipe runs on GPUs and none is visible here: name it with --gpu (A100, "
                        "H100, H200) and give --bandwidth and --latency, or run cohort plan on a GPU node")
    capacity, capacity_source = device_memory_of(args, device, args.devices)
    profile = profile_network(model.plain_network, module_step_loss(model, template.sequence_length),
                              template.micro_batch_size, template.precision.name, device_type)
    candidates = enumerate_layouts(template, args.devices, args.nodes, type(model), recipe.config.model.init_args,
                                   recipe.config.data.get("init_args") or Namespace())
    fitting = [candidate for candidate in candidates if memory_bytes(profile, candidate, device_type) <= capacity]
    if not fitting:
        raise refusal(recipe, profile, args.devices, args.nodes, capacity, device_type)
    facts = model_facts(model, profile, template)
    if speed is None:
        speed = (stated_device(args.gpu, template.precision.compute_dtype) if args.gpu is not None
                 else probe_device(model, template.sequence_length, template.micro_batch_size, args.devices, device))
    links = links or links_of(args, args.devices, args.nodes, device)
    return Ranking(recipe, facts, len(candidates), predictions(fitting, profile, facts, speed, links, device_type),
                   f"{format_bytes(capacity, 'GiB')} per device ({capacity_source})", speed, links, device_type)


def fit_runs(ranking: Ranking, args: Namespace, count: int) -> list[list[str]]:
    """The preset and overrides that run each of the best ``count`` layouts."""
    template = ranking.recipe.template
    return [fit_arguments(prediction.layout, ranking.recipe.accelerator, args.devices, args.nodes,
                          template.precision.name) for prediction in ranking.ranked[:count]]


def calibrate_ranking(ranking: Ranking, args: Namespace, fit_args: list[str]) -> Ranking:
    """The ranking with each strategy's measured overhead added to its layouts (app/tools/plan_trials.py)."""
    ranked, calibrations = calibrate(fit_args, ranking.ranked, fit_runs(ranking, args, len(ranking.ranked)),
                                     ranking.recipe.template.micro_batch_size, args.steps)
    return replace(ranking, ranked=ranked, calibration=tuple(calibrations))


def main(argv: list[str]) -> None:
    args, fit_args = parser().parse_known_args(argv)
    if min(args.devices, args.nodes, args.top, args.steps) < 1 or args.trials < 0:
        raise UserError(f"cohort plan: --devices {args.devices}, --nodes {args.nodes}, --top {args.top} and --steps "
                        f"{args.steps} must be at least 1, --try {args.trials} at least 0")
    if (args.trials or args.calibrate) and (args.nodes > 1 or args.gpu is not None):
        raise UserError("cohort plan: --try and --calibrate run cohort fit on this machine: plan for one node of its "
                        "own devices (no --nodes, no --gpu), or run cohort plan on a node of the cluster")
    ranking = rank_layouts(args, fit_args)
    if args.calibrate:
        ranking = calibrate_ranking(ranking, args, fit_args)
    template, facts, ranked = ranking.recipe.template, ranking.facts, ranking.ranked
    runs = fit_runs(ranking, args, max(args.top, args.trials))
    print(f"cohort plan: {args.nodes} node(s) x {args.devices} device(s) ({ranking.device_type}), "
          f"{template.precision.name}, {ranking.recipe.model.parameters_and_size()}; global batch "
          f"{template.global_batch_size} x {template.sequence_length} {template.unit}\n"
          f"{ranking.layouts} layouts, {len(ranked)} fit in {ranking.capacity}; the best {min(args.top, len(ranked))}:")
    print(format_table(ranked[:args.top], facts, [f"cohort fit {' '.join(fit_args)} {' '.join(run)}" for run in runs]))
    overlap = ("overlapped with compute where the strategy allows" if ranking.speed.overlaps_communication
               else "not overlapped: the collectives' threads share the cores with the compute")
    print(f"compute: {ranking.speed.source}\ncommunication: {ranking.communication_source()}; {overlap}\n"
          "memory: cohort doctor's estimate (app/tools/memory.py)")
    if ranking.calibration:
        print(f"unmodelled: measured here, two runs of each strategy ({2 * args.steps} steps, the last {args.steps} "
              f"timed): {'; '.join(calibration.describe() for calibration in ranking.calibration)}")
    else:
        print("unmodelled: the loop's, hooks' and dispatch's own cost is not counted: --calibrate measures it here")
    if args.trials:
        # sums taken in another order: float32 rounding (tests/helpers.py's bound); with a 16-bit compute dtype the
        # gradient norms of two layouts differ by a few bfloat16 rounding steps (2^-8 each) compounded over the
        # steps: 2e-2 is an empirical bound, not a derived one
        tolerance = 1e-4 if template.precision.compute_dtype == torch.float32 else 2e-2
        try_layouts(fit_args, ranked[:args.trials], runs[:args.trials], facts, args.steps, ranking.recipe.accelerator,
                    tolerance)
