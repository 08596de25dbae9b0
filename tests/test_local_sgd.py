"""Local SGD and DiLoCo (app/strategies/local_updates.py): real 2-process runs over gloo, shared by the tests; a DiLoCo
run resumed from a checkpoint; the mistakes refused before start."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from tests.helpers import (
    CONFIG_DIR, DDP_2, MODEL_PARALLEL, assert_comparable_runs_agree, assert_weights_agree, assert_weights_equal,
    batch_sizes, fit, last_checkpoint, last_checkpoint_weights, one_line_error, record_weight_digests, scalars,
    weight_digests_per_rank,
)

STEPS = 8
EVERY = 4  # local SGD's H in the counting test
DILOCO_STEPS = 6
DILOCO_EVERY = 2  # a checkpoint at step 3 falls inside a round: each rank's own weights and moments must come back


def local_updates(method: str, every: int) -> list[str]:
    return ["--local_updates.method", method, "--local_updates.sync_every", str(every)]


def diloco_run(debug_run_args: list[str]) -> list[str]:
    """DILOCO_STEPS steps on 2 processes (the shipped preset configs/trainer/diloco_cpu.yaml), a checkpoint every 3;
    the LR schedule does not depend on max_steps, so a run resumed from step 3 follows the same one."""
    return [*debug_run_args, "-c", str(CONFIG_DIR / "trainer/diloco_cpu.yaml"), *batch_sizes(8, 4),
            "--trainer.max_steps", str(DILOCO_STEPS), "--model.optimizer.learning_rate", "1e-2", "--model.optimizer.lr_decay_steps", "8",
            "--checkpoint.every_n_train_steps", "3", *local_updates("diloco", DILOCO_EVERY)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, debug_run_args: list[str],
            comparable_run_args: list[str]) -> Callable[[str], Path]:
    """name -> the folder of its finished run, run the first time a test asks for it."""
    runs: dict[str, Path] = {}

    def args_of(name: str, run_dir: Path) -> list[str]:
        if name == "local_sgd H=1":
            return [*comparable_run_args, *DDP_2, *local_updates("local_sgd", 1)]
        if name == f"local_sgd H={EVERY}":  # 2 micro-batches per step and rank, to count them as the no_sync test does
            return [*debug_run_args, *DDP_2, *batch_sizes(8, 2), "--trainer.max_steps", str(STEPS),
                    *local_updates("local_sgd", EVERY), "--replica_check.every_n_steps", "1",
                    "--trainer.callbacks+=tests.helpers.AllReduceLog",
                    f"--trainer.callbacks.out_dir={run_dir}", *record_weight_digests(run_dir)]
        if name == "diloco as averaging":  # outer lr 1 without momentum: the synced weights less the mean progress
            return [*debug_run_args, *DDP_2, *batch_sizes(8, 2), "--trainer.max_steps", str(STEPS),
                    *local_updates("diloco", EVERY), "--local_updates.outer_learning_rate", "1.0",
                    "--local_updates.outer_momentum", "0.0"]
        return diloco_run(debug_run_args)

    def get(name: str) -> Path:
        if name not in runs:
            run_dir = tmp_path_factory.mktemp(name.replace(" ", "_").replace("=", ""))
            runs[name] = fit(run_dir, args_of(name, run_dir))
        return runs[name]

    return get


@pytest.mark.slow
def test_local_sgd_with_one_step_between_syncs_is_ddp(trained: Callable[[str], Path],
                                                     one_process_comparable_run: Path) -> None:
    """H = 1 all-reduces the gradient at every step, as DDP: it trains as one process does, as DDP's runs do (the
    same validation loss and weights up to the order of sums), and sends every gradient at every step. (Averaging
    parameters after each rank's own AdamW step would not be DDP: Adam's per-rank moments and local clipping make it
    another update; app/strategies/local_updates.py says why it is not done.)"""
    local = trained("local_sgd H=1")
    assert_comparable_runs_agree(one_process_comparable_run, local)
    weights = {tensor.data_ptr(): tensor for tensor in last_checkpoint_weights(local).values()}
    parameters = sum(tensor.numel() for tensor in weights.values())  # the tied embedding and head once
    steps = len(scalars(local, "train/loss"))
    assert scalars(local, "comm/bytes_per_step") == [4.0 * parameters] * steps


@pytest.mark.slow
def test_local_sgd_all_reduces_once_every_h_steps(trained: Callable[[str], Path]) -> None:
    """8 steps of 2 micro-batches per rank, H = 4: no gradient is all-reduced, the parameters (all of them, once)
    after the last micro-batch of steps 4 and 8 only; the ranks' weights differ between syncs and agree after, where
    the monitor checks them (asked to at every step, it waits for a sync instead of stopping the run)."""
    run = trained(f"local_sgd H={EVERY}")
    weights = {tensor.data_ptr(): tensor for tensor in last_checkpoint_weights(run).values()}
    parameters = sum(tensor.numel() for tensor in weights.values())  # the tied embedding and head once
    for rank in (0, 1):
        calls = json.loads((run / f"allreduce_log_rank{rank}.json").read_text())
        large = [(batch, size) for batch, size in calls if size > 100]  # not the bad-step verdict's 3 numbers
        assert large == [(7, parameters), (15, parameters)], calls
    assert scalars(run, "comm/bytes_per_step") == [0.0, 0.0, 0.0, 4.0 * parameters] * (STEPS // EVERY)
    digests = weight_digests_per_rank(run)
    synced = [step for step in range(STEPS + 1) if digests[0][step] == digests[1][step]]
    assert synced == [0, 4, 8], synced  # steps 1-3 and 5-7 each rank stepped on its own gradient


@pytest.mark.slow
def test_diloco_trains_and_syncs_every_h_steps(trained: Callable[[str], Path]) -> None:
    run = trained("diloco")
    losses = scalars(run, "train/loss")
    assert len(losses) == DILOCO_STEPS and sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.5, losses
    pseudo_gradient_bytes = 4 * sum(tensor.numel() for tensor in {
        tensor.data_ptr(): tensor for tensor in last_checkpoint_weights(run).values()}.values())
    assert scalars(run, "comm/bytes_per_step") == [0.0, pseudo_gradient_bytes] * (DILOCO_STEPS // DILOCO_EVERY)
    assert min(scalars(run, "monitor/sync_wait_s/median")[1::2]) > 0  # the outer step's all-reduce is sync wait


@pytest.mark.slow
def test_diloco_with_outer_lr_1_and_no_momentum_is_local_sgd(trained: Callable[[str], Path]) -> None:
    """synced - 1.0 x mean(synced - weights) = mean(weights): DiLoCo's outer step reduces to torch's model averaging,
    up to the rounding of the subtractions (1e-4, as for runs whose sums were taken in another order)."""
    assert_weights_agree(trained(f"local_sgd H={EVERY}"), trained("diloco as averaging"))


@pytest.mark.slow
def test_diloco_resumes_with_its_outer_state(tmp_path: Path, trained: Callable[[str], Path],
                                            debug_run_args: list[str]) -> None:
    """Resumed from the straight run's step-3 checkpoint (inside the second round), a new run trains bitwise as
    the straight run: the outer momentum, the synced parameters, the step within the round and each rank's own
    weights and AdamW moments came back (dropped, the step-4 outer step would start without momentum or from other
    parameters, or rank 1 from rank 0's)."""
    run = diloco_run(debug_run_args)
    step_3 = last_checkpoint(trained("diloco")).with_name("step=000003.ckpt")
    saved = torch.load(step_3, weights_only=True)["callbacks"]["LocalUpdates"]
    assert saved["method"] == "diloco" and saved["steps_since_sync"] == 1 and saved["syncs"] == 1
    assert saved["synced"].keys() == saved["outer_momentum"].keys() and saved["synced"]
    assert all(momentum.abs().sum() > 0 for momentum in saved["outer_momentum"].values())
    ranks = saved["ranks"]
    assert len(ranks) == 2 and any(not torch.equal(ranks[0][name], ranks[1][name]) for name in ranks[0]
                                   if name.startswith("weights/"))  # mid-round: each rank's own

    resumed = fit(tmp_path / "resumed", run, "--ckpt_path", str(step_3))
    assert torch.load(last_checkpoint(resumed), weights_only=True)["callbacks"]["LocalUpdates"]["syncs"] == 3
    assert_weights_equal(last_checkpoint_weights(trained("diloco")), last_checkpoint_weights(resumed))


@pytest.mark.parametrize(("flags", "expected"), [
    (["--local_updates.method", "async"],
     "local_updates.method='async' is not an update method: use one of sync, local_sgd, diloco"),
    ([*local_updates("local_sgd", 0)], "local_updates.sync_every=0 must be at least 1"),
    ([*local_updates("diloco", 4), "--local_updates.outer_learning_rate", "0"],
     "local_updates.outer_learning_rate=0.0 must be > 0"),
    ([*local_updates("diloco", 4), "--local_updates.outer_momentum", "1.0"],
     "local_updates.outer_momentum=1.0 must be in [0, 1)"),
    ([*MODEL_PARALLEL, *local_updates("diloco", 4)],
     "local_updates.method=diloco lets each DDP replica step on its own, but trainer.strategy is "
     "lightning.pytorch.strategies.ModelParallelStrategy"),
    (["-c", str(CONFIG_DIR / "trainer/pipeline_cpu.yaml"), *local_updates("local_sgd", 4)],
     "but trainer.strategy is app.strategies.pipeline.PipelineParallelStrategy"),
    ([*local_updates("local_sgd", 4), "--gradient_compression.method", "powersgd"],
     "local_updates.method=local_sgd all-reduces no gradients, so gradient_compression.method=powersgd would have "
     "nothing to compress"),
    ([*local_updates("diloco", 4), "--bad_steps.action", "rollback"],
     "bad_steps.action=rollback reloads rank 0's weights and optimizer state into every rank"),
], ids=["unknown", "sync-every", "outer-lr", "outer-momentum", "model_parallel", "pipeline", "compression",
        "rollback"])
def test_mistakes_are_refused_before_start_in_one_line(flags: list[str], expected: str, debug_run_args: list[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["fit", *debug_run_args, *DDP_2, *batch_sizes(8, 4), *flags]
    assert expected in one_line_error(args, monkeypatch)


def test_lightning_still_registers_its_model_averaging_on_cuda_only() -> None:
    """Why app/strategies/local_updates.py exists: DDPStrategy(model_averaging_period=...) needs its PostLocalSGDState
    comm hook, which Lightning registers only on CUDA. Should an upgrade lift that, Cohort's own could give way to
    it."""
    assert 'self.root_device.type == "cuda"' in inspect.getsource(DDPStrategy._register_ddp_hooks)
