"""Gradient compression for DDP (app/strategies/gradient_compression.py): real 2-process runs over gloo, one per method,
shared by the tests; a PowerSGD run resumed from a checkpoint; the mistakes refused before start."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

from app.strategies.gradient_compression import CompressionSettings, check_config
from app.strategies.kind import ConfiguredStrategy, StrategyKind
from core.errors import UserError
from core.precision import PRECISIONS
from core.run_plan import RunPlan
from tests.helpers import (
    CONFIG_DIR, DDP_2, MODEL_PARALLEL, assert_weights_equal, batch_sizes, fit, last_checkpoint, last_checkpoint_weights,
    one_line_error, scalars,
)

STEPS = 6
START = 2  # PowerSGD's plain all-reduce steps: the shortest torch allows with error feedback
RANK = 2
METHODS = ("none", "bf16", "powersgd")  # fp16 is bf16's hook with another dtype: not worth another 2-process run


def compression_run(debug_run_args: list[str], method: str) -> list[str]:
    """STEPS steps on 2 processes (the shipped preset configs/trainer/ddp_powersgd_cpu.yaml) with ``method``, a
    checkpoint every 3 steps; the LR schedule does not depend on max_steps, so a run resumed to STEPS follows the
    same one."""
    return [*debug_run_args, "-c", str(CONFIG_DIR / "trainer/ddp_powersgd_cpu.yaml"), *batch_sizes(8, 4),
            "--trainer.max_steps", str(STEPS),
            "--model.optimizer.learning_rate", "1e-2", "--model.optimizer.lr_decay_steps", "8", "--checkpoint.every_n_train_steps", "3",
            "--gradient_compression.method", method, "--gradient_compression.powersgd_rank", str(RANK),
            "--gradient_compression.powersgd_start_step", str(START)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, debug_run_args: list[str]) -> Callable[[str], Path]:
    """method -> the folder of its finished run, run the first time a test asks for it."""
    runs: dict[str, Path] = {}

    def get(method: str) -> Path:
        if method not in runs:
            runs[method] = fit(tmp_path_factory.mktemp(method), compression_run(debug_run_args, method))
        return runs[method]

    return get


def expected_powersgd_bytes(shapes: list[torch.Size]) -> int:
    """What PowerSGD all-reduces per step for parameters of ``shapes`` (float32): P and Q of each matrix worth
    compressing, the other tensors whole."""
    numbers = 0
    for shape in shapes:
        rows, columns = shape[0], math.prod(shape[1:])
        compress, whole, factors = _should_compress(rows, columns, min(rows, columns, RANK), 2.0)
        numbers += factors if compress else whole
    return 4 * numbers


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_each_method_trains_and_the_monitor_times_its_hook(trained: Callable[[str], Path], method: str) -> None:
    run = trained(method)
    losses = scalars(run, "train/loss")
    assert len(losses) == STEPS and sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.2, losses
    assert len(scalars(run, "comm/bytes_per_step")) == STEPS  # the hook ran at every step
    assert min(scalars(run, "monitor/sync_wait_s/median")) > 0  # timed from the chosen hook's last bucket


@pytest.mark.slow
def test_sixteen_bit_hooks_send_half_the_bytes_of_plain_ddp(trained: Callable[[str], Path]) -> None:
    plain = scalars(trained("none"), "comm/bytes_per_step")
    weights = {tensor.data_ptr(): tensor for tensor in last_checkpoint_weights(trained("none")).values()}
    parameters = sum(tensor.numel() for tensor in weights.values())  # the tied embedding and head once
    assert plain == [4 * parameters] * STEPS  # every float32 gradient, once per step
    assert scalars(trained("bf16"), "comm/bytes_per_step") == [2 * parameters] * STEPS


@pytest.mark.slow
def test_powersgd_sends_its_factors_after_the_start_step(trained: Callable[[str], Path]) -> None:
    run = trained("powersgd")
    sent, plain = scalars(run, "comm/bytes_per_step"), scalars(trained("none"), "comm/bytes_per_step")
    state = torch.load(last_checkpoint(run), weights_only=True)["callbacks"]["GradientCompression"]
    factors = expected_powersgd_bytes([residual.shape for residual in state["residuals"][0].values()])
    assert sent == plain[:START] + [factors] * (STEPS - START) and factors < plain[0] / 4
    different = [name for name, weight in last_checkpoint_weights(run).items()
                 if not torch.equal(weight, last_checkpoint_weights(trained("none"))[name])]
    assert different, "PowerSGD trained the same weights as plain DDP: its hook changed nothing"


@pytest.mark.slow
def test_powersgd_resumes_with_its_state(tmp_path: Path, trained: Callable[[str], Path],
                                         debug_run_args: list[str]) -> None:
    """A new run resumed from the straight run's step-3 checkpoint trains bitwise as the straight run: each rank's
    residual, the Q factors, the step counter and the generator came back (dropped, the resumed run would restart
    PowerSGD with zero residuals, fresh random factors and START plain steps)."""
    run = compression_run(debug_run_args, "powersgd")
    step_3 = last_checkpoint(trained("powersgd")).with_name("step=000003.ckpt")
    saved = torch.load(step_3, weights_only=True)["callbacks"]["GradientCompression"]
    assert saved["step"] == 3 and saved["rank"] == RANK and saved["warm"] and saved["q"]
    residuals = saved["residuals"]
    assert len(residuals) == 2 and residuals[0].keys() == residuals[1].keys()
    assert all(residual.abs().sum() > 0 for residual in residuals[0].values() if residual.dim() == 2)
    assert any(not torch.equal(residuals[0][name], residuals[1][name]) for name in residuals[0])  # each rank's own

    resumed = fit(tmp_path / "resumed", run, "--ckpt_path", str(step_3))
    assert torch.load(last_checkpoint(resumed), weights_only=True)["callbacks"]["GradientCompression"]["step"] == STEPS
    assert_weights_equal(last_checkpoint_weights(trained("powersgd")), last_checkpoint_weights(resumed))


@pytest.mark.parametrize(("flags", "expected"), [
    (["--gradient_compression.method", "int8"],
     "gradient_compression.method='int8' is not a compression: use one of none, bf16, fp16, powersgd"),
    (["--gradient_compression.method", "powersgd", "--gradient_compression.powersgd_rank", "0"],
     "gradient_compression.powersgd_rank=0 must be at least 1"),
    (["--gradient_compression.method", "powersgd", "--gradient_compression.powersgd_start_step", "1"],
     "gradient_compression.powersgd_start_step=1 must be at least 2"),
    ([*MODEL_PARALLEL, "--gradient_compression.method", "bf16"],
     "gradient_compression.method=bf16 compresses DDP's gradient all-reduce, but trainer.strategy is "
     "lightning.pytorch.strategies.ModelParallelStrategy"),
    (["-c", str(CONFIG_DIR / "trainer/pipeline_cpu.yaml"), "--gradient_compression.method", "powersgd"],
     "but trainer.strategy is app.strategies.pipeline.PipelineParallelStrategy"),
], ids=["unknown", "rank", "start-step", "model_parallel", "pipeline"])
def test_mistakes_are_refused_before_start_in_one_line(flags: list[str], expected: str, debug_run_args: list[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["fit", *debug_run_args, *DDP_2, *batch_sizes(8, 4), *flags]
    assert expected in one_line_error(args, monkeypatch)


def test_one_process_notes_that_compression_does_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """Noted, not refused: a config with compression also runs on one process to debug, with exact gradients."""
    options = CompressionSettings(method="bf16", powersgd_rank=4, powersgd_start_step=10)
    one_process = RunPlan(devices_per_node=1, num_nodes=1, data_parallel_size=1, tensor_parallel_size=1,
                          global_batch_size=4, micro_batch_size=4, sequence_length=8, precision=PRECISIONS["32-true"],
                          seed=0)
    with caplog.at_level(logging.INFO):
        check_config(options, one_process, ConfiguredStrategy(StrategyKind.DDP, "auto"))
    assert "gradient_compression: method bf16 does nothing on one process" in caplog.text
    with pytest.raises(UserError, match="trainer.strategy is fsdp"):
        check_config(options, one_process, ConfiguredStrategy(StrategyKind.FSDP, "fsdp"))
