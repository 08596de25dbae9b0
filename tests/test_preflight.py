"""The run plan and the pre-flight checks that resolve it (batch arithmetic, sizes, seed, precision), the
learning-rate schedule and scaling."""

from __future__ import annotations

import inspect
import math
from dataclasses import asdict

import pytest
import torch
from jsonargparse import Namespace

from app.cli.preflight import check_config, resolve_precision
from app.cli.run_plan_resolution import configured_strategy
from app.strategies.fault_tolerance.settings import FaultToleranceSettings
from app.strategies.fault_tolerance.strategy import FaultTolerantStrategy
from app.strategies.kind import StrategyKind
from app.tools.doctor import DoctorCLI
from core.errors import UserError
from core.precision import PRECISIONS
from core.run_plan import RunPlan
from models.gpt.family import GPTLanguageModel
from models.gpt.network import GPT, GPT_CONFIGS
from models.optimizer import OptimizerSettings, warmup_cosine_schedule, weight_decay_groups
from tests.helpers import REPO_ROOT, one_line_error


def plan(world_size: int = 1, micro: int = 4, global_batch: int = 32, num_nodes: int = 1,
         tensor_parallel: int = 1) -> RunPlan:
    return RunPlan(devices_per_node=world_size // num_nodes, num_nodes=num_nodes,
                   data_parallel_size=world_size // tensor_parallel, tensor_parallel_size=tensor_parallel,
                   global_batch_size=global_batch, micro_batch_size=micro, sequence_length=64,
                   precision=PRECISIONS["32-true"], seed=0)


@pytest.mark.parametrize(("world_size", "micro", "expected"), [(1, 4, 8), (2, 4, 4), (8, 4, 1), (4, 2, 4)])
def test_accumulation_keeps_the_global_batch(world_size: int, micro: int, expected: int) -> None:
    assert plan(world_size, micro).accumulation == expected
    assert expected * micro * world_size == 32


