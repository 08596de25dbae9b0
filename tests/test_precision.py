"""Every precision under every CPU strategy, and every shipped preset and recipe, trained for real with clipping.

The GPU presets run with their accelerator and device count switched to CPU equivalents (gloo), keeping their
strategy, precision, clipping and accumulation; the model is the debug one. ``16-mixed`` on CPU runs as
``bf16-mixed``, as the CLI announces. fp16 with a grad scaler exists on GPUs only through the CLI, so its path
(unscale, then clip, then the fused step) is checked in one process here against torch's own AMP recipe.
Not run here: ``fsdp_gpu_bf16.yaml`` (Lightning refuses FSDPStrategy without CUDA; its clipping is checked by
``tests/test_parallelize.py`` on FSDP over gloo and by ``tests/test_gpu.py``) and ``multinode_gpu_bf16.yaml``
(run by ``tests/test_launch.py`` with two torchrun node agents).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision

from core.precision import precision_named
from core.run_plan import RunPlan
from datamodules.language_modeling import LanguageModelingDataModule
from models.gpt.family import GPTLanguageModel
from models.optimizer import OptimizerSettings, weight_decay_groups
from tests.helpers import (
    CLIP, CONFIG_DIR, GPU_LAYOUTS, PRECISIONS, adam_weight_drift, assert_trains_as_one_does,
    assert_trains_with_clipping_that_bites, cached_fits, clipped_run, fit, scalars, shrunk,
)

pytestmark = pytest.mark.slow

# a trainer preset composed after a recipe, as the README does; GPU presets with CPU devices of the same strategy
CPU_LAYOUTS = {
    "1 process": ["-c", str(CONFIG_DIR / "trainer/cpu.yaml")],
    "ddp-2": ["-c", str(CONFIG_DIR / "trainer/ddp_cpu.yaml")],
    "model_parallel-2": ["-c", str(CONFIG_DIR / "trainer/model_parallel_cpu.yaml")],
}
PIPELINE_LAYOUT = {"pipeline-2": ["-c", str(CONFIG_DIR / "trainer/pipeline_cpu.yaml")]}  # bfloat16 only here
ON_CPU = ["--trainer.accelerator", "cpu"]
GPU_PRESETS_ON_CPU = {layout: [*GPU_LAYOUTS[gpu_layout], *ON_CPU]
                      for layout, gpu_layout in {"1 process": "1 gpu", "ddp-2": "ddp-2",
                                                 "model_parallel-2": "model_parallel-2", "pipeline-2": "pipeline-2"}.items()}


def layout_preset(precision: str, layout: str) -> list[str]:
    """The shipped preset where one ships this precision (32-true: the CPU presets; bf16-mixed: the GPU ones)."""
    if precision == "bf16-mixed":
        return GPU_PRESETS_ON_CPU[layout]
    return [*{**CPU_LAYOUTS, **PIPELINE_LAYOUT}[layout], "--trainer.precision", precision]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, byte_corpus: Path) -> Callable[[str, str], Path]:
    return cached_fits(tmp_path_factory,
                       lambda precision, layout: clipped_run(byte_corpus, *layout_preset(precision, layout)),
                       in_process=lambda precision, layout: layout == "1 process")


@pytest.mark.parametrize("layout", CPU_LAYOUTS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_each_precision_trains_with_clipping_that_bites(trained: Callable[[str, str], Path], precision: str,
                                                        layout: str) -> None:
    assert_trains_with_clipping_that_bites(trained(precision, layout))


@pytest.mark.parametrize("layout", ["ddp-2", "model_parallel-2"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_two_processes_train_as_one_does_in_each_precision(trained: Callable[[str, str], Path], precision: str,
                                                           layout: str) -> None:
    """Same global batch, so the same training (see assert_trains_as_one_does)."""
    assert_trains_as_one_does(trained(precision, "1 process"), trained(precision, layout), precision)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_a_pipeline_trains_as_one_process_does_in_bfloat16(trained: Callable[[str, str], Path], precision: str) -> None:
    """The pipeline presets' other precisions (float32 is tests/test_pipeline.py's; 16-mixed is refused)."""
    assert_trains_as_one_does(trained(precision, "1 process"), trained(precision, "pipeline-2"), precision)


def test_16_mixed_on_cpu_says_it_runs_as_bf16(trained: Callable[[str, str], Path]) -> None:
    hparams = (trained("16-mixed", "1 process") / "lightning_logs/version_0/config.yaml").read_text()
    assert "precision: bf16-mixed" in hparams


@pytest.mark.parametrize("recipe, preset", [
    ("gpt2/pretrain.yaml", GPU_PRESETS_ON_CPU["ddp-2"]),
    ("gpt-6.7b/pretrain.yaml", GPU_PRESETS_ON_CPU["model_parallel-2"]),
], ids=["gpt2-ddp", "gpt-6.7b-model_parallel"])
def test_gpu_recipes_run_two_steps_with_their_preset(tmp_path: Path, byte_corpus: Path, recipe: str,
                                                     preset: list[str]) -> None:
    """The README's GPU commands on CPU: the recipe's clipping, accumulation (32 and 128 micro-batches per rank
    per step), activation checkpointing and compile are kept."""
    fit(tmp_path, ["-c", str(CONFIG_DIR / recipe), *preset, *shrunk(byte_corpus, 2)])
    assert all(torch.isfinite(torch.tensor(scalars(tmp_path, "train/loss") + scalars(tmp_path, "val/loss"))))
    assert len(scalars(tmp_path, "train/grad_norm")) == 2


class RecordBatchesAndNorms(Callback):
    def __init__(self) -> None:
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.norms: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.batches.append(batch)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.norms.append(trainer.callback_metrics["train/grad_norm"].item())


def test_fp16_grad_scaler_with_fused_adamw_matches_torchs_amp_recipe(byte_corpus: Path, tmp_path: Path) -> None:
    """The GPU's 16-mixed path, on CPU: Lightning's grad scaler leaves a fused optimizer's gradients scaled, so
    configure_gradient_clipping unscales them; the norm it clips and logs must be the true one, and the weights
    those of the recipe (scale, backward, unscale_, clip, step, update) written by hand."""
    steps, scale, lr = 3, 2.0**12, 1e-3
    # a constant learning rate, as the hand-written loop has
    hyperparameters = {"model_name": "debug", "vocab_size": 256,
                       "optimizer": OptimizerSettings(learning_rate=lr, warmup_steps=1, min_learning_rate_ratio=1.0)}
    module, reference = GPTLanguageModel(**hyperparameters), GPTLanguageModel(**hyperparameters)
    reference.configure_model()  # the same seed, so the same initial weights as the trained module's
    record = RecordBatchesAndNorms()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, gradient_clip_val=CLIP, logger=False,
                        log_every_n_steps=1,  # the norm is logged on the steps the logger writes: every one
                        plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=scale))],
                        callbacks=[record], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, limit_val_batches=0,
                        default_root_dir=tmp_path)
    datamodule = LanguageModelingDataModule(data_dir=str(byte_corpus), vocab_size=256, sequence_length=32,
                                            global_batch_size=4, micro_batch_size=4)
    module.run_plan = datamodule.run_plan = RunPlan(  # what the CLI would resolve for this one-process run
        devices_per_node=1, num_nodes=1, data_parallel_size=1, tensor_parallel_size=1, global_batch_size=4,
        micro_batch_size=4, sequence_length=32, precision=precision_named("16-mixed"), seed=module.hparams.seed)
    trainer.fit(module, datamodule=datamodule)

    optimizer = torch.optim.AdamW(weight_decay_groups(reference.model, 0.1), lr=lr, betas=(0.9, 0.95), fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    reference_norms = []
    for inputs, targets in record.batches:
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = F.cross_entropy(reference.model(inputs).flatten(0, 1), targets.flatten())
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        reference_norms.append(torch.nn.utils.clip_grad_norm_(reference.model.parameters(), CLIP).item())
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    assert len(record.norms) == steps and min(record.norms) > CLIP
    assert record.norms == pytest.approx(reference_norms, rel=1e-6)
    # the same updates in another order of sums (torch's CPU float16 kernels vary with global state: 4e-9 to 4e-7
    # seen here), within what AdamW's normalised steps allow (tests/helpers.py adam_weight_drift)
    drift = adam_weight_drift({"hyper_parameters": dict(module.hparams), "global_step": steps})
    expected = reference.model.state_dict()
    for name, weight in module.model.state_dict().items():
        torch.testing.assert_close(weight, expected[name], rtol=0, atol=drift, msg=name)
