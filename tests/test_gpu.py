"""The CPU tests' precision matrix on CUDA (bf16 autocast, fp16 with a grad scaler, NCCL), with clipping that bites,
and the sharded presets' resume. Skipped where no CUDA GPU is visible; 2-GPU tests where fewer are."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    QUIET, REPO_ROOT, assert_weights_close, cached_fits, fit, last_checkpoint_weights, run_cohort, scalars, shrunk,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TRAINER = REPO_ROOT / "configs" / "trainer"
QUICKSTART = ["-c", str(REPO_ROOT / "configs/quickstart.yaml")]
STEPS = 6
CLIP = 0.1  # below the debug model's gradient norm in these steps (as on CPU), so clipping bites at every step
LAYOUTS = {  # the shipped GPU presets on 1 or 2 GPUs
    "1 gpu": ["-c", str(TRAINER / "gpu_bf16.yaml")],
    "fsdp-1": ["-c", str(TRAINER / "fsdp_gpu_bf16.yaml"), "--trainer.devices", "1"],
    "model_parallel-1": ["-c", str(TRAINER / "model_parallel_gpu_bf16.yaml"), "--trainer.devices", "1",
                         "--trainer.strategy.init_args.data_parallel_size", "1"],
    "ddp-2": ["-c", str(TRAINER / "ddp_gpu_bf16.yaml"), "--trainer.devices", "2"],
    "fsdp-2": ["-c", str(TRAINER / "fsdp_gpu_bf16.yaml"), "--trainer.devices", "2"],
    "model_parallel-2": ["-c", str(TRAINER / "model_parallel_gpu_bf16.yaml"), "--trainer.devices", "2",
                         "--trainer.strategy.init_args.data_parallel_size", "2"],
}
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, byte_corpus: Path) -> Callable[[str, str], Path]:
    return cached_fits(tmp_path_factory, lambda precision, layout: [
        *QUICKSTART, *LAYOUTS[layout], *shrunk(byte_corpus, STEPS), "--trainer.precision", precision,
        "--trainer.gradient_clip_val", str(CLIP)])


@pytest.mark.parametrize("layout", ["1 gpu", "fsdp-1", "model_parallel-1"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed", "bf16-true"])
def test_each_precision_trains_on_one_gpu_with_clipping_that_bites(trained: Callable[[str, str], Path],
                                                                   precision: str, layout: str) -> None:
    """The first step's norm (same weights, same batch) is float32's within mixed precision's rounding: a grad
    scaler's factor (65536 at the start) left in the gradients would show here."""
    run_dir = trained(precision, layout)
    losses, norms = scalars(run_dir, "train/loss"), scalars(run_dir, "train/grad_norm")
    assert len(losses) == len(norms) == STEPS
    assert all(torch.isfinite(torch.tensor(losses + norms))) and min(norms) > CLIP
    assert losses[-1] < losses[0] - 0.3, losses
    assert norms[0] == pytest.approx(scalars(trained("32-true", "1 gpu"), "train/grad_norm")[0], rel=3e-2)
    assert all(torch.isfinite(tensor).all() for tensor in last_checkpoint_weights(run_dir).values())


