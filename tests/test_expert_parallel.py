"""Expert parallelism (models/parallel/expert_parallel.py, configs/trainer/expert_parallel_cpu.yaml) on gloo
processes: the MoE 'debug' model with its experts split over 2 ranks computes the same loss, gradients and clipped
norm as one process over the whole batch, alone (2 ranks) and with 2 replicas of each expert (4 ranks); each rank
holds its half of the experts; runs through the CLI train as one process does, resume bitwise, and save whole
experts; and what expert parallelism cannot do is refused in one line."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from core.precision import PRECISIONS
from core.run_plan import RunPlan
from models.moe.family import MoELanguageModel
from models.routed_experts import moe_layers
from models.moe.network import MOE_CONFIGS, MoE, MoEConfig
from models.parallel.expert_parallel import reduce_expert_gradients
from models.parallel.parallelize import build_network, choose_gradient_reduction, clip_grad_norm_
from tests.helpers import (
    CONFIG_DIR, assert_comparable_runs_agree, assert_one_line_error_in_process,
    assert_sharded_resume_after_sigkill_is_bitwise_exact, batch_sizes, fit, fit_in_process, free_port,
    last_checkpoint, last_checkpoint_contents, scalars,
)

CONFIG = MOE_CONFIGS["debug"]
# with a capacity, so that some choices are dropped (their rows stay on their rank, with zero outputs)
CAPPED = replace(CONFIG, capacity_factor=1.0)
FAMILY = MoELanguageModel(model_name="debug")
SEED = 5
SAMPLES, TOKENS = 8, 32
MAX_NORM = 0.1
FORKED = "forkserver"  # as tests/test_parallelize.py: ranks forked from tests/processes.py's server
MOE = ["--model.class_path", "models.moe.family.MoELanguageModel"]
EXPERT_PARALLEL = ["-c", str(CONFIG_DIR / "trainer/expert_parallel_cpu.yaml")]  # EP 2 x FSDP2 on 2 processes
EXPERT_PARALLEL_4 = [*EXPERT_PARALLEL, "--trainer.devices", "4", "--trainer.strategy.init_args.data_parallel_size", "4",
                     *batch_sizes(8, 2)]  # 2 replicas of each half of the experts, FSDP2 over 4 ranks
# the dense layers under HSDP (2 replicas x 2 shards), the experts split over 2 ranks x 2 replicas
EXPERT_PARALLEL_HSDP = ["-c", str(CONFIG_DIR / "trainer/hsdp_cpu.yaml"),
                        "--trainer.strategy.init_args.expert_parallel_size", "2", *batch_sizes(8, 2)]
RECORD_ROUTING = ["--trainer.callbacks+=tests.helpers.RoutingRecord"]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, CONFIG.vocab_size, (SAMPLES, TOKENS + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def router_gap(network: MoE, inputs: torch.Tensor) -> float:
    """The smallest gap, over every token of every layer, between its k-th and (k+1)-th router probability: a
    router choice can flip only where the layouts' rounding moves the probabilities by more than this."""
    gaps = []

    def record(layer: torch.nn.Module, args: tuple[torch.Tensor], _: torch.Tensor) -> None:
        probabilities = layer.router(args[0].float()).softmax(dim=-1).sort(dim=-1, descending=True).values
        gaps.append((probabilities[..., CONFIG.top_k - 1] - probabilities[..., CONFIG.top_k]).min().item())

    hooks = [layer.register_forward_hook(record) for layer in moe_layers(network)]
    with torch.no_grad():
        network(inputs)
    for hook in hooks:
        hook.remove()
    return min(gaps)


