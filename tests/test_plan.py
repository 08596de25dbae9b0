"""``cohort plan``: the layouts it enumerates (what the run plan and the family accept, nothing else), the memory
filter, the cost model's arithmetic on a case worked by hand, the one-line refusals and the table it prints. The
probes are replaced by stated constants, so that nothing here depends on this machine's speed."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
from jsonargparse import Namespace

from app.tools import plan, plan_trials
from app.tools.cost_model import DeviceSpeed, Layout, Link, Links, ModelFacts, Overhead, fastest_first, predict
from app.tools.layouts import divisors, enumerate_layouts, splits
from tests.helpers import QUICKSTART, one_line_error

SPEED = DeviceSpeed(flops_per_second=1e10, call_overhead_s=1e-3, optimizer_s_per_parameter=1e-8,
                    overlaps_communication=False, source="stated for the test")
LINK = Link(bandwidth=1e9, latency=1e-4, source="stated for the test")
LINKS = Links(LINK, LINK, devices_per_node=2)


@pytest.fixture(scope="module")
def recipe_args(debug_run_args: list[str]) -> list[str]:
    return [*QUICKSTART, *debug_run_args]


@pytest.fixture(scope="module")
def recipe(recipe_args: list[str]) -> plan.Recipe:
    return plan.read_recipe(recipe_args, gpu=False)


def options(**given: object) -> Namespace:
    return Namespace(**{"devices": 2, "nodes": 1, "gpu": None, "device_memory": "8GiB", "bandwidth": None,
                        "latency": None, "node_bandwidth": None, "node_latency": None, **given})


def test_splits_multiply_to_the_world_size() -> None:
    assert sorted(splits(4)) == [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]
    assert divisors(12) == [1, 2, 3, 4, 6, 12]


def test_enumeration_keeps_what_the_run_plan_and_the_family_accept(recipe: plan.Recipe) -> None:
    """The debug GPT (2 blocks, 2 heads) on 2 and 4 processes: every strategy where it can run, each batch split
    whole, no interleaved schedule (4 stages for 2 blocks), no tensor parallelism over 4 (2 heads)."""
    model = type(recipe.model)
    two = enumerate_layouts(recipe.template, 2, 1, model, recipe.config.model.init_args, recipe.config.data.init_args)
    layouts = [candidate.layout for candidate in two]
    assert {layout.strategy for layout in layouts} == {"ddp", "fsdp", "tp", "pipeline"}
    assert {layout.schedule for layout in layouts if layout.strategy == "pipeline"} == {"GPipe", "1F1B"}
    for candidate in two:
        layout = candidate.layout
        assert layout.micro_batch_size * layout.data_parallel * layout.accumulation == 32
        assert layout.data_parallel * layout.tensor_parallel * layout.pipeline_parallel == candidate.plan.world_size == 2
    assert {layout.activation_checkpointing for layout in layouts} == {False, True}
    four = enumerate_layouts(recipe.template, 4, 1, model, recipe.config.model.init_args, recipe.config.data.init_args)
    assert four and max(candidate.layout.tensor_parallel for candidate in four) == 2
    assert max(candidate.layout.pipeline_parallel for candidate in four) == 2  # a stage needs a block


def test_the_cost_model_on_a_case_worked_by_hand() -> None:
    facts = ModelFacts(flops_per_sample=1e9, parameters=10**6, blocks=2, parameter_bytes=4, compute_bytes=4,
                       block_input_bytes_per_sample=1000, samples_per_step=32, units_per_sample=64)
    ddp = predict(Layout("ddp", 2, 1, 1, micro_batch_size=8, accumulation=2), facts, SPEED, LINKS, 0.0, 0)
    # compute 2 x (8 x 1e9 / 1e10 + 1e-3) = 1.602 s; AdamW 1e6 x 1e-8; one all-reduce of 4 MB in one bucket over 2
    # ranks: 2 x 1 x (1e-4 + 4e6 / (2 x 1e9))
    assert ddp.parts == pytest.approx({"compute": 1.602, "optimizer": 0.01, "data-parallel comm": 2 * (1e-4 + 2e-3)})
    fsdp = predict(Layout("fsdp", 2, 1, 1, 8, 2), facts, SPEED, LINKS, 0.0, 0)
    # per micro batch 2 all-gathers, per step a reduce-scatter, of 4 MB in 3 messages (2 blocks and the root); sharded
    # state
    assert fsdp.parts["data-parallel comm"] == pytest.approx(5 * (3e-4 + 2e-3))
    assert fsdp.parts["optimizer"] == pytest.approx(0.005)
    one_f_one_b = predict(Layout("pipeline", 1, 1, 2, 8, 4, schedule="1F1B", pipeline_microbatches=4), facts, SPEED,
                          LINKS, 1 / 5, 0)  # (p - 1) / (m + p - 1)
    compute = 4 * (8 * 1e9 / 2 / 1e10 + 1e-3 * 4 / 2)
    assert one_f_one_b.parts["compute"] == pytest.approx(compute)
    assert one_f_one_b.parts["bubble"] == pytest.approx(compute / 4)
    # per micro batch 2 x 4 sends of 2 samples' block input (2000 bytes)
    assert one_f_one_b.parts["pipeline comm"] == pytest.approx(4 * 8 * (1e-4 + 2000 / 1e9))
    checkpointed = predict(Layout("tp", 1, 2, 1, 16, 2, activation_checkpointing=True), facts, SPEED, LINKS, 0.0, 0)
    assert checkpointed.parts["compute"] == pytest.approx(2 * (16 * 1e9 * 4 / 3 / 2 / 1e10 + 1e-3 * 4 / 3))
    # 6 all-reduces of 16 samples' block input per block with checkpointing, 2 blocks
    assert checkpointed.parts["tensor-parallel comm"] == pytest.approx(2 * 2 * (12 * 1e-4 + 16000 / 2e9))


def test_calibration_fits_each_strategy_a_time_per_step_and_per_call_from_two_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each strategy runs its fastest layout at the recipe's micro batch without checkpointing and the same at half
    the micro batch; the time beyond the model is fitted as a line in the calls per step, which every layout of the
    strategy is given (a third more per call with checkpointing), shown as ``unmodelled``."""
    facts = ModelFacts(flops_per_sample=1e9, parameters=10**6, blocks=2, parameter_bytes=4, compute_bytes=4,
                       block_input_bytes_per_sample=1000, samples_per_step=32, units_per_sample=64)
    layouts = [Layout("ddp", 2, 1, 1, 16, 1), Layout("ddp", 2, 1, 1, 8, 2), Layout("fsdp", 2, 1, 1, 16, 1, True),
               Layout("fsdp", 2, 1, 1, 16, 1), Layout("fsdp", 2, 1, 1, 8, 2), Layout("fsdp", 2, 1, 1, 4, 4)]
    ranked = fastest_first(predict(layout, facts, SPEED, LINKS, 0.0, 0) for layout in layouts)
    modelled = {prediction.layout: prediction.step_seconds for prediction in ranked}
    # beyond the model: DDP 1 s a step + 2 s a call; FSDP2 3 s a call
    beyond = {layouts[0]: 3.0, layouts[1]: 5.0, layouts[3]: 3.0, layouts[4]: 6.0}
    ran = []

    def run_fit(arguments: list[str], steps: int, folder: object) -> Layout:
        ran.append(arguments[-1])
        return next(layout for layout in layouts if layout.describe() == arguments[-1])

    monkeypatch.setattr(plan_trials, "run_fit", run_fit)
    monkeypatch.setattr(plan_trials, "measured_step_seconds", lambda layout: modelled[layout] + beyond[layout])
    scaled, calibrations = plan_trials.calibrate([], ranked, [[prediction.layout.describe()] for prediction in ranked],
                                                 16, 6)
    assert sorted(ran) == sorted(layout.describe() for layout in beyond)
    overheads = {calibration.strategy: calibration.overhead for calibration in calibrations}
    assert overheads["ddp"].per_step == pytest.approx(1.0) and overheads["ddp"].per_call == pytest.approx(2.0)
    assert overheads["fsdp"].per_step == pytest.approx(0.0, abs=1e-9) and overheads["fsdp"].per_call == pytest.approx(3.0)
    unmodelled = {prediction.layout: prediction.parts["unmodelled"] for prediction in scaled}
    assert unmodelled[layouts[2]] == pytest.approx(3.0 * 4 / 3) and unmodelled[layouts[5]] == pytest.approx(12.0)
    assert all(prediction.step_seconds == pytest.approx(modelled[prediction.layout] + unmodelled[prediction.layout])
               for prediction in scaled)
    assert [prediction.step_seconds for prediction in scaled] == sorted(prediction.step_seconds for prediction in scaled)