def test_tensor_parallel_ranks_share_a_data_parallel_rank() -> None:
    run = plan(world_size=8, micro=2, tensor_parallel=2)  # mesh (data_parallel 4, tensor_parallel 2), row-major
    assert run.accumulation == 4
    assert [run.data_parallel_rank(rank) for rank in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [run.tensor_parallel_rank(rank) for rank in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [index for index in range(12) if run.ends_optimizer_step(index)] == [3, 7, 11]
    assert [index for index in range(12) if run.starts_optimizer_step(index)] == [0, 4, 8]
    assert [run.micro_batch_in_step(index) for index in range(6)] == [0, 1, 2, 3, 0, 1]


def test_the_servers_plan_takes_whole_global_batches() -> None:
    """An asynchronous run's server (rank 0) applies one worker's push, a whole global batch, per update: its micro
    batch is the global batch and it never accumulates; each worker accumulates the global batch's micro-batches."""
    asynchronous = RunPlan(devices_per_node=3, num_nodes=1, data_parallel_size=1, tensor_parallel_size=1,
                           global_batch_size=32, micro_batch_size=4, sequence_length=64,
                           precision=PRECISIONS["32-true"], seed=0, asynchronous_workers=2)
    assert asynchronous.for_rank(1) == asynchronous.for_rank(2) == asynchronous and asynchronous.accumulation == 8
    server = asynchronous.for_rank(0)
    assert (server.micro_batch_size, server.accumulation) == (32, 1)
    assert all(server.ends_optimizer_step(index) for index in range(3))
    synchronous = plan(world_size=2, micro=4)
    assert synchronous.for_rank(0) == synchronous


def test_non_dividing_batch_names_every_number() -> None:
    with pytest.raises(UserError) as error:
        plan(global_batch=30, micro=4, world_size=4, num_nodes=2)
    message = str(error.value)
    assert "global_batch_size=30" in message and "micro_batch_size=4" in message
    assert "4 processes (2 devices x 2 nodes) = 16" in message and "\n" not in message


def test_sizes_that_do_not_make_the_world_size_are_refused() -> None:
    with pytest.raises(UserError, match="data_parallel_size=2 x tensor_parallel_size=2 must equal the world size 2"):
        RunPlan(devices_per_node=2, num_nodes=1, data_parallel_size=2, tensor_parallel_size=2, global_batch_size=8,
                micro_batch_size=2, sequence_length=8, precision=PRECISIONS["32-true"], seed=0)
    with pytest.raises(UserError, match="data.micro_batch_size=0 must be a positive integer"):
        plan(micro=0)


def test_the_plan_is_resolved_from_the_config_alone(debug_run_args: list[str]) -> None:
    """The config as fit parses it (nothing instantiated): sizes, seed and precision in one value."""
    cli = DoctorCLI([*debug_run_args, "--trainer.devices", "4", "--trainer.strategy", "ddp",
                     "--seed_everything", "7", "--data.global_batch_size", "32", "--data.micro_batch_size", "4",
                     "--trainer.precision", "bf16"])
    resolved = check_config(cli.config)
    assert (resolved.world_size, resolved.data_parallel_size, resolved.accumulation) == (4, 4, 2)
    assert (resolved.seed, resolved.precision.name, resolved.sequence_length) == (7, "bf16-mixed", 64)
    assert cli.config.model.init_args.seed == 7  # linked, as vocab_size is


def test_hybrid_sharding_splits_the_data_parallel_ranks_into_replicas_of_shards(debug_run_args: list[str],
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """hsdp_cpu.yaml as fit resolves it: 4 data-parallel ranks, 2 replicas x 2 shards, each rank reading its own
    samples (data-parallel rank = replica x shards + shard, the mesh's row-major order); the batch line shows both.
    A replicate size that does not divide the data-parallel ranks is refused in one line; so is one given to a
    strategy without hybrid sharding (Lightning's ModelParallelStrategy), by the parser."""
    hsdp = ["-c", str(REPO_ROOT / "configs/trainer/hsdp_cpu.yaml"), "--data.global_batch_size", "16",
            "--data.micro_batch_size", "2"]
    resolved = check_config(DoctorCLI([*debug_run_args, *hsdp]).config)
    assert (resolved.data_parallel_size, resolved.data_parallel_replicate_size, resolved.data_parallel_shard_size,
            resolved.accumulation, resolved.reduce_gradients_every_micro_batch) == (4, 2, 2, 2, False)
    assert [resolved.data_parallel_rank(rank) for rank in range(4)] == [0, 1, 2, 3]
    assert ("global batch 16 = micro batch 2 x 4 data-parallel ranks (2 replicas x 2 shards) x 2 accumulation steps"
            in resolved.describe())
    for replicas in ("3", "0"):
        with pytest.raises(UserError, match=f"data_parallel_replicate_size={replicas} must be at least 1 and divide "
                                            "data_parallel_size=4") as error:
            check_config(DoctorCLI([*debug_run_args, *hsdp,
                                    "--trainer.strategy.init_args.data_parallel_replicate_size", replicas]).config)
        assert "\n" not in str(error.value)
    model_parallel = ["-c", str(REPO_ROOT / "configs/trainer/model_parallel_cpu.yaml")]
    assert check_config(DoctorCLI([*debug_run_args, *model_parallel]).config).data_parallel_replicate_size == 1
    assert "unknown option trainer.strategy.data_parallel_replicate_size" in one_line_error(
        ["fit", *debug_run_args, *model_parallel, "--trainer.strategy.init_args.data_parallel_replicate_size", "2",
         "--print_config"], monkeypatch)


@pytest.mark.parametrize(("strategy", "kind"), [
    ("auto", StrategyKind.DDP), ("ddp_spawn", StrategyKind.DDP), ("deepspeed", StrategyKind.OTHER),
    ("xla", StrategyKind.OTHER), ("single_device", StrategyKind.OTHER),
    ("lightning.pytorch.strategies.ModelParallelStrategy", StrategyKind.MODEL_PARALLEL),
    ("app.strategies.hybrid_sharding.HybridShardedStrategy", StrategyKind.MODEL_PARALLEL),
    ("app.strategies.pipeline.PipelineParallelStrategy", StrategyKind.PIPELINE),
    ("app.strategies.parameter_server.strategy.ParameterServerStrategy", StrategyKind.PARAMETER_SERVER),
    ("app.strategies.fault_tolerance.strategy.FaultTolerantStrategy", StrategyKind.FAULT_TOLERANT),
])
def test_the_strategy_kind_comes_from_the_class_the_config_names(strategy: str, kind: StrategyKind) -> None:
    """A subclass is its own kind, not its base's: the pipeline is a ModelParallelStrategy; the parameter server,
    DeepSpeed and XLA are DDPStrategies."""
    named = strategy if "." not in strategy else Namespace(class_path=strategy, init_args=Namespace())
    assert configured_strategy(named, "cpu").kind is kind


def test_the_fault_tolerance_settings_default_as_the_strategy_does() -> None:
    """The settings record's defaults are the strategy's, which a config that leaves a field out gets."""
    settings, strategy = asdict(FaultToleranceSettings()), inspect.signature(FaultTolerantStrategy.__init__).parameters
    assert settings == {name: strategy[name].default for name in settings}


def test_a_seed_that_is_not_an_integer_is_refused(debug_run_args: list[str]) -> None:
    """Lightning's seed_everything also takes true (a random seed), which a resumed run could not draw again."""
    with pytest.raises(UserError, match=r"seed_everything: Expected a <class 'int'>. Got value: True"):
        DoctorCLI([*debug_run_args, "--seed_everything", "true"])


def test_precision_aliases_and_cpu_rules() -> None:
    assert resolve_precision(None, "cpu") == "32-true"
    assert resolve_precision("bf16", "cpu") == "bf16-mixed"
    assert resolve_precision("16-mixed", "cpu") == "bf16-mixed"  # Lightning does this too, we say so plainly
    with pytest.raises(UserError, match="16-true"):
        resolve_precision("16-true", "cpu")
    with pytest.raises(UserError, match="not supported"):
        resolve_precision("fp8", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_gpu_precision_without_a_gpu_is_refused() -> None:
    with pytest.raises(UserError, match="no CUDA GPU is visible"):
        resolve_precision("bf16-mixed", "gpu")


def test_warmup_then_cosine_to_the_floor() -> None:
    schedule = warmup_cosine_schedule(warmup_steps=10, decay_steps=110, min_ratio=0.1)
    assert schedule(0) == pytest.approx(0.1) and schedule(9) == pytest.approx(1.0)
    assert schedule(10) == pytest.approx(1.0)
    assert schedule(60) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert schedule(110) == pytest.approx(0.1) and schedule(1000) == pytest.approx(0.1)


def test_linear_lr_scaling_rule() -> None:
    assert OptimizerSettings(learning_rate=1e-3, reference_batch_size=16).peak_learning_rate(64) == pytest.approx(4e-3)
    assert OptimizerSettings(learning_rate=1e-3).peak_learning_rate(64) == 1e-3


def test_no_weight_decay_on_biases_norms_and_embeddings() -> None:
    model = GPT(GPT_CONFIGS["debug"])
    decay, no_decay = weight_decay_groups(model, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(names[id(p)].endswith("weight") and "ln" not in names[id(p)] for p in decay["params"])
    assert {"wte.weight", "wpe.weight", "ln_f.weight", "blocks.0.attn.qkv.bias"} <= {names[id(p)] for p in no_decay["params"]}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_unknown_model_name_lists_the_known_ones() -> None:
    with pytest.raises(UserError, match="unknown model.model_name 'gpt5'.*gpt2-medium"):
        GPTLanguageModel("gpt5")