@TWO_GPUS
@pytest.mark.parametrize("layout", ["ddp-2", "fsdp-2", "model_parallel-2"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_two_gpus_train_as_one_does(trained: Callable[[str, str], Path], precision: str, layout: str) -> None:
    """As on CPU: the same global batch gives the same global gradient norm at every step; in float32 the same
    weights too."""
    one, two = trained(precision, "1 gpu"), trained(precision, layout)
    tolerance = 1e-5 if precision == "32-true" else 2e-2
    assert scalars(two, "train/grad_norm") == pytest.approx(scalars(one, "train/grad_norm"), rel=tolerance)
    if precision == "32-true":
        assert_weights_close(last_checkpoint_weights(one), last_checkpoint_weights(two), rtol=1e-4)


def test_gpt2_recipe_runs_with_its_preset(tmp_path: Path, byte_corpus: Path) -> None:
    """The README's headline command, shrunk to the debug model: bf16-mixed, clipping, 32 micro-batches a step."""
    fit(tmp_path, ["-c", str(TRAINER / "ddp_gpu_bf16.yaml"), "-c", str(REPO_ROOT / "configs/gpt2/pretrain.yaml"),
                   "--trainer.devices", "1", *shrunk(byte_corpus, 2)])
    assert len(scalars(tmp_path, "train/grad_norm")) == 2
    assert scalars(tmp_path, "throughput/tflops")
    if any(name in torch.cuda.get_device_name() for name in ("A100", "H100", "H200")):
        assert scalars(tmp_path, "throughput/mfu")


@pytest.mark.parametrize("preset", ["fsdp_gpu_bf16", "model_parallel_gpu_bf16"])
@pytest.mark.parametrize("compile", ["false", "true"], ids=["eager", "compiled"])
def test_sharded_fit_on_one_gpu_resumes_and_consolidates(tmp_path: Path, debug_run_args: list[str], preset: str,
                                                         compile: str) -> None:
    """FSDPStrategy and ModelParallelStrategy (FSDP2) over NCCL on one GPU: train, resume from the sharded folder,
    consolidate it for a one-process validate."""
    args = ["-c", str(REPO_ROOT / f"configs/trainer/{preset}.yaml"), *debug_run_args, *QUIET,
            "--trainer.accelerator", "gpu", "--trainer.devices", "1", "--model.compile", compile,
            "--data.global_batch_size", "8", "--data.micro_batch_size", "4"]
    if preset.startswith("model_parallel"):
        args += ["--trainer.strategy.init_args.data_parallel_size", "1"]
    for max_steps, resume in (("2", []), ("4", ["--ckpt_path", "last"])):
        result = run_cohort(["fit", *args, "--trainer.max_steps", max_steps, *resume], cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "lightning_logs/version_0/checkpoints/last.ckpt").is_dir()
    weights = last_checkpoint_weights(tmp_path)  # consolidated from the shards
    assert all(torch.isfinite(tensor).all() for tensor in weights.values())
    result = run_cohort(["validate", *debug_run_args, *QUIET, "--trainer.accelerator", "gpu",
                         "--ckpt_path", str(tmp_path / "lightning_logs/version_0/checkpoints/last.consolidated.ckpt")],
                        cwd=tmp_path)
    assert result.returncode == 0 and "val/loss" in result.stdout, result.stderr[-3000:]


@TWO_GPUS
def test_tensor_parallel_on_two_gpus_over_nccl(tmp_path: Path, debug_run_args: list[str]) -> None:
    result = run_cohort(["fit", "-c", str(REPO_ROOT / "configs/trainer/model_parallel_gpu_bf16.yaml"), *debug_run_args,
                         *QUIET, "--trainer.accelerator", "gpu", "--trainer.devices", "2",
                         "--trainer.strategy.init_args.data_parallel_size", "1",
                         "--trainer.strategy.init_args.tensor_parallel_size", "2",
                         "--trainer.max_steps", "4", "--data.global_batch_size", "8", "--data.micro_batch_size", "4"],
                        cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_a_nan_gradient_is_skipped_on_the_gpu(tmp_path: Path, byte_corpus: Path, precision: str) -> None:
    """The CUDA side of bad steps: the verdict reaches the fused optimizer as a device flag and the host through a
    pinned copy (bf16), or the grad scaler skips the step itself (fp16); either way training goes on with finite
    weights and the skip is reported one step later."""
    result = run_cohort(["fit", *QUICKSTART, *LAYOUTS["1 gpu"], *shrunk(byte_corpus, STEPS), *QUIET,
                         "--trainer.precision", precision, "--bad_steps.action", "skip",
                         "--trainer.callbacks+=tests.helpers.PoisonGradientAtStep", "--trainer.callbacks.rank=0",
                         "--trainer.callbacks.step=3"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    if precision == "bf16-mixed":  # fp16: the scaler's own skip; the loss stayed finite, so bad_steps saw nothing
        assert "step 3: the loss or gradients were NaN or inf on rank 0 of 1" in result.stderr
        assert scalars(tmp_path, "train/skipped_steps")[-1] == 1
    assert all(torch.isfinite(tensor).all() for tensor in last_checkpoint_weights(tmp_path).values())