def check_on_mesh(rank: int, port: int, data_parallel: int, expert_parallel: int, config: MoEConfig,
                  report: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=data_parallel)
    try:
        mesh = init_device_mesh("cpu", (data_parallel, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
        make = lambda: MoE(config)  # noqa: E731
        sharded = build_network(make, torch.device("cpu"), SEED, mesh, expert_parallel_size=expert_parallel)
        reference = build_network(make, torch.device("cpu"), SEED)
        inputs, targets = batch()
        FAMILY.batch_loss(reference, (inputs, targets)).backward()
        report[(rank, "gap")] = router_gap(reference, inputs)
        report[(rank, "dropped")] = sum(layer.dropped_tokens.item() for layer in moe_layers(reference))
        # two micro-batches per step (accumulation), each rank's own share of each: a mean over a quarter of this
        # rank's samples, halved as Lightning's accumulation would
        micro_batches = list(zip(inputs.chunk(2 * data_parallel), targets.chunk(2 * data_parallel)))
        for micro_batch in (0, 1):
            plan = type("Plan", (), {"ends_optimizer_step": lambda self, index: index == 1,
                                     "reduce_gradients_every_micro_batch": False})()
            choose_gradient_reduction(sharded, plan, micro_batch)
            loss = FAMILY.batch_loss(sharded, micro_batches[micro_batch * data_parallel + rank]) / 2
            loss.backward()
            reduce_expert_gradients(sharded)
        report[(rank, "norm")] = {"sharded": clip_grad_norm_(sharded, sharded.parameters(), MAX_NORM).item(),
                                  "reference": torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM).item()}
        reference_parameters = dict(reference.named_parameters())
        for name, param in sharded.named_parameters():
            whole = reference_parameters[name]
            report[(rank, name)] = {
                "local": param.to_local().shape[0] if isinstance(param, DTensor) else param.shape[0],
                "experts_on_own_mesh": isinstance(param, DTensor) and param.device_mesh.mesh_dim_names == (
                    "expert_replicate", "expert_parallel"),
                "same_init": torch.equal(param.full_tensor().detach(), whole.detach()),
                "grad_error": ((param.grad.full_tensor() - whole.grad).abs().max() / whole.grad.abs().max()).item(),
            }
        dist.barrier()
        report[(rank, "done")] = True
    finally:
        dist.destroy_process_group()


def mesh_report(data_parallel: int, expert_parallel: int, config: MoEConfig) -> dict:
    report = mp.Manager().dict()
    try:
        mp.start_processes(check_on_mesh, args=(free_port(), data_parallel, expert_parallel, config, report),
                           nprocs=data_parallel, start_method=FORKED)
    except mp.ProcessExitedException as error:  # gloo's teardown abort after the barrier: see tests/test_parallelize.py
        if error.signal_name != "SIGABRT" or not all(report.get((rank, "done")) for rank in range(data_parallel)):
            raise
    return {key: entry for key, entry in report.items() if key[1] != "done"}


# Router choices are discrete: a layout could only route a token elsewhere where its rounding moved a k-th and a
# (k+1)-th probability past each other. Both layouts compute each token's router input with the same weights and
# the same per-token arithmetic, summed in another order at most: a few float32 ulps (1e-7 each) of probabilities
# under 1, so a gap ten times 1e-6 cannot close.
SAFE_ROUTER_GAP = 1e-5
# Gradients: the same sums in another order (over micro-batches and ranks, and the experts' rows regrouped),
# float32 rounding of some 1e-7 relative each, a few of them per element: 1e-5 as tests/test_parallelize.py allows
GRADIENT_ERROR = 1e-5


@pytest.mark.parametrize("data_parallel, config", [(2, CAPPED), pytest.param(4, CONFIG, marks=pytest.mark.slow)],
                         ids=["ep2-capacity", "ep2-x2"])
def test_experts_split_over_ranks_give_one_process_gradients(data_parallel: int, config: MoEConfig) -> None:
    """Two micro-batches per rank (the expert gradients reduced once, on the second) against one process's
    whole batch: the same initial weights, the same global gradient norm (clipping bites) and the same clipped
    gradients; each expert weight lives on the (expert_replicate, expert_parallel) mesh, half of its experts on
    each rank, while FSDP2 shards the rest over every data-parallel rank. With a capacity some choices are dropped
    (capacity and its drops are per sequence, so one process drops the same ones)."""
    report = mesh_report(data_parallel, 2, config)
    assert all(report[(rank, "gap")] > SAFE_ROUTER_GAP for rank in range(data_parallel))
    assert (report[(0, "dropped")] > 0) == (config.capacity_factor is not None)
    norms = [report[(rank, "norm")] for rank in range(data_parallel)]
    assert all(norm["sharded"] == pytest.approx(norm["reference"], rel=GRADIENT_ERROR) and norm["sharded"] > MAX_NORM
               for norm in norms)
    parameters = {key: entry for key, entry in report.items() if key[1] not in ("gap", "dropped", "norm")}
    assert all(entry["same_init"] for entry in parameters.values())
    worst = max(parameters.items(), key=lambda item: item[1]["grad_error"])
    assert worst[1]["grad_error"] < GRADIENT_ERROR, worst
    experts = {key: entry for key, entry in parameters.items() if ".experts." in key[1]}
    assert len(experts) == data_parallel * CONFIG.n_layer * 3
    assert all(entry["experts_on_own_mesh"] and entry["local"] == CONFIG.n_expert // 2 for entry in experts.values())
    dense = [entry for key, entry in parameters.items() if key not in experts]
    assert not any(entry["experts_on_own_mesh"] for entry in dense)


# ----- what expert parallelism cannot do, refused in one line before anything starts -----

def strategy_sizes(devices: int, data_parallel: int, expert_parallel: int, *more: str) -> list[str]:
    return [*EXPERT_PARALLEL, "--trainer.devices", str(devices), "--trainer.strategy.init_args.data_parallel_size",
            str(data_parallel), "--trainer.strategy.init_args.expert_parallel_size", str(expert_parallel), *more]


GPT: list[str] = []  # the default family
REFUSALS = {  # case -> (family, layout, the refusal)
    "no experts": (GPT, strategy_sizes(2, 2, 2), "GPTLanguageModel has no experts to split over expert_parallel_size=2"),
    "not dividing the experts": (MOE, strategy_sizes(3, 3, 3, *batch_sizes(6, 2)),
                                 "expert_parallel_size=3 does not divide the 4 experts of model 'debug'"),
    "not dividing data_parallel_size": (MOE, strategy_sizes(4, 4, 3, *batch_sizes(8, 2)),
                                        "expert_parallel_size=3 must be at least 1 and divide data_parallel_size=4"),
    "with tensor parallelism": (
        MOE, strategy_sizes(4, 2, 2, "--trainer.strategy.init_args.tensor_parallel_size", "2"),
        "expert_parallel_size=2 with tensor_parallel_size=2: experts are split over data-parallel ranks only"),
    # DDP, FSDP (1), the pipeline, the parameter server and Lightning's own ModelParallelStrategy have no such option
    "under DDP": (MOE, ["-c", str(CONFIG_DIR / "trainer/ddp_cpu.yaml"),
                        "--trainer.strategy.init_args.expert_parallel_size", "2"],
                  "unknown option trainer.strategy.expert_parallel_size (trainer.strategy is "
                  "lightning.pytorch.strategies.DDPStrategy)"),
    "under pipeline stages": (MOE, ["-c", str(CONFIG_DIR / "trainer/pipeline_cpu.yaml"),
                                    "--trainer.strategy.init_args.expert_parallel_size", "2"],
                              "unknown option trainer.strategy.expert_parallel_size"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_what_expert_parallelism_cannot_do_is_refused_in_one_line(case: str, tmp_path: Path, debug_run_args: list[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    family, layout, expected = REFUSALS[case]
    assert_one_line_error_in_process(["fit", *family, *debug_run_args, *layout, "--print_config"], tmp_path, expected,
                                     monkeypatch)


def test_the_batch_plan_names_the_expert_split() -> None:
    plan = RunPlan(devices_per_node=4, num_nodes=1, data_parallel_size=4, tensor_parallel_size=1, global_batch_size=8,
                   micro_batch_size=2, sequence_length=64, precision=PRECISIONS["32-true"], seed=1,
                   expert_parallel_size=2)
    assert plan.describe().endswith("per optimizer step; experts split over 2 ranks x 2 replicas")
    assert "experts" not in replace(plan, expert_parallel_size=1).describe()


# ----- through the CLI -----

@pytest.fixture(scope="module")
def moe_run_args(comparable_run_args: list[str]) -> list[str]:
    """COMPARABLE_RUN (4 clipped steps, validated after each) with the MoE 'debug' model."""
    return [*MOE, *comparable_run_args]


def routed_fit(run_dir: Path, args: list[str], *extra: str, in_process: bool = False) -> Path:
    """A run that records its routing (tests.helpers.RoutingRecord)."""
    runner = fit_in_process if in_process else fit
    return runner(run_dir, args, *extra, *RECORD_ROUTING, f"--trainer.callbacks.out_dir={run_dir}")


def routing(run_dir: Path) -> dict:
    return json.loads((run_dir / "routing.json").read_text())


@pytest.fixture(scope="module")
def one_process_moe_run(tmp_path_factory: pytest.TempPathFactory, moe_run_args: list[str]) -> Path:
    return routed_fit(tmp_path_factory.mktemp("one_process"), moe_run_args, in_process=True)


@pytest.fixture(scope="module")
def expert_parallel_run(tmp_path_factory: pytest.TempPathFactory, moe_run_args: list[str]) -> Path:
    return routed_fit(tmp_path_factory.mktemp("expert_parallel"), moe_run_args, *EXPERT_PARALLEL)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2", "ep2-x2", "ep2-x2-hsdp"])
def test_expert_parallel_runs_train_as_one_process_does(tmp_path: Path, layout: str, moe_run_args: list[str],
                                                        one_process_moe_run: Path, expert_parallel_run: Path) -> None:
    """4 clipped steps of 8 samples: the same gradient norm at every step, validation loss after it and final
    weights as one process (micro-batches of 4: one per rank under EP 2, two after each other in one process; of 2
    on the 4 ranks of EP 2 x 2 replicas, the dense layers under FSDP2 over 4 or HSDP 2 x 2). Routing is discrete,
    so the runs are compared where it could differ: the routers of the 8 x 64 tokens x 2 layers of each step start
    nearly even (probabilities near 1/4; smallest gap between a k-th and a (k+1)-th about 1e-6, recorded), a few
    float32 ulps (3e-8 each) above what the layouts' rounding moves them; so the routing itself is compared, and
    every step's token choices per expert per layer, over all ranks, are one process's exactly (a choice routed
    elsewhere moves two counts)."""
    others = {"ep2-x2": EXPERT_PARALLEL_4, "ep2-x2-hsdp": EXPERT_PARALLEL_HSDP}
    run = expert_parallel_run if layout == "ep2" else routed_fit(tmp_path, moe_run_args, *others[layout])
    assert routing(run)["counts"] == routing(one_process_moe_run)["counts"]
    assert routing(run)["smallest_gap"] > 0  # no tie, which the layouts could break either way
    assert_comparable_runs_agree(one_process_moe_run, run)


@pytest.mark.slow
def test_an_expert_parallel_resume_after_sigkill_is_bitwise_exact(tmp_path: Path, moe_run_args: list[str]) -> None:
    run = [*moe_run_args, *EXPERT_PARALLEL, "--trainer.max_steps", "6", "--checkpoint.every_n_train_steps", "3",
           "--data.micro_batch_size", "2"]  # 2 micro-batches per step per rank: the kill lands between them
    assert_sharded_resume_after_sigkill_is_bitwise_exact(tmp_path, run)


@pytest.mark.slow
def test_expert_parallel_checkpoints_hold_whole_experts_and_resume_across_layouts(
        tmp_path: Path, moe_run_args: list[str], one_process_moe_run: Path, expert_parallel_run: Path) -> None:
    """The sharded checkpoint consolidates into whole (n_expert, ...) expert weights and Adam moments, which a
    one-file checkpoint (save_distributed_checkpoint false) holds as they are; resumed in one process it trains the
    next 2 steps as the one-process run's own checkpoint does, and so does that one resumed under EP 2."""
    consolidated = last_checkpoint_contents(expert_parallel_run)
    one_file = fit(tmp_path / "one_file", moe_run_args, *EXPERT_PARALLEL,
                   "--trainer.strategy.init_args.save_distributed_checkpoint", "false")
    single = torch.load(last_checkpoint(one_file), weights_only=True, map_location="cpu")
    for contents in (consolidated, single):
        experts = {name: weight for name, weight in contents["state_dict"].items() if ".experts." in name}
        assert len(experts) == 3 * CONFIG.n_layer
        assert all(weight.shape[0] == CONFIG.n_expert for weight in experts.values())
        moments = contents["optimizer_states"][0]["state"]
        assert all(moments[name]["exp_avg"].shape == weight.shape for name, weight in experts.items())
    resumed = {source: fit_in_process(tmp_path / f"from_{source.name}", moe_run_args, "--trainer.max_steps", "6",
                                      "--ckpt_path", str(last_checkpoint(source)))
               for source in (one_process_moe_run, expert_parallel_run)}
    assert_comparable_runs_agree(*resumed.values())
    # and the other way: the one-process file resumed under expert parallelism
    expert_parallel_resumed = fit(tmp_path / "expert_parallel_from_one_process", moe_run_args, *EXPERT_PARALLEL,
                                  "--trainer.max_steps", "6", "--ckpt_path", str(last_checkpoint(one_process_moe_run)))
    assert_comparable_runs_agree(resumed[one_process_moe_run], expert_parallel_resumed)


@pytest.mark.slow
def test_the_monitor_takes_each_ranks_all_to_all_time_out_of_compute(tmp_path: Path, moe_run_args: list[str]) -> None:
    """4 steps of 2 micro-batches per rank in windows of 2, each micro-batch computing 10 s on the monitor's clock
    and each of its 4 token exchanges (dispatch and combine in each of 2 layers) taking 1 s on rank 0 and 2 s on
    rank 1 (tests.helpers.ScriptedExchangeTimes): per step 8 or 16 s of all-to-all, logged per rank and taken out
    of compute, which stays 20 s; validation's exchanges (after steps 2 and 4) count for nothing."""
    fit(tmp_path, moe_run_args, *EXPERT_PARALLEL, *batch_sizes(8, 2), "--val_every_n_steps", "2",
        "--monitor.every_n_steps", "2", "--trainer.callbacks+=tests.helpers.ScriptedExchangeTimes",
        "--trainer.callbacks.compute_seconds=[10.0, 10.0]", "--trainer.callbacks.exchange_seconds=[1.0, 2.0]")
    for rank, exchange in ((0, 1.0), (1, 2.0)):
        assert scalars(tmp_path, f"monitor/all_to_all_s/rank{rank}") == pytest.approx([8 * exchange] * 2)
        assert scalars(tmp_path, f"monitor/compute_s/rank{rank}") == pytest.approx([20.0] * 2)
        assert scalars(tmp_path, f"monitor/step_s/rank{rank}") == pytest.approx([20.0 + 8 * exchange] * 2)
