"""GPU runs (bf16 autocast, fp16 with a grad scaler, NCCL). Skipped where no CUDA GPU is visible."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import QUIET, REPO_ROOT, last_checkpoint_weights, run_cohort

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true"])
def test_one_gpu_fit(tmp_path: Path, debug_run_args: list[str], precision: str) -> None:
    result = run_cohort(["fit", "-c", str(REPO_ROOT / "configs/trainer/gpu_bf16.yaml"), *debug_run_args, *QUIET,
                         "--trainer.accelerator", "gpu", "--trainer.precision", precision,
                         "--trainer.max_steps", "4", "--data.global_batch_size", "8", "--data.micro_batch_size", "4"],
                        cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    weights = last_checkpoint_weights(tmp_path)
    assert all(torch.isfinite(tensor).all() for tensor in weights.values())
    events = EventAccumulator(str(tmp_path / "lightning_logs" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    assert "throughput/tflops" in events.Tags()["scalars"]
    if any(name in torch.cuda.get_device_name() for name in ("A100", "H100", "H200")):
        assert "throughput/mfu" in events.Tags()["scalars"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ddp_on_two_gpus_over_nccl(tmp_path: Path, debug_run_args: list[str]) -> None:
    result = run_cohort(["fit", "-c", str(REPO_ROOT / "configs/trainer/ddp_gpu_bf16.yaml"), *debug_run_args, *QUIET,
                         "--trainer.accelerator", "gpu", "--trainer.devices", "2", "--trainer.precision", "bf16-mixed",
                         "--trainer.max_steps", "4", "--data.global_batch_size", "8", "--data.micro_batch_size", "2"],
                        cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]


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


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_on_two_gpus_over_nccl(tmp_path: Path, debug_run_args: list[str]) -> None:
    result = run_cohort(["fit", "-c", str(REPO_ROOT / "configs/trainer/model_parallel_gpu_bf16.yaml"), *debug_run_args,
                         *QUIET, "--trainer.accelerator", "gpu", "--trainer.devices", "2",
                         "--trainer.strategy.init_args.data_parallel_size", "1",
                         "--trainer.strategy.init_args.tensor_parallel_size", "2",
                         "--trainer.max_steps", "4", "--data.global_batch_size", "8", "--data.micro_batch_size", "4"],
                        cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
