"""The CPU tests' precision matrix on CUDA (bf16 autocast, fp16 with a grad scaler, NCCL), with clipping that bites,
the sharded presets' resume and tensor parallelism, and bad steps, each compared as its CPU twin compares
(tests/test_precision.py, test_sharding.py, test_bad_steps.py), through the same helpers. Skipped where no CUDA GPU
is visible; 2-GPU tests where fewer are.

Where a CPU twin compares weights bitwise after a resume, the GPU test compares them within the tolerance of the
other float32 comparisons (1e-4 of each tensor's largest weight), because on CUDA bitwise need not hold: attention's
backward (SDPA's memory-efficient and flash kernels) adds partial gradients with atomics in no fixed order, so two
runs of the same steps can differ in the last bits, and Adam turns such differences into visible ones where a
gradient is near zero. A skipped update stays exact (nothing is computed), so bad steps are still compared bitwise.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    COMPARABLE_RUN, CONFIG_DIR, GPU_LAYOUTS, PRECISIONS, QUICKSTART, QUIET, assert_comparable_runs_agree,
    assert_only_step_skipped, assert_trains_as_one_does, assert_trains_with_clipping_that_bites, assert_weights_agree,
    cached_fits, clipped_run, fit, last_checkpoint, last_checkpoint_weights, poison_gradient, record_weight_digests,
    run_cohort, scalars, shrunk, validate, weight_digests,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TRAINER = CONFIG_DIR / "trainer"
ON_ONE_GPU = ["--trainer.accelerator", "gpu", "--trainer.devices", "1"]
ON_TWO_GPUS = ["--trainer.accelerator", "gpu", "--trainer.devices", "2"]
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, byte_corpus: Path) -> Callable[[str, str], Path]:
    return cached_fits(tmp_path_factory, lambda precision, layout: clipped_run(
        byte_corpus, *GPU_LAYOUTS[layout], "--trainer.precision", precision))


@pytest.mark.parametrize("layout", ["1 gpu", "fsdp-1", "model_parallel-1"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_each_precision_trains_on_one_gpu_with_clipping_that_bites(trained: Callable[[str, str], Path],
                                                                   precision: str, layout: str) -> None:
    """As on CPU. The first step's norm (same weights, same batch) is float32's within mixed precision's rounding:
    a grad scaler's factor (65536 at the start) left in the gradients would show here. The sharded presets on one
    GPU train as the plain one does, as FSDP2 on CPU processes trains as one process does."""
    run_dir = trained(precision, layout)
    _, norms = assert_trains_with_clipping_that_bites(run_dir)
    assert norms[0] == pytest.approx(scalars(trained("32-true", "1 gpu"), "train/grad_norm")[0], rel=3e-2)
    assert all(torch.isfinite(tensor).all() for tensor in last_checkpoint_weights(run_dir).values())
    if layout != "1 gpu":
        assert_trains_as_one_does(trained(precision, "1 gpu"), run_dir, precision)


@TWO_GPUS
@pytest.mark.parametrize("layout", ["ddp-2", "fsdp-2", "model_parallel-2"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_two_gpus_train_as_one_does(trained: Callable[[str, str], Path], precision: str, layout: str) -> None:
    """As on CPU: the same global batch gives the same global gradient norm at every step; in float32 the same
    weights too (NCCL sums in another order than one GPU: the same tolerances as gloo's)."""
    assert_trains_as_one_does(trained(precision, "1 gpu"), trained(precision, layout), precision)


def test_gpt2_recipe_runs_with_its_preset(tmp_path: Path, byte_corpus: Path) -> None:
    """The README's headline command, shrunk to the debug model: bf16-mixed, clipping, 32 micro-batches a step."""
    fit(tmp_path, ["-c", str(TRAINER / "ddp_gpu_bf16.yaml"), "-c", str(CONFIG_DIR / "gpt2/pretrain.yaml"),
                   "--trainer.devices", "1", *shrunk(byte_corpus, 2)])
    assert all(torch.isfinite(torch.tensor(scalars(tmp_path, "train/loss") + scalars(tmp_path, "val/loss"))))
    assert len(scalars(tmp_path, "train/grad_norm")) == 2
    assert scalars(tmp_path, "throughput/tflops")
    if any(name in torch.cuda.get_device_name() for name in ("A100", "H100", "H200")):
        assert scalars(tmp_path, "throughput/mfu")


@pytest.mark.parametrize("preset", ["fsdp_gpu_bf16", "model_parallel_gpu_bf16"])
@pytest.mark.parametrize("compile", ["false", "true"], ids=["eager", "compiled"])
def test_sharded_fit_on_one_gpu_resumes_and_consolidates(tmp_path: Path, debug_run_args: list[str], preset: str,
                                                         compile: str) -> None:
    """FSDPStrategy and ModelParallelStrategy (FSDP2) over NCCL on one GPU, in float32 (debug_run_args' precision
    comes after the preset's): train, resume from the sharded folder to the weights of a run never stopped,
    consolidate it for a one-process validate that gives the sharded validate's loss, as on CPU."""
    args = ["-c", str(TRAINER / f"{preset}.yaml"), *debug_run_args, *COMPARABLE_RUN, *ON_ONE_GPU,
            "--model.compile", compile]
    if preset.startswith("model_parallel"):
        args += ["--trainer.strategy.init_args.data_parallel_size", "1"]
    resumed = tmp_path / "resumed"
    for max_steps, resume in (("2", []), ("4", ["--ckpt_path", "last"])):
        fit(resumed, args, "--trainer.max_steps", max_steps, *resume)
    assert last_checkpoint(resumed).is_dir()
    weights = last_checkpoint_weights(resumed)  # consolidated from the shards
    assert all(torch.isfinite(tensor).all() for tensor in weights.values())
    # bitwise on CPU; within float32's tolerance on CUDA (see the module's docstring)
    assert_weights_agree(fit(tmp_path / "straight", args), resumed)

    sharded_loss = validate(resumed, args, "--ckpt_path", str(last_checkpoint(resumed)))
    single_loss = validate(resumed, [*debug_run_args, *COMPARABLE_RUN, *ON_ONE_GPU, "--model.compile", compile],
                           "--ckpt_path", str(last_checkpoint(resumed).with_name("last.consolidated.ckpt")))
    # 1e-6 on CPU; compiled, the sharded and the plain module may become different kernels, whose float32 sums
    # round differently (tests/test_parallelize.py allows 1e-5 for compiled against eager)
    assert single_loss == pytest.approx(sharded_loss, rel=1e-5)


@TWO_GPUS
def test_tensor_parallel_on_two_gpus_over_nccl(tmp_path: Path, debug_run_args: list[str]) -> None:
    """Tensor parallel over 2 GPUs (NCCL) trains as one GPU does, in float32, as on CPU processes (gloo): NCCL's
    all-reduce of the partial products sums in another order, as gloo's does, so the same tolerances."""
    args = [*debug_run_args, *COMPARABLE_RUN]
    one_gpu = fit(tmp_path / "one_gpu", args, *ON_ONE_GPU)
    tensor_parallel = fit(tmp_path / "tensor_parallel", ["-c", str(TRAINER / "model_parallel_gpu_bf16.yaml"), *args],
                          *ON_TWO_GPUS, "--trainer.strategy.init_args.data_parallel_size", "1",
                          "--trainer.strategy.init_args.tensor_parallel_size", "2")
    assert_comparable_runs_agree(one_gpu, tensor_parallel)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_a_nan_gradient_is_skipped_on_the_gpu(tmp_path: Path, byte_corpus: Path, precision: str) -> None:
    """The CUDA side of bad steps: the verdict reaches the fused optimizer as a device flag and the host through a
    pinned copy (bf16), or the grad scaler skips the step itself (fp16); either way that step leaves the weights
    bitwise as they were, every other step changes them, training goes on with finite weights, and the skip is
    reported one step later."""
    steps = 6
    result = run_cohort(["fit", *QUICKSTART, *GPU_LAYOUTS["1 gpu"], *shrunk(byte_corpus, steps), *QUIET,
                         "--trainer.precision", precision, "--bad_steps.action", "skip", *poison_gradient(0, 3),
                         *record_weight_digests(tmp_path)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    if precision == "bf16-mixed":  # fp16: the scaler's own skip; the loss stayed finite, so bad_steps saw nothing
        assert "step 3: the loss or gradients were NaN or inf on rank 0 of 1" in result.stderr
        assert scalars(tmp_path, "train/skipped_steps")[-1] == 1
    assert_only_step_skipped(weight_digests(tmp_path, world_size=1), skipped=3, steps=steps)
    assert all(torch.isfinite(tensor).all() for tensor in last_checkpoint_weights(tmp_path).values())


def test_fault_tolerant_groups_average_over_nccl(tmp_path: Path, byte_corpus: Path) -> None:
    """The GPU preset's replica groups (two, sharing this machine's GPUs when it has fewer) average their gradients
    over torchft's NCCL group and end with the same weights, bitwise, as on CPUs."""
    pytest.importorskip("torchft")
    steps = 6
    result = run_cohort(["fit", *QUICKSTART, "-c", str(TRAINER / "fault_tolerant_gpu_bf16.yaml"),
                         *shrunk(byte_corpus, steps), *QUIET], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    job = tmp_path / "lightning_logs" / "version_0"
    finals = [torch.load(job / f"replica_group_{group}/checkpoints/last.ckpt", weights_only=True) for group in (0, 1)]
    assert [final["global_step"] for final in finals] == [steps, steps]
    assert all(torch.equal(finals[0]["state_dict"][name], finals[1]["state_dict"][name]) for name in finals[0]["state_dict"])