def test_an_overhead_the_noise_tilts_below_zero_keeps_its_terms_at_zero_or_more() -> None:
    """Two runs whose extra time falls with more calls: a time per step alone (their mean); whose line would start
    below zero: a time per call alone, fitted to both through the origin; one run: a time per call alone."""
    one, two = Layout("ddp", 2, 1, 1, 16, 1), Layout("ddp", 2, 1, 1, 8, 2)  # 1 and 2 calls per step
    assert Overhead.fitted([(one, 3.0), (two, 2.0)]) == Overhead(2.5, 0.0)
    falling_start = Overhead.fitted([(one, 1.0), (two, 4.0)])
    assert falling_start.per_step == 0.0 and falling_start.per_call == pytest.approx((1 + 8) / 5)
    # one run, with checkpointing: 4 calls of a third more work each
    assert Overhead.fitted([(Layout("ddp", 2, 1, 1, 4, 4, True), 2.0)]).per_call == pytest.approx(2.0 / (4 * 4 / 3))


def test_only_layouts_that_fit_are_ranked_fastest_first(recipe_args: list[str], recipe: plan.Recipe) -> None:
    everything = plan.rank_layouts(options(), recipe_args, SPEED, LINKS)
    memories = sorted(prediction.memory_bytes for prediction in everything.ranked)
    limit = memories[len(memories) // 2]
    some = plan.rank_layouts(options(device_memory=str(limit)), recipe_args, SPEED, LINKS)
    assert 0 < len(some.ranked) < len(everything.ranked) == everything.layouts
    assert all(prediction.memory_bytes <= limit for prediction in some.ranked)
    times = [prediction.step_seconds for prediction in some.ranked]
    assert times == sorted(times) and all(math.isfinite(time) for time in times)


def test_a_cluster_no_layout_fits_gets_one_line_saying_what_would(recipe_args: list[str], recipe: plan.Recipe,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    profile = plan.profile_network(recipe.model.plain_network, plan.module_step_loss(recipe.model, 64), 16,
                                   "32-true", "cpu")
    need_on_two, _ = plan.smallest_memory(recipe, profile, 2, 1, "cpu")
    need_on_four, _ = plan.smallest_memory(recipe, profile, 4, 1, "cpu")
    assert need_on_four < need_on_two
    between = (need_on_four + need_on_two) // 2
    line = one_line_error(["plan", *recipe_args, "--devices", "2", "--device_memory", str(between)], monkeypatch)
    assert "no layout fits 1 node(s) x 2 device(s)" in line and "or 1 x 4 devices" in line, line
    line = one_line_error(["plan", *recipe_args, "--devices", "2", "--device_memory", "1KiB"], monkeypatch)
    assert "the model is too large for devices of" in line and "none on up to 64x the devices fits" in line, line
    line = one_line_error(["plan", *recipe_args, "--devices", "2", "--bandwidth", "1GB/s"], monkeypatch)
    assert "give --bandwidth and --latency together" in line


def test_the_table_names_each_layout_its_time_and_the_command_that_runs_it(
        recipe_args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(plan, "probe_device", lambda *args: SPEED)
    monkeypatch.setattr(plan, "probe_link", lambda *args: LINK)
    plan.main([*recipe_args, "--devices", "2", "--top", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("cohort plan: 1 node(s) x 2 device(s) (cpu), 32-true")
    assert "layouts," in lines[1] and lines[1].endswith("the best 3:")
    rows, commands = lines[3:9:2], lines[4:9:2]
    assert [row.split()[0] for row in rows] == ["1", "2", "3"] and all(" ms " in row and "compute" in row for row in rows)
    assert all(command.strip().startswith(f"cohort fit {' '.join(recipe_args)} -c configs/trainer/")
               for command in commands)
    assert lines[9] == "compute: stated for the test" and lines[10].startswith("communication: stated for the test")


def test_a_layout_runs_with_the_preset_and_overrides_it_prints(recipe: plan.Recipe) -> None:
    """The arguments of a pipeline layout, parsed as fit parses them, resolve to that layout's run plan."""
    layout = Layout("pipeline", 1, 1, 2, 8, 4, activation_checkpointing=True, schedule="GPipe",
                    pipeline_microbatches=2)
    arguments = plan.fit_arguments(layout, "cpu", 2, 1, "32-true")
    assert arguments[:2] == ["-c", "configs/trainer/pipeline_cpu.yaml"]
    config = plan.DoctorCLI([*QUICKSTART, *arguments, "--model.model_name", "debug"]).config
    strategy = config.trainer.strategy.init_args
    assert (strategy.pipeline_parallel_size, strategy.pipeline_schedule, strategy.pipeline_microbatches) == (2, "GPipe", 2)
    assert config.data.init_args.micro_batch_size == 8 and config.model.init_args.activation_checkpointing
    assert replace(layout, activation_checkpointing=False).describe() == "PP pp2 GPipe m2 dp1 tp1, micro 8 x 4"


def test_hsdp_shards_within_a_node_and_reduces_across_nodes_once_per_step() -> None:
    """On 2 nodes of 2 devices, with a link across nodes 10x slower and with 10x the latency: HSDP's shards (2
    neighbouring ranks) gather within a node and only the gradient shards cross between the nodes, once per step;
    FSDP2 over all 4 ranks and DDP cross it with everything. Worked by hand (4 MB of parameters, 3 messages)."""
    facts = ModelFacts(flops_per_sample=1e9, parameters=10**6, blocks=2, parameter_bytes=4, compute_bytes=4,
                       block_input_bytes_per_sample=1000, samples_per_step=32, units_per_sample=64)
    links = Links(LINK, Link(bandwidth=1e8, latency=1e-3, source="stated"), devices_per_node=2)
    hsdp = predict(Layout("hsdp", 4, 1, 1, 4, 2, replicas=2), facts, SPEED, links, 0.0, 0)
    # within a node: 2 x 2 all-gathers and a reduce-scatter of 4 MB over 2 ranks, 3 messages each: 5 x (3e-4 + 2e-3);
    # across: an all-reduce of the 2 MB gradient shard over 2 replicas: 2 x (3e-3 + 2e6 / 2e8)
    assert hsdp.parts["data-parallel comm"] == pytest.approx(5 * 2.3e-3 + 2 * 1.3e-2)
    fsdp = predict(Layout("fsdp", 4, 1, 1, 4, 2), facts, SPEED, links, 0.0, 0)
    assert fsdp.parts["data-parallel comm"] == pytest.approx(5 * 3 * (3e-3 + 4e6 / 4e8))  # all across the nodes
    ddp = predict(Layout("ddp", 4, 1, 1, 4, 2), facts, SPEED, links, 0.0, 0)
    assert ddp.parts["data-parallel comm"] == pytest.approx(2 * 3 * (1e-3 + 4e6 / 4e8))
    assert hsdp.parts["optimizer"] == fsdp.parts["optimizer"] * 2  # state sharded over 2 ranks, not 4
    assert hsdp.layout.describe() == "HSDP dp4 (2 x 2), micro 4 x 2"


def test_hsdp_layouts_run_with_the_hsdp_preset(recipe: plan.Recipe) -> None:
    """On 4 processes the planner offers 2 replicas x 2 shards, and its arguments resolve to that plan."""
    model = type(recipe.model)
    four = enumerate_layouts(recipe.template, 4, 1, model, recipe.config.model.init_args, recipe.config.data.init_args)
    hsdp = [candidate for candidate in four if candidate.layout.strategy == "hsdp"]
    assert hsdp and all(candidate.plan.data_parallel_replicate_size == candidate.layout.replicas == 2
                        for candidate in hsdp)
    arguments = plan.fit_arguments(hsdp[0].layout, "cpu", 4, 1, "32-true")
    assert arguments[:2] == ["-c", "configs/trainer/hsdp_cpu.yaml"]
    config = plan.DoctorCLI([*QUICKSTART, *arguments, "--model.model_name", "debug"]).config
    strategy = config.trainer.strategy.init_args
    assert (strategy.data_parallel_size, strategy.data_parallel_replicate_size) == (4, 2)


def test_several_nodes_need_the_link_between_them(recipe_args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    line = one_line_error(["plan", *recipe_args, "--nodes", "2", "--devices", "2", "--bandwidth", "10GB/s",
                           "--latency", "10us"], monkeypatch)
    assert "2 nodes need the link between them: give --node_bandwidth and --node_latency" in line, line
    line = one_line_error(["plan", *recipe_args, "--nodes", "2", "--devices", "2", "--node_bandwidth", "1GB/s"],
                          monkeypatch)
    assert "give --node_bandwidth and --node_latency together" in line, line


def test_on_a_gpu_the_steps_reduction_hides_behind_the_last_backward_only() -> None:
    """With 4 micro-batches of 0.2 s compute each, DDP's one all-reduce of 0.5 s per step hides behind the last
    micro-batch's backward (2/3 x 0.2 s), not behind the whole step's 0.8 s: 0.5 - 0.1333 s stays exposed."""
    gpu = replace(SPEED, flops_per_second=1e10, call_overhead_s=0.0, overlaps_communication=True)
    facts = ModelFacts(flops_per_sample=1e9, parameters=125 * 10**6, blocks=2, parameter_bytes=4, compute_bytes=4,
                       block_input_bytes_per_sample=1000, samples_per_step=32, units_per_sample=64)
    slow = Links(Link(bandwidth=1e9, latency=0.0, source="stated"), Link(1e9, 0.0, "stated"), devices_per_node=2)
    ddp = predict(Layout("ddp", 2, 1, 1, micro_batch_size=2, accumulation=4), facts, gpu, slow, 0.0, 0)
    # 500 MB in 20 buckets over 2 ranks: 2 x (500e6 / 2e9) = 0.5 s
    assert ddp.parts["compute"] == pytest.approx(0.8)
    assert ddp.parts["data-parallel comm"] == pytest.approx(0.5 - 2 / 3 * 0.2)


def test_inputs_the_planner_cannot_use_get_one_line(recipe_args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A bandwidth of nothing, --try with no step to time, an A100 of unstated memory, a
    recipe whose sequence exceeds the model's context (refused before the layouts are profiled), runs asked of a
    cluster that is not this machine."""
    cases = {
        ("--bandwidth", "0GB/s", "--latency", "10us"): "--bandwidth 0GB/s is no bandwidth",
        ("--try", "1", "--steps", "0"): "--steps 0 must be at least 1",
        ("--gpu", "A100", "--bandwidth", "100GB/s", "--latency", "10us"): "--gpu A100 comes in more than one memory size",
        ("--data.sequence_length", "128"): "data.sequence_length=128 exceeds the block_size 64",
        ("--nodes", "2", "--node_bandwidth", "1GB/s", "--node_latency", "1ms", "--calibrate"):
            "--try and --calibrate run cohort fit on this machine",
    }
    for extra, expected in cases.items():
        line = one_line_error(["plan", *recipe_args, "--devices", "2", *extra], monkeypatch)
        assert expected in line, line


@pytest.mark.slow
def test_calibrate_and_try_run_cohort_fit_and_hold_the_layout_to_one_process(
        recipe_args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """On one process, with the probes measuring this machine: --calibrate runs the one strategy there is (at the
    recipe's micro batch and half of it), and --try
    runs the top layout and the one-process reference for the same steps, whose gradient norms agree."""
    monkeypatch.chdir(tmp_path)
    plan.main([*recipe_args, "--devices", "1", "--calibrate", "--try", "1", "--steps", "2", "--top", "1"])
    out = capsys.readouterr().out
    run = r"one process, micro \d+ x \d+: [\d.]+ ms \(modelled [\d.]+\)"
    assert re.search(rf"^unmodelled: measured here, two runs of each strategy \(4 steps, the last 2 timed\): {run}, "
                     rf"{run}: [\d.]+ ms a step \+ [\d.]+ ms a forward and backward$", out, re.MULTILINE), out
    assert re.search(r"^ 1  one process, micro \d+ x \d+ .* ms .* ms .* yes \(gradient norm per step", out,
                     re.MULTILINE), out
    assert "winner: #1 one process" in out
